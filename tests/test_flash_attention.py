"""Pallas flash attention (interpret mode on CPU) against jax.nn.dot_product_attention."""
import jax
import jax.numpy as jnp
import pytest

from jax_pretrain.kernels.flash_attention import flash_attention

_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2}


def _rel_err(a, b):
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _inputs(seed, B, T, S, N, K, H, dtype):
  kq, kk, kv, kc = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (B, T, N, H), jnp.float32).astype(dtype)
  k = jax.random.normal(kk, (B, S, K, H), jnp.float32).astype(dtype)
  v = jax.random.normal(kv, (B, S, K, H), jnp.float32).astype(dtype)
  cotangent = jax.random.normal(kc, (B, T, N, H), jnp.float32).astype(dtype)
  return q, k, v, cotangent


def _value_and_grads(attend, q, k, v, cotangent):
  """o and d/d(q, k, v) of sum(o * cotangent), in one forward + backward."""
  o, pullback = jax.vjp(attend, q, k, v)
  return (o, *pullback(cotangent))


def _check(seed, B, T, S, N, K, H, dtype, causal, **blocks):
  q, k, v, ct = _inputs(seed, B, T, S, N, K, H, dtype)
  with jax.default_matmul_precision('float32'):
    ours = _value_and_grads(
        lambda q, k, v: flash_attention(q, k, v, causal=causal, **blocks), q, k, v, ct)
    # The reference sees the same (possibly bf16-rounded) inputs, computed in float32.
    f32 = lambda x: x.astype(jnp.float32)
    ref = _value_and_grads(
        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                     implementation='xla'),
        f32(q), f32(k), f32(v), f32(ct))
  for name, a, b, like in zip(('o', 'dq', 'dk', 'dv'), ours, ref, (q, q, k, v)):
    assert a.shape == b.shape and a.dtype == like.dtype, (name, a.shape, a.dtype)
    err = _rel_err(a, b)
    assert err < _TOL[dtype], f'{name}: relative error {err:.3g} >= {_TOL[dtype]}'


# (causal, N, K, H, block_q, block_k, T)
_F32_CASES = [
    (True, 4, 2, 64, 16, 16, 64),     # GQA 2:1
    (True, 4, 1, 64, 32, 16, 64),     # MQA, block_q > block_k
    (True, 2, 2, 64, 16, 32, 64),     # MHA, block_k > block_q
    (True, 4, 2, 128, 32, 32, 128),   # head dim 128
    (False, 4, 2, 64, 16, 32, 64),
    (False, 4, 1, 128, 32, 16, 64),
]


@pytest.mark.parametrize('causal,N,K,H,block_q,block_k,T', _F32_CASES)
def test_float32_matches_reference(causal, N, K, H, block_q, block_k, T):
  _check(0, 2, T, T, N, K, H, jnp.float32, causal, block_q=block_q, block_k=block_k)


@pytest.mark.parametrize('causal,N,K,H,block_q,block_k', [
    (True, 4, 2, 128, 32, 16),
    (True, 2, 2, 64, 16, 16),
    (False, 2, 2, 64, 16, 32),
])
def test_bfloat16_matches_reference(causal, N, K, H, block_q, block_k):
  _check(1, 2, 64, 64, N, K, H, jnp.bfloat16, causal, block_q=block_q, block_k=block_k)


def test_separate_backward_blocks():
  _check(2, 2, 64, 64, 4, 2, 64, jnp.float32, True, block_q=32, block_k=32,
         bwd_block_q=16, bwd_block_k=32)


def test_default_blocks_are_clamped_to_sequence():
  # block_q = block_k = 128 > T = 32: clamped to one block per sequence.
  _check(3, 1, 32, 32, 2, 1, 64, jnp.float32, True)


@pytest.mark.parametrize('causal,T,S', [(False, 32, 64), (True, 64, 32), (True, 32, 64)])
def test_different_query_and_key_lengths(causal, T, S):
  # Causal masks are top-left aligned (query i sees keys 0..i), like the reference.
  _check(4, 1, T, S, 2, 1, 64, jnp.float32, causal, block_q=16, block_k=16)


def test_grad_under_jit():
  q, k, v, ct = _inputs(5, 1, 32, 32, 2, 2, 64, jnp.float32)
  loss = lambda q, k, v, attend: jnp.sum(attend(q, k, v) * ct)
  ours = lambda q, k, v: flash_attention(q, k, v, block_q=16, block_k=16)
  ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                     implementation='xla')
  with jax.default_matmul_precision('float32'):
    got = jax.jit(jax.grad(lambda *a: loss(*a, ours), argnums=(0, 1, 2)))(q, k, v)
    want = jax.grad(lambda *a: loss(*a, ref), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(got, want):
    assert _rel_err(a, b) < 1e-5


def test_causal_differs_from_non_causal():
  # Guards against a mask that is silently never applied.
  q, k, v, _ = _inputs(6, 1, 32, 32, 2, 2, 64, jnp.float32)
  causal = flash_attention(q, k, v, causal=True, block_q=16, block_k=16)
  full = flash_attention(q, k, v, causal=False, block_q=16, block_k=16)
  assert _rel_err(causal, full) > 0.1
  # The last query sees every key, so its output is the same either way.
  assert _rel_err(causal[:, -1], full[:, -1]) < 1e-5


def _zeros(B, T, N, H, S=None, K=None):
  S, K = S or T, K or N
  return (jnp.zeros((B, T, N, H)), jnp.zeros((B, S, K, H)), jnp.zeros((B, S, K, H)))


def test_error_length_not_multiple_of_block_q():
  with pytest.raises(ValueError, match=r'sequence length 100 is not a multiple of block_q=64'):
    flash_attention(*_zeros(1, 100, 2, 64), block_q=64, block_k=50)


def test_error_length_not_multiple_of_block_k():
  with pytest.raises(ValueError, match=r'sequence length 96 is not a multiple of block_k=64'):
    flash_attention(*_zeros(1, 96, 2, 64), block_q=32, block_k=64)


def test_error_bad_gqa_ratio():
  with pytest.raises(ValueError, match=r'query heads 3 is not a multiple of .* kv heads 2'):
    flash_attention(*_zeros(1, 32, 3, 64, K=2), block_q=16, block_k=16)


def test_error_mismatched_shapes():
  q = jnp.zeros((1, 32, 2, 64))
  k = jnp.zeros((1, 32, 2, 64))
  with pytest.raises(ValueError, match=r'\(1, 32, 2, 64\).*\(1, 32, 2, 32\)'):
    flash_attention(q, k, jnp.zeros((1, 32, 2, 32)))
  with pytest.raises(ValueError, match=r'\(1, 32, 2, 64\).*\(1, 32, 2, 32\)'):
    flash_attention(q, jnp.zeros((1, 32, 2, 32)), jnp.zeros((1, 32, 2, 32)))
  with pytest.raises(ValueError, match=r'\(1, 32, 2, 64\).*\(2, 32, 2, 64\)'):
    flash_attention(q, jnp.zeros((2, 32, 2, 64)), jnp.zeros((2, 32, 2, 64)))


def test_error_gpu_block_not_power_of_two():
  # Triton tiles must be powers of two; checked up front, before any lowering.
  with pytest.raises(ValueError, match=r'block_q=48 .* power of two'):
    flash_attention(*_zeros(1, 96, 2, 64), block_q=48, block_k=32, interpret=False)
