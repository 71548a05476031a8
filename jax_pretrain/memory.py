"""The train step's device memory, and the trainer's micro-batch fit (train.micro_batch_size=0).

  resolved, run = config.resolve(config, len(devices), device=devices[0])
  resolved, run, lines = memory.fit_micro_batch(config, resolved, run, devices)

`compile_step` compiles the real train step for a resolved config (nothing is allocated or run),
`peak_bytes` reads its memory from XLA's buffer assignment, and `fit_micro_batch` compiles a few
candidate micro-batches and keeps the largest that fits; where not even one sequence per device
fits, it also tries the mesh's FSDP and full remat, where the config leaves them automatic
(`search_layouts`), and where no unrolled layout fits, the same layouts with the layers scanned
(model.layers 'auto'). The trainer and the planner (plan.py) both use them.
"""
import dataclasses

import jax
import numpy as np

from jax_pretrain import config as config_lib
from jax_pretrain import gpu_targets
from jax_pretrain import sharding

GIB = 2**30
# train.micro_batch_size=0 on a GPU takes the largest micro-batch whose compiled step needs at most
# this share of the memory JAX may use: XLA's buffer assignment is exact, but the allocator rounds
# and fragments, and the candidates are compiled without autotuning (whose kernels may want other
# workspaces).
FIT_MARGIN = 0.95
# ... and whose compiled FLOPs per token exceed the smallest micro-batch's by at most this much.
MAX_EXTRA_FLOPS = 0.02
# Where the state does not fit as resolved, the fit compares at most this many (fsdp, remat, layers)
# layouts that fit: each costs a micro-batch search (two to four compiles), one that does not fit
# a single compile.
MAX_FITTING_LAYOUTS = 4


def compile_step(config: config_lib.Config, run: config_lib.RunShape, devices,
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

  measure(m) -> (peak bytes, compiled FLOPs per token, ...: anything more the caller wants kept
  in `tried`). m fits when its peak is within budget and its FLOPs per token are within
  `extra_flops` of the smallest candidate's: near the memory limit
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
  small_peak, big_peak = tried[small][0], tried[big][0]
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


def with_micro_batch[C: config_lib.Config](config: config_lib.Config, resolved: C,
                                            run: config_lib.RunShape,
                                            micro_batch: int) -> tuple[C, config_lib.RunShape]:
  """(resolved, run) with train.micro_batch_size=micro_batch, re-derived as config.resolve derives
  it (config.resolve_batch, without resolving again): the accumulation steps, and the eval batch
  where `config` (as given, unresolved) leaves it 0 (one micro-batch per data-parallel device)."""
  train, accum, _ = config_lib.resolve_batch(
      dataclasses.replace(resolved.train, micro_batch_size=micro_batch,
                          eval_batch_size=config.train.eval_batch_size),
      resolved.data.seq_len, resolved.mesh)
  return (dataclasses.replace(resolved, train=train),
          dataclasses.replace(run, grad_accum_steps=accum))


type Layout = tuple[int, str, str]  # (mesh.fsdp, model.remat, model.layers)


def with_layout[C: config_lib.Config](resolved: C, run: config_lib.RunShape,
                                       layout: Layout) -> tuple[C, config_lib.RunShape]:
  """(resolved, run) with a layout (mesh.fsdp, model.remat, model.layers; mesh.data the
  data-parallel devices the fsdp leaves), re-derived as config.resolve derives them (without
  resolving again): the mesh shape, and the start-up lines without the resolve's remat or layers
  choice where the fit replaced it. The data-parallel devices (data × fsdp), and so the batch's
  splits, stay."""
  fsdp, remat, layers = layout
  mesh = resolved.mesh
  dp = mesh.data * mesh.fsdp
  c = dataclasses.replace(
      resolved, mesh=dataclasses.replace(mesh, data=dp // fsdp, fsdp=fsdp),
      model=dataclasses.replace(resolved.model, remat=remat, layers=layers))
  replaced = {name for name, value in (('remat', remat), ('layers', layers))
              if value != getattr(resolved.model, name)}
  choices = tuple(x for x in run.choices  # (config._resolve_model's lines)
                  if not any(x.startswith(f'{name} ') for name in replaced))
  return c, dataclasses.replace(run, mesh_shape=(dp // fsdp, fsdp, mesh.tensor), choices=choices)



def layout_candidates(dp: int, d_model: int, fsdp: int, remat: str, fsdp_auto: bool,
                      remat_auto: bool, layers: str = 'unroll') -> list[Layout]:
  """(fsdp, remat, layers) layouts the fit may use, the resolved one (fsdp, remat, layers) first,
  in the order that prefers less sharding, then less recompute. With fsdp_auto: every power of two
  from fsdp up that divides the dp data-parallel devices and d_model (the mesh.fsdp rule), and dp
  itself where it does; with remat_auto: the resolve's choice, then 'full' (only the layers'
  inputs kept). The layers stay as given (search_layouts is asked once per layers value)."""
  fsdps = [fsdp]
  if fsdp_auto:
    fsdps = [f for f in micro_batch_candidates(dp) if f >= fsdp and d_model % f == 0]
  remats = [remat] + (['full'] if remat_auto and remat != 'full' else [])
  return [(f, r, layers) for f in fsdps for r in remats]


def search_layouts(layouts: list[Layout], search, per_device: int, ranked: bool):
  """(the layout chosen or None, {layout: search(layout)} for every layout searched).

  layouts: layout_candidates' list. search(layout) -> (the micro-batch it fits, or None; the
  roofline's seconds per token at that micro-batch, or None without a roofline). The first layout
  (the resolved one: the run as configured) is kept when it fits: the search goes on only where
  it does not. Then, without `ranked` (no roofline for the device), the first that fits in the
  order of `layouts` (less sharding, then less recompute); with it, the fastest per token of
  those that fit (ties: the earlier), skipping layouts that cannot be faster than one found, so
  that few are compiled:
  - once (f, r) fits the whole per-device batch (no accumulation), every layout with at least f's
    sharding and r's recompute: at best the same micro-batch, with more collectives or recompute;
  - once r at fsdp f is no faster than r at the smaller fsdp before it, r at any larger fsdp:
    sharding more stopped paying for itself (its gathers cost more than its larger micro-batch
    saves);
  and at most MAX_FITTING_LAYOUTS that fit.
  """
  rank = {r: i for i, r in enumerate(dict.fromkeys(r for _, r, _ in layouts))}  # by recompute
  results: dict[Layout, tuple] = {}
  whole: list[tuple[int, str]] = []
  stopped: set[str] = set()
  last: dict[str, float] = {}
  for layout in layouts:
    f, r, _ = layout
    if r in stopped or any(f >= f0 and rank[r] >= rank[r0] for f0, r0 in whole):
      continue
    if sum(m is not None for m, _ in results.values()) >= MAX_FITTING_LAYOUTS:
      break
    results[layout] = m, seconds = search(layout)
    if m is None:
      continue
    if layout == layouts[0] or not ranked or seconds is None:
      return layout, results
    if m == per_device:
      whole.append((f, r))
    if r in last and seconds >= last[r]:
      stopped.add(r)
    last[r] = seconds
  fitting = {layout: seconds for layout, (m, seconds) in results.items() if m is not None}
  return (min(fitting, key=lambda x: fitting[x]) if fitting else None), results


def _compiled_line(tried: dict) -> str:
  """A micro-batch search's compiles, ascending: 'micro-batch -> peak GiB', with the FLOPs XLA
  recomputes beyond the smallest micro-batch's per token."""
  base = tried[min(tried)][1]
  return ', '.join(
      f'{m} -> {p / GIB:.1f} GiB' + (f' +{f / base - 1:.0%} FLOPs' if f > base * 1.005 else '')
      for m, (p, f, *_) in sorted(tried.items()))


def fit_micro_batch[C: config_lib.Config](
    config: config_lib.Config, resolved: C, run: config_lib.RunShape, devices,
    target: gpu_targets.Target | None = None, alongside: float = 0.0, batch=None,
    loss=None) -> tuple[C, config_lib.RunShape, tuple[str, ...]]:
  """train.micro_batch_size=0 on a GPU: the largest micro-batch whose compiled step fits, and
  where not even one sequence per device fits, the mesh's FSDP, the remat policy and the layers'
  scan too.

  config: the config as given (config.typed: its micro_batch_size 0 asks for the fit); resolved,
  run: what config.resolve made of it. Returns (resolved, run, the lines to print) with the choice
  re-derived (with_layout, with_micro_batch), or (resolved, run, ()) where nothing was chosen: an
  explicit micro-batch, or not a GPU (there 0 keeps meaning batch_size / data-parallel devices,
  no accumulation). Each candidate is the real train step compiled for these devices, without
  autotuning; its peak is XLA's buffer assignment, against FIT_MARGIN of `usable_memory` less
  `alongside` (bytes per device that stay allocated beside the step: GRPO's engine cache); the
  step is the program's (batch, loss: as compile_step takes them).

  Where the resolved mesh and remat do not fit one sequence per device, the layouts that
  config leaves automatic (mesh.fsdp 0 with mesh.data -1: more FSDP; model.remat 'auto': 'full')
  are searched (search_layouts), each with its own micro-batch search, and ranked by the
  compiled step's roofline per token at the speeds of `target`, or on a real GPU of the
  gpu_targets target of its device kind; without one, the first that fits in the order less
  sharding, then less recompute. Where no layout fits with the layers unrolled and model.layers
  is 'auto', the same search runs with them scanned (the scan keeps one layer's activations
  and weight gradients at a time: less memory, slower; xxlarge on 2 A100 40GB): auto unrolls
  where an unrolled step fits and scans only where nothing else does. Explicit values are never
  replaced. Raises config.ConfigError when no layout fits one sequence per device.
  """
  if config.train.micro_batch_size != 0 or devices[0].platform != 'gpu':
    return resolved, run, ()
  dp = run.mesh_shape[0] * run.mesh_shape[1]
  per_device = resolved.train.batch_size // dp
  # Each process asks one of its own devices (another process's cannot report its memory); all
  # take the smallest answer, so that every process compiles the same micro-batch.
  local = [d for d in devices if d.process_index == devices[0].client.process_index()]
  limit = usable_memory((local or devices)[0], target)
  if target is None:
    from jax_pretrain import multihost  # noqa: PLC0415  (imports jax)
    limit = multihost.minimum(limit)
  speeds = target if target is not None else gpu_targets.for_device_kind(devices[0].device_kind)
  if speeds is not None and speeds.matmul_flops is None:
    speeds = None
  budget = FIT_MARGIN * limit - alongside
  searched = {}  # layout -> {micro-batch: (peak bytes, FLOPs per token, seconds per token)}

  def search(layout):
    at = with_layout(resolved, run, layout)

    def measure(m):
      from jax_pretrain import hlo  # noqa: PLC0415
      s, compiled = compile_step(*with_micro_batch(config, *at, m), devices, autotune=False,
                                 batch=batch, loss=loss)
      stats = hlo.analyze(compiled.as_text(), speeds.devices_per_node if speeds else 8)
      tokens = s.run.tokens_per_step
      r = gpu_targets.roofline(stats, speeds) if speeds else None
      return peak_bytes(compiled), stats.flops / tokens, r.step_s / tokens if r else None

    chosen, searched[layout] = search_micro_batch(micro_batch_candidates(per_device), measure,
                                                  budget)
    return chosen, searched[layout][chosen][2] if chosen else None

  m = resolved.model
  layers = [m.layers] + (['scan'] if config.model.layers == config_lib.AUTO_LAYERS
                         and m.layers != 'scan' else [])
  results: dict[Layout, tuple] = {}
  for each in layers:  # the resolved layers first; 'scan' only where no unrolled layout fits
    layouts = layout_candidates(
        dp, m.d_model, resolved.mesh.fsdp, m.remat,
        fsdp_auto=config.mesh.fsdp == sharding.AUTO_FSDP and config.mesh.data == -1,
        remat_auto=config.model.remat == config_lib.AUTO_REMAT, layers=each)
    layout, found = search_layouts(layouts, search, per_device, ranked=speeds is not None)
    results.update(found)
    if layout is not None:
      break
  beside = f' less {alongside / GIB:.1f} GiB held beside the step' if alongside else ''
  within = f'{FIT_MARGIN:.0%} of {limit / GIB:.1f} GiB{beside}'
  first = (resolved.mesh.fsdp, m.remat, m.layers)
  if layout is None:
    raise _no_fit(config, searched, first, dp, f'{FIT_MARGIN:.0%} of the {limit / GIB:.1f} GiB '
                  f'per device{beside}')
  lines = [f'micro-batch {results[layout][0]} (auto: the largest within {within} that XLA does '
           f'not recompute more of; compiled: {_compiled_line(searched[layout])})']
  if layout != first:
    lines.insert(0, _layout_line(layout, first, results, searched, dp, within, speeds,
                                 devices[0].device_kind))
  resolved, run = with_layout(resolved, run, layout)
  return (*with_micro_batch(config, resolved, run, results[layout][0]), tuple(lines))


def _layout_name(layout: Layout) -> str:
  return f'fsdp {layout[0]} {layout[1]}' + (' scanned' if layout[2] == 'scan' else '')


def _layout_outcome(layout: Layout, result: tuple, tried: dict) -> str:
  """What a layout's micro-batch search found: its micro-batch and roofline tokens/s, or its
  peak at one sequence per device."""
  micro_batch, seconds = result
  if micro_batch is None:
    return f'{_layout_name(layout)} does not fit ({_compiled_line(tried)})'
  speed = f', {1 / seconds:,.0f} tokens/s' if seconds else ''
  return f'{_layout_name(layout)} -> micro-batch {micro_batch}{speed}'


def _layout_line(layout: Layout, first: Layout, results: dict, searched: dict, dp: int,
                 within: str, speeds, device_kind: str) -> str:
  """The start-up line of a layout the fit chose over the resolved one (`first`): what it is,
  why the resolved one was left, and every other layout it tried."""
  f, r, layers = first
  if speeds is not None:
    how = f'the fastest by the {speeds.name} roofline (compiled, not measured)'
  else:
    how = (f'no roofline for {device_kind} (not in gpu_targets): the first that fits, less '
           'sharding first, then less recompute')
  if layout[2] != layers:
    how = f'no layout fits with the layers unrolled, so scanned: {how}'
  tried = '; '.join(_layout_outcome(x, result, searched[x])
                    for x, result in results.items() if x != first)
  mesh = f'mesh data={dp // layout[0]} fsdp={layout[0]}, ' if layout[0] != f else ''
  scanned = f', layers {layout[2]}' if layout[2] != layers else ''
  return (f'{mesh}remat {layout[1]}{scanned} (auto: '
          f'{"data parallelism" if f == 1 else f"fsdp {f}"} with remat {r} does not fit '
          f'{within} even with one sequence per device ({_compiled_line(searched[first])}); '
          f'{how}: {tried})')


def _no_fit(config: config_lib.Config, searched: dict, first: Layout, dp: int,
            within: str) -> config_lib.ConfigError:
  """The error where no layout searched fits one sequence per device, with what each compiled
  to and what the user may set that the fit did not try."""
  compiled = (_compiled_line(searched[first]) if len(searched) == 1 else '; '.join(
      f'{_layout_name(x)}: {_compiled_line(tried)}' for x, tried in searched.items()))
  advice = []
  if len({x[0] for x in searched}) == 1 and dp > 1:
    advice.append('shard the state (--config.mesh.fsdp)')
  if all(x[1] != 'full' for x in searched):
    advice.append(f'set --config.model.remat=full (now {first[1]})')
  if all(x[2] != 'scan' for x in searched):
    advice.append('scan the layers (--config.model.layers=scan)')
  more = 'shard the state over more devices (mesh.fsdp)' + (
      ', or split the layers too (--config.mesh.tensor)' if dp > 1 else '')
  return config_lib.ConfigError(
      f'the train step does not fit {within} even with one sequence per device (compiled: '
      f'{compiled}): {", or ".join(advice or [more])}.')
