"""Decoder-only transformer, Llama-style: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, no biases, tied or untied embeddings.

The model reads the resolved model group, config.ModelConfig (its dtype and remat policy
through its properties: compute_dtype, master_dtype, remat_policy).

Parameters are float32 (param_dtype) and cast to the compute dtype at use; norms, softmax
statistics and the logits returned to the loss are float32. Every parameter carries logical axis
names (see sharding.LOGICAL_AXIS_RULES).

Layers: the params (init's, the train state's, every checkpoint's) stack the layers on a leading
axis, params['layers'], whichever way a step runs them (model.layers): 'scan' runs them as one
scanned layer over that axis; 'unroll' runs each layer apart, on params['layers_0'],
params['layers_1'], ... (`unstack_layers`: the train step makes them once a step, when it casts
the weights, `with_compute_weights`, and stacks their gradients back, `stack_layers`).

Decoding (engine/runner.py): the model runs unrolled (layers='unroll', params per layer) with a
`KVCache` of one buffer per layer, which each call updates in place (scatter of the new positions;
under jit with the cache donated, no copy of it is made), and with the engine's params
(runner.decoding_params): each layer's query, key and value projections one matrix `wqkv`
[D, N + 2K, H] and its gate and up projections one `w_gate_up` [D, 2, F], so that a step reads
few, large operands (the model reads the projections as its params hold them: init makes them
apart, as the trainer and checkpoints keep them); with model.fp8 each projection quantized once,
its scales and its input's recorded amax beside it (quantize_projections, fp8.quantized_dense).
Two calls:
  prefill  tokens [B, P] at positions 0..P-1 of fresh sequences: causal self-attention over them
           (model.attention's kernel, as in training), their keys and values written into cache
           rows `slots_B`, and the logits at `last_B` only; with `prefix` (the engine's prefix
           cache), tokens at positions_BxT after a prefix already in those rows: written, then
           attended over the whole rows as decode attends (the causal mask on absolute positions);
           into an 8-bit cache, a prefill's attention reads its written rows too (positions
           [0, P)): the quantized keys and values decode reads, whether a prefix was cached or not;
  decode   tokens [B, T] (T = 1 a step) at positions_BxT of cache rows 0..B-1: attention over the
           first `live` positions of those rows (the live context, a static bucket), with a causal
           mask on absolute positions, reading the cache's dtype with float32 accumulation.
A cache may store its keys and values in 8 bits (KV_CACHE_DTYPES): written quantized, read
dequantized inside decode attention.
Training never passes a cache.

Shape suffixes: B batch, T length, D d_model, N query heads, K kv heads, H head_dim, F mlp_dim,
V vocab, L layers, S cache length.
"""
from collections.abc import Callable
import functools
import math

import flax
import flax.linen as nn
import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_pretrain import fp8
from jax_pretrain import sharding
from jax_pretrain.config import ModelConfig
from jax_pretrain.kernels import attention


def _param(module: nn.Module, name: str, shape, axes, std: float):
  init = nn.initializers.normal(std) if std else nn.initializers.ones
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      module.config.master_dtype)


# What an engine's cache may store its keys and values as (engine.kv_cache_dtype): 'auto' the
# compute dtype; 'fp8' (float8 e4m3) and 'int8' a quarter or half of bf16's bytes, each (row,
# position, kv head) vector of head_dim values with its own float32 scale (its largest magnitude
# maps to the type's largest value), written quantized and dequantized where decode attention reads
# it: the scale of a key multiplies its scores, the scale of a value its probabilities.
KV_CACHE_DTYPES = {'auto': None, 'fp8': jnp.float8_e4m3fn, 'int8': jnp.int8}


def kv_storage_dtype(c: ModelConfig, kv_cache_dtype: str):
  """The dtype a cache of this kind stores keys and values in."""
  if kv_cache_dtype not in KV_CACHE_DTYPES:
    raise ValueError(f'kv_cache_dtype={kv_cache_dtype!r} is not one of '
                     f'{", ".join(KV_CACHE_DTYPES)}.')
  return jnp.dtype(KV_CACHE_DTYPES[kv_cache_dtype] or c.compute_dtype)


def kv_bytes_per_token(c: ModelConfig, kv_cache_dtype: str = 'auto') -> int:
  """Bytes a cache holds per token of a row: every layer's key and value (and their scales)."""
  dtype = kv_storage_dtype(c, kv_cache_dtype)
  scales = 0 if KV_CACHE_DTYPES[kv_cache_dtype] is None else 4  # float32, per kv head
  return 2 * c.num_layers * c.num_kv_heads * (c.head_dim * dtype.itemsize + scales)


@flax.struct.dataclass
class LayerKV:
  """One layer's cache: keys and values [B, S, K, H] and, quantized, their scales [B, S, K]
  (float32; None: stored in the compute dtype)."""
  k_BxSxKxH: jax.Array
  v_BxSxKxH: jax.Array
  k_scale_BxSxK: jax.Array | None = None
  v_scale_BxSxK: jax.Array | None = None

  def write(self, rows_B, positions_BxT, k_BxTxKxH, v_BxTxKxH) -> 'LayerKV':
    """The new keys and values written at positions_BxT of rows_B (quantized if the cache is),
    in place; out-of-range rows or positions are dropped."""
    at = lambda cache, new: cache.at[rows_B[:, None], positions_BxT].set(new, mode='drop')
    if self.k_scale_BxSxK is None:
      return LayerKV(*(at(cache, new.astype(cache.dtype)) for cache, new in
                       ((self.k_BxSxKxH, k_BxTxKxH), (self.v_BxSxKxH, v_BxTxKxH))))
    (k, k_scale), (v, v_scale) = (quantize(x, self.k_BxSxKxH.dtype) for x in (k_BxTxKxH,
                                                                            v_BxTxKxH))
    return LayerKV(at(self.k_BxSxKxH, k), at(self.v_BxSxKxH, v), at(self.k_scale_BxSxK, k_scale),
                   at(self.v_scale_BxSxK, v_scale))

  def window(self, rows: int, live: int) -> 'LayerKV':
    """Positions [0, live) of rows [0, rows): what a decode call's attention reads."""
    return jax.tree.map(lambda x: x[:rows, :live], self)


def quantize(x_BxTxKxH: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(x in `dtype` (int8 or float8), its float32 scale [B, T, K]): each head's vector scaled so
  that its largest magnitude is the dtype's largest value; x ≈ q × scale."""
  x = x_BxTxKxH.astype(jnp.float32)
  scale_BxTxK = fp8.scale_of(jnp.max(jnp.abs(x), axis=-1), dtype)
  y = x / scale_BxTxK[..., None]
  if jnp.issubdtype(dtype, jnp.integer):
    y = jnp.round(y)
  top = fp8.largest(dtype)
  return jnp.clip(y, -top, top).astype(dtype), scale_BxTxK


@flax.struct.dataclass
class KVCache:
  """Keys and values of every layer at positions [0, S) of each row: one LayerKV per layer, so
  that a step writes its new positions into each in place (a stacked [L, ...] cache through a
  scan is cut out and copied back every step). Positions past a row's current one hold stale
  values; the causal mask never reads them."""
  layers: tuple[LayerKV, ...]

  @classmethod
  def zeros(cls, c: 'ModelConfig', batch: int, max_len: int,
            kv_cache_dtype: str = 'auto') -> 'KVCache':
    shape = (batch, max_len, c.num_kv_heads, c.head_dim)
    dtype = kv_storage_dtype(c, kv_cache_dtype)
    quantized = KV_CACHE_DTYPES[kv_cache_dtype] is not None
    scale = lambda: jnp.ones(shape[:3], jnp.float32) if quantized else None
    return cls(tuple(LayerKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), scale(), scale())
                     for _ in range(c.num_layers)))


def rope_frequencies(c: ModelConfig) -> jax.Array:
  """The rotary inverse frequencies, float32 [H/2], rescaled as Llama checkpoints state it.

  'linear' divides every frequency by rope_factor (positions / factor). 'llama3' (Llama 3.1+)
  divides only the low frequencies, whose wavelength exceeds rope_original_max_len /
  rope_low_freq_factor, keeps the high ones (wavelength below rope_original_max_len /
  rope_high_freq_factor) and interpolates in between: the equations of transformers'
  _compute_llama3_parameters, in float32 as there, so imported models compute the same angles.
  """
  H = c.head_dim
  inv_freq = 1.0 / (c.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
  if c.rope_scaling == 'linear':
    return inv_freq / c.rope_factor
  if c.rope_scaling == 'llama3':
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = c.rope_original_max_len / c.rope_low_freq_factor
    high_freq_wavelen = c.rope_original_max_len / c.rope_high_freq_factor
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / c.rope_factor, inv_freq)
    smooth = ((c.rope_original_max_len / wavelen - c.rope_low_freq_factor)
              / (c.rope_high_freq_factor - c.rope_low_freq_factor))
    smoothed = (1 - smooth) * scaled / c.rope_factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(medium, smoothed, scaled)
  return inv_freq


def rope_tables(positions: jax.Array, inv_freq_H2: jax.Array):
  """cos and sin of the rotary angles, float32 [..., H/2] for positions [...] ([T] or [B, T])."""
  angles = positions.astype(jnp.float32)[..., None] * inv_freq_H2
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x_BxTxNxH: jax.Array, cos_TxH2: jax.Array, sin_TxH2: jax.Array) -> jax.Array:
  """Rotates pairs (i, i + H/2), the Hugging Face Llama convention, in float32.

  The tables are [T, H/2] (same positions for every row) or [B, T, H/2] (decoding)."""
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_TxH2[..., None, :], sin_TxH2[..., None, :]  # broadcast over heads
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


# The attention and MLP projections the train step runs: FP8 with model.fp8 (not the embedding or
# the output head, whose logits feed the loss directly).
PROJECTIONS = ('wq', 'wk', 'wv', 'wo', 'w_gate', 'w_up', 'w_down')
# The projections that read one input (a layer's normed x): FP8 quantizes it once for them.
SAME_INPUT = (('wq', 'wk', 'wv'), ('w_gate', 'w_up'))


def _dense_einsum(module: nn.Module):
  """einsum(equation, x, weight, name) of a module's projection `name`, the weight cast to the
  compute dtype: FP8 with model.fp8, with its amax history and its weight quantized for the step
  where the train step gives them (fp8.py), or quantized once with its scales beside it (the
  engine's params, runner.decoding_params: fp8.quantized_dense), else a plain einsum."""
  c = module.config
  dt = c.compute_dtype
  if not c.fp8:
    return lambda equation, x, w, name: jnp.einsum(equation, x, w.astype(dt))
  get = lambda key: (module.get_variable('params', key) if module.has_variable('params', key)
                     else None)

  def fp8_einsum(equation: str, x, w, name: str):
    inputs = equation.split('->')[0].split(',')
    contract = len(set(inputs[0]) & set(inputs[1]))
    if w.dtype == fp8.FORWARD_DTYPE:  # quantized once, for inference
      return fp8.quantized_dense(x, w, module.get_variable('params', name + fp8.WEIGHT_SCALE),
                                 module.get_variable('params', name + fp8.INPUT_AMAX),
                                 contract=contract)
    quantized = tuple(get(name + suffix) for suffix in (fp8.WEIGHT, fp8.SCALES, fp8.INPUT))
    return fp8.dense(x, w.astype(dt), contract=contract, history=get(name + fp8.SUFFIX),
                     gradients=c.fp8_gradients,
                     quantized=None if quantized[0] is None else quantized)
  return fp8_einsum


class RMSNorm(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    scale_D = _param(self, 'scale', (x_BxTxD.shape[-1],), ('norm',), std=0.0)
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.config.norm_eps)
    return checkpoint_name((x * scale_D).astype(self.config.compute_dtype), 'normed')


@flax.struct.dataclass
class CacheUse:
  """How a call with a KVCache writes and reads it (the module docstring's prefill and decode)."""
  positions_BxT: jax.Array  # int32: each token's absolute position in its cache row
  slots_B: jax.Array | None = None  # prefill: the cache rows of the B sequences (out of range:
  #                                   a padding row, dropped); None: decode rows 0..B-1
  logits_at_B: jax.Array | None = None  # the one position of each row whose logits to return
  live: int = flax.struct.field(pytree_node=False, default=0)  # decode: the attention reads
  #                                   positions [0, live) of the rows
  prefix: bool = flax.struct.field(pytree_node=False, default=False)  # prefill after a cached
  #                                   prefix: its rows' earlier positions are in the cache already
  #                                   (the engine's prefix cache), the attention reads them there


class Attention(nn.Module):
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_BxTxD, cos_TxH2, sin_TxH2, segments_BxT=None, kv=None,
               use: CacheUse | None = None):
    """Returns (output, kv): kv is None in training, else this layer's updated cache (LayerKV).

    segments_BxT (training on packed rows): attention stays within each segment."""
    c = self.config
    D, N, K, H = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    out_std = c.init_std / math.sqrt(2 * c.num_layers)
    dt, dense = c.compute_dtype, _dense_einsum(self)
    if self.has_variable('params', 'wqkv'):  # the engine's: one matrix, one matmul
      wqkv_DxJxH = _param(self, 'wqkv', (D, N + 2 * K, H), ('embed', None, 'head_dim'),
                          c.init_std)
      qkv_BxTxJxH = dense('btd,djh->btjh', x_BxTxD, wqkv_DxJxH, 'wqkv')
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = jnp.split(qkv_BxTxJxH, [N, N + K], axis=2)
    else:  # (init makes these: the trainer's params, a checkpoint's)
      wq_DxNxH = _param(self, 'wq', (D, N, H), ('embed', 'heads', 'head_dim'), c.init_std)
      wk_DxKxH = _param(self, 'wk', (D, K, H), ('embed', 'kv_heads', 'head_dim'), c.init_std)
      wv_DxKxH = _param(self, 'wv', (D, K, H), ('embed', 'kv_heads', 'head_dim'), c.init_std)
      q_BxTxNxH = dense('btd,dnh->btnh', x_BxTxD, wq_DxNxH, 'wq')
      k_BxTxKxH = dense('btd,dkh->btkh', x_BxTxD, wk_DxKxH, 'wk')
      v_BxTxKxH = dense('btd,dkh->btkh', x_BxTxD, wv_DxKxH, 'wv')
    wo_NxHxD = _param(self, 'wo', (N, H, D), ('heads', 'head_dim', 'embed'), out_std)
    q_BxTxNxH = sharding.constrain(q_BxTxNxH, ('batch', 'length', 'act_heads', None), self.mesh)
    k_BxTxKxH = sharding.constrain(k_BxTxKxH, ('batch', 'length', 'act_kv_heads', None), self.mesh)
    v_BxTxKxH = sharding.constrain(v_BxTxKxH, ('batch', 'length', 'act_kv_heads', None), self.mesh)
    # (named: remat policies may keep them rotated, so that the backward does not rotate again)
    q_BxTxNxH = checkpoint_name(apply_rope(q_BxTxNxH, cos_TxH2, sin_TxH2), 'rotated')
    k_BxTxKxH = checkpoint_name(apply_rope(k_BxTxKxH, cos_TxH2, sin_TxH2), 'rotated')

    # Training, or a prefill attending to itself. One after a cached prefix, or into an 8-bit cache,
    # reads its rows after writing them (below): its queries see what decode's see, so that a
    # prompt's keys and values are the same numbers whether a prefix of it was cached or not.
    quantized = kv is not None and kv.k_scale_BxSxK is not None
    if use is None or (use.slots_B is not None and not use.prefix and not quantized):
      o_BxTxNxH = attention.causal_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                                             implementation=c.attention, mesh=self.mesh,
                                             segments_BxT=segments_BxT)
    if kv is not None:
      assert use is not None  # (a cache comes with its CacheUse, training with neither)
      B = x_BxTxD.shape[0]
      rows_B = use.slots_B if use.slots_B is not None else jnp.arange(B)
      kv = kv.write(rows_B, use.positions_BxT, k_BxTxKxH, v_BxTxKxH)
      if use.slots_B is None:
        o_BxTxNxH = cached_attention(q_BxTxNxH, kv.window(B, use.live),
                                      use.positions_BxT).astype(dt)
      elif use.prefix or quantized:  # its rows' cached prefix and its own tokens, written now
        width = kv.k_BxSxKxH.shape[1] if use.prefix else x_BxTxD.shape[1]  # (else at 0 .. T-1)
        rows = jax.tree.map(lambda x: jnp.take(x[:, :width], rows_B, axis=0, mode='clip'), kv)
        o_BxTxNxH = cached_attention(q_BxTxNxH, rows, use.positions_BxT).astype(dt)
    o_BxTxNxH = checkpoint_name(o_BxTxNxH, 'attn_out')
    return dense('btnh,nhd->btd', o_BxTxNxH, wo_NxHxD, 'wo'), kv


def cached_attention(q_BxTxNxH, kv: LayerKV, positions_BxT):
  """Attention of the new queries over the cache's window: a query at position p sees slots <= p.

  Plain einsums: decoding is one query per row, so no fused kernel is needed. They read the
  cache's keys and values as they are stored, converted to the compute dtype inside the products
  (no 16-bit copy of the window is made), accumulate in float32 (preferred_element_type), the
  softmax in float32 and its probabilities in the compute dtype for the second product, as flash
  attention does. A quantized cache's scales multiply the scores (keys) and the probabilities
  (values) in float32: per position, so the products never see them.
  """
  B, T, N, H = q_BxTxNxH.shape
  k_BxSxKxH, v_BxSxKxH = kv.k_BxSxKxH, kv.v_BxSxKxH
  S, K = k_BxSxKxH.shape[1], k_BxSxKxH.shape[2]
  dt = q_BxTxNxH.dtype if kv.k_scale_BxSxK is not None else k_BxSxKxH.dtype
  # Query head n uses kv head n // (N // K), as in the training path.
  q_BxTxKxGxH = q_BxTxNxH.astype(dt).reshape(B, T, K, N // K, H)
  scores_BxKxGxTxS = jnp.einsum('btkgh,bskh->bkgts', q_BxTxKxGxH, k_BxSxKxH.astype(dt),
                                preferred_element_type=jnp.float32) / math.sqrt(H)
  if kv.k_scale_BxSxK is not None:
    scores_BxKxGxTxS = scores_BxKxGxTxS * kv.k_scale_BxSxK.transpose(0, 2, 1)[:, :, None, None]
  visible_BxTxS = jnp.arange(S)[None, None, :] <= positions_BxT[:, :, None]
  scores_BxKxGxTxS = jnp.where(visible_BxTxS[:, None, None], scores_BxKxGxTxS, -jnp.inf)
  probs_BxKxGxTxS = jax.nn.softmax(scores_BxKxGxTxS, axis=-1)
  top_BxKxGxTx1 = None
  if kv.v_scale_BxSxK is not None:
    # The probabilities times the values' scales, divided by their largest (in (0, 1], as flash
    # attention's unnormalized probabilities), which multiplies the float32 output instead: a
    # long, spread row's products (~1/S × scale) would fall below float16's normal range.
    probs_BxKxGxTxS = probs_BxKxGxTxS * kv.v_scale_BxSxK.transpose(0, 2, 1)[:, :, None, None]
    top_BxKxGxTx1 = jnp.max(probs_BxKxGxTxS, axis=-1, keepdims=True)
    probs_BxKxGxTxS = probs_BxKxGxTxS / top_BxKxGxTx1
  o_BxTxKxGxH = jnp.einsum('bkgts,bskh->btkgh', probs_BxKxGxTxS.astype(dt), v_BxSxKxH.astype(dt),
                           preferred_element_type=jnp.float32)
  if top_BxKxGxTx1 is not None:
    o_BxTxKxGxH = o_BxTxKxGxH * top_BxKxGxTx1.transpose(0, 3, 1, 2, 4)
  return o_BxTxKxGxH.reshape(B, T, N, H)


class Mlp(nn.Module):
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_BxTxD):
    c = self.config
    D, F = c.d_model, c.mlp_dim
    dense = _dense_einsum(self)
    if self.has_variable('params', 'w_gate_up'):  # the engine's: one matrix, one matmul
      w_gate_up_Dx2xF = _param(self, 'w_gate_up', (D, 2, F), ('embed', None, 'mlp'), c.init_std)
      gate_up_BxTx2xF = dense('btd,dgf->btgf', x_BxTxD, w_gate_up_Dx2xF, 'w_gate_up')
      gate_BxTxF, up_BxTxF = gate_up_BxTx2xF[:, :, 0], gate_up_BxTx2xF[:, :, 1]
    else:  # (init makes these)
      w_gate_DxF = _param(self, 'w_gate', (D, F), ('embed', 'mlp'), c.init_std)
      w_up_DxF = _param(self, 'w_up', (D, F), ('embed', 'mlp'), c.init_std)
      gate_BxTxF = dense('btd,df->btf', x_BxTxD, w_gate_DxF, 'w_gate')
      up_BxTxF = dense('btd,df->btf', x_BxTxD, w_up_DxF, 'w_up')
    w_down_FxD = _param(self, 'w_down', (F, D), ('mlp', 'embed'),
                        c.init_std / math.sqrt(2 * c.num_layers))
    h_BxTxF = nn.silu(gate_BxTxF) * up_BxTxF
    h_BxTxF = sharding.constrain(h_BxTxF, ('batch', 'length', 'act_mlp'), self.mesh)
    h_BxTxF = checkpoint_name(h_BxTxF, 'mlp_hidden')
    return dense('btf,fd->btd', h_BxTxF, w_down_FxD, 'w_down')


class Block(nn.Module):
  """Pre-norm residual block. Returns (x, kv): kv is None in training, else this layer's updated
  cache (LayerKV)."""
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_BxTxD, cos_TxH2, sin_TxH2, segments_BxT=None, kv=None, use=None):
    x_BxTxD = sharding.constrain(x_BxTxD, ('batch', 'length', 'act_embed'), self.mesh)
    h, kv = Attention(self.config, self.mesh, name='attn')(
        RMSNorm(self.config, name='attn_norm')(x_BxTxD), cos_TxH2, sin_TxH2, segments_BxT, kv,
        use)
    x_BxTxD = checkpoint_name(x_BxTxD + h, 'residual')  # (named: 'dots' unrolled keeps it)
    h = Mlp(self.config, self.mesh, name='mlp')(RMSNorm(self.config, name='mlp_norm')(x_BxTxD))
    return x_BxTxD + h, kv


class Transformer(nn.Module):
  """tokens [B, T] int32 -> logits [B, T, V] float32.

  With logits=False (training, without a cache): -> (the final hidden states [B, T, D] after the
  final norm, the output projection [D, V]), both in the compute dtype, for the loss to compute
  the logits itself, a chunk at a time (state.target_logprobs, kernels/logprobs.py).

  With cache (a KVCache) and use (a CacheUse), unscanned: -> (logits, updated cache), the
  module docstring's prefill or decode; logits [B, 1, V] at use.logits_at_B when given.
  With segments_BxT (int32 [B, T], training on packed rows, e.g. SFT examples): a token attends
  only to earlier tokens of its own segment. Positions still run 0..T-1 along the row: rotary
  attention scores depend only on the distance between query and key, so an example scores the
  same wherever it sits in the row (tests/test_sft.py checks it).
  """
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, tokens_BxT: jax.Array, cache: KVCache | None = None,
               use: CacheUse | None = None, segments_BxT: jax.Array | None = None,
               logits: bool = True):
    c = self.config
    if cache is not None and c.scan_layers:
      raise ValueError("decoding runs the model unrolled (layers='unroll'), with the params "
                       'of each layer apart: engine.decoding_params')
    # init makes the stacked params of either way (the module docstring), by the scanned layer.
    scan = c.scan_layers or self.is_initializing()
    embedding_VxD = _param(self, 'embedding', (c.vocab_size, c.d_model), ('vocab', 'embed'),
                           c.init_std)
    # The lookup reads a replicated compute-dtype copy of the table (V·D·2 bytes): XLA's SPMD
    # partitioner aborts on a gather from a sharded table inside the train step's shard_map.
    table_VxD = embedding_VxD.astype(c.compute_dtype)
    if c.tie_embeddings and table_VxD.dtype == embedding_VxD.dtype:
      # No cast separates the replicated copy from the sharded output projection (float32
      # compute): XLA's SPMD partitioner then aborts (spmd_partitioner_util.cc:498, a CHECK on
      # replica groups) on the backward of the train step for some meshes, e.g. data=2, fsdp=2,
      # tensor=2 with 4 rows per data-parallel device (tests/test_parallel.py). A barrier gives
      # the lookup its own value; it computes nothing.
      table_VxD = jax.lax.optimization_barrier(table_VxD)
    table_VxD = sharding.constrain(table_VxD, (None, None), self.mesh)
    x_BxTxD = jnp.take(table_VxD, tokens_BxT, axis=0)
    inv_freq_H2 = rope_frequencies(c)
    if cache is None:
      cos_TxH2, sin_TxH2 = rope_tables(jnp.arange(tokens_BxT.shape[1]), inv_freq_H2)
    else:  # per-row positions: tables [B, T, H/2]
      assert use is not None
      cos_TxH2, sin_TxH2 = rope_tables(use.positions_BxT, inv_freq_H2)

    block = Block
    if c.remat != 'none':
      # prevent_cse is only needed outside scan (scan already stops XLA from merging recomputation).
      block = nn.remat(Block, policy=c.remat_policy, prevent_cse=not scan)
    if scan:
      stack = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True},
                      in_axes=(nn.broadcast,) * 3, length=c.num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BxTxD, _ = stack(c, self.mesh, name='layers')(x_BxTxD, cos_TxH2, sin_TxH2, segments_BxT)
    else:
      written = []
      for i in range(c.num_layers):
        kv = None if cache is None else cache.layers[i]
        x_BxTxD, kv = block(c, self.mesh, name=f'layers_{i}')(
            x_BxTxD, cos_TxH2, sin_TxH2, segments_BxT, kv, use)
        written.append(kv)
      if cache is not None:
        cache = KVCache(tuple(written))
    if use is not None and use.logits_at_B is not None:
      x_BxTxD = x_BxTxD[jnp.arange(x_BxTxD.shape[0]), use.logits_at_B][:, None]

    x_BxTxD = RMSNorm(c, name='final_norm')(x_BxTxD)
    if c.tie_embeddings:
      w_DxV = embedding_VxD.T
    else:
      w_DxV = _param(self, 'lm_head', (c.d_model, c.vocab_size), ('embed', 'vocab'), c.init_std)
    w_DxV = w_DxV.astype(c.compute_dtype)
    if not logits:  # training: the loss computes the logits, chunk by chunk (kernels/logprobs.py)
      return x_BxTxD, w_DxV
    logits_BxTxV = jnp.einsum('btd,dv->btv', x_BxTxD, w_DxV, preferred_element_type=jnp.float32)
    logits_BxTxV = sharding.constrain(logits_BxTxV, ('batch', 'length', 'act_vocab'), self.mesh)
    if cache is None:
      return logits_BxTxV
    return logits_BxTxV, cache


def unstack_layers(params, num_layers: int):
  """Stacked params (params['layers'], a leading layer axis) as the unrolled model reads them:
  params['layers_0'], params['layers_1'], ..., each layer's slices. Others are returned as
  they are."""
  if 'layers' not in params:
    return params
  params = dict(params)
  layers = params.pop('layers')
  for i in range(num_layers):
    params[f'layers_{i}'] = jax.tree.map(lambda x, i=i: x[i], layers)
  return params


def stack_layers(tree, num_layers: int):
  """unstack_layers' inverse: a tree with layers_0 ... layers_{L-1} (e.g. their gradients) with
  them stacked as 'layers'. Others are returned as they are."""
  if 'layers_0' not in tree:
    return tree
  tree = dict(tree)
  per_layer = [tree.pop(f'layers_{i}') for i in range(num_layers)]
  tree['layers'] = jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)
  return tree


def layers_as_run(c: ModelConfig, params):
  """Stacked params in the layout the model runs them (model.layers): unstacked to unroll."""
  return params if c.scan_layers else unstack_layers(params, c.num_layers)


# The engine's fused projections (fuse_projections): each of its parts, and how they join along
# the second axis from the end: wqkv [D, N + 2K, H] concatenated, w_gate_up [D, 2, F] stacked.
FUSED: dict[str, tuple[str, tuple[str, ...], Callable[..., jax.Array]]] = {
    'attn': ('wqkv', ('wq', 'wk', 'wv'), jnp.concatenate),
    'mlp': ('w_gate_up', ('w_gate', 'w_up'), jnp.stack)}
# How many leading input axes a projection's weight contracts (the rest are its output axes).
_CONTRACT = {'wo': 2}


def fuse_projections(layers):
  """Layer params (stacked or one layer's) with each layer's query, key and value projections one
  matrix, wqkv [..., D, N + 2K, H], and its gate and up projections one, w_gate_up [..., D, 2, F]:
  the matmuls that read the same input read it once (the engine's decoding params; the train
  step keeps them apart: BENCHMARKS.md, fused they compiled slower). Quantized for FP8 inference
  (quantize_projections), each part keeps its own scales (one a column, joined as the weights
  are) and the fused matmul's input amax is the largest of the parts' (the same input: equal)."""
  out = dict(layers)
  for module, (fused, parts, join) in FUSED.items():
    m = dict(layers[module])
    m[fused] = join([m.pop(p) for p in parts], axis=-2)
    if parts[0] + fp8.WEIGHT_SCALE in m:
      m[fused + fp8.WEIGHT_SCALE] = join([m.pop(p + fp8.WEIGHT_SCALE) for p in parts], axis=-2)
      m[fused + fp8.INPUT_AMAX] = functools.reduce(
          jnp.maximum, [m.pop(p + fp8.INPUT_AMAX) for p in parts])
    out[module] = m
  return out


def quantize_projections(layer, fp8_histories=None):
  """One layer's params (its projections in the compute dtype) for FP8 inference: each
  projection quantized once (fp8.quantize_weight: e4m3, its scale beside it, 'wq_scale'), with
  its activation's largest recorded amax from the layer's amax histories ('wq_input_amax';
  0 without histories: fp8.quantized_dense then scales each row from its own)."""
  out = dict(layer)
  for module in FUSED:
    m, histories = dict(layer[module]), (fp8_histories or {}).get(module, {})
    for name in PROJECTIONS:
      if name in m:
        m[name], m[name + fp8.WEIGHT_SCALE] = fp8.quantize_weight(m[name],
                                                                  _CONTRACT.get(name, 1))
        history = histories.get(name + fp8.SUFFIX)
        m[name + fp8.INPUT_AMAX] = (jnp.zeros((), jnp.float32) if history is None
                                    else fp8.input_amax(history))
    out[module] = m
  return out


def with_compute_weights(c: ModelConfig, params, fp8_histories=None):
  """params with the layers' matmul weights in the compute dtype, which the model casts them to
  at use anyway (their norm scales, used in float32, stay as they are), with the FP8 amax
  histories beside them where given (fp8.merge), in the layout the model runs them
  (layers_as_run).

  The train step makes them once a step: every micro-batch's layers, forward and backward, then
  read compute-dtype weights instead of casting float32 ones again, and their gradients come back
  in the compute dtype, the values the casts' gradients had (each weight is used once per layer),
  half the bytes per micro-batch. Unrolled, the same once-a-step pass writes each layer's weights
  apart: no micro-batch slices them again. The embedding stays float32: the
  lookup and the tied output projection each cast it, and their gradients are summed in float32.
  `as_params` takes the gradients back to the params' layout."""
  if 'layers' not in params:
    return params
  layers = jax.tree_util.tree_map_with_path(
      lambda path, p: p if path[-1].key == 'scale' else p.astype(c.compute_dtype),
      params['layers'])
  return layers_as_run(c, fp8.merge({**params, 'layers': layers}, fp8_histories))


def as_params(c: ModelConfig, grads):
  """Gradients of with_compute_weights' weights in the params' layout, and those of the amax
  histories apart (fp8.split; None without them)."""
  return fp8.split(stack_layers(grads, c.num_layers))


def count_params(params) -> int:
  return sum(x.size for x in jax.tree.leaves(params))


def flops_per_token(c: ModelConfig, seq_len: int) -> float:
  """Training FLOPs per token: 6 per parameter that does a matmul, plus causal attention.

  Attention scores and the weighted sum are 2·2·T·N·H FLOPs per token and layer forward without
  a mask; causal halves that, and forward + backward is 3× forward: 6·L·T·N·H.
  The input embedding is a lookup (no FLOPs) unless tied to the output projection.
  """
  per_layer = (c.d_model * c.head_dim * (2 * c.num_heads + 2 * c.num_kv_heads)
               + 3 * c.d_model * c.mlp_dim)
  matmul_params = c.num_layers * per_layer + c.d_model * c.vocab_size
  return 6.0 * matmul_params + 6.0 * c.num_layers * seq_len * c.num_heads * c.head_dim
