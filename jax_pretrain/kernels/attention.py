"""Causal grouped-query attention, dispatched by `config.model.attention`.

'xla'    jax.nn.dot_product_attention's XLA path (any backend; GSPMD partitions it).
'cudnn'  jax.nn.dot_product_attention(implementation='cudnn'), the fused cuDNN kernel (GPU only).
'pallas' our own flash-attention kernel (jax_pretrain/kernels/flash_attention.py).

The fused kernels are custom calls that GSPMD cannot split, so on a mesh they run under shard_map:
each device attends over its own batch rows and heads, which needs no communication.
"""
import functools

import jax
from jax.sharding import Mesh

from jax_pretrain import sharding

IMPLEMENTATIONS = ('xla', 'cudnn', 'pallas')


def check_available(implementation: str, backend: str | None = None) -> None:
  """Raises a clear error for an attention choice this machine cannot run (never falls back)."""
  backend = backend or jax.default_backend()
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f'model.attention={implementation!r}: choose one of {IMPLEMENTATIONS}.')
  if implementation == 'cudnn' and backend != 'gpu':
    raise ValueError(f"model.attention='cudnn' needs an NVIDIA GPU, but jax's backend is "
                     f"{backend!r}; use --config.model.attention=xla (or pallas).")


def _fused(implementation: str):
  if implementation == 'cudnn':
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation='cudnn')
  from jax_pretrain.kernels import flash_attention  # pylint: disable=g-import-not-at-top
  return functools.partial(flash_attention.flash_attention, causal=True)


def causal_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array, *,
                     implementation: str, mesh: Mesh | None) -> jax.Array:
  if implementation == 'xla':
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, is_causal=True,
                                        implementation='xla')
  attend = _fused(implementation)
  # Inside the train step's shard_map over 'data', the kernel is mapped over the other axes too,
  # even of size 1: cuDNN's custom partitioning fails in a partly manual region.
  manual = sharding.manual_axes()
  if manual:
    mesh = jax.sharding.get_abstract_mesh()
  elif mesh is None or mesh.size == 1:
    return attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)
  q_spec = sharding.logical_to_spec(('batch', 'length', 'act_heads', None))
  kv_spec = sharding.logical_to_spec(('batch', 'length', 'act_kv_heads', None))
  return jax.shard_map(attend, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                       axis_names=set(mesh.axis_names) - manual,
                       check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)
