"""FP8 matmuls for the dense projections (model.fp8): e4m3 operands, per-tensor scales.

Each operand of a projection's matmuls is quantized to float8_e4m3fn with a per-tensor scale
(x ≈ q · scale): the forward operands (activations and weights) and the gradient arriving at the
matmul's output. The gradient is e4m3 too, not the customary e5m2: a per-tensor scale already
gives it its range, and e4m3's extra mantissa bit matters more (BENCHMARKS.md: the embedded
default's eval loss with e5m2 and e4m3 gradients). The three matmuls of a projection (forward,
and the two of its backward pass) take the FP8 arrays themselves, accumulate in float32 and write
the compute dtype, times the product of their scales (one multiply in that dtype, the form XLA's
GEMM rewriter folds into the GEMM); the CPU runs the same FP8 arithmetic, so the numerics are
checked without a GPU.

Two ways to scale, one arithmetic:
  delayed (the train step's, given each projection's amax history): the activation's and the
      gradient's scales come from the largest |value| each had over the last HISTORY steps
      (Transformer Engine's and flax's delayed scaling), so quantizing needs no pass over the
      tensor first and XLA fuses it into the kernel that produces it; the step records this
      step's amax of each, which the train state's history (TrainState.fp8) takes in: the
      maximum over micro-batches and data-parallel devices, never a sum (state.py). The
      weights, read once per micro-batch, are scaled from their own amax (current scaling).
  current (no history: evaluation, the engine): every operand scaled from its own amax.
The history of a projection weight 'wq' is 'wq_fp8' beside it ([2, HISTORY]: row 0 the
activation's, row 1 the gradient's), in a tree of the params' nesting (`histories`); the
train step gives it to the model with the params (`merge`) and takes this step's amaxes back as
its gradient (`split`: column 0 of each, the rest zero). Quantizing is flax's
(flax.linen.fp8_ops.quantize: scale, clip, round).
"""
import math

from flax.linen import fp8_ops
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

FORWARD_DTYPE = jnp.float8_e4m3fn
GRADIENT_DTYPE = jnp.float8_e4m3fn  # (e5m2: see above)
HISTORY = 16  # steps of amax history a delayed scale looks back over (Transformer Engine: 1-1024)
SUFFIX = '_fp8'  # the history of projection weight 'wq' is 'wq_fp8'
QUANTIZED = 'fp8_quantized'  # the name (jax.ad_checkpoint) of a projection's quantized operands


def _quantize(x: jax.Array, q_dtype) -> tuple[jax.Array, jax.Array]:
  """(x in q_dtype, its float32 scale): x ≈ q * scale, the scale from x's own amax."""
  scale = scale_of(_amax(x), q_dtype)
  return fp8_ops.quantize(x, q_dtype, scale, jnp.float32), scale


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def largest(q_dtype) -> float:
  """q_dtype's largest finite value: a float8's (e4m3: 448) or an integer's (int8: 127)."""
  d = jnp.dtype(q_dtype)
  return float(jnp.iinfo(d).max if jnp.issubdtype(d, jnp.integer) else jnp.finfo(d).max)


def scale_of(amax: jax.Array, q_dtype) -> jax.Array:
  """The scale that maps amax to q_dtype's largest finite value (1 for an amax of 0); elementwise,
  so per tensor here and per head and position in the engine's 8-bit KV cache (model.quantize)."""
  return jnp.where(amax > 0, amax / largest(q_dtype), 1.0)


def _scaled_dot(a, b, dims, scale, dtype):
  """dot_general of two FP8 arrays (accumulated in float32 by the GEMM, written in the compute
  dtype: remat policies that keep matmul outputs keep them at that size), times the product of
  their scales: in that dtype, no conversion between the GEMM and its scale."""
  out = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=dtype)
  return out * scale.astype(dtype)


@jax.custom_vjp
def _matmul(x_MxK: jax.Array, w_KxN: jax.Array) -> jax.Array:
  """x @ w in FP8; x and w in the same (compute) dtype, which the output keeps."""
  return _matmul_fwd(x_MxK, w_KxN)[0]


def _matmul_fwd(x_MxK, w_KxN):
  qx_MxK, sx = _quantize(x_MxK, FORWARD_DTYPE)
  qw_KxN, sw = _quantize(w_KxN, FORWARD_DTYPE)
  y_MxN = _scaled_dot(qx_MxK, qw_KxN, ((1,), (0,)), sx * sw, x_MxK.dtype)
  return y_MxN, (qx_MxK, sx, qw_KxN, sw)


def _backward_dots(qx_MxK, sx, qw_KxN, sw, qg_MxN, sg, dtype):
  """(dx, dw) of a projection from its quantized operands and gradient and their scales (x, w
  and the output share the compute dtype: the model casts the weights to it)."""
  dx_MxK = _scaled_dot(qg_MxN, qw_KxN, ((1,), (1,)), sg * sw, dtype)
  dw_KxN = _scaled_dot(qx_MxK, qg_MxN, ((0,), (0,)), sx * sg, dtype)
  return dx_MxK, dw_KxN


def _matmul_bwd(residuals, g_MxN):
  qx_MxK, sx, qw_KxN, sw = residuals
  qg_MxN, sg = _quantize(g_MxN, GRADIENT_DTYPE)
  return _backward_dots(qx_MxK, sx, qw_KxN, sw, qg_MxN, sg, g_MxN.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


@jax.custom_vjp
def _delayed_matmul(x_MxK: jax.Array, w_KxN: jax.Array, history_2xH: jax.Array) -> jax.Array:
  """x @ w in FP8, x's and the gradient's scales from history_2xH (the module docstring); the
  gradient of history_2xH is [[amax(|x|), 0, ...], [amax(|gradient|), 0, ...]]."""
  return _delayed_matmul_fwd(x_MxK, w_KxN, history_2xH)[0]


def _delayed_matmul_fwd(x_MxK, w_KxN, history_2xH):
  scale_x, scale_g = scale_of(jnp.max(history_2xH, axis=1), FORWARD_DTYPE)
  qx_MxK = fp8_ops.quantize(x_MxK, FORWARD_DTYPE, scale_x, jnp.float32)
  qw_KxN, sw = _quantize(w_KxN, FORWARD_DTYPE)
  # (named: a remat policy keeps them, so that the backward quantizes nothing twice)
  qx_MxK, qw_KxN, sw, amax_x = checkpoint_name((qx_MxK, qw_KxN, sw, _amax(x_MxK)), QUANTIZED)
  y_MxN = _scaled_dot(qx_MxK, qw_KxN, ((1,), (0,)), scale_x * sw, x_MxK.dtype)
  return y_MxN, (qx_MxK, scale_x, qw_KxN, sw, scale_g, amax_x, history_2xH.shape)


def _delayed_matmul_bwd(residuals, g_MxN):
  qx_MxK, scale_x, qw_KxN, sw, scale_g, amax_x, history_shape = residuals
  qg_MxN = fp8_ops.quantize(g_MxN, GRADIENT_DTYPE, scale_g, jnp.float32)
  dx_MxK, dw_KxN = _backward_dots(qx_MxK, scale_x, qw_KxN, sw, qg_MxN, scale_g, g_MxN.dtype)
  amax_2xH = jnp.zeros(history_shape, jnp.float32).at[:, 0].set(
      jnp.stack([amax_x, _amax(g_MxN)]))
  return dx_MxK, dw_KxN, amax_2xH


_delayed_matmul.defvjp(_delayed_matmul_fwd, _delayed_matmul_bwd)


def dense(x: jax.Array, w: jax.Array, contract: int = 1,
          history: jax.Array | None = None) -> jax.Array:
  """x's last `contract` dims times w's first `contract` dims (a dense projection), in FP8:
  delayed scaling with w's amax history [2, HISTORY], current scaling without one.

  E.g. dense(x_BxTxD, w_DxNxH) -> BxTxNxH; dense(o_BxTxNxH, w_NxHxD, contract=2) -> BxTxD.
  """
  lead, out = x.shape[:-contract], w.shape[contract:]
  k = math.prod(w.shape[:contract])
  x_MxK, w_KxN = x.reshape(-1, k), w.reshape(k, -1)
  y = _matmul(x_MxK, w_KxN) if history is None else _delayed_matmul(x_MxK, w_KxN, history)
  return y.reshape(*lead, *out)


def is_history(path) -> bool:
  """Whether a params-tree path (jax.tree_util's) names an amax history."""
  return str(getattr(path[-1], 'key', '')).endswith(SUFFIX)


def histories(params, projections: tuple[str, ...]):
  """Fresh (zero) amax histories of the projection weights named `projections` in `params`
  (arrays or their shapes): a tree of the params' nesting, each [*layers, 2, HISTORY] float32,
  with the stacked layers' leading axis where the weight has one."""
  def walk(tree, stacked):
    out = {}
    for key, value in tree.items():
      if isinstance(value, dict):
        sub = walk(value, stacked or key == 'layers')
        if sub:
          out[key] = sub
      elif key in projections:
        out[key + SUFFIX] = jnp.zeros((*value.shape[:1 if stacked else 0], 2, HISTORY),
                                      jnp.float32)
    return out
  return walk(params, False)


def merge(params, fp8_histories):
  """params with the histories beside their weights (what the train step gives the model)."""
  if not fp8_histories:
    return params
  out = dict(params)
  for key, value in fp8_histories.items():
    out[key] = merge(params[key], value) if isinstance(value, dict) else value
  return out


def split(tree):
  """merge's inverse: (the tree without its histories, the histories; None where it has none)."""
  rest, found = {}, {}
  for key, value in tree.items():
    if isinstance(value, dict):
      rest[key], sub = split(value)
      if sub:
        found[key] = sub
    elif key.endswith(SUFFIX):
      found[key] = value
    else:
      rest[key] = value
  return rest, found or None


def combine(path, a: jax.Array, b: jax.Array) -> jax.Array:
  """Two micro-batches' gradients of one leaf of merged params: summed, but an amax history's
  recorded amaxes take their maximum."""
  return jnp.maximum(a, b) if is_history(path) else a + b


def updated(fp8_histories, amaxes, keep: jax.Array):
  """Each history with this step's amax (column 0 of `amaxes`, `split`'s) first and its oldest
  dropped; unchanged where `keep` (a step dropped as non-finite) or the amax is not finite."""
  def update(history, amax):
    new = jnp.concatenate([amax[..., :1], history[..., :-1]], axis=-1)
    return jnp.where(keep | ~jnp.all(jnp.isfinite(amax[..., :1])), history, new)
  return jax.tree.map(update, fp8_histories, amaxes)
