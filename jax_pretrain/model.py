"""Decoder-only transformer, Llama-style: RMSNorm, rotary embeddings, grouped-query attention,
SwiGLU MLP, no biases, tied or untied embeddings.

Parameters are float32 (param_dtype) and cast to the compute dtype at use; norms, softmax
statistics and the logits returned to the loss are float32. Every parameter carries logical axis
names (see sharding.LOGICAL_AXIS_RULES). Layers are stacked on a leading 'layers' axis and scanned,
so compile time does not grow with depth.

Shape suffixes: B batch, T length, D d_model, N query heads, K kv heads, H head_dim, F mlp_dim,
V vocab, L layers.
"""
import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
import ml_collections

from jax_pretrain import sharding
from jax_pretrain.kernels import attention

REMAT_POLICIES = {
    'none': None,  # keep every activation
    'full': jax.checkpoint_policies.nothing_saveable,  # recompute the whole block in backward
    'dots': jax.checkpoint_policies.dots_saveable,  # keep matmul outputs, recompute the rest
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # projections only
    'minimal': jax.checkpoint_policies.save_only_these_names('attn_out', 'mlp_hidden'),
}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  num_layers: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  vocab_size: int
  tie_embeddings: bool = True
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  init_std: float = 0.02
  attention: str = 'xla'
  remat: str = 'full'
  scan_layers: bool = True
  dtype: Any = jnp.bfloat16
  param_dtype: Any = jnp.float32

  @classmethod
  def from_config(cls, m: ml_collections.ConfigDict) -> 'ModelConfig':
    """From the (resolved) config.model group."""
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in m.items() if k in fields}
    kwargs['dtype'] = jnp.dtype(m.dtype)
    kwargs['param_dtype'] = jnp.dtype(m.param_dtype)
    return cls(**kwargs)


def _param(module: nn.Module, name: str, shape, axes, std: float):
  init = nn.initializers.normal(std) if std else nn.initializers.ones
  return module.param(name, nn.with_logical_partitioning(init, axes), shape,
                      module.config.param_dtype)


def rope_tables(positions_T: jax.Array, head_dim: int, theta: float):
  """cos and sin of the rotary angles, float32 [T, H/2]."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  angles_TxH2 = positions_T.astype(jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.cos(angles_TxH2), jnp.sin(angles_TxH2)


def apply_rope(x_BxTxNxH: jax.Array, cos_TxH2: jax.Array, sin_TxH2: jax.Array) -> jax.Array:
  """Rotates pairs (i, i + H/2), the Hugging Face Llama convention, in float32."""
  x1, x2 = jnp.split(x_BxTxNxH.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos_TxH2[None, :, None, :], sin_TxH2[None, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxH.dtype)


class RMSNorm(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
    scale_D = _param(self, 'scale', (x_BxTxD.shape[-1],), ('norm',), std=0.0)
    x = x_BxTxD.astype(jnp.float32)
    x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.config.norm_eps)
    return (x * scale_D).astype(self.config.dtype)


class Attention(nn.Module):
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_BxTxD, cos_TxH2, sin_TxH2):
    c = self.config
    D, N, K, H = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim
    out_std = c.init_std / math.sqrt(2 * c.num_layers)
    wq_DxNxH = _param(self, 'wq', (D, N, H), ('embed', 'heads', 'head_dim'), c.init_std)
    wk_DxKxH = _param(self, 'wk', (D, K, H), ('embed', 'kv_heads', 'head_dim'), c.init_std)
    wv_DxKxH = _param(self, 'wv', (D, K, H), ('embed', 'kv_heads', 'head_dim'), c.init_std)
    wo_NxHxD = _param(self, 'wo', (N, H, D), ('heads', 'head_dim', 'embed'), out_std)

    dt = c.dtype
    q_BxTxNxH = jnp.einsum('btd,dnh->btnh', x_BxTxD, wq_DxNxH.astype(dt))
    k_BxTxKxH = jnp.einsum('btd,dkh->btkh', x_BxTxD, wk_DxKxH.astype(dt))
    v_BxTxKxH = jnp.einsum('btd,dkh->btkh', x_BxTxD, wv_DxKxH.astype(dt))
    q_BxTxNxH = sharding.constrain(q_BxTxNxH, ('batch', 'length', 'act_heads', None), self.mesh)
    k_BxTxKxH = sharding.constrain(k_BxTxKxH, ('batch', 'length', 'act_kv_heads', None), self.mesh)
    v_BxTxKxH = sharding.constrain(v_BxTxKxH, ('batch', 'length', 'act_kv_heads', None), self.mesh)
    q_BxTxNxH = apply_rope(q_BxTxNxH, cos_TxH2, sin_TxH2)
    k_BxTxKxH = apply_rope(k_BxTxKxH, cos_TxH2, sin_TxH2)

    o_BxTxNxH = attention.causal_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH,
                                           implementation=c.attention, mesh=self.mesh)
    o_BxTxNxH = checkpoint_name(o_BxTxNxH, 'attn_out')
    return jnp.einsum('btnh,nhd->btd', o_BxTxNxH, wo_NxHxD.astype(dt))


class Mlp(nn.Module):
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_BxTxD):
    c = self.config
    D, F = c.d_model, c.mlp_dim
    w_gate_DxF = _param(self, 'w_gate', (D, F), ('embed', 'mlp'), c.init_std)
    w_up_DxF = _param(self, 'w_up', (D, F), ('embed', 'mlp'), c.init_std)
    w_down_FxD = _param(self, 'w_down', (F, D), ('mlp', 'embed'),
                        c.init_std / math.sqrt(2 * c.num_layers))
    dt = c.dtype
    gate_BxTxF = jnp.einsum('btd,df->btf', x_BxTxD, w_gate_DxF.astype(dt))
    up_BxTxF = jnp.einsum('btd,df->btf', x_BxTxD, w_up_DxF.astype(dt))
    h_BxTxF = nn.silu(gate_BxTxF) * up_BxTxF
    h_BxTxF = sharding.constrain(h_BxTxF, ('batch', 'length', 'act_mlp'), self.mesh)
    h_BxTxF = checkpoint_name(h_BxTxF, 'mlp_hidden')
    return jnp.einsum('btf,fd->btd', h_BxTxF, w_down_FxD.astype(dt))


class Block(nn.Module):
  """Pre-norm residual block. Returns (x, None) so that nn.scan can stack it."""
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, x_BxTxD, cos_TxH2, sin_TxH2):
    x_BxTxD = sharding.constrain(x_BxTxD, ('batch', 'length', 'act_embed'), self.mesh)
    h = Attention(self.config, self.mesh, name='attn')(
        RMSNorm(self.config, name='attn_norm')(x_BxTxD), cos_TxH2, sin_TxH2)
    x_BxTxD = x_BxTxD + h
    h = Mlp(self.config, self.mesh, name='mlp')(RMSNorm(self.config, name='mlp_norm')(x_BxTxD))
    return x_BxTxD + h, None


class Transformer(nn.Module):
  """tokens [B, T] int32 -> logits [B, T, V] float32."""
  config: ModelConfig
  mesh: Mesh | None = None

  @nn.compact
  def __call__(self, tokens_BxT: jax.Array) -> jax.Array:
    c = self.config
    embedding_VxD = _param(self, 'embedding', (c.vocab_size, c.d_model), ('vocab', 'embed'),
                           c.init_std)
    x_BxTxD = jnp.take(embedding_VxD.astype(c.dtype), tokens_BxT, axis=0)
    cos_TxH2, sin_TxH2 = rope_tables(jnp.arange(tokens_BxT.shape[1]), c.head_dim, c.rope_theta)

    block = Block
    if c.remat != 'none':
      # prevent_cse is only needed outside scan (scan already stops XLA from merging recomputation).
      block = nn.remat(Block, policy=REMAT_POLICIES[c.remat], prevent_cse=not c.scan_layers)
    if c.scan_layers:
      stack = nn.scan(block, variable_axes={'params': 0}, split_rngs={'params': True},
                      in_axes=(nn.broadcast, nn.broadcast), length=c.num_layers,
                      metadata_params={nn.PARTITION_NAME: 'layers'})
      x_BxTxD, _ = stack(c, self.mesh, name='layers')(x_BxTxD, cos_TxH2, sin_TxH2)
    else:
      for i in range(c.num_layers):
        x_BxTxD, _ = block(c, self.mesh, name=f'layers_{i}')(x_BxTxD, cos_TxH2, sin_TxH2)

    x_BxTxD = RMSNorm(c, name='final_norm')(x_BxTxD)
    if c.tie_embeddings:
      w_DxV = embedding_VxD.T
    else:
      w_DxV = _param(self, 'lm_head', (c.d_model, c.vocab_size), ('embed', 'vocab'), c.init_std)
    logits_BxTxV = jnp.einsum('btd,dv->btv', x_BxTxD, w_DxV.astype(c.dtype),
                              preferred_element_type=jnp.float32)
    return sharding.constrain(logits_BxTxV, ('batch', 'length', 'act_vocab'), self.mesh)


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
