"""The train step's device memory, and the trainer's micro-batch fit (train.micro_batch_size=0).

  resolved, run = config.resolve(config, len(devices), device=devices[0])
  resolved, run, line = memory.fit_micro_batch(config, resolved, run, devices)

`compile_step` compiles the real train step for a resolved config (nothing is allocated or run),
`peak_bytes` reads its memory from XLA's buffer assignment, and `fit_micro_batch` compiles a few
candidate micro-batches and keeps the largest that fits; the trainer and the planner (plan.py)
both use them.
"""
import dataclasses

import jax
import ml_collections
import numpy as np

from jax_pretrain import config as config_lib
from jax_pretrain import gpu_targets

GIB = 2**30
# train.micro_batch_size=0 on a GPU takes the largest micro-batch whose compiled step needs at most
# this share of the memory JAX may use: XLA's buffer assignment is exact, but the allocator rounds
# and fragments, and the candidates are compiled without autotuning (whose kernels may want other
# workspaces).
FIT_MARGIN = 0.95
# ... and whose compiled FLOPs per token exceed the smallest micro-batch's by at most this much.
MAX_EXTRA_FLOPS = 0.02


def compile_step(config: ml_collections.ConfigDict, run: config_lib.RunShape, devices,
                 autotune: bool = True, batch=None, loss=None):
  """(state.Setup, compiled train step) of a resolved config for these devices. Nothing is
  allocated or run.

  autotune=False skips XLA:GPU's kernel autotuning (a memory estimate needs no fast kernels; a
  compile without a GPU never autotunes). batch(s), loss(s): the program's update (its abstract
  batch and loss function, train.Program's); None: pretraining's.
  """
  from jax_pretrain import state as state_lib  # noqa: PLC0415
  s = state_lib.build(config, run, devices)
  abstract = batch(s) if batch else state_lib.abstract_batch(s, s.config.train.batch_size)
  lowered = state_lib.jit_train_step(s, -1, loss(s) if loss else None).lower(
      s.abstract_state, abstract)
  options = {} if autotune or devices[0].platform != 'gpu' else {'xla_gpu_autotune_level': 0}
  return s, lowered.compile(compiler_options=options)


def peak_bytes(compiled) -> float:
  """Device memory the program needs at its peak: its arguments (the state and a batch), outputs
  not written in place of a donated argument, and XLA's temporary buffer."""
  m = compiled.memory_analysis()
  return (m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
          + m.temp_size_in_bytes)


def device_bytes(tree) -> float:
  """Bytes one device holds of a tree of abstract arrays (ShapeDtypeStructs with a sharding, e.g.
  state.Setup.abstract_state): each leaf's shard."""
  return float(sum(np.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                   for x in jax.tree.leaves(tree)))


def micro_batch_candidates(per_device: int) -> list[int]:
  """Micro-batch sizes for a device's share of the batch, ascending: the powers of two that divide
  it, and the share itself (no accumulation)."""
  return sorted({m for m in (2**i for i in range(per_device.bit_length())) if per_device % m == 0}
                | {per_device})


def search_micro_batch(candidates: list[int], measure, budget: float,
                       extra_flops: float = MAX_EXTRA_FLOPS):
  """(largest candidate m that fits or None, {m: measure(m) for every m compiled}).

  measure(m) -> (peak bytes, compiled FLOPs per token). m fits when its peak is within budget and
  its FLOPs per token are within `extra_flops` of the smallest candidate's: near the memory limit
  XLA rematerializes on its own (tiny on one A100 40GB at micro-batch 64: 23% more FLOPs), and a
  smaller micro-batch without that recompute is faster. Memory grows linearly with the
  micro-batch, so after the smallest and the largest candidate, the line through their peaks
  points at the answer: usually three compiles, two when the largest fits.
  """
  tried = {}
  small, big = candidates[0], candidates[-1]

  def fits(m):
    tried[m] = measure(m)
    return tried[m][0] <= budget and tried[m][1] <= (1 + extra_flops) * tried[small][1]

  if not fits(small):
    return None, tried
  if small == big or fits(big):
    return big, tried
  (small_peak, _), (big_peak, _) = tried[small], tried[big]
  guess = small + (budget - small_peak) * (big - small) / (big_peak - small_peak)
  for m in reversed([m for m in candidates if small < m < big and m <= guess]):
    if fits(m):
      return m, tried
  return small, tried


def usable_memory(device, target: gpu_targets.Target | None = None) -> float:
  """Bytes JAX may allocate on a device: its allocator's limit on a real GPU; for a compile-only
  device, the target's memory times the preallocated fraction (runtime.MEM_FRACTION)."""
  from jax_pretrain import runtime  # noqa: PLC0415
  if target is not None:
    if target.file is None:
      return target.device_memory
    return runtime.mem_fraction() * target.device_memory
  return float(device.memory_stats()['bytes_limit'])


def with_micro_batch(config: ml_collections.ConfigDict, resolved: ml_collections.ConfigDict,
                     run: config_lib.RunShape, micro_batch: int):
  """(resolved, run) with train.micro_batch_size=micro_batch, re-derived as config.resolve derives
  it (without resolving again): the accumulation steps, and the eval batch where `config` (the
  unresolved one) leaves it 0 (one micro-batch per data-parallel device)."""
  c = ml_collections.ConfigDict(resolved.to_dict())
  dp = c.mesh.data * c.mesh.fsdp
  c.train.micro_batch_size = micro_batch
  if config.train.eval_batch_size == 0:
    c.train.eval_batch_size = micro_batch * dp
  c.lock()
  return c, dataclasses.replace(run, grad_accum_steps=c.train.batch_size // (micro_batch * dp))


def fit_micro_batch(config: ml_collections.ConfigDict, resolved: ml_collections.ConfigDict,
                    run: config_lib.RunShape, devices,
                    target: gpu_targets.Target | None = None, alongside: float = 0.0,
                    batch=None, loss=None):
  """train.micro_batch_size=0 on a GPU: the largest micro-batch whose compiled step fits.

  config: the config as given (its micro_batch_size 0 asks for the fit); resolved, run: what
  config.resolve made of it. Returns (resolved, run, the line to print) with the chosen
  micro-batch (with_micro_batch), or (resolved, run, None) where nothing was chosen: an explicit
  micro-batch, or not a GPU (there 0 keeps meaning batch_size / data-parallel devices, no
  accumulation). Each candidate is the real train step compiled for these devices, without
  autotuning; its peak is XLA's buffer assignment, against FIT_MARGIN of `usable_memory` less
  `alongside` (bytes per device that stay allocated beside the step: GRPO's engine cache); the
  step is the program's (batch, loss: as compile_step takes them). Raises config.ConfigError when
  not even one sequence per device fits.
  """
  if config.train.micro_batch_size != 0 or devices[0].platform != 'gpu':
    return resolved, run, None
  per_device = resolved.train.batch_size // (run.mesh_shape[0] * run.mesh_shape[1])
  # Each process asks one of its own devices (another process's cannot report its memory); all
  # take the smallest answer, so that every process compiles the same micro-batch.
  local = [d for d in devices if d.process_index == devices[0].client.process_index()]
  limit = usable_memory((local or devices)[0], target)
  if target is None:
    from jax_pretrain import multihost  # noqa: PLC0415  (imports jax)
    limit = multihost.minimum(limit)

  def measure(m):
    from jax_pretrain import hlo  # noqa: PLC0415
    s, compiled = compile_step(*with_micro_batch(config, resolved, run, m), devices,
                               autotune=False, batch=batch, loss=loss)
    flops = hlo.analyze(compiled.as_text()).flops
    return peak_bytes(compiled), flops / s.run.tokens_per_step

  budget = FIT_MARGIN * limit - alongside
  chosen, tried = search_micro_batch(micro_batch_candidates(per_device), measure, budget)
  base = tried[min(tried)][1]
  beside = f' less {alongside / GIB:.1f} GiB held beside the step' if alongside else ''
  compiled = ', '.join(
      f'{m} -> {p / GIB:.1f} GiB' + (f' +{f / base - 1:.0%} FLOPs' if f > base * 1.005 else '')
      for m, (p, f) in sorted(tried.items()))
  if chosen is None:
    remat = ('' if resolved.model.remat == 'full' else ', or set --config.model.remat=full '
             f'(now {resolved.model.remat})')
    raise config_lib.ConfigError(
        f'the train step does not fit {FIT_MARGIN:.0%} of the {limit / GIB:.1f} GiB per device'
        f'{beside} even with one sequence per device (compiled: {compiled}): shard the state '
        f'(--config.mesh.fsdp){remat}.')
  return (*with_micro_batch(config, resolved, run, chosen),
          f'micro-batch {chosen} (auto: the largest within {FIT_MARGIN:.0%} of {limit / GIB:.1f} '
          f'GiB{beside} that XLA does not recompute more of; compiled: {compiled})')
