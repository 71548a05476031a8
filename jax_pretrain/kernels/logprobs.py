"""Log-probabilities of the target tokens from the model's final hidden states, computed in chunks
of the sequence: no [tokens, vocabulary] array (the logits, or their gradient) is ever held.

The output head's logits are B·T·V float32 (2 GiB for 8 × 2048 tokens and a 32,768-token
vocabulary), and their gradient as much again; XLA computed the head's two backward GEMMs against
that float32 gradient (TF32 on a GPU; BENCHMARKS.md, issue 30). Here,
`target_logprobs` runs a scan over chunks of the sequence: each chunk's logits come from compute
dtype operands with float32 accumulation, give the target's logit and the logsumexp at each
temperature, and are dropped. The backward (a custom VJP) recomputes each chunk's logits (one GEMM
more: 2·D·V FLOPs a token, ~1% of a step), forms their gradient in float32 from the saved
logsumexps, casts it to the compute dtype and runs both GEMMs, dx and dW, on compute-dtype operands
with float32 accumulation; dW is summed over the chunks in float32. A temperature whose
log-probabilities get no gradient (GRPO's stop_gradient ones) costs nothing in the backward.

Chunks split the sequence, not the batch, so the batch keeps its sharding; their length is the
largest divisor of T whose float32 logits take at most CHUNK_BYTES per device. Under a mesh the
logits are split over the vocabulary as before ('act_vocab'), and the target's logit is a masked
sum, not a gather (XLA's SPMD partitioner aborts on that gather when the vocabulary is split over
'tensor' inside the train step's shard_map).

Shape suffixes: B batch, T length, C chunk length, N chunks, D d_model, V vocab.
"""
import functools
import math

import jax
from jax.custom_derivatives import SymbolicZero
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_pretrain import sharding

# A chunk's float32 logits per device at most (256 MiB: 2,048 tokens of a 32,768-token vocabulary,
# GEMMs of 2,048 rows, which keep a GPU's tensor cores busy).
CHUNK_BYTES = 256 * 2**20


def _devices_along(logical: str, mesh: Mesh | None) -> int:
  """How many devices split an array's dimension named `logical` (outside any enclosing
  shard_map's manual axes, along which the array is already this device's block)."""
  if mesh is None:
    return 1
  axes = sharding.logical_to_spec((logical,))[0]
  axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
  return math.prod(mesh.shape[a] for a in axes)


def chunk_length(B: int, T: int, V: int, mesh: Mesh | None = None) -> int:
  """The largest divisor of T whose chunk of float32 logits [B, C, V] takes at most CHUNK_BYTES
  per device (1 where none does)."""
  per_token = 4 * (B // _devices_along('batch', mesh)) * (V // _devices_along('act_vocab', mesh))
  fitting = [c for c in range(1, T + 1) if T % c == 0 and c * per_token <= CHUNK_BYTES]
  return max(fitting, default=1)


def target_logprobs(x_BxTxD: jax.Array, w_DxV: jax.Array, targets_BxT: jax.Array,
                    temperatures: tuple[float, ...] = (1.0,),
                    mesh: Mesh | None = None) -> tuple[jax.Array, ...]:
  """log softmax(x @ w / temperature)[target], float32 [B, T], for each temperature.

  x_BxTxD: the final hidden states (after the final norm), w_DxV: the output projection, both in
  the compute dtype; targets_BxT: int token ids. Equal to the log-softmax of the full float32
  logits x @ w (the model's logits) up to float32 rounding, in float32 compute; in bfloat16, the
  backward's logit gradient is rounded to bfloat16 before its GEMMs (they took it in float32)."""
  B, T, _ = x_BxTxD.shape
  C = chunk_length(B, T, w_DxV.shape[1], mesh)
  return _logprobs(tuple(temperatures), C, mesh, x_BxTxD, w_DxV, targets_BxT)


def _chunks(a_BxT: jax.Array, C: int) -> jax.Array:
  """[B, T, ...] -> [T/C, B, C, ...]: the chunks, for a scan."""
  B, T = a_BxT.shape[:2]
  return jnp.moveaxis(a_BxT.reshape(B, T // C, C, *a_BxT.shape[2:]), 1, 0)


def _unchunk(a_NxBxC: jax.Array) -> jax.Array:
  """[T/C, B, C, ...] -> [B, T, ...]."""
  N, B, C = a_NxBxC.shape[:3]
  return jnp.moveaxis(a_NxBxC, 0, 1).reshape(B, N * C, *a_NxBxC.shape[3:])


def _logits(x_BxCxD, w_DxV, mesh):
  """A chunk's logits, float32 [B, C, V], split over the vocabulary like the model's."""
  logits_BxCxV = jnp.einsum('bcd,dv->bcv', x_BxCxD, w_DxV, preferred_element_type=jnp.float32)
  return sharding.constrain(logits_BxCxV, ('batch', 'length', 'act_vocab'), mesh)


def _is_target(targets_BxC, V: int):
  return targets_BxC[..., None] == jnp.arange(V)


def _scaled(logits, temperature: float):
  return logits if temperature == 1.0 else logits / temperature


def _forward(temperatures, C, mesh, x_BxTxD, w_DxV, targets_BxT):
  """(log-probabilities, logsumexps): one float32 [B, T] per temperature each."""
  V = w_DxV.shape[1]

  def chunk(_, xs):
    x_BxCxD, targets_BxC = xs
    logits_BxCxV = _logits(x_BxCxD, w_DxV, mesh)
    target_BxC = jnp.sum(jnp.where(_is_target(targets_BxC, V), logits_BxCxV, 0.0), axis=-1)
    return None, (target_BxC, tuple(jax.nn.logsumexp(_scaled(logits_BxCxV, t), axis=-1)
                                    for t in temperatures))

  _, (target_NxBxC, lses) = jax.lax.scan(chunk, None, (_chunks(x_BxTxD, C),
                                                       _chunks(targets_BxT, C)))
  target_BxT, lses = _unchunk(target_NxBxC), tuple(_unchunk(lse) for lse in lses)
  return tuple(_scaled(target_BxT, t) - lse for t, lse in zip(temperatures, lses)), lses


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _logprobs(temperatures, C, mesh, x_BxTxD, w_DxV, targets_BxT):
  return _forward(temperatures, C, mesh, x_BxTxD, w_DxV, targets_BxT)[0]


def _logprobs_fwd(temperatures, C, mesh, x, w, targets):
  # (symbolic_zeros: the differentiable arguments come as CustomVJPPrimal records)
  x_BxTxD, w_DxV, targets_BxT = x.value, w.value, targets.value
  logprobs, lses = _forward(temperatures, C, mesh, x_BxTxD, w_DxV, targets_BxT)
  return logprobs, (x_BxTxD, w_DxV, targets_BxT, lses)


def _logprobs_bwd(temperatures, C, mesh, residuals, cotangents):
  """d logp_t / d logits = (onehot(target) - softmax(logits / t)) / t, weighted by each
  temperature's cotangent and summed; then dx = dlogits @ w.T and dW = x.T @ dlogits."""
  x_BxTxD, w_DxV, targets_BxT, lses = residuals
  # A barrier, so that XLA never merges the recomputed logits with the forward's (it did for one
  # chunk, keeping them alive instead): the step's FLOPs and memory then do not depend on the
  # number of chunks, which the micro-batch fit compares (memory.search_micro_batch).
  x_BxTxD, w_DxV = jax.lax.optimization_barrier((x_BxTxD, w_DxV))
  used = [(t, lse, g) for t, lse, g in zip(temperatures, lses, cotangents)
          if not isinstance(g, SymbolicZero)]
  if not used:
    return jnp.zeros(x_BxTxD.shape, x_BxTxD.dtype), jnp.zeros(w_DxV.shape, w_DxV.dtype), None
  V = w_DxV.shape[1]

  def chunk(dw_DxV, xs):
    x_BxCxD, targets_BxC, lse_and_g = xs
    logits_BxCxV = _logits(x_BxCxD, w_DxV, mesh)
    g_BxC = [g / t for (t, _, _), (_, g) in zip(used, lse_and_g)]  # each cotangent / t
    dlogits_BxCxV = jnp.where(_is_target(targets_BxC, V), sum(g_BxC[1:], g_BxC[0])[..., None], 0.0)
    for (t, _, _), (lse_BxC, _), g in zip(used, lse_and_g, g_BxC):
      dlogits_BxCxV = dlogits_BxCxV - g[..., None] * jnp.exp(
          _scaled(logits_BxCxV, t) - lse_BxC[..., None])
    dlogits_BxCxV = sharding.constrain(dlogits_BxCxV.astype(x_BxCxD.dtype),
                                       ('batch', 'length', 'act_vocab'), mesh)
    dx_BxCxD = jnp.einsum('bcv,dv->bcd', dlogits_BxCxV, w_DxV, preferred_element_type=jnp.float32)
    dw_DxV = dw_DxV + jnp.einsum('bcd,bcv->dv', x_BxCxD, dlogits_BxCxV,
                                 preferred_element_type=jnp.float32)
    return dw_DxV, dx_BxCxD.astype(x_BxCxD.dtype)

  lse_and_g = tuple((_chunks(lse, C), _chunks(g.astype(jnp.float32), C)) for _, lse, g in used)
  dw_DxV, dx_NxBxCxD = jax.lax.scan(chunk, jnp.zeros(w_DxV.shape, jnp.float32),
                                    (_chunks(x_BxTxD, C), _chunks(targets_BxT, C), lse_and_g))
  return _unchunk(dx_NxBxCxD), dw_DxV.astype(w_DxV.dtype), None


_logprobs.defvjp(_logprobs_fwd, _logprobs_bwd, symbolic_zeros=True)
