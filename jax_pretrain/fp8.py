"""FP8 matmuls for the dense projections (model.fp8): per-tensor current scaling.

Each operand is quantized just before its matmul to float8_e4m3fn: the forward operands
(activations and weights) and the gradient arriving at the matmul's output, each with the scale
amax(|x|) / FP8_MAX computed from the tensor itself in the same step ("current scaling"). The
gradient is e4m3 too, not the customary e5m2: a per-tensor scale computed from the tensor itself
already gives it its range, and e4m3's extra mantissa bit matters more. Measured on the embedded
default (bfloat16, 200 steps, BENCHMARKS.md): eval loss +2.7% over bfloat16 with e5m2 gradients,
+0.26% with e4m3. The three matmuls of a projection (forward, and the two of its
backward pass) take the FP8 arrays themselves and are rescaled after: on an
NVIDIA GPU of compute capability >= 8.9 (Hopper, Ada) XLA lowers each to a cuBLASLt FP8 GEMM
(`__cublas$lt$matmul$f8` in the compiled program; tests/test_fp8.py counts them); the CPU runs
the same FP8 arithmetic, so the numerics are checked without a GPU.

Why current and not delayed scaling (flax's Fp8DotGeneralOp keeps amax histories in an
'_overwrite_with_gradient' collection): current scaling keeps no state, so the train state, its
checkpoints, gradient accumulation (which sums gradients: an amax history must not be summed) and
the data-parallel reduction stay as they are; its cost is one extra read of each operand to find
its amax (and, for an operand sharded over several devices, an all-reduce of one number). The
quantization itself is flax's (flax.linen.fp8_ops.quantize: scale, clip, round).
"""
import math

from flax.linen import fp8_ops
import jax
import jax.numpy as jnp

FORWARD_DTYPE = jnp.float8_e4m3fn
GRADIENT_DTYPE = jnp.float8_e4m3fn  # (e5m2: see above)


def _quantize(x: jax.Array, q_dtype) -> tuple[jax.Array, jax.Array]:
  """(x in q_dtype, its float32 scale): x ≈ q * scale, the scale from x's own amax."""
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  scale = jnp.where(amax > 0, amax / fp8_ops.get_fp8_max(q_dtype, jnp.float32), 1.0)
  return fp8_ops.quantize(x, q_dtype, scale, jnp.float32), scale


def _scaled_dot(a, b, dims, scale, dtype):
  """dot_general of two FP8 arrays (accumulated in float32 by the GEMM, written in the compute
  dtype: remat policies that keep matmul outputs keep them at that size), times the product of
  their scales."""
  out = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)
  return (out.astype(jnp.float32) * scale).astype(dtype)


@jax.custom_vjp
def _matmul(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """x @ w in FP8; x and w in the same (compute) dtype, which the output keeps."""
  return _matmul_fwd(x_MxK, w_KxN)[0]


def _matmul_fwd(x_MxK, w_KxN):
  qx_MxK, sx = _quantize(x_MxK, FORWARD_DTYPE)
  qw_KxN, sw = _quantize(w_KxN, FORWARD_DTYPE)
  y_MxN = _scaled_dot(qx_MxK, qw_KxN, ((1,), (0,)), sx * sw, x_MxK.dtype)
  return y_MxN, (qx_MxK, sx, qw_KxN, sw)


def _matmul_bwd(residuals, g_MxN):
  qx_MxK, sx, qw_KxN, sw = residuals
  qg_MxN, sg = _quantize(g_MxN, GRADIENT_DTYPE)
  # (x, w and the output share the compute dtype: the model casts the weights to it.)
  dx_MxK = _scaled_dot(qg_MxN, qw_KxN, ((1,), (1,)), sg * sw, g_MxN.dtype)
  dw_KxN = _scaled_dot(qx_MxK, qg_MxN, ((0,), (0,)), sx * sg, g_MxN.dtype)
  return dx_MxK, dw_KxN


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def dense(x: jax.Array, w: jax.Array, contract: int = 1) -> jax.Array:
  """x's last `contract` dims times w's first `contract` dims (a dense projection), in FP8.

  E.g. dense(x_BxTxD, w_DxNxH) -> BxTxNxH; dense(o_BxTxNxH, w_NxHxD, contract=2) -> BxTxD.
  """
  lead, out = x.shape[:-contract], w.shape[contract:]
  k = math.prod(w.shape[:contract])
  y = _matmul(x.reshape(-1, k), w.reshape(k, -1))
  return y.reshape(*lead, *out)
