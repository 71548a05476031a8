"""FP8 matmuls for the dense projections (model.fp8): e4m3 operands, per-tensor scales.

Each operand of a projection's matmuls is quantized to float8_e4m3fn with a per-tensor scale
(x ≈ q · scale): the forward operands (activations and weights); the gradient arriving at the
matmul's output is quantized to model.fp8_gradients' format, e4m3 (448 its largest value, 3
mantissa bits) or e5m2 (57344, 2 bits; Transformer Engine's HYBRID recipe), each scaled to its
own largest value (BENCHMARKS.md compares them on the embedded default). The three matmuls of a
projection (forward, and the two of its backward pass) take the FP8 arrays themselves, accumulate
and write float32, multiply by the product of their float32 scales and cast to the compute dtype
(cuBLASLt's and Transformer Engine's order, which XLA fuses into the GEMM; float16 overflowed
when the GEMM wrote it before the scales); the CPU runs the same FP8 arithmetic, so the numerics
are checked without a GPU.

Two ways to scale, one arithmetic:
  delayed (the train step's, given each projection's amax history): the activation's and the
      gradient's scales come from the largest |value| each had over the last HISTORY steps
      (Transformer Engine's and flax's delayed scaling); while a history holds no amax yet
      (the first step) from the tensor's own, not 1. The step records this step's amax of
      each, which the train state's history (TrainState.fp8) takes in: the maximum over
      micro-batches and data-parallel devices, never a sum (state.py), and a non-finite one
      (an infinite gradient, clipped to the format's largest value when quantized) makes the
      step's gradient norm infinite, so that the guard skips the step and keeps the history.
      The weights are scaled from their own amax (current scaling), and quantized once a step
      for all its micro-batches (`prepare`, before the train step's micro-batch loop, with the
      activations' and gradients' delayed scales: nothing in them changes between micro-batches);
      the first step (every history empty) runs as a branch of its own (state.py's lax.cond),
      so that the other steps' quantizations wait for no amax.
  current (no history: evaluation): every operand scaled from its own amax.
  inference (the engine's and lm_eval's params, runner.decoding_params; Transformer Engine's
      delayed recipe at inference): each weight quantized once, `quantize_weight` (per tensor,
      from its own amax, as the train step does: its scale one value a column, so that the
      engine's fused wqkv and w_gate_up keep each projection's), and the activation scaled from
      its history's largest amax (`input_amax`), the scale the next train step uses, fixed, so a
      row computes the same alone or in any batch (`quantized_dense`). With no amax recorded (a
      fresh or imported model, a non-FP8 checkpoint: 0) each row, a token, is scaled from its
      own amax instead: batch-independent too.
The history of a projection weight 'wq' is 'wq_fp8' beside it ([2, HISTORY]: row 0 the
activation's, row 1 the gradient's), in a tree of the params' nesting (`histories`); the
train step gives it to the model with the params (`merge`) and takes this step's amaxes back as
its gradient (`split`: column 0 of each, the rest zero); `prepare`'s quantized weights and
scales ('wq_fp8_weight', 'wq_fp8_scales', 'wq_fp8_input') go beside them the same way, not
differentiated.
Quantizing is flax's (flax.linen.fp8_ops.quantize: scale, clip, round).
"""
import functools
import math

from flax.linen import fp8_ops
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

FORWARD_DTYPE = jnp.float8_e4m3fn
# model.fp8_gradients: the format of the gradient at a projection's output (e4m3: largest 448,
# 3 mantissa bits; e5m2: largest 57344, 2 mantissa bits), each scaled to its own largest value.
GRADIENT_DTYPES = {'e4m3': jnp.float8_e4m3fn, 'e5m2': jnp.float8_e5m2}
GRADIENT_FORMAT = 'e4m3'  # model.fp8_gradients' default (BENCHMARKS.md)
HISTORY = 16  # steps of amax history a delayed scale looks back over (Transformer Engine: 1-1024)
SUFFIX = '_fp8'  # the history of projection weight 'wq' is 'wq_fp8'
# At inference (quantize_weight, quantized_dense), beside a weight 'wq' quantized once: its scales
# 'wq_scale' (one a column) and its activation's largest recorded amax 'wq_input_amax'.
WEIGHT_SCALE, INPUT_AMAX = '_scale', '_input_amax'
WEIGHT = '_fp8_weight'  # 'wq_fp8_weight': wq in e4m3, quantized once a step (prepare)
SCALES = '_fp8_scales'  # 'wq_fp8_scales': its step's scales (prepare)
INPUT = '_fp8_input'  # 'wq_fp8_input': its input's scale for the step (prepare)
QUANTIZED = 'fp8_quantized'  # the name (jax.ad_checkpoint) of a projection's quantized operands
OUTPUT = 'fp8_output'  # the name of an FP8 matmul's output (scaled, in the compute dtype)


def _quantize(x: jax.Array, q_dtype) -> tuple[jax.Array, jax.Array]:
  """(x in q_dtype, its float32 scale): x ≈ q * scale, the scale from x's own amax."""
  scale = scale_of(_amax(x), q_dtype)
  return fp8_ops.quantize(x, q_dtype, scale, jnp.float32), scale


def _amax(x: jax.Array) -> jax.Array:
  """max |x| in float32: each row's (the last axis) first, then theirs, the same value; a
  reduction that keeps x's shape as its input is one that XLA fuses with x's quantization beside
  it (one read of x, not two: a reduction to one value is split into stages of other shapes)."""
  return jnp.max(jnp.max(jnp.abs(x), axis=-1).astype(jnp.float32))


def largest(q_dtype) -> float:
  """q_dtype's largest finite value: a float8's (e4m3: 448) or an integer's (int8: 127)."""
  d = jnp.dtype(q_dtype)
  return float(jnp.iinfo(d).max if jnp.issubdtype(d, jnp.integer) else jnp.finfo(d).max)


def scale_of(amax: jax.Array, q_dtype) -> jax.Array:
  """The scale that maps amax to q_dtype's largest finite value (1 for an amax of 0; NaN for a
  NaN amax, so that a NaN survives even an integer type, in its scale); elementwise, so per
  tensor here and per head and position in the engine's 8-bit KV cache (model.quantize)."""
  return jnp.where(amax == 0, 1.0, amax / largest(q_dtype))


def _scaled_dot(a, b, dims, scale, dtype):
  """dot_general of two FP8 arrays, accumulated and written in float32, times the product of
  their float32 scales, then cast to the compute dtype: cuBLASLt's and Transformer Engine's
  order (XLA's GEMM rewriter folds the scale and the cast into the FP8 GEMM). Written in the
  compute dtype before scaling, float16's sums of operands scaled up to ±448 overflow."""
  out = jax.lax.dot_general(a, b, (dims, ((), ())), preferred_element_type=jnp.float32)
  # (named: remat policies that keep matmul outputs keep this one, in the compute dtype, and not
  # the float32 GEMM output before it)
  return checkpoint_name((out * scale).astype(dtype), OUTPUT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _matmul(x_MxK: jax.Array, w_KxN: jax.Array, gradient_dtype) -> jax.Array:
  """x @ w in FP8; x and w in the same (compute) dtype, which the output keeps."""
  return _matmul_fwd(x_MxK, w_KxN, gradient_dtype)[0]


def _matmul_fwd(x_MxK, w_KxN, gradient_dtype):
  del gradient_dtype
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


def _matmul_bwd(gradient_dtype, residuals, g_MxN):
  qx_MxK, sx, qw_KxN, sw = residuals
  qg_MxN, sg = _quantize(g_MxN, gradient_dtype)
  return _backward_dots(qx_MxK, sx, qw_KxN, sw, qg_MxN, sg, g_MxN.dtype)


_matmul.defvjp(_matmul_fwd, _matmul_bwd)


def _delayed_scale(history_amax: jax.Array, amax: jax.Array, q_dtype) -> jax.Array:
  """The delayed scale of a history's largest amax; while the history holds none yet (the first
  step), the tensor's own amax: current scaling, so no tensor is quantized with scale 1."""
  return scale_of(jnp.where(history_amax > 0, history_amax, amax), q_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _delayed_matmul(x_MxK: jax.Array, w_KxN: jax.Array, qw_KxN: jax.Array, scales: jax.Array,
                    scale_x: jax.Array | None, history_2xH: jax.Array,
                    gradient_dtype) -> jax.Array:
  """x @ w in FP8 with w's e4m3 form qw_KxN and its scales (prepare's): x's scale `scale_x` and
  `scales` [w's, the gradient's], the step's; without scale_x, `scales` [w's] and x's and the
  gradient's scales from history_2xH (the module docstring), which wait for their tensors'
  amaxes. The gradient of w_KxN (which the product reads only as qw_KxN) is dw; that of
  history_2xH [[amax(|x|), 0, ...], [amax(|gradient|), 0, ...]]; qw_KxN and the scales get
  none."""
  return _delayed_matmul_fwd(x_MxK, w_KxN, qw_KxN, scales, scale_x, history_2xH,
                             gradient_dtype)[0]


def _delayed_matmul_fwd(x_MxK, w_KxN, qw_KxN, scales, scale_x, history_2xH, gradient_dtype):
  del w_KxN, gradient_dtype
  history_x, history_g = jnp.max(history_2xH, axis=1)
  amax_x = _amax(x_MxK)
  if scale_x is None:
    scale_x = _delayed_scale(history_x, amax_x, FORWARD_DTYPE)
  qx_MxK = fp8_ops.quantize(x_MxK, FORWARD_DTYPE, scale_x, jnp.float32)
  # (named: a remat policy keeps them, so that the backward quantizes nothing twice)
  qx_MxK, amax_x = checkpoint_name((qx_MxK, amax_x), QUANTIZED)
  y_MxN = _scaled_dot(qx_MxK, qw_KxN, ((1,), (0,)), scale_x * scales[0], x_MxK.dtype)
  return y_MxN, (qx_MxK, scale_x, qw_KxN, scales, history_g, amax_x, history_2xH.shape)


def _delayed_matmul_bwd(gradient_dtype, residuals, g_MxN):
  qx_MxK, scale_x, qw_KxN, scales, history_g, amax_x, history_shape = residuals
  amax_g = _amax(g_MxN)
  scale_g = (scales[1] if scales.shape[-1] == 2
             else _delayed_scale(history_g, amax_g, gradient_dtype))
  qg_MxN = fp8_ops.quantize(g_MxN, gradient_dtype, scale_g, jnp.float32)
  dx_MxK, dw_KxN = _backward_dots(qx_MxK, scale_x, qw_KxN, scales[0], qg_MxN, scale_g,
                                  g_MxN.dtype)
  amax_2xH = jnp.zeros(history_shape, jnp.float32).at[:, 0].set(jnp.stack([amax_x, amax_g]))
  return dx_MxK, dw_KxN, None, None, None, amax_2xH


_delayed_matmul.defvjp(_delayed_matmul_fwd, _delayed_matmul_bwd)


def dense(x: jax.Array, w: jax.Array, contract: int = 1, history: jax.Array | None = None,
          gradients: str = GRADIENT_FORMAT, quantized: tuple | None = None) -> jax.Array:
  """x's last `contract` dims times w's first `contract` dims (a dense projection), in FP8:
  delayed scaling with w's amax history [2, HISTORY], current scaling without one; the gradient
  at its output quantized to `gradients` (a key of GRADIENT_DTYPES). `quantized`: w's e4m3 form,
  its scales and x's scale (or None) as `prepare` makes them once a step (the train step's, with
  a history); without it, w is quantized here, from its own amax.

  E.g. dense(x_BxTxD, w_DxNxH) -> BxTxNxH; dense(o_BxTxNxH, w_NxHxD, contract=2) -> BxTxD.
  """
  lead, out = x.shape[:-contract], w.shape[contract:]
  k = math.prod(w.shape[:contract])
  x_MxK, w_KxN = x.reshape(-1, k), w.reshape(k, -1)
  g_dtype = GRADIENT_DTYPES[gradients]
  if history is None:
    y = _matmul(x_MxK, w_KxN, g_dtype)
  else:
    if quantized is None:
      qw_KxN, sw = checkpoint_name(_quantize(w_KxN, FORWARD_DTYPE), QUANTIZED)
      quantized = qw_KxN, sw[None], None
    qw, scales, scale_x = quantized
    y = _delayed_matmul(x_MxK, w_KxN, qw.reshape(k, -1), scales, scale_x, history, g_dtype)
  return y.reshape(*lead, *out)


def quantize_weight(w: jax.Array, contract: int = 1) -> tuple[jax.Array, jax.Array]:
  """(w in e4m3, its scale as one float32 a column: w's output dims): w (in the compute dtype)
  quantized as the train step's forward quantizes it, per tensor from its own amax; once, for
  inference (`quantized_dense`). Columns of one projection share its scale; weights fused along
  an output axis (the engine's wqkv) keep their own."""
  out = w.shape[contract:]
  q, scale = _quantize(w.reshape(math.prod(w.shape[:contract]), -1), FORWARD_DTYPE)
  return q.reshape(w.shape), jnp.broadcast_to(scale, out)


def input_amax(history_2xH: jax.Array) -> jax.Array:
  """The activation's largest recorded amax of a history [..., 2, HISTORY] (0: none recorded),
  from which its delayed scale comes, at inference as in the next train step."""
  return jnp.max(history_2xH[..., 0, :], axis=-1)


def quantized_dense(x: jax.Array, q_w: jax.Array, w_scale: jax.Array, amax: jax.Array,
                    contract: int = 1) -> jax.Array:
  """dense() at inference: x times a weight quantized once (quantize_weight: q_w and its scale
  per output column), x scaled from `amax` (input_amax: the delayed scale of the train step
  that comes next), or where that is 0 (no history) each row of x from its own amax; the same
  arithmetic as the train step's (float32 GEMM output and scales, then the compute dtype)."""
  lead, out = x.shape[:-contract], q_w.shape[contract:]
  k = math.prod(q_w.shape[:contract])
  x_MxK, q_KxN = x.reshape(-1, k), q_w.reshape(k, -1)
  amax_Mx1 = jnp.max(jnp.abs(x_MxK), axis=1, keepdims=True).astype(jnp.float32)
  scale_Mx1 = _delayed_scale(amax.astype(jnp.float32), amax_Mx1, FORWARD_DTYPE)
  qx_MxK = fp8_ops.quantize(x_MxK, FORWARD_DTYPE, scale_Mx1, jnp.float32)
  scale_MxN = scale_Mx1 * w_scale.astype(jnp.float32).reshape(1, -1)
  return _scaled_dot(qx_MxK, q_KxN, ((1,), (0,)), scale_MxN, x.dtype).reshape(*lead, *out)


def prepare(weights, first_step: bool, gradients: str = GRADIENT_FORMAT,
            same_input: tuple[tuple[str, ...], ...] = ()):
  """The train step's FP8 weights, quantized once for all of a step's micro-batches (under
  delayed scaling nothing in a weight's quantization changes between them): for each projection
  weight 'wq' of `weights` (with_compute_weights': the compute dtype, the layout the model runs)
  with its amax history 'wq_fp8' beside it, 'wq_fp8_weight' (wq in e4m3, scaled from its own
  amax, per layer where stacked) and 'wq_fp8_scales', float32 [..., 2]: the weight's scale and
  the gradient's (delayed: its history's largest amax), and 'wq_fp8_input', its input's delayed
  scale; on the first step (`first_step`: every history empty) 'wq_fp8_scales' [..., 1], the
  weight's alone, and no input scale: each micro-batch's activations and gradients are scaled
  from themselves. (A delayed scale is 1 where a history is still empty after the first step,
  its tensors all zeros so far.) The projections of a group in `same_input` (model.py's: they
  read one input, whose amax each records) take one input scale, the same array, so that the
  compiled step quantizes that input once for all of them. A tree of the weights' nesting, for
  `merge`; {} where no weight has a history."""
  out: dict = {}
  for key, value in weights.items():
    if isinstance(value, dict):
      sub = prepare(value, first_step, gradients, same_input)
      if sub:
        out[key] = sub
    elif key + SUFFIX in weights:
      history = weights[key + SUFFIX]
      lead = history.shape[:-2]  # (the stacked layers' axis, where the weights are stacked)
      amax = jnp.max(jnp.abs(value), axis=tuple(range(len(lead), value.ndim)))
      sw = scale_of(amax.astype(jnp.float32), FORWARD_DTYPE)
      out[key + WEIGHT] = fp8_ops.quantize(
          value, FORWARD_DTYPE, sw.reshape(*lead, *(1,) * (value.ndim - len(lead))), jnp.float32)
      delayed = () if first_step else (
          scale_of(jnp.max(history[..., 1, :], axis=-1), GRADIENT_DTYPES[gradients]),)
      out[key + SCALES] = jnp.stack([sw, *delayed], axis=-1)
  if not first_step:
    groups = [g for g in same_input if g[0] + SUFFIX in weights]
    for group in groups + [(k,) for k in weights if k + SUFFIX in weights
                           and not any(k in g for g in groups)]:
      amax_x = jnp.max(jnp.stack([weights[k + SUFFIX][..., 0, :] for k in group]), axis=(0, -1))
      scale_x = scale_of(amax_x, FORWARD_DTYPE)
      out.update({k + INPUT: scale_x for k in group})
  return out


def empty(fp8_histories) -> jax.Array:
  """Whether no history holds an amax yet (a run's first step, or steps skipped since): the
  train step then scales activations and gradients from themselves (prepare's first_step)."""
  return jnp.all(jnp.stack([jnp.all(h == 0) for h in jax.tree.leaves(fp8_histories)]))


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


def merge(params, beside):
  """params with the histories (or prepare's quantized weights) beside their weights, a tree of
  their nesting (what the train step gives the model)."""
  if not beside:
    return params
  out = dict(params)
  for key, value in beside.items():
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


def all_finite(amaxes) -> jax.Array:
  """Whether every amax a step recorded (`split`'s; None without FP8) is finite: an infinite
  gradient quantizes to its format's largest value, and only its amax shows it (state.py's
  guard)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(amaxes)] or
                           [jnp.bool_(True)]))


def updated(fp8_histories, amaxes, keep: jax.Array):
  """Each history with this step's amax (column 0 of `amaxes`, `split`'s) first and its oldest
  dropped; unchanged where `keep` (a step dropped as non-finite, a non-finite amax among them)."""
  def update(history, amax):
    new = jnp.concatenate([amax[..., :1], history[..., :-1]], axis=-1)
    return jnp.where(keep, history, new)
  return jax.tree.map(update, fp8_histories, amaxes)
