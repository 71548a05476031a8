"""KV-cache decoding (the engine's model and sample.generate, which runs the engine): cached logits
equal the full forward pass, greedy decoding equals re-running the full forward pass each step,
per-row prompt lengths, EOS, top-k / top-p."""
import dataclasses

from flax.linen import meta
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import engine
from jax_pretrain import model as model_lib
from jax_pretrain import sample
from jax_pretrain.data.tokenizer import ByteTokenizer
from jax_pretrain.engine import runner


def model_and_params(**overrides):
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  # A larger init gives peaked next-token distributions: greedy choices are not near-ties.
  cfg = dataclasses.replace(config.model, init_std=0.2, **overrides)
  model = model_lib.Transformer(cfg)
  params = jax.jit(model.init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))['params']
  return cfg, model, meta.unbox(params)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize('dtype, kv_cache_dtype, tolerance', [
    ('float32', 'auto', 1e-5), ('bfloat16', 'auto', 2e-2), ('float32', 'int8', 3e-2),
    ('float32', 'fp8', 0.12), ('bfloat16', 'fp8', 0.12)])
def test_cached_logits_equal_full_forward_with_per_row_prompt_lengths(dtype, kv_cache_dtype,
                                                                      tolerance):
  """The engine's model: a prefill into cache rows 2 and 0 (rows out of order, one padding row
  dropped), then one token a step at each row's own position over a live window of the cache.
  bfloat16: the cache's keys and values read as they are, with float32 accumulation; int8 and
  fp8: stored in 8 bits, dequantized by their scales where attention reads them."""
  cfg, model, params = model_and_params(tie_embeddings=False, dtype=dtype)
  decoder = runner.decoding_model(cfg)
  dparams = runner.decoding_params(decoder.config, params)
  B, T, S = 2, 12, 16
  tokens_BxT = jax.random.randint(jax.random.key(1), (B, T), 0, cfg.vocab_size)
  full_BxTxV = model.apply({'params': params}, tokens_BxT)

  lengths = np.array([5, 3])  # row 1's prompt is right-padded with junk (tokens 3 and 4)
  slots = np.array([2, 0])
  cache = model_lib.KVCache.zeros(decoder.config, 3, S, kv_cache_dtype)
  apply = jax.jit(decoder.apply)
  prompts = jnp.concatenate([tokens_BxT[:, :5], jnp.zeros((1, 5), jnp.int32)])  # + a padding row
  use = model_lib.CacheUse(jnp.broadcast_to(jnp.arange(5), (3, 5)), slots_B=jnp.array([2, 0, 3]),
                           logits_at_B=jnp.array([*(lengths - 1), 0]))
  last_Bx1xV, cache = apply({'params': dparams}, prompts, cache, use)
  for b in range(B):
    assert rel_err(last_Bx1xV[b, 0], full_BxTxV[b, lengths[b] - 1]) < tolerance
  # Rows 0 and 1 of the decode: the prompts' slots.
  cache = jax.tree.map(lambda x: x[slots], cache)
  for i in range(T - 5):  # one token per step, each row at its own position
    pos_B = lengths + i
    token_Bx1 = tokens_BxT[jnp.arange(B), pos_B][:, None]
    live = engine.live_bucket(int(pos_B.max()) + 1, S)
    logits_Bx1xV, cache = apply({'params': dparams}, token_Bx1, cache,
                                model_lib.CacheUse(jnp.asarray(pos_B)[:, None], live=live))
    assert rel_err(logits_Bx1xV[:, 0], full_BxTxV[jnp.arange(B), pos_B]) < tolerance


@pytest.mark.parametrize('kv_cache_dtype', ['int8', 'fp8'])
def test_quantized_cache_rounds_each_vector_and_decode_attention_reads_it_exactly(kv_cache_dtype):
  """An 8-bit cache: each (row, position, head) vector stored as q × scale, q within the type's
  rounding of x / scale (int8: half a step; fp8 e4m3: 2^-4 relative, or the subnormal step); and
  decode attention over it equals a float64 NumPy attention over the dequantized keys and values
  (the scales applied to the scores and the probabilities, not to a copy of the window)."""
  cfg, _, _ = model_and_params()
  B, T, S, K, G, H = 3, 1, 11, 2, 2, 16
  rng = np.random.default_rng(0)
  k_BxSxKxH, v_BxSxKxH = (rng.normal(size=(B, S, K, H)) * rng.uniform(0.01, 30, (B, S, K, 1))
                          for _ in 'kv')
  q_BxTxNxH = rng.normal(size=(B, T, K * G, H))
  empty = model_lib.KVCache.zeros(dataclasses.replace(
      cfg, num_layers=1, num_kv_heads=K, num_heads=K * G, d_model=K * G * H, dtype='float32'),
      B, S, kv_cache_dtype).layers[0]
  kv = empty.write(jnp.arange(B), jnp.broadcast_to(jnp.arange(S), (B, S)),
                   jnp.asarray(k_BxSxKxH, jnp.float32), jnp.asarray(v_BxSxKxH, jnp.float32))
  assert kv.k_BxSxKxH.dtype == model_lib.KV_CACHE_DTYPES[kv_cache_dtype]
  deq = {}
  for name, x in (('k', k_BxSxKxH), ('v', v_BxSxKxH)):
    q = np.asarray(getattr(kv, f'{name}_BxSxKxH').astype(jnp.float32), np.float64)
    scale = np.asarray(getattr(kv, f'{name}_scale_BxSxK'), np.float64)[..., None]
    top = 127 if kv_cache_dtype == 'int8' else 448
    np.testing.assert_allclose(np.abs(q).max(-1), top, rtol=1e-6)  # each vector's full range
    step = 0.5 if kv_cache_dtype == 'int8' else np.maximum(np.abs(x / scale) * 2.0**-4, 2.0**-9)
    assert np.all(np.abs(q - x / scale) <= step * (1 + 1e-5))
    deq[name] = q * scale
  positions_BxT = np.array([[10], [4], [7]])
  got = model_lib.cached_attention(jnp.asarray(q_BxTxNxH, jnp.float32), kv,
                                    jnp.asarray(positions_BxT))
  scores = np.einsum('btkgh,bskh->bkgts', q_BxTxNxH.reshape(B, T, K, G, H), deq['k']) / H**0.5
  scores = np.where(np.arange(S) <= positions_BxT[:, None, None, :, None], scores, -np.inf)
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  probs /= probs.sum(-1, keepdims=True)
  want = np.einsum('bkgts,bskh->btkgh', probs, deq['v']).reshape(B, T, K * G, H)
  assert rel_err(got, want) < 1e-5


@pytest.mark.parametrize('kv_cache_dtype', ['int8', 'fp8'])
def test_a_quantized_cache_under_float16_is_as_accurate_as_dequantizing_first(kv_cache_dtype):
  """float16 compute, one query over 32k positions of spread attention: the values' scales
  applied in float32 (the probabilities times them fall below float16's normal range, ~1/S ×
  scale), so the 8-bit cache is within 1.2× the error of its values dequantized to a float16
  cache first, both against float64 attention over the unquantized keys and values."""
  B, T, S, K, G, H = 1, 1, 32768, 1, 2, 64
  rng = np.random.default_rng(0)
  k_BxSxKxH = rng.normal(size=(B, S, K, H))
  v_BxSxKxH = rng.normal(size=(B, S, K, H)) * rng.uniform(0.1, 2, (B, S, K, 1))
  q_BxTxNxH = rng.normal(size=(B, T, K * G, H))
  scores = np.einsum('btkgh,bskh->bkgts', q_BxTxNxH.reshape(B, T, K, G, H), k_BxSxKxH) / H**0.5
  probs = np.exp(scores - scores.max(-1, keepdims=True))
  want = np.einsum('bkgts,bskh->btkgh', probs / probs.sum(-1, keepdims=True),
                   v_BxSxKxH).reshape(B, T, K * G, H)
  dtype = model_lib.KV_CACHE_DTYPES[kv_cache_dtype]
  (k, k_scale), (v, v_scale) = (model_lib.quantize(jnp.asarray(x, jnp.float32), dtype)
                                for x in (k_BxSxKxH, v_BxSxKxH))
  dequantized = lambda x, scale: (x.astype(jnp.float32) * scale[..., None]).astype(jnp.float16)
  q, positions = jnp.asarray(q_BxTxNxH, jnp.float16), jnp.full((B, T), S - 1)
  got = model_lib.cached_attention(q, model_lib.LayerKV(k, v, k_scale, v_scale), positions)
  first = model_lib.cached_attention(
      q, model_lib.LayerKV(dequantized(k, k_scale), dequantized(v, v_scale)), positions)
  assert rel_err(got, want) < 1.2 * rel_err(first, want)


@pytest.mark.parametrize('kv_cache_dtype', ['auto', 'int8', 'fp8'])
def test_a_nan_written_to_the_cache_reaches_the_queries_that_attend_to_it(kv_cache_dtype):
  """A NaN key or value is kept by every cache (int8 has no NaN: its vector's scale is NaN), so
  that decode attention over it is NaN, and a row that never wrote one is not."""
  cfg, _, _ = model_and_params()
  B, S, K, H = 2, 4, 1, 16
  c = dataclasses.replace(cfg, num_layers=1, num_kv_heads=K, num_heads=K, d_model=K * H,
                          dtype='float32')
  for name in 'kv':
    x = {n: np.random.default_rng(0).normal(size=(B, S, K, H)) for n in 'kv'}
    x[name][0, 2, 0, 5] = np.nan  # row 0, position 2
    kv = model_lib.KVCache.zeros(c, B, S, kv_cache_dtype).layers[0].write(
        jnp.arange(B), jnp.broadcast_to(jnp.arange(S), (B, S)),
        *(jnp.asarray(x[n], jnp.float32) for n in 'kv'))
    out = np.asarray(model_lib.cached_attention(jnp.ones((B, 1, K, H), jnp.float32), kv,
                                                jnp.full((B, 1), S - 1)))
    assert np.isnan(out[0]).any() and np.isfinite(out[1]).all(), (name, out)


def full_forward_greedy(forward, prompt, max_new_tokens, eos_id):
  """The reference: re-run the whole sequence through the model for every new token."""
  tokens = np.zeros((1, 20), np.int32)  # one shape for all prompts: one compile
  tokens[0, :len(prompt)] = prompt
  new = []
  for t in range(len(prompt), len(prompt) + max_new_tokens):
    nxt = int(np.argmax(forward(tokens)[0, t - 1]))
    if nxt == eos_id:
      break
    tokens[0, t] = nxt
    new.append(nxt)
  return new


def test_greedy_cached_decode_equals_full_forward_each_step():
  cfg, model, params = model_and_params()
  forward = jax.jit(lambda t: model.apply({'params': params}, t))
  prompts = [[72, 101, 108, 108, 111, 32, 119], [1, 2, 3], [300]]
  eos_id, pad_id, n = cfg.vocab_size - 2, cfg.vocab_size - 1, 12
  cached = sample.generate(cfg, params, prompts, n, eos_id=eos_id, pad_id=pad_id,
                           sampling=sample.Sampling(temperature=0.0))
  for prompt, got in zip(prompts, cached):
    assert got == full_forward_greedy(forward, prompt, n, eos_id)
    assert len(got) == n
  assert len({tuple(g) for g in cached}) == 3  # the rows are not all the same

  # Stopping at EOS: make row 0's fourth token the EOS; the other rows go on unchanged.
  eos_id = cached[0][3]
  stopped = sample.generate(cfg, params, prompts, n, eos_id=eos_id, pad_id=pad_id,
                            sampling=sample.Sampling(temperature=0.0))
  assert stopped[0] == cached[0][:3]
  for prompt, got in zip(prompts, stopped):
    assert got == full_forward_greedy(forward, prompt, n, eos_id)


def test_top_k_top_p_and_temperature():
  B = 4096
  logits_BxV = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * B))
  keys_B = jax.random.split(jax.random.key(0), B)

  def draw(temperature=1.0, top_k=0, top_p=1.0):
    return np.asarray(engine.sample_rows(logits_BxV, keys_B, jnp.full(B, temperature),
                                         jnp.full(B, top_k), jnp.full(B, top_p)))

  def counts(**kw):
    return np.bincount(draw(**kw), minlength=4)

  assert (draw(temperature=0.0) == 0).all()  # greedy
  # No cut: the tokens of plain sampling (the cut's branch does not run).
  assert (np.asarray(jax.vmap(jax.random.categorical)(keys_B, logits_BxV)) == draw()).all()
  assert counts(top_k=1)[1:].sum() == 0
  c = counts(top_k=2)
  assert c[2:].sum() == 0 and 0.55 < c[0] / c[:2].sum() < 0.70  # 0.5 / 0.8 = 0.625
  assert counts(top_p=0.7)[2:].sum() == 0  # 0.5 + 0.3 reaches 0.7
  assert counts(top_p=0.85)[3] == 0 and counts(top_p=0.85)[2] > 0
  assert counts(top_p=0.1)[1:].sum() == 0  # always at least the most likely token
  c = counts()
  assert abs(c[3] / c.sum() - 0.05) < 0.015
  cold = counts(temperature=0.25)  # sharper: p ∝ p^4
  assert cold[0] / cold.sum() > 0.8


def test_sampling_never_picks_ids_outside_the_tokenizer_and_is_seeded():
  cfg, _, params = model_and_params()
  tok = ByteTokenizer()  # 259 ids; the model has 384

  def run(seed):
    return sample.generate(cfg, params, [sample.encode_prompt(tok, 'The ')] * 4, 20,
                           eos_id=tok.eos_id, pad_id=tok.pad_id, vocab_size=tok.vocab_size,
                           sampling=sample.Sampling(temperature=2.0), seed=seed)

  ids = run(3)
  assert all(0 <= t < tok.vocab_size and t != tok.pad_id for row in ids for t in row)
  assert len({tuple(row) for row in ids}) > 1  # rows draw different samples
  assert run(3) == ids and run(4) != ids
  assert sample.encode_prompt(tok, '').tolist() == [tok.eos_id]
