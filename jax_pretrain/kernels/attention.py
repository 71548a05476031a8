"""Causal grouped-query attention, dispatched by `config.model.attention`.

'xla'    jax.nn.dot_product_attention's XLA path (any backend; GSPMD partitions it).
'cudnn'  jax.nn.dot_product_attention(implementation='cudnn'), the fused cuDNN kernel (GPU only).
'pallas' our own flash-attention kernel (jax_pretrain/kernels/flash_attention.py): a reference
         kernel that 'auto' never picks (measured on one H100: its backward runs at half cuDNN's
         speed; the kernel's docstring says why).
'auto'   (the default) resolved once, at start-up, by `choose`: cuDNN on an NVIDIA GPU where it
         supports the dtype and head_dim, else XLA (cuDNN's kernel trains xlarge about twice as
         fast as XLA's attention on one H100: BENCHMARKS.md).

The fused kernels are custom calls that GSPMD cannot split, so on a mesh they run under shard_map:
each device attends over its own batch rows and heads, which needs no communication.

Packed rows (SFT, data.format='sft') pass segment ids: a query attends only to keys of its own
segment, causally (a block-diagonal causal mask). 'xla' and 'cudnn' take it as jax's boolean
`mask` [B, 1, T, T] (cuDNN gets it as an additive bias broadcast over heads); the Pallas kernel
has no mask, and config.resolve refuses it for packed data.
"""
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from jax_pretrain import sharding

IMPLEMENTATIONS = ('xla', 'cudnn', 'pallas')
AUTO = 'auto'
# NVIDIA GPUs before Ampere (compute capability < 8.0), which cuDNN's fused attention does not run
# on, by the names jax gives them (device_kind) where the device reports no compute capability.
PRE_AMPERE = ('V100', 'P100', 'T4', 'TITAN V', 'Quadro', 'RTX 20')


def compute_capability(device) -> tuple[int, int] | None:
  """The (major, minor) compute capability an NVIDIA device states (jax's
  Device.compute_capability, e.g. '9.0'), parsed here only; None where it states none (a
  compile-only device, another backend, no device)."""
  stated = getattr(device, 'compute_capability', None)
  if stated is None:
    return None
  major, minor = str(stated).split('.')[:2]
  return int(major), int(minor)


def capability_text(capability: tuple[int, int] | None) -> str:
  """'9.0', as jax states it; 'unknown' for None."""
  return 'unknown' if capability is None else '.'.join(map(str, capability))


def is_ampere_or_newer(device_kind: str, capability: tuple[int, int] | None) -> bool:
  """An NVIDIA GPU of compute capability >= 8.0 (bfloat16, cuDNN's fused attention); one that
  states no capability (compile-only) is judged by its name."""
  if capability is not None:
    return capability >= (8, 0)
  return not any(name in device_kind for name in PRE_AMPERE)


def choose(backend: str, device_kind: str, capability: tuple[int, int] | None, dtype: str,
           head_dim: int) -> tuple[str, str]:
  """What model.attention='auto' means on this device: (implementation, the reason, to print).
  capability: compute_capability(device)."""
  nvidia = device_kind.startswith(('NVIDIA', 'Tesla', 'Quadro'))
  if backend != 'gpu' or not nvidia:
    return 'xla', f'no NVIDIA GPU ({device_kind or backend})'
  if not is_ampere_or_newer(device_kind, capability):
    return 'xla', f'{device_kind} predates Ampere; cuDNN fused attention needs sm_80+'
  if dtype not in ('bfloat16', 'float16'):
    return 'xla', f'cuDNN fused attention needs bf16 or fp16, model.dtype is {dtype}'
  if head_dim % 8 or head_dim > 128:
    return 'xla', f'cuDNN fused attention needs head_dim <= 128 and a multiple of 8, not {head_dim}'
  return 'cudnn', f'{device_kind}, {dtype}, head_dim {head_dim}'


# The primitives that run the fused kernels' forward passes, their outputs what the backward
# reads: jax's cuDNN attention binds this one in its custom_vjp's forward rule (the attention
# output and the softmax statistics: jax._src.cudnn.fused_attention_stablehlo), our Pallas kernel
# its forward's pallas_call (the output and the logsumexp: kernels/flash_attention.py).
_FORWARD_PRIMITIVES = ('dot_product_attention_fwd_wrapper', 'pallas_call')


def forward_saveable(prim, *_, **__) -> bool:
  """A remat policy (jax.checkpoint_policies' signature) that keeps the fused kernels' forward
  outputs, so that the backward pass does not run the forward kernel again for them. It costs
  their size per layer: the output B·T·N·H in the compute dtype and the statistics B·N·T float32
  (xlarge, micro-batch 8: 64 MB a layer)."""
  return prim.name in _FORWARD_PRIMITIVES


def unavailable_reason(implementation: str, backend: str | None = None) -> str | None:
  """Why this machine cannot run the attention choice (None: it can). Never a silent fallback."""
  backend = backend or jax.default_backend()
  if implementation == 'cudnn' and backend != 'gpu':
    return (f"model.attention='cudnn' needs an NVIDIA GPU, but jax's backend is {backend!r}; use "
            '--config.model.attention=xla (or pallas).')
  return None


def _fused(implementation: str):
  if implementation == 'cudnn':
    return functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation='cudnn')
  if implementation != 'pallas':  # e.g. 'auto' that skipped config.resolve
    raise ValueError(f'attention implementation {implementation!r} is not one of '
                     f'{IMPLEMENTATIONS}; resolve the config first.')
  from jax_pretrain.kernels import flash_attention  # noqa: PLC0415
  return functools.partial(flash_attention.flash_attention, causal=True)


def segment_mask(segments_BxT: jax.Array | None) -> jax.Array | None:
  """bool [B, 1, T, T]: query t may see key s of the same segment (None: no segments)."""
  if segments_BxT is None:
    return None
  return segments_BxT[:, None, :, None] == segments_BxT[:, None, None, :]


def causal_attention(q_BxTxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array, *,
                     implementation: str, mesh: Mesh | None,
                     segments_BxT: jax.Array | None = None) -> jax.Array:
  """Causal attention; with segments_BxT (int [B, T]), only within each segment."""
  mask_Bx1xTxT = segment_mask(segments_BxT)
  if implementation == 'xla':
    dtype = q_BxTxNxH.dtype
    if dtype == jnp.float16 and _platform(mesh) == 'cpu':
      # jax's XLA attention asks float16 scores for the F16_F16_F32 dot algorithm, which the CPU
      # refuses when the step is compiled: there (only) it attends in float32, so that float16
      # runs, and its loss scaling, can be tested on the CPU. GPU programs are unchanged.
      q_BxTxNxH, k_BxTxKxH, v_BxTxKxH = (x.astype(jnp.float32)
                                          for x in (q_BxTxNxH, k_BxTxKxH, v_BxTxKxH))
    return jax.nn.dot_product_attention(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask=mask_Bx1xTxT,
                                        is_causal=True, implementation='xla').astype(dtype)
  if mask_Bx1xTxT is not None:
    if implementation != 'cudnn':
      raise ValueError(f'attention implementation {implementation!r} takes no segment mask; '
                       "use 'xla' or 'cudnn' for packed data.")
    return _sharded(lambda q, k, v, m: _fused(implementation)(q, k, v, mask=m), mesh,
                    q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, mask_Bx1xTxT)
  return _sharded(_fused(implementation), mesh, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH)


def _platform(mesh: Mesh | None) -> str:
  """The platform the program is compiled for: the mesh's devices' (compile-only ones too, in
  `plan`), else jax's default backend."""
  if mesh is not None:
    return mesh.devices.flat[0].platform
  return jax.default_backend()


def _sharded(attend, mesh: Mesh | None, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *mask_Bx1xTxT):
  """attend(q, k, v[, mask]) on each device's rows and heads (a fused kernel under shard_map)."""
  # Inside the train step's shard_map over 'data', the kernel is mapped over the other axes too,
  # even of size 1: cuDNN's custom partitioning fails in a partly manual region.
  manual = sharding.manual_axes()
  where: Mesh | jax.sharding.AbstractMesh | None = mesh
  if manual:
    where = jax.sharding.get_abstract_mesh()
    local = manual >= set(where.axis_names)  # the engine's shard_map: whole rows and heads here
  else:
    local = where is None or where.size == 1
  if local or where is None:
    return attend(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *mask_Bx1xTxT)
  q_spec = sharding.logical_to_spec(('batch', 'length', 'act_heads', None))
  kv_spec = sharding.logical_to_spec(('batch', 'length', 'act_kv_heads', None))
  mask_specs = (sharding.logical_to_spec(('batch', None, None, None)),) * len(mask_Bx1xTxT)
  return jax.shard_map(attend, mesh=where, in_specs=(q_spec, kv_spec, kv_spec) + mask_specs,
                       out_specs=q_spec, axis_names=set(where.axis_names) - manual,
                       check_vma=False)(q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, *mask_Bx1xTxT)
