"""Model behaviour: shapes, causality, RoPE, GQA, scan, and a float64 NumPy reference."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import model as model_lib


def small_config(**overrides) -> model_lib.ModelConfig:
  config, _ = config_lib.resolve(config_lib.preset('test'), num_devices=1, backend='cpu')
  return dataclasses.replace(config.model, **overrides)


def init(cfg, seed=0, T=16):
  model = model_lib.Transformer(cfg)
  params = jax.jit(model.init)(jax.random.key(seed), jnp.zeros((1, T), jnp.int32))['params']
  from flax.linen import meta  # noqa: PLC0415
  return model, meta.unbox(params)


def random_tokens(seed, B, T, V):
  return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


def rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_logits_shape_and_dtype():
  cfg = small_config()
  model, params = init(cfg)
  logits = model.apply({'params': params}, random_tokens(1, 3, 16, cfg.vocab_size))
  assert logits.shape == (3, 16, cfg.vocab_size)
  assert logits.dtype == jnp.float32
  assert np.isfinite(np.asarray(logits)).all()


def test_bf16_compute_keeps_float32_params_and_logits():
  cfg = small_config(dtype='bfloat16')
  model, params = init(cfg)
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(params))
  logits = model.apply({'params': params}, random_tokens(1, 2, 16, cfg.vocab_size))
  assert logits.dtype == jnp.float32


def test_causality_later_tokens_do_not_change_earlier_logits():
  cfg = small_config()
  model, params = init(cfg)
  tokens = random_tokens(2, 2, 16, cfg.vocab_size)
  changed = tokens.at[:, 10:].set((tokens[:, 10:] + 7) % cfg.vocab_size)
  a = model.apply({'params': params}, tokens)
  b = model.apply({'params': params}, changed)
  np.testing.assert_array_equal(np.asarray(a[:, :10]), np.asarray(b[:, :10]))
  assert np.abs(np.asarray(a[:, 10:] - b[:, 10:])).max() > 1e-3  # and later ones do change


def test_rope_scores_depend_only_on_relative_position():
  H = 16
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, H))
  k = jax.random.normal(jax.random.key(1), (1, 1, 1, H))
  inv_freq = model_lib.rope_frequencies(small_config(head_dim=H))

  def score(m, n):
    cos, sin = model_lib.rope_tables(jnp.array([m, n]), inv_freq)
    qm = model_lib.apply_rope(q, cos[:1], sin[:1])
    kn = model_lib.apply_rope(k, cos[1:], sin[1:])
    return float(jnp.sum(qm * kn))

  base = score(3, 1)
  for shift in (1, 5, 100, 1000):
    np.testing.assert_allclose(score(3 + shift, 1 + shift), base, rtol=1e-4, atol=1e-5)
  assert abs(score(3, 1) - score(1, 3)) > 1e-4  # not symmetric: it encodes direction
  # Position 0 is the identity rotation.
  cos, sin = model_lib.rope_tables(jnp.array([0]), inv_freq)
  np.testing.assert_allclose(model_lib.apply_rope(q, cos, sin), q, rtol=0, atol=0)


def test_gqa_equals_mha_with_repeated_kv_heads():
  gqa_cfg = small_config(num_heads=4, num_kv_heads=2)
  mha_cfg = dataclasses.replace(gqa_cfg, num_kv_heads=4)
  gqa, params = init(gqa_cfg)
  mha = model_lib.Transformer(mha_cfg)
  group = gqa_cfg.num_heads // gqa_cfg.num_kv_heads

  def repeat_kv(path, x):
    name = path[-1].key
    # Scanned weights are [layers, embed, kv_heads, head_dim]; query head n uses kv head n // group.
    return jnp.repeat(x, group, axis=2) if name in ('wk', 'wv') else x

  mha_params = jax.tree_util.tree_map_with_path(repeat_kv, params)
  tokens = random_tokens(3, 2, 16, gqa_cfg.vocab_size)
  a = gqa.apply({'params': params}, tokens)
  b = mha.apply({'params': mha_params}, tokens)
  assert rel_err(a, b) < 1e-6


def test_scanned_and_unrolled_layers_are_one_model_with_one_layout_of_params():
  cfg = small_config()
  scanned, params = init(cfg)
  unrolled_cfg = dataclasses.replace(cfg, layers='unroll')
  unrolled = model_lib.Transformer(unrolled_cfg)
  # Either way init makes the same stacked params, the same numbers from the same seed.
  _, own = init(unrolled_cfg)
  jax.tree.map(np.testing.assert_array_equal, own, params)
  # The unrolled model runs each layer's slices (layers_as_run), and stack_layers inverts it.
  per_layer = model_lib.layers_as_run(unrolled_cfg, params)
  assert 'layers' not in per_layer and f'layers_{cfg.num_layers - 1}' in per_layer
  jax.tree.map(np.testing.assert_array_equal,
               model_lib.stack_layers(per_layer, cfg.num_layers), params)
  tokens = random_tokens(4, 2, 16, cfg.vocab_size)
  a = scanned.apply({'params': params}, tokens)
  b = unrolled.apply({'params': per_layer}, tokens)
  assert rel_err(a, b) < 1e-6


@pytest.mark.parametrize('remat', ['full', 'dots', 'dots_no_batch', 'minimal'])
def test_remat_policies_change_memory_not_results(remat):
  cfg = small_config()
  model, params = init(cfg)
  remat_model = model_lib.Transformer(dataclasses.replace(cfg, remat=remat))
  tokens = random_tokens(5, 2, 16, cfg.vocab_size)
  loss = lambda m: lambda p: jnp.mean(m.apply({'params': p}, tokens) ** 2)
  g_ref = jax.grad(loss(model))(params)
  g = jax.grad(loss(remat_model))(params)
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert rel_err(a, b) < 1e-5


# A straightforward float64 NumPy implementation of the same equations.

def _np_rmsnorm(x, scale, eps):
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def _np_rope(x_TxNxH, theta):
  T, _, H = x_TxNxH.shape
  inv_freq = 1.0 / theta ** (np.arange(0, H, 2) / H)
  ang = np.arange(T)[:, None] * inv_freq[None, :]
  cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
  x1, x2 = x_TxNxH[..., :H // 2], x_TxNxH[..., H // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def numpy_forward(cfg: model_lib.ModelConfig, params, tokens_T):
  p = jax.tree.map(lambda x: np.asarray(x, np.float64), params)
  T, N, K, H = len(tokens_T), cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  x = p['embedding'][tokens_T]
  causal = np.tril(np.ones((T, T), bool))
  for i in range(cfg.num_layers):
    layer = jax.tree.map(lambda a, i=i: a[i], p['layers'])
    h = _np_rmsnorm(x, layer['attn_norm']['scale'], cfg.norm_eps)
    q = _np_rope(np.einsum('td,dnh->tnh', h, layer['attn']['wq']), cfg.rope_theta)
    k = _np_rope(np.einsum('td,dkh->tkh', h, layer['attn']['wk']), cfg.rope_theta)
    v = np.einsum('td,dkh->tkh', h, layer['attn']['wv'])
    out = np.zeros((T, N, H))
    for n in range(N):
      kv = n // (N // K)
      s = q[:, n] @ k[:, kv].T / np.sqrt(H)
      s = np.where(causal, s, -np.inf)
      w = np.exp(s - s.max(axis=-1, keepdims=True))
      out[:, n] = (w / w.sum(axis=-1, keepdims=True)) @ v[:, kv]
    x = x + np.einsum('tnh,nhd->td', out, layer['attn']['wo'])
    h = _np_rmsnorm(x, layer['mlp_norm']['scale'], cfg.norm_eps)
    gate = h @ layer['mlp']['w_gate']
    up = h @ layer['mlp']['w_up']
    x = x + (gate / (1 + np.exp(-gate)) * up) @ layer['mlp']['w_down']
  x = _np_rmsnorm(x, p['final_norm']['scale'], cfg.norm_eps)
  w_out = p['embedding'].T if cfg.tie_embeddings else p['lm_head']
  return x @ w_out


@pytest.mark.parametrize('tie', [True, False])
def test_forward_matches_float64_numpy_reference(tie):
  cfg = small_config(tie_embeddings=tie)
  model, params = init(cfg, seed=7)
  # Norm scales start at 1: perturb them so the test sees them used.
  params = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.1 * jax.random.normal(jax.random.key(len(path)), x.shape)
      if path[-1].key == 'scale' else x, params)
  tokens = random_tokens(8, 2, 16, cfg.vocab_size)
  with jax.default_matmul_precision('float32'):
    logits = np.asarray(model.apply({'params': params}, tokens))
  for b in range(2):
    ref = numpy_forward(cfg, params, np.asarray(tokens[b]))
    assert rel_err(logits[b], ref) < 1e-4


def test_flops_per_token_counts_matmul_params_and_attention():
  cfg = small_config()
  _, params = init(cfg)
  n = model_lib.count_params(params)
  norms = cfg.num_layers * 2 * cfg.d_model + cfg.d_model
  attention = 6 * cfg.num_layers * 32 * cfg.num_heads * cfg.head_dim
  # Tied: every parameter but the norms does a matmul (the embedding via the output projection).
  assert model_lib.flops_per_token(cfg, 32) == 6 * (n - norms) + attention


def test_pallas_attention_model_matches_xla_attention_model():
  cfg = small_config()
  model, params = init(cfg)
  pallas = model_lib.Transformer(dataclasses.replace(cfg, attention='pallas'))
  tokens = random_tokens(9, 2, 32, cfg.vocab_size)
  loss = lambda m: lambda p: jnp.mean(m.apply({'params': p}, tokens) ** 2)
  with jax.default_matmul_precision('float32'):
    (l_ref, g_ref), (l_pallas, g) = (jax.value_and_grad(loss(m))(params) for m in (model, pallas))
  assert rel_err(l_pallas, l_ref) < 1e-5
  for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
    assert rel_err(a, b) < 1e-4


@pytest.mark.parametrize('remat, kernels', [('dots', 3), ('dots_no_batch', 3), ('full', 4)])
def test_dots_remat_keeps_the_fused_attention_forward_for_the_backward(remat, kernels):
  """The gradient's program runs the Pallas forward kernel once per layer and its two backward
  kernels: 'dots' keeps the forward's output and logsumexp (attention.forward_saveable) where
  'full' recomputes them (cuDNN's: tests/test_plan.py counts them in the compiled H100 step)."""
  cfg = small_config(attention='pallas', remat=remat)
  model, params = init(cfg, T=32)
  tokens = random_tokens(10, 2, 32, cfg.vocab_size)
  grad = jax.grad(lambda p: jnp.sum(model.apply({'params': p}, tokens)))
  assert str(jax.make_jaxpr(grad)(params)).count('pallas_call[') == kernels
