"""Sampling the next token of each row (the engine's decode; sample.py's settings are these).

First the logits are processed as vLLM's sampler processes them (penalized): each row's
logit_bias added (its token ids and biases), then its presence penalty subtracted from the logit
of every token it has generated and its frequency penalty times the number of times it has
(counts: the row's output tokens only, not its prompt, as vLLM and OpenAI count them), and the
tokens its grammar does not allow next set to -inf (a row of a bitmask, engine/grammar.py: a row
without a grammar allows every token). The
log-probabilities the engine reports are the model's own, before any of this (vLLM's default).

Temperature 0 is greedy (argmax of the processed logits); otherwise the logits are divided by
the temperature, cut to the top_k most likely tokens (0: no cut) and then to the smallest set whose
probability reaches top_p (1.0: no cut), and sampled. Ids the tokenizer cannot produce (the padding
rows of the embedding, and pad itself) are never sampled (allowed_ids: the engine sets their logits
to -inf).

Each row samples with its own settings and its own random stream: its token i is drawn with the
key fold_in(fold_in(key(seed), stream), i) (row_streams, token_keys), its seed and stream those
of its sequence (stream: its index among the choices of one request), so a sequence's tokens do
not depend on which other sequences were decoded beside it, nor on the mesh, nor on when it was
admitted.
"""
import jax
import jax.numpy as jnp
import numpy as np

TOP_N = 20  # alternatives reported per generated token at most (OpenAI's and vLLM's top_logprobs)
MAX_LOGIT_BIAS = 300  # logit_bias entries per sequence (the width of its rows on the device)


def allowed_ids(vocab_size: int, tokenizer) -> np.ndarray:
  """bool [vocab_size]: the ids a sequence may sample (the tokenizer's, but pad)."""
  ids_V = np.arange(vocab_size)
  return (ids_V < tokenizer.vocab_size) & (ids_V != tokenizer.pad_id)


def row_streams(seeds_R: jax.Array, streams_R: jax.Array) -> jax.Array:
  """Each row's random stream: its seed's key folded with its stream index."""
  return jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(seeds_R, streams_R)


def token_keys(streams_R: jax.Array, counts_R: jax.Array) -> jax.Array:
  """The key of each row's token number counts_R (its tokens generated before it)."""
  return jax.vmap(jax.random.fold_in)(streams_R, counts_R)


def filter_logits(logits_BxV: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """Logits divided by the temperature, with the tokens outside the top_k and then outside the
  top_p set to -inf, float32.

  The settings are numbers (one for the whole batch) or arrays [B] (one per row: the server decodes
  requests with different settings together). top_k 0 and top_p 1.0 cut nothing (and the cut's
  sort runs only when a row asks for it: a runtime branch, one program for both).
  """
  temperature_Bx1, top_k_Bx1, top_p_Bx1 = (jnp.reshape(jnp.asarray(x), (-1, 1))
                                           for x in (temperature, top_k, top_p))
  logits_BxV = logits_BxV.astype(jnp.float32) / temperature_Bx1
  V = logits_BxV.shape[-1]

  def threshold():
    sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
    k_Bx1 = jnp.where((top_k_Bx1 > 0) & (top_k_Bx1 < V), top_k_Bx1, V)
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, k_Bx1 - 1, axis=-1)
    sorted_BxV = jnp.where(sorted_BxV < kth_Bx1, -jnp.inf, sorted_BxV)
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    # Keep a token while the tokens more likely than it hold less than top_p: always >= 1 kept.
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    n_kept_Bx1 = jnp.sum(before_BxV < top_p_Bx1, axis=-1, keepdims=True)
    n_kept_Bx1 = jnp.where(top_p_Bx1 < 1.0, n_kept_Bx1, V)
    return jnp.maximum(kth_Bx1, jnp.take_along_axis(sorted_BxV, n_kept_Bx1 - 1, axis=-1))

  # The sort is the costly part of a decoding step on the CPU: skipped when nothing is cut.
  any_cut = jnp.any((top_k_Bx1 > 0) & (top_k_Bx1 < V)) | jnp.any(top_p_Bx1 < 1.0)
  threshold_Bx1 = jax.lax.cond(any_cut, threshold,
                               lambda: jnp.full((logits_BxV.shape[0], 1), -jnp.inf))
  return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def sample_rows(logits_BxV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Next token per row, int32 [B], each row with its own settings and its own key, so that a
  request's tokens do not depend on the other requests decoded beside it. Temperature 0: greedy."""
  sampled_B = jax.vmap(lambda key, logits_V: jax.random.categorical(key, logits_V))(
      keys_B, filter_logits(logits_BxV, jnp.where(temperature_B > 0, temperature_B, 1.0),
                            top_k_B, top_p_B))
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  return jnp.where(temperature_B > 0, sampled_B, greedy_B).astype(jnp.int32)


def penalized(logits_BxV: jax.Array, counts_BxV: jax.Array, presence_B: jax.Array,
              frequency_B: jax.Array, bias_ids_BxK: jax.Array, bias_BxK: jax.Array,
              mask_BxW: jax.Array | None = None) -> jax.Array:
  """The logits with each row's logit_bias added (bias_BxK at ids bias_ids_BxK; padding: a bias
  of 0) and its penalties subtracted: presence_B where the row's counts_BxV (its output tokens so
  far) are > 0, frequency_B × counts_BxV; then -inf where its grammar's mask_BxW (int32 words: bit
  i % 32 of word i // 32 set where id i is allowed; all bits set: no grammar) forbids; float32."""
  rows_Bx1 = jnp.arange(logits_BxV.shape[0])[:, None]
  logits_BxV = jnp.asarray(logits_BxV, jnp.float32).at[rows_Bx1, bias_ids_BxK].add(bias_BxK)
  counts_BxV = jnp.asarray(counts_BxV, jnp.float32)
  logits_BxV = (logits_BxV - frequency_B[:, None] * counts_BxV
                - presence_B[:, None] * (counts_BxV > 0).astype(jnp.float32))
  if mask_BxW is None:
    return logits_BxV
  return jnp.where(allowed_by(mask_BxW, logits_BxV.shape[-1]), logits_BxV, -jnp.inf)


def allowed_by(mask_BxW: jax.Array, vocab_size: int) -> jax.Array:
  """bool [B, vocab_size]: the ids a bitmask allows (bit i % 32 of int32 word i // 32)."""
  bits_BxWx32 = (mask_BxW[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
  return bits_BxWx32.reshape(mask_BxW.shape[0], -1)[:, :vocab_size].astype(bool)
