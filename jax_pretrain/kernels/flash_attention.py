"""FlashAttention-2 in Pallas: fused softmax attention, forward and backward.

Algorithm (Dao, "FlashAttention-2", 2023). Attention is computed tile by tile without ever writing
the T×S score matrix to HBM:

* Forward: one program per (q block, batch, head). It keeps its q tile [block_q, H] on chip and
  loops (`fori_loop`) over key/value tiles [block_k, H], keeping a running row max `m`, running row
  sum `l` and an unnormalised float32 output accumulator (online softmax). At the end it writes
  `o = acc / l` and the row logsumexp `lse = m + log2(l)` for the backward. Scores are kept in
  base 2 (scaled by `log2(e) / sqrt(H)`) so that the exponentials are `exp2`, which is one
  instruction on GPUs.
* Backward: `D = rowsum(dO * O)` is computed first (an XLA reduction). Then two kernels recompute
  `P = exp2(s - lse)` from q, k and the saved lse: a dK/dV kernel (one program per kv block and kv
  head, looping over the q blocks of every query head of its group, so GQA reductions happen in
  registers and no atomics are needed) and a dQ kernel (one program per q block and query head,
  looping over kv blocks).
* Causal: tiles entirely above the diagonal are skipped by the loop bounds; the tiles that cross
  the diagonal run in a separate loop that applies the mask, so the common, fully visible tiles pay
  nothing for masking. The mask is aligned at the top left (query i sees keys 0..i), as in
  `jax.nn.dot_product_attention`.

Memory layout: q, o, dq are [B, T, N, H] and k, v, dk, dv are [B, S, K, H] (batch, length, heads,
head_dim; the layout of `jax.nn.dot_product_attention`), used in place: the BlockSpecs pick one
head out of the strided array, so there is no transpose. The residuals lse and D are float32
[B, N, T] (contiguous per head, so a q tile's statistics are one contiguous load). With
grouped-query attention (N = G * K) query head n reads kv head n // G through the BlockSpec index
map; k and v are never repeated in HBM.

On the CPU the kernels run in Pallas interpret mode (for tests); on a GPU they lower through
Pallas' Triton backend.

Status: a reference kernel, tested, outside model.attention='auto' (which takes cuDNN wherever
it runs): on one H100 its backward runs at about half cuDNN's speed (BENCHMARKS.md, "GPU check on
one H100"). The backward is the gap: its two kernels (dK/dV, and dQ: no atomics)
each recompute the scores and dP = dO·Vᵀ, 7 matmuls a tile where one fused backward with atomic
dQ accumulation does 5, and run them as Triton's matmuls, where cuDNN's are written for the
Hopper tensor cores. Pallas' Triton backend
is deprecated in jax (Mosaic GPU replaces it), so nothing more is built on this kernel: closing
the gap would mean a one-kernel backward with atomic dQ accumulation, a change to measure on a
GPU first.
"""
import dataclasses
import functools
import math
import types

import jax
from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

# The Triton backend's compiler params (CompilerParams; TritonCompilerParams in older jax);
# absent from some jaxlib builds.
plgpu: types.ModuleType | None
try:
  from jax.experimental.pallas import triton as plgpu
except ImportError:  # pragma: no cover
  plgpu = None

_LOG2E = math.log2(math.e)
# Finite stand-in for -inf for masked scores: exp2(mask * scale - m) underflows to 0 without
# risking inf - inf = nan (stays finite for any scale <= 2).
_MASK_VALUE = -0.5 * float(jnp.finfo(jnp.float32).max)


@dataclasses.dataclass(frozen=True)
class _Config:
  """Static (hashable) settings shared by the forward and backward passes."""
  causal: bool
  scale: float
  block_q: int  # forward: q rows per program
  block_k: int  # forward: kv rows per loop step
  bwd_block_q: int  # backward: q rows per dQ program / per dK-dV loop step
  bwd_block_k: int  # backward: kv rows per dK-dV program / per dQ loop step
  interpret: bool


# Small helpers. Matmuls take bfloat16/float32 operands and always accumulate in float32.

def _dot_nt(a_MxD, b_NxD):
  """a @ b.T without materialising the transpose (Triton reads b transposed)."""
  return lax.dot_general(a_MxD, b_NxD, (((1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _dot_nn(a_MxD, b_DxN):
  return lax.dot_general(a_MxD, b_DxN, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _cdiv(a, b: int):
  """Ceil division of a traced non-negative int32 scalar by a static int."""
  return lax.div(a + (b - 1), b)


def _q_block_index(program, num_q_blocks: int, causal: bool):
  # Causal q blocks near the end of the sequence do the most work; launching them first (program 0
  # gets the last block) shortens the tail of the grid.
  return num_q_blocks - 1 - program if causal else program


def _compiler_params(config: _Config, head_dim: int, tile_elements: int, num_stages: int):
  """Triton launch settings; None in interpret mode (they would be ignored)."""
  if config.interpret or plgpu is None:
    return None
  params_cls = getattr(plgpu, 'CompilerParams', None) or plgpu.TritonCompilerParams
  # Register budget (checked with ptxas for sm_90): a 128x128 float32 score tile or a 64x128
  # float32 accumulator pair spills at 4 warps, so big tiles get 8 warps; smaller ones run 4 warps
  # and fit two programs per SM.
  big = tile_elements >= 128 * 128 or (head_dim > 64 and tile_elements >= 64 * 64)
  num_warps = 8 if big else 4
  return params_cls(num_warps=num_warps, num_stages=num_stages)


# Forward.

def _loop_over_k_blocks(body, carry, i, block_q: int, block_k: int, num_k_blocks: int,
                        causal: bool):
  """Runs body(j, carry, masked=...) over the kv blocks that q block i sees.

  Causal: kv blocks [0, n_full) lie entirely before this q block's first row (no mask), blocks
  [n_full, hi) cross the diagonal (masked), and blocks >= hi are skipped.
  """
  if not causal:
    return lax.fori_loop(0, num_k_blocks, functools.partial(body, masked=False), carry)
  n_full = jnp.minimum(lax.div(i * block_q, block_k), num_k_blocks)
  hi = jnp.minimum(_cdiv((i + 1) * block_q, block_k), num_k_blocks)
  carry = lax.fori_loop(0, n_full, functools.partial(body, masked=False), carry)
  return lax.fori_loop(n_full, hi, functools.partial(body, masked=True), carry)


def _fwd_kernel(q_ref, k_ref, v_ref, o_ref, lse_ref, *, config: _Config, num_q_blocks: int,
                num_k_blocks: int):
  # q_ref/o_ref: [Q, H] (this program's q tile of one head); k_ref/v_ref: [S, H] (the whole
  # sequence of the matching kv head); lse_ref: [Q] float32.
  block_q, block_k = config.block_q, config.block_k
  i = _q_block_index(pl.program_id(0), num_q_blocks, config.causal)
  qk_scale = config.scale * _LOG2E  # base-2 scores: exp(x * scale) = exp2(x * qk_scale)
  q_QxH = q_ref[...]
  q_pos_Q = i * block_q + jnp.arange(block_q, dtype=jnp.int32)

  def body(j, carry, masked: bool):
    acc_QxH, m_Q, l_Q = carry
    start = pl.multiple_of(j * block_k, block_k)
    k_KxH = k_ref[pl.ds(start, block_k), :]
    v_KxH = v_ref[pl.ds(start, block_k), :]
    s_QxK = _dot_nt(q_QxH, k_KxH)  # unscaled scores
    if masked:
      k_pos_K = start + jnp.arange(block_k, dtype=jnp.int32)
      s_QxK = jnp.where(q_pos_Q[:, None] >= k_pos_K[None, :], s_QxK, _MASK_VALUE)
    # The scale is applied to the row max and inside exp2's argument (one FMA per score) rather
    # than as a separate pass over the tile.
    m_new_Q = jnp.maximum(m_Q, jnp.max(s_QxK, axis=1) * qk_scale)
    # Rescale what was accumulated under the old max (online softmax).
    alpha_Q = jnp.exp2(m_Q - m_new_Q)
    p_QxK = jnp.exp2(s_QxK * qk_scale - m_new_Q[:, None])
    l_Q = l_Q * alpha_Q + jnp.sum(p_QxK, axis=1)
    acc_QxH = acc_QxH * alpha_Q[:, None] + _dot_nn(p_QxK.astype(v_KxH.dtype), v_KxH)
    return acc_QxH, m_new_Q, l_Q

  head_dim = q_ref.shape[-1]
  carry = (jnp.zeros((block_q, head_dim), jnp.float32),
           jnp.full((block_q,), _MASK_VALUE, jnp.float32),
           jnp.zeros((block_q,), jnp.float32))
  carry = _loop_over_k_blocks(body, carry, i, block_q, block_k, num_k_blocks, config.causal)
  acc_QxH, m_Q, l_Q = carry
  # Every row sees key 0 (top-left causal alignment), so l > 0.
  o_ref[...] = (acc_QxH * (1.0 / l_Q)[:, None]).astype(o_ref.dtype)
  lse_ref[...] = m_Q + jnp.log2(l_Q)


def _fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, config: _Config):
  """Returns o [B, T, N, H] and lse [B, N, T] (float32, base 2)."""
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  group = N // K
  num_q_blocks, num_k_blocks = T // config.block_q, S // config.block_k
  kernel = functools.partial(_fwd_kernel, config=config, num_q_blocks=num_q_blocks,
                             num_k_blocks=num_k_blocks)
  qi = lambda i: _q_block_index(i, num_q_blocks, config.causal)
  # Grid (q block, batch, head): the first axis varies fastest on the GPU, so programs running
  # together share a (batch, head) and its k/v stay in L2.
  o_BxTxNxH, lse_BxNxT = pl.pallas_call(
      kernel,
      grid=(num_q_blocks, B, N),
      in_specs=[
          pl.BlockSpec((None, config.block_q, None, H), lambda i, b, n: (b, qi(i), n, 0)),
          pl.BlockSpec((None, S, None, H), lambda i, b, n: (b, 0, n // group, 0)),
          pl.BlockSpec((None, S, None, H), lambda i, b, n: (b, 0, n // group, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, config.block_q, None, H), lambda i, b, n: (b, qi(i), n, 0)),
          pl.BlockSpec((None, None, config.block_q), lambda i, b, n: (b, n, qi(i))),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((B, T, N, H), q_BxTxNxH.dtype),
          jax.ShapeDtypeStruct((B, N, T), jnp.float32),
      ],
      compiler_params=_compiler_params(config, H, config.block_q * config.block_k,
                                       num_stages=3 if H <= 64 else 2),
      interpret=config.interpret,
      name='flash_attention_fwd',
  )(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH)
  return o_BxTxNxH, lse_BxNxT


# Backward.

def _dq_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dq_ref, *, config: _Config,
               num_q_blocks: int, num_k_blocks: int):
  # q_ref/do_ref/dq_ref: [Q, H]; k_ref/v_ref: [S, H]; lse_ref/delta_ref: [Q].
  block_q, block_k = config.bwd_block_q, config.bwd_block_k
  i = _q_block_index(pl.program_id(0), num_q_blocks, config.causal)
  qk_scale = config.scale * _LOG2E
  q_QxH = q_ref[...]
  do_QxH = do_ref[...]
  lse_Q = lse_ref[...]
  delta_Q = delta_ref[...]
  q_pos_Q = i * block_q + jnp.arange(block_q, dtype=jnp.int32)

  def body(j, dq_QxH, masked: bool):
    start = pl.multiple_of(j * block_k, block_k)
    k_KxH = k_ref[pl.ds(start, block_k), :]
    v_KxH = v_ref[pl.ds(start, block_k), :]
    s_QxK = _dot_nt(q_QxH, k_KxH)
    if masked:
      k_pos_K = start + jnp.arange(block_k, dtype=jnp.int32)
      s_QxK = jnp.where(q_pos_Q[:, None] >= k_pos_K[None, :], s_QxK, _MASK_VALUE)
    # Recomputed softmax probabilities (lse is in base-2 units, already scaled).
    p_QxK = jnp.exp2(s_QxK * qk_scale - lse_Q[:, None])
    dp_QxK = _dot_nt(do_QxH, v_KxH)
    ds_QxK = p_QxK * (dp_QxK - delta_Q[:, None])
    return dq_QxH + _dot_nn(ds_QxK.astype(k_KxH.dtype), k_KxH)

  dq_QxH = jnp.zeros(q_QxH.shape, jnp.float32)
  dq_QxH = _loop_over_k_blocks(body, dq_QxH, i, block_q, block_k, num_k_blocks, config.causal)
  # The softmax scale is applied once here instead of on every tile.
  dq_ref[...] = (dq_QxH * config.scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, dk_ref, dv_ref, *,
                config: _Config, group: int, num_q_blocks: int):
  # q_ref/do_ref: [T, G, H] (all query heads that share this kv head); k_ref/v_ref/dk_ref/dv_ref:
  # [Kb, H] (this program's kv tile); lse_ref/delta_ref: [G, T]. Works with transposed scores
  # s^T = k q^T [Kb, Q] so that dV += P^T dO and dK += dS^T q are plain matmuls with no transposed
  # P tile.
  block_q, block_k = config.bwd_block_q, config.bwd_block_k
  j = pl.program_id(0)
  qk_scale = config.scale * _LOG2E
  k_KxH = k_ref[...]
  v_KxH = v_ref[...]
  k_pos_K = j * block_k + jnp.arange(block_k, dtype=jnp.int32)

  def body(t, carry, masked: bool):
    dk_KxH, dv_KxH = carry
    # One flat loop over (q block, head in group): a single long loop pipelines better than
    # nested ones; consecutive heads read neighbouring memory.
    g: int | jax.Array
    if group == 1:
      i, g = t, 0
    else:
      i, g = lax.div(t, group), lax.rem(t, group)
    start = pl.multiple_of(i * block_q, block_q)
    q_QxH = q_ref[pl.ds(start, block_q), g, :]
    do_QxH = do_ref[pl.ds(start, block_q), g, :]
    lse_Q = lse_ref[g, pl.ds(start, block_q)]
    delta_Q = delta_ref[g, pl.ds(start, block_q)]
    sT_KxQ = _dot_nt(k_KxH, q_QxH)
    if masked:
      q_pos_Q = start + jnp.arange(block_q, dtype=jnp.int32)
      sT_KxQ = jnp.where(q_pos_Q[None, :] >= k_pos_K[:, None], sT_KxQ, _MASK_VALUE)
    pT_KxQ = jnp.exp2(sT_KxQ * qk_scale - lse_Q[None, :])
    dv_KxH = dv_KxH + _dot_nn(pT_KxQ.astype(do_QxH.dtype), do_QxH)
    dpT_KxQ = _dot_nt(v_KxH, do_QxH)
    dsT_KxQ = pT_KxQ * (dpT_KxQ - delta_Q[None, :])
    dk_KxH = dk_KxH + _dot_nn(dsT_KxQ.astype(q_QxH.dtype), q_QxH)
    return dk_KxH, dv_KxH

  carry = (jnp.zeros(k_KxH.shape, jnp.float32), jnp.zeros(v_KxH.shape, jnp.float32))
  if config.causal:
    # q blocks before lo cannot see this kv tile; blocks [lo, mid) cross the diagonal; blocks
    # >= mid see all of it.
    lo = jnp.minimum(lax.div(j * block_k, block_q), num_q_blocks)
    mid = jnp.minimum(_cdiv((j + 1) * block_k, block_q), num_q_blocks)
    carry = lax.fori_loop(lo * group, mid * group, functools.partial(body, masked=True), carry)
    carry = lax.fori_loop(mid * group, num_q_blocks * group,
                          functools.partial(body, masked=False), carry)
  else:
    carry = lax.fori_loop(0, num_q_blocks * group, functools.partial(body, masked=False), carry)
  dk_KxH, dv_KxH = carry
  dk_ref[...] = (dk_KxH * config.scale).astype(dk_ref.dtype)
  dv_ref[...] = dv_KxH.astype(dv_ref.dtype)


def _bwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, o_BxTxNxH, lse_BxNxT, do_BxTxNxH, config: _Config):
  B, T, N, H = q_BxTxNxH.shape
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  group = N // K
  block_q, block_k = config.bwd_block_q, config.bwd_block_k
  num_q_blocks, num_k_blocks = T // block_q, S // block_k
  # D = rowsum(dO * O): the softmax-Jacobian correction term, in float32.
  delta_BxTxN = jnp.sum(o_BxTxNxH.astype(jnp.float32) * do_BxTxNxH.astype(jnp.float32), axis=-1)
  delta_BxNxT = jnp.transpose(delta_BxTxN, (0, 2, 1))
  params = _compiler_params(config, H, block_q * block_k, num_stages=2)

  qi = lambda i: _q_block_index(i, num_q_blocks, config.causal)
  q_tile = pl.BlockSpec((None, block_q, None, H), lambda i, b, n: (b, qi(i), n, 0))
  kv_full = pl.BlockSpec((None, S, None, H), lambda i, b, n: (b, 0, n // group, 0))
  stat_tile = pl.BlockSpec((None, None, block_q), lambda i, b, n: (b, n, qi(i)))
  dq_BxTxNxH = pl.pallas_call(
      functools.partial(_dq_kernel, config=config, num_q_blocks=num_q_blocks,
                        num_k_blocks=num_k_blocks),
      grid=(num_q_blocks, B, N),
      in_specs=[q_tile, kv_full, kv_full, q_tile, stat_tile, stat_tile],
      out_specs=q_tile,
      out_shape=jax.ShapeDtypeStruct(q_BxTxNxH.shape, q_BxTxNxH.dtype),
      compiler_params=params,
      interpret=config.interpret,
      name='flash_attention_bwd_dq',
  )(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, do_BxTxNxH, lse_BxNxT, delta_BxNxT)

  # Grid (kv block, batch, kv head); each program sums over its G query heads.
  q_group = pl.BlockSpec((None, T, group, H), lambda j, b, h: (b, 0, h, 0))
  kv_tile = pl.BlockSpec((None, block_k, None, H), lambda j, b, h: (b, j, h, 0))
  stat_group = pl.BlockSpec((None, group, T), lambda j, b, h: (b, h, 0))
  dk_BxSxKxH, dv_BxSxKxH = pl.pallas_call(
      functools.partial(_dkv_kernel, config=config, group=group, num_q_blocks=num_q_blocks),
      grid=(num_k_blocks, B, K),
      in_specs=[q_group, kv_tile, kv_tile, q_group, stat_group, stat_group],
      out_specs=[kv_tile, kv_tile],
      out_shape=[jax.ShapeDtypeStruct(k_BxSxKxH.shape, k_BxSxKxH.dtype),
                 jax.ShapeDtypeStruct(v_BxSxKxH.shape, v_BxSxKxH.dtype)],
      compiler_params=params,
      interpret=config.interpret,
      name='flash_attention_bwd_dkv',
  )(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, do_BxTxNxH, lse_BxNxT, delta_BxNxT)
  return dq_BxTxNxH, dk_BxSxKxH, dv_BxSxKxH


# custom_vjp plumbing.

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _flash(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, config: _Config):
  return _fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, config)[0]


def _flash_fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, config: _Config):
  o_BxTxNxH, lse_BxNxT = _fwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, config)
  return o_BxTxNxH, (q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, o_BxTxNxH, lse_BxNxT)


def _flash_bwd(config: _Config, residuals, do_BxTxNxH):
  q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, o_BxTxNxH, lse_BxNxT = residuals
  return _bwd(q_BxTxNxH, k_BxSxKxH, v_BxSxKxH, o_BxTxNxH, lse_BxNxT,
              do_BxTxNxH.astype(q_BxTxNxH.dtype), config)


_flash.defvjp(_flash_fwd, _flash_bwd)


# Public API.

def _is_pow2(x: int) -> bool:
  return x > 0 and (x & (x - 1)) == 0


def _check_block(name: str, block: int, length: int, what: str, interpret: bool) -> int:
  if block <= 0:
    raise ValueError(f'{name} must be positive, got {block}')
  block = min(block, length)  # a block longer than the sequence is clamped
  if length % block:
    raise ValueError(f'{what} {length} is not a multiple of {name}={block}')
  if not interpret and (not _is_pow2(block) or block < 16):
    # Triton tiles must be powers of two and at least 16 for tensor-core dots.
    raise ValueError(f'{name}={block} (for {what} {length}) must be a power of two >= 16 on GPU')
  return block


def flash_attention(q_BxTxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, *,
                    causal: bool = True, block_q: int = 128, block_k: int = 128,
                    interpret: bool | None = None, bwd_block_q: int | None = None,
                    bwd_block_k: int | None = None) -> jax.Array:
  """Multi-head / grouped-query attention with a fused Pallas kernel; o_BxTxNxH in q's dtype.

  q_BxTxNxH: queries [batch, T, N heads, head_dim], bfloat16 or float32. k_BxSxKxH, v_BxSxKxH: keys
  and values [batch, S, K heads, head_dim], q's dtype; N must be a multiple of K (query head n
  uses kv head n // (N // K)). causal: top-left aligned causal mask (query i sees keys 0..i).
  block_q, block_k: forward tile sizes; T and S must be multiples of them (blocks longer than the
  sequence are clamped to its length). interpret: run in Pallas interpret mode; None means True on
  the CPU. bwd_block_q, bwd_block_k: tile sizes of the backward kernels; None means
  min(block, 64), which keeps the backward accumulators in registers.

  The softmax scale is 1/sqrt(head_dim). Differentiable (custom VJP with FlashAttention-2
  backward kernels).
  """
  q, k, v = q_BxTxNxH, k_BxSxKxH, v_BxSxKxH
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError('flash_attention expects 4-D [batch, length, heads, head_dim] inputs, '
                     f'got q {q.shape}, k {k.shape}, v {v.shape}')
  if k.shape != v.shape:
    raise ValueError(f'k and v shapes differ: k {k.shape} vs v {v.shape}')
  B, T, N, H = q.shape
  _, S, K, _ = k.shape
  if k.shape[0] != B or k.shape[3] != H:
    raise ValueError('q and k/v must have the same batch size and head_dim: '
                     f'q {q.shape} vs k {k.shape}')
  if N % K:
    raise ValueError(f'number of query heads {N} is not a multiple of the number of kv heads {K} '
                     f'(q {q.shape}, k {k.shape})')
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(f'q, k, v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}')
  if interpret is None:
    interpret = jax.default_backend() == 'cpu'
  interpret = bool(interpret)

  block_q = _check_block('block_q', block_q, T, 'sequence length', interpret)
  block_k = _check_block('block_k', block_k, S, 'key/value sequence length', interpret)
  bwd_block_q = _check_block(
      'bwd_block_q', min(block_q, 64) if bwd_block_q is None else bwd_block_q, T,
      'sequence length', interpret)
  bwd_block_k = _check_block(
      'bwd_block_k', min(block_k, 64) if bwd_block_k is None else bwd_block_k, S,
      'key/value sequence length', interpret)

  config = _Config(causal=bool(causal), scale=1.0 / math.sqrt(H), block_q=block_q,
                   block_k=block_k, bwd_block_q=bwd_block_q, bwd_block_k=bwd_block_k,
                   interpret=interpret)

  if not interpret and not _is_pow2(H):
    # Triton tiles need power-of-two sizes: zero-pad the head dim (zeros add nothing to q·k and
    # produce zero output columns, which are sliced off).
    pad = [(0, 0)] * 3 + [(0, pl.next_power_of_2(H) - H)]
    o_BxTxNxH = _flash(jnp.pad(q, pad), jnp.pad(k, pad), jnp.pad(v, pad), config)
    return o_BxTxNxH[..., :H]
  return _flash(q, k, v, config)
