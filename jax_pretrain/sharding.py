"""Device mesh and the one table that maps logical axis names to mesh axes.

Every parameter and key activation carries logical axis names (e.g. ('embed', 'mlp')).
LOGICAL_AXIS_RULES turns them into a PartitionSpec over the mesh axes ('data', 'fsdp', 'tensor').
A one-device mesh is the degenerate case: every spec then places everything on that device.
"""
from collections.abc import Sequence
import math

import jax
from jax.sharding import AxisType
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

MESH_AXES = ('data', 'fsdp', 'tensor')

# logical name -> mesh axis (or tuple of axes, or None: replicated).
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    # Parameters: FSDP shards the model dimension, tensor parallelism splits heads, MLP and vocab.
    ('layers', None),
    ('vocab', 'tensor'),
    ('embed', 'fsdp'),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('head_dim', None),
    ('mlp', 'tensor'),
    ('norm', None),
    # Activations: the batch is split over every data-parallel axis; features follow the weights.
    ('batch', ('data', 'fsdp')),
    ('length', None),
    ('act_embed', None),
    ('act_heads', 'tensor'),
    ('act_kv_heads', 'tensor'),
    ('act_mlp', 'tensor'),
    ('act_vocab', 'tensor'),
)
_RULES = dict(LOGICAL_AXIS_RULES)


def manual_axes() -> frozenset[str]:
  """Mesh axes that an enclosing shard_map has made manual (none outside one)."""
  return frozenset(jax.sharding.get_abstract_mesh().manual_axes)


def logical_to_spec(logical_axes: Sequence[str | None]) -> P:
  """PartitionSpec for an array whose dimensions carry these logical names.

  Inside a shard_map (the train step maps over 'data'), the manual axes are left out: the array
  there is already this device's block along them.
  """
  manual = manual_axes()

  def mesh_axes(name):
    axes = _RULES[name] if name is not None else None
    if axes is None or not manual:
      return axes
    kept = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if a not in manual)
    return None if not kept else kept[0] if len(kept) == 1 else kept
  return P(*(mesh_axes(name) for name in logical_axes))


AUTO_FSDP = 0


def resolve_mesh_shape(data: int, fsdp: int, tensor: int, num_devices: int) -> tuple[int, int, int]:
  """Fills in the one axis given as -1 and checks the product equals the device count.

  fsdp 0 (AUTO_FSDP) is 1 where another axis is -1 (plain data parallelism: the trainer's fit,
  memory.fit_micro_batch, raises it when the state does not fit that way), else the devices the
  other two leave (as -1 would be: nothing else could fill them).
  """
  sizes = [data, fsdp, tensor]
  named = ', '.join(f'{n}={s}' for n, s in zip(MESH_AXES, sizes))
  if sizes.count(-1) > 1:
    raise ValueError(f'mesh: at most one axis may be -1 (all remaining devices); got {named}.')
  if fsdp == AUTO_FSDP:
    sizes[1] = 1 if -1 in sizes else -1
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f'mesh: axis sizes must be positive or -1 (fsdp also 0: automatic); got '
                     f'{named}.')
  if -1 in sizes:
    known = math.prod(s for s in sizes if s != -1)
    if num_devices % known:
      raise ValueError(f'mesh: {named} cannot fill {num_devices} devices '
                       f'({num_devices} is not a multiple of {known}).')
    sizes[sizes.index(-1)] = num_devices // known
  if math.prod(sizes) != num_devices:
    raise ValueError(f'mesh: {named} uses {math.prod(sizes)} devices but {num_devices} are '
                     f'present; set the sizes so their product is {num_devices} '
                     '(or set one axis to -1).')
  return sizes[0], sizes[1], sizes[2]


def make_mesh(shape: tuple[int, int, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = jax.devices() if devices is None else list(devices)
  if len(devices) == math.prod(shape):
    return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES),
                         devices=devices)
  # A mesh over a subset of the devices (tests): keep the given order.
  return Mesh(np.asarray(devices).reshape(shape), MESH_AXES,
              axis_types=(AxisType.Auto,) * len(MESH_AXES))


def named_sharding(mesh: Mesh, logical_axes: Sequence[str | None]) -> NamedSharding:
  return NamedSharding(mesh, logical_to_spec(logical_axes))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def constrain(x: jax.Array, logical_axes: Sequence[str | None], mesh: Mesh | None) -> jax.Array:
  """with_sharding_constraint by logical names; a no-op without a mesh (plain apply, tests)."""
  if mesh is None:
    return x
  return jax.lax.with_sharding_constraint(x, named_sharding(mesh, logical_axes))

