"""Text generation with a KV cache: one jit-compiled prefill + decode loop for a batch of prompts.

  python -m jax_pretrain.sample --workdir=runs/x --prompt "The for statement " \
      [--prompt "Another prompt" ...] [--max_new_tokens 200 --temperature 0.8 --top_k 50 \
      --top_p 0.95 --seed 0]

Prompts of different lengths are right-padded to a common length P and each row keeps its own
length: the prefill runs all P positions (pad positions write junk into the cache beyond a row's
prompt), row b's first new token is sampled from the logits at its position len_b - 1, and decode
step i writes row b's token at position len_b + i, overwriting that junk before any query can see
it (the causal mask only shows a query the slots at or before its own position). So every row
sees exactly its own prompt and its own continuation, at the positions it would have alone.

Sampling: temperature 0 is greedy (argmax); otherwise the logits are divided by the temperature,
cut to the top_k most likely tokens (0: no cut) and then to the smallest set whose probability
reaches top_p (1.0: no cut), and sampled. Ids the tokenizer cannot produce (the padding rows of the
embedding, and pad itself) are never sampled. A row stops at EOS; the loop stops when every row
has stopped or after max_new_tokens.
"""
import dataclasses
import functools

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from jax_pretrain import cli
from jax_pretrain import config as config_lib
from jax_pretrain import model as model_lib
from jax_pretrain import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Sampling:
  temperature: float = 0.8
  top_k: int = 0  # 0: no top-k cut
  top_p: float = 1.0  # 1.0: no nucleus cut


def filter_logits(logits_BxV: jax.Array, temperature, top_k, top_p) -> jax.Array:
  """Logits divided by the temperature, with the tokens outside the top_k and then outside the
  top_p set to -inf, float32.

  The settings are numbers (one for the whole batch) or arrays [B] (one per row: the server decodes
  requests with different settings together). top_k 0 and top_p 1.0 cut nothing.
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
  cuts = jnp.any((top_k_Bx1 > 0) & (top_k_Bx1 < V)) | jnp.any(top_p_Bx1 < 1.0)
  threshold_Bx1 = jax.lax.cond(cuts, threshold,
                               lambda: jnp.full((logits_BxV.shape[0], 1), -jnp.inf))
  return jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)


def sample_logits(logits_BxV: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
  """Next token per row, int32 [B]."""
  if s.temperature == 0:
    return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
  logits_BxV = filter_logits(logits_BxV, s.temperature, s.top_k, s.top_p)
  return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


def sample_rows(logits_BxV: jax.Array, keys_B: jax.Array, temperature_B: jax.Array,
                top_k_B: jax.Array, top_p_B: jax.Array) -> jax.Array:
  """Next token per row, int32 [B], each row with its own settings and its own key, so that a
  request's tokens do not depend on the other requests decoded beside it. Temperature 0: greedy."""
  sampled_B = jax.vmap(lambda key, logits_V: jax.random.categorical(key, logits_V))(
      keys_B, filter_logits(logits_BxV, jnp.where(temperature_B > 0, temperature_B, 1.0),
                            top_k_B, top_p_B))
  greedy_B = jnp.argmax(logits_BxV, axis=-1)
  return jnp.where(temperature_B > 0, sampled_B, greedy_B).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=('model', 'max_new_tokens', 'sampling'))
def _generate(model, params, prompts_BxP, lengths_B, rng, eos_id, pad_id, vocab_size, *,
              max_new_tokens: int, sampling: Sampling):
  """New tokens int32 [B, max_new_tokens]: up to and including each row's EOS, then pad_id.

  The special ids are traced, not static: a new tokenizer does not recompile."""
  B, P = prompts_BxP.shape
  cache = model_lib.KVCache.zeros(model.config, B, P + max_new_tokens)
  allowed_V = (jnp.arange(model.config.vocab_size) < vocab_size) & (
      jnp.arange(model.config.vocab_size) != pad_id)

  def step_logits(tokens_BxT, positions_BxT, cache):
    logits_BxTxV, cache = model.apply({'params': params}, tokens_BxT, cache, positions_BxT)
    return jnp.where(allowed_V, logits_BxTxV, -jnp.inf), cache

  positions_BxP = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, P))
  logits_BxPxV, cache = step_logits(prompts_BxP, positions_BxP, cache)
  logits_BxV = logits_BxPxV[jnp.arange(B), lengths_B - 1]  # each row's last prompt token

  def cond(state):
    i, _, _, _, done_B, _ = state
    return (i < max_new_tokens) & ~jnp.all(done_B)

  def body(state):
    i, logits_BxV, cache, out_BxN, done_B, rng = state
    rng, key = jax.random.split(rng)
    token_B = jnp.where(done_B, pad_id, sample_logits(logits_BxV, key, sampling))
    out_BxN = out_BxN.at[:, i].set(token_B)
    done_B = done_B | (token_B == eos_id)
    logits_Bx1xV, cache = step_logits(token_B[:, None], (lengths_B + i)[:, None], cache)
    return i + 1, logits_Bx1xV[:, 0], cache, out_BxN, done_B, rng

  out_BxN = jnp.full((B, max_new_tokens), pad_id, jnp.int32)
  state = (jnp.int32(0), logits_BxV, cache, out_BxN, jnp.zeros((B,), bool), rng)
  return jax.lax.while_loop(cond, body, state)[3]


def decoding_model(model_config: model_lib.ModelConfig) -> model_lib.Transformer:
  """No remat (nothing is differentiated) and no mesh (jit places the params). With a cache the
  model attends with plain einsums, whatever model.attention says."""
  return model_lib.Transformer(dataclasses.replace(model_config, remat='none'))


def generate(model_config: model_lib.ModelConfig, params, prompts: list, max_new_tokens: int, *,
             eos_id: int, pad_id: int, vocab_size: int | None = None,
             sampling: Sampling = Sampling(), seed: int = 0) -> list[list[int]]:
  """New token ids for each prompt (a sequence of ids, at least one), EOS excluded.

  vocab_size: ids at or above it are never sampled (default: the model's vocabulary).
  """
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError('every prompt needs at least one token')
  lengths = np.array([len(p) for p in prompts], np.int32)
  prompts_BxP = np.full((len(prompts), lengths.max()), pad_id, np.int32)
  for b, p in enumerate(prompts):
    prompts_BxP[b, :len(p)] = p
  out_BxN = np.asarray(_generate(
      decoding_model(model_config), params, jnp.asarray(prompts_BxP), jnp.asarray(lengths),
      jax.random.key(seed), eos_id, pad_id, vocab_size or model_config.vocab_size,
      max_new_tokens=max_new_tokens, sampling=sampling))
  result = []
  for row in out_BxN.tolist():
    stop = row.index(eos_id) if eos_id in row else len(row)
    result.append([t for t in row[:stop] if t != pad_id])
  return result


def encode_prompt(tokenizer, prompt: str) -> np.ndarray:
  """The prompt's ids; an empty prompt is [EOS], the start of a new document as in training."""
  ids = np.asarray(tokenizer.encode(prompt), np.int32)
  return ids if len(ids) else np.array([tokenizer.eos_id], np.int32)


def generate_texts(model_config: model_lib.ModelConfig, params, tokenizer, prompts: list[str],
                   max_new_tokens: int, *, temperature: float = 0.8, top_k: int = 0,
                   top_p: float = 1.0, seed: int = 0) -> list[str]:
  """Continuations (decoded new tokens only) of a batch of prompts, each stopping at EOS."""
  ids = generate(model_config, params, [encode_prompt(tokenizer, p) for p in prompts],
                 max_new_tokens, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id,
                 vocab_size=tokenizer.vocab_size, sampling=Sampling(temperature, top_k, top_p),
                 seed=seed)
  return [tokenizer.decode(new) for new in ids]


def generate_text(model_config: model_lib.ModelConfig, params, tokenizer, prompt: str,
                  max_new_tokens: int, temperature: float = 0.8, seed: int = 0,
                  top_k: int = 0, top_p: float = 1.0) -> str:
  """Continuation of one prompt (decoded new tokens only), stopping at EOS."""
  return generate_texts(model_config, params, tokenizer, [prompt], max_new_tokens,
                        temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)[0]


def main():
  f = flags.FLAGS
  run = workdir_lib.load(f.workdir, f.step, devices=jax.devices()[:1])
  prompts = f.prompt or ['']
  texts = generate_texts(config_lib.model_config(run.config), run.params, run.tokenizer, prompts,
                         f.max_new_tokens, temperature=f.temperature, top_k=f.top_k,
                         top_p=f.top_p, seed=f.seed)
  for k, (prompt, text) in enumerate(zip(prompts, texts)):
    if k:
      print('-' * 40)
    print(f'{prompt}{text}' if f.echo else text, flush=True)


if __name__ == '__main__':
  # Flags only when run as a program: train.py imports this module for its end-of-run sample.
  cli.define_run_flags()
  flags.DEFINE_multi_string('prompt', [], 'Prompt; repeat the flag for a batch of prompts (none: '
                            'one empty prompt, i.e. the start of a document).')
  flags.DEFINE_integer('max_new_tokens', 200, 'Tokens to generate at most per prompt.')
  flags.DEFINE_float('temperature', 0.8, 'Softmax temperature; 0 is greedy decoding.')
  flags.DEFINE_integer('top_k', 50, 'Sample among the k most likely tokens; 0 disables.')
  flags.DEFINE_float('top_p', 0.95, 'Nucleus sampling: the smallest set of tokens with this '
                     'probability; 1.0 disables.')
  flags.DEFINE_integer('seed', 0, 'Random seed of the sampling.')
  flags.DEFINE_bool('echo', True, 'Print each prompt before its continuation.')
  cli.run(main)
