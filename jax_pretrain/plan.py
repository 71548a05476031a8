"""Compiles the real train step for a GPU this machine does not have, and says what it would do.

  python -m jax_pretrain.plan --config=configs/xlarge.py [--config.x=y ...] \\
      --target=h100|a100-80|a100-40|v100|rtx-a6000|cpu [--num_devices=8] [--json] \\
      [--memory_gib=24] [--grpo [--grpo_prompt_tokens=N] | --dpo | --serve [--serve_slots=16]
      [--serve_context=0] [--serve_chunk=8] [--serve_kv_cache_dtype=auto|int8|fp8]
      [--serve_workdir=RUN]]

For a GPU target, XLA's GPU compiler (in jax's CUDA plugin: pip install -r requirements-gpu.txt;
no GPU needed) compiles the trainer's own step (memory.compile_step: state.build,
state.jit_train_step) for devices described by jax_pretrain/gpu_targets/. The compiled program
gives, per device and optimizer step:
  memory       XLA's buffer assignment (arguments + outputs - donated + temporaries) against the
               device memory JAX may use (runtime.MEM_FRACTION of it): fits or not;
  FLOPs        counted in the compiled HLO (hlo.py), against the model's 6·N·tokens + attention;
  collectives  by kind: how many, and the bytes of the buffers they reduce or gather;
  roofline     each kernel takes max(FLOPs / FLOP/s, HBM bytes / bandwidth) at the target's
               speeds (gpu_targets), collectives bytes / link bandwidth, added up without overlap:
               a step time and tokens/s that are estimates, not measurements (no autotuning ran)
               (gpu_targets.roofline).
The step is the one the trainer would run there: its micro-batch chosen by the trainer's fit
(memory.fit_micro_batch), which where data parallelism fits no sequence also chooses an automatic
mesh.fsdp and model.remat by that roofline; the 'chosen' lines say what and why.
Targets: gpu_targets.TARGETS. 'cpu' compiles for this machine's CPU devices (no roofline).

With --grpo and a config with the grpo group (--config=configs/grpo.py:xlarge, or :RUN), the
programs of a GRPO step instead (its update, rollout and scoring): jax_pretrain/grpo/plan.py, which
registers its plan here (register) as grpo/config.py registers its config group. With --dpo and
a config with the dpo group (--config=configs/dpo.py:xlarge), a DPO step's update with the
reference params beside it: jax_pretrain/dpo/plan.py, registered the same way. With --serve, the
engine as `serve` runs it (the model of --config, or of a run's config.json with --serve_workdir;
serve's --slots, --context, --chunk and --kv_cache_dtype as --serve_*, their defaults serve's):
its weights, its KV cache (which is also the prefix cache: no memory of its own), its largest
prefill and its decode over the whole context, each compiled, and whether they fit:
jax_pretrain/engine/plan.py (registered as 'engine'). A plan that cannot run where it is planned
(serving's that does not fit) ends its report with one error line (exit status 1).
"""
from collections.abc import Callable
import dataclasses
import importlib
import json
import os
import time

from absl import flags
import jax

from jax_pretrain import cli
from jax_pretrain import config as config_lib
from jax_pretrain import gpu_targets
from jax_pretrain import hlo
from jax_pretrain import memory
from jax_pretrain import model as model_lib
from jax_pretrain import runtime
from jax_pretrain.errors import UserError


class PlanError(UserError):
  """The plan cannot be made here (e.g. jax's CUDA plugin is missing); the message says why."""


def target_of(name: str, memory_gib: float | None = None) -> gpu_targets.Target:
  """The target of this name (gpu_targets.TARGETS), or with memory_gib a card of its family with
  that much device memory."""
  t = gpu_targets.TARGETS[name]
  return dataclasses.replace(t, memory_override=memory_gib * memory.GIB) if memory_gib else t


def devices_for(target: gpu_targets.Target, num_devices: int) -> list:
  """Compile-only devices of a GPU target (nodes of 8), or this process's CPU devices."""
  if target.file is None:
    cpus = jax.devices('cpu')
    if len(cpus) < num_devices:
      raise PlanError(f'--num_devices={num_devices} but this process has {len(cpus)} CPU '
                      'devices (python -m jax_pretrain.plan sets jax_num_cpu_devices itself).')
    return cpus[:num_devices]
  if gpu_targets.plugin_library() is None:
    raise PlanError(
        f"--target={target.name} compiles with jax's CUDA plugin, which is not installed: "
        f'pip install -r requirements-gpu.txt (or "jax[cuda12]=={jax.__version__}"; ~5.5 GB, '
        'no GPU needed), or use --target=cpu.')
  per_node = min(num_devices, target.devices_per_node)
  if num_devices % per_node:
    raise PlanError(f'--num_devices={num_devices}: more than one node needs a multiple of '
                    f'{target.devices_per_node} devices.')
  from jax.experimental import topologies  # noqa: PLC0415
  try:
    topology = topologies.get_topology_desc(
        platform='cuda', target_config=target.config_text(),
        topology=f'1x{num_devices // per_node}x{per_node}')
  except NotImplementedError as e:
    raise PlanError(f"jax's CUDA plugin did not load ({e}); with JAX_PLATFORMS naming cuda it "
                    'needs a GPU driver: run with JAX_PLATFORMS=cpu.') from None
  return topology.devices


def resolve_program(config, group: str, config_type: type, target: str, num_devices: int,
                    memory_gib: float | None) -> tuple:
  """The start of a program's plan (--grpo, --dpo: group 'grpo', 'dpo'): (the config typed, as
  config_type, the program's config with its group; config.resolve's resolved config and run
  for the target's devices; the target; its devices). PlanError: a config without the group."""
  config = config_lib.typed(config)
  if not isinstance(config, config_type):
    raise PlanError(f'--{group} plans a {group.upper()} step: give a config with the {group} '
                    f'group, e.g. --config=configs/{group}.py:xlarge (a preset\'s model) or '
                    f'configs/{group}.py:RUN.')
  t = target_of(target, memory_gib)
  devices = devices_for(t, num_devices)
  c, run = config_lib.resolve(config, len(devices), device=devices[0])
  return config, c, run, t, devices


def memory_report(compiled, target: gpu_targets.Target, alongside: dict[str, float]) -> dict:
  """A compiled program's peak per device (XLA's buffer assignment), what stays on each device
  beside it (alongside: {what: bytes}), and whether both fit the memory JAX may use there."""
  m = compiled.memory_analysis()
  peak = memory.peak_bytes(compiled)
  usable = memory.usable_memory(None, target)
  total = peak + sum(alongside.values())
  return {
      'peak_memory_gib': peak / memory.GIB,
      'argument_gib': m.argument_size_in_bytes / memory.GIB,
      'temp_gib': m.temp_size_in_bytes / memory.GIB,
      'alongside_gib': {k: v / memory.GIB for k, v in alongside.items()},
      'total_memory_gib': total / memory.GIB,
      'device_memory_gib': target.device_memory / memory.GIB,
      'usable_memory_gib': usable / memory.GIB,
      'fits': total <= usable,
  }


def report(s, compiled, target: gpu_targets.Target, compile_s: float | None = None,
           choices=(), *, tokens_per_step: int | None = None, seq_len: int | None = None,
           alongside: dict[str, float] | None = None) -> dict:
  """The plan of a compiled step (see the module docstring), as a JSON-ready dict.

  tokens_per_step, seq_len: a step's tokens and rows' length when they are not the run's
  (GRPO's update: batch_size rows of its width); alongside: {what: bytes per device} that stays
  on each device while the step runs without being one of its buffers: 'fits' counts it.
  """
  c, run = s.config, s.run
  n = s.mesh.size
  stats = hlo.analyze(compiled.as_text(), target.devices_per_node)
  tokens_per_step = tokens_per_step or run.tokens_per_step
  flops_per_token = model_lib.flops_per_token(c.model,
                                              seq_len or c.data.seq_len)
  model_flops = flops_per_token * tokens_per_step / n
  r = gpu_targets.roofline(stats, target)
  tokens_per_s = tokens_per_step / r.step_s if r else None
  return {
      'target': target.name,
      'device_kind': target.device_kind,
      'num_devices': n,
      'mesh': dict(zip(('data', 'fsdp', 'tensor'), run.mesh_shape)),
      'params': model_lib.count_params(s.abstract_state.params),
      'attention': c.model.attention,
      'remat': c.model.remat,
      'layers': c.model.layers,
      'micro_batch_size': c.train.micro_batch_size,
      'grad_accum_steps': run.grad_accum_steps,
      'tokens_per_step': tokens_per_step,
      'choices': list(run.choices) + list(choices),
      **memory_report(compiled, target, alongside or {}),
      'compute_flops_per_step': stats.flops,
      'matmul_flops_per_step': stats.matmul_flops,
      'fp8_matmul_flops_per_step': stats.fp8_matmul_flops,
      'fp8_matmuls': stats.fp8_matmuls,
      'attention_flops_per_step': stats.attention_flops,
      'model_flops_per_step': model_flops,
      'flops_ratio': stats.flops / model_flops,
      'hbm_bytes_per_step': stats.hbm_bytes,
      'uncounted_kernels': dict(stats.uncounted),
      'kernels_by_kind': kernels_by_kind(stats, r),
      'collective_counts_per_step': {k: v.count for k, v in stats.collectives.items()},
      'collective_bytes_per_step': {k: v.bytes for k, v in stats.collectives.items()},
      'collective_wire_bytes_per_step': {k: v.wire_bytes for k, v in stats.collectives.items()},
      'collective_cross_node_wire_bytes_per_step': {
          k: v.cross_node_wire_bytes for k, v in stats.collectives.items()},
      'compute_s': r.compute_s if r else None,
      'communication_s': r.communication_s if r else None,
      'step_s': r.step_s if r else None,
      'tokens_per_s': tokens_per_s,
      'mfu': model_flops * n / r.step_s / (n * target.peak_flops) if r else None,
      'compile_s': compile_s,
  }


def kernels_by_kind(stats, r) -> dict[str, dict]:
  """{kind (hlo.py's): {'launches', 'flops', 'hbm_bytes' per step, and 'roofline_s' (None
  without a roofline)}}, the costliest kind first: the compiled program's counterpart of a
  profile's device time by kind of kernel."""
  kinds: dict[str, dict] = {}
  for k in stats.kernels:
    row = kinds.setdefault(k.kind, {'launches': 0.0, 'flops': 0.0, 'hbm_bytes': 0.0})
    row['launches'] += k.times
    row['flops'] += k.flops * k.times
    row['hbm_bytes'] += k.hbm_bytes * k.times
  for kind, row in kinds.items():
    row['roofline_s'] = r.by_kind.get(kind, 0.0) if r else None
  return dict(sorted(kinds.items(), key=lambda x: -(x[1]['roofline_s'] or x[1]['hbm_bytes'])))


def plan(config, target: str = 'h100', num_devices: int = 1, hlo_path: str | None = None,
         memory_gib: float | None = None) -> dict:
  """Compiles the train step of `config` (a ConfigDict, as --config gives it, or a Config) for
  `num_devices` of `target`; returns `report`'s dict (and writes the compiled HLO text to
  hlo_path if given). memory_gib: plan for a card of the target's family with this much memory
  (e.g. 24 for an RTX 3090 against the A100 program).

  Raises PlanError (no CUDA plugin, too few CPU devices) and config.ConfigError.
  """
  config = config_lib.typed(config)
  t = target_of(target, memory_gib)
  devices = devices_for(t, num_devices)
  resolved, run = config_lib.resolve(config, len(devices), device=devices[0])
  resolved, run, fitted = memory.fit_micro_batch(config, resolved, run, devices, t)
  t0 = time.perf_counter()
  s, compiled = memory.compile_step(resolved, run, devices)
  compile_s = time.perf_counter() - t0
  if hlo_path:
    with open(hlo_path, 'w', encoding='utf-8') as f:
      f.write(compiled.as_text())
  return report(s, compiled, t, compile_s, fitted)


def call_report(compiled, target: gpu_targets.Target, alongside: dict[str, float], tokens: int,
                compile_s: float | None = None, unknown_trips: int = 1) -> dict:
  """Memory, collectives and roofline of one call of a compiled program other than the train
  step (the engine's prefill and decode), as a JSON-ready dict. alongside: as `report` takes it;
  tokens: what one call processes, for tokens/s; unknown_trips: the trips of a loop whose count
  is traced (the decode's steps)."""
  stats = hlo.analyze(compiled.as_text(), target.devices_per_node, unknown_trips)
  r = gpu_targets.roofline(stats, target)
  return {
      **memory_report(compiled, target, alongside),
      'compute_flops_per_call': stats.flops,
      'hbm_bytes_per_call': stats.hbm_bytes,
      'unknown_trip_counts': stats.unknown_trip_counts,
      'collective_counts_per_call': {k: v.count for k, v in stats.collectives.items()},
      'collective_bytes_per_call': {k: v.bytes for k, v in stats.collectives.items()},
      'compute_s': r.compute_s if r else None,
      'communication_s': r.communication_s if r else None,
      'call_s': r.step_s if r else None,
      'tokens_per_s': tokens / r.step_s if r else None,
      'compile_s': compile_s,
  }


def gb_text(x: float) -> str:
  """Bytes as the reports print them."""
  return f'{x / 1e9:,.2f} GB'


def memory_text(r: dict) -> str:
  """A program's peak per device, what stays beside it, and whether they fit."""
  alongside = r.get('alongside_gib') or {}
  held = ''
  if alongside:
    parts = ', '.join(f'{k} {v:.1f}' for k, v in alongside.items())
    held = (f' + {sum(alongside.values()):.1f} GiB held alongside ({parts}) = '
            f'{r["total_memory_gib"]:.1f} GiB')
  return (f'{r["peak_memory_gib"]:.1f} GiB peak per device (arguments {r["argument_gib"]:.1f}, '
          f'temporaries {r["temp_gib"]:.1f}){held} of {r["usable_memory_gib"]:.1f} GiB usable '
          f'({r["device_memory_gib"]:.1f} GiB device): {"fits" if r["fits"] else "DOES NOT FIT"}')


def call_line(name: str, c: dict, what: str) -> str:
  """One call's line of a report (plan.call_report's dict c): the engine's calls, GRPO's scoring
  pass."""
  line = f'{name:<12} {what}: {memory_text(c)}'
  if c['call_s'] is not None:
    line += f'; roofline {c["call_s"]:.3f} s a call -> {c["tokens_per_s"]:,.0f} tokens/s'
  moved = [f'{k} {c["collective_counts_per_call"][k]:g} × = {gb_text(v)}'
           for k, v in c['collective_bytes_per_call'].items() if v]
  if moved:
    line += f'; collectives {"; ".join(moved)} a call'
  return line + (f'; compiled in {c["compile_s"]:.1f} s' if c['compile_s'] is not None else '')


def format_report(r: dict) -> str:
  mesh = ' '.join(f'{k}={v}' for k, v in r['mesh'].items())
  lines = [
      f'target       {r["num_devices"]} × {r["device_kind"]} ({r["target"]}), mesh {mesh}',
      f'model        {r["params"]:,} parameters; {r["tokens_per_step"]:,} tokens per step',
      f'settings     attention {r["attention"]}, remat {r["remat"]}, layers {r["layers"]}, '
      f'micro-batch '
      f'{r["micro_batch_size"]} × {r["grad_accum_steps"]} accumulation steps per device',
  ] + [f'chosen       {x}' for x in r['choices']] + [
      f'memory       {memory_text(r)}',
      f'FLOPs        {r["compute_flops_per_step"] / 1e12:,.1f} TFLOP per device per step in the '
      f'compiled program (matmul {r["matmul_flops_per_step"] / 1e12:,.1f}, fused attention '
      f'{r["attention_flops_per_step"] / 1e12:,.1f}); model {r["model_flops_per_step"] / 1e12:,.1f}'
      f' (6·N·tokens + attention): {r["flops_ratio"]:.2f}×',
  ]
  if r['fp8_matmuls']:
    lines.append(f'             FP8: {r["fp8_matmuls"]} matmuls of FP8 operands in the program, '
                 f'{r["fp8_matmul_flops_per_step"] / 1e12:,.1f} TFLOP per step')
  if r['uncounted_kernels']:
    lines.append(f'             not counted: {r["uncounted_kernels"]} (kernels of unknown FLOPs)')
  lines.append('kernels      per device per step, by kind: ' + '; '.join(
      f'{kind} {k["launches"]:,.0f} ×' + (f' {k["roofline_s"]:.3f} s' if r['step_s'] else '')
      + f' ({gb_text(k["hbm_bytes"])})' for kind, k in r['kernels_by_kind'].items()))
  counts, sizes = r['collective_counts_per_step'], r['collective_bytes_per_step']
  moved = [f'{k} {counts[k]:g} × = {gb_text(sizes[k])}' for k in sizes if counts[k]]
  lines.append(f'collectives  per device per step: {"; ".join(moved) if moved else "none"}')
  if r['step_s'] is not None:
    lines.append(
        f'roofline     {r["step_s"]:.3f} s per step (kernels {r["compute_s"]:.3f} s, collectives '
        f'{r["communication_s"]:.3f} s, not overlapped) -> {r["tokens_per_s"]:,.0f} tokens/s, MFU '
        f'{r["mfu"]:.1%}: compiled, not measured')
  if r['compile_s'] is not None:
    lines.append(f'compiled in  {r["compile_s"]:.1f} s on this machine')
  return '\n'.join(lines)


@dataclasses.dataclass(frozen=True)
class ProgramPlan:
  """A program's plan of its own step (grpo's: jax_pretrain/grpo/plan.py), which its module
  registers here as it registers its config group (config.register). plan(config, target,
  num_devices, hlo_path, memory_gib, **options) compiles the step's programs and returns a
  JSON-ready dict; format(that dict) is its report."""
  name: str
  plan: Callable[..., dict]
  format: Callable[[dict], str]


_PROGRAM_PLANS: dict[str, ProgramPlan] = {}  # registered by the modules that define them


def register(program: ProgramPlan) -> ProgramPlan:
  """Makes a program's plan known to program_plan (and so to `main`)."""
  _PROGRAM_PLANS[program.name] = program
  return program


def program_plan(name: str) -> ProgramPlan:
  """The plan of the program of this name, its module (jax_pretrain/NAME/plan.py, which registers
  it) loaded if it was not."""
  if name not in _PROGRAM_PLANS:
    importlib.import_module(f'jax_pretrain.{name}.plan')
  return _PROGRAM_PLANS[name]


def main(config, target: str = 'h100', num_devices: int = 1, *, program: str = '',
         options: dict | None = None, as_json: bool = False, hlo_path: str | None = None,
         memory_gib: float | None = None) -> None:
  """`python -m jax_pretrain.plan` once its flags are read: sets this process's jax for a compile
  without the target's devices (call it before jax starts a backend), plans the train step of
  `config` (a ConfigDict or Config), or the step of the registered `program` (options: its plan's
  own, e.g. grpo's prompt_tokens), and prints the report, or with as_json one JSON object."""
  runtime.configure(cache=False)
  if not os.environ.get('JAX_PLATFORMS'):
    # A GPU target compiles without a GPU; with CUDA among the platforms, a machine without one
    # fails the CUDA plugin's driver check, while the plugin still compiles with the CPU platform.
    jax.config.update('jax_platforms', 'cpu')
  if target == 'cpu':
    jax.config.update('jax_num_cpu_devices', num_devices)
  if program:
    p = program_plan(program)
    result = p.plan(config, target, num_devices, hlo_path, memory_gib, **(options or {}))
    text = p.format
  else:
    result, text = plan(config, target, num_devices, hlo_path, memory_gib), format_report
  print(json.dumps(result, indent=1) if as_json else text(result), flush=True)
  if result.get('error'):
    raise PlanError(result['error'])


if __name__ == '__main__':
  # Flags only when run as a program: importing this module defines none (main takes them). Run
  # with -m, this file is the module __main__, apart from jax_pretrain.plan, with which the
  # programs' plans register: main is jax_pretrain.plan's.
  from jax_pretrain import plan as plan_lib
  from jax_pretrain.engine import core as engine_core  # (its sizes' defaults: serve's)
  _CONFIG = cli.define_config('xlarge.py', 'Preset (configs/*.py); fields are overridden with '
                              '--config.group.field=value.')
  _TARGET = flags.DEFINE_enum('target', 'h100', list(gpu_targets.TARGETS), 'Device to compile for.')
  _NUM_DEVICES = flags.DEFINE_integer(
      'num_devices', 1, 'Devices (8 per node for a GPU target; the mesh comes from the config: '
      'data=-1 and fsdp automatic by default, which the fit raises where data parallelism fits no '
      'sequence).')
  _JSON = flags.DEFINE_bool('json', False, 'Print one JSON object instead of the report.')
  _HLO = flags.DEFINE_string('hlo', None, 'Also write the compiled program (HLO text) to this '
                             'file.')
  _GRPO = flags.DEFINE_bool(
      'grpo', False, "A GRPO step's programs instead (jax_pretrain/grpo/; a config with the grpo "
      "group, e.g. --config=configs/grpo.py:xlarge): the update and the engine's rollout calls "
      "(--hlo: the update's).")
  _DPO = flags.DEFINE_bool(
      'dpo', False, "A DPO step instead (jax_pretrain/dpo/; a config with the dpo group, e.g. "
      '--config=configs/dpo.py:xlarge): the update on pairs of data.seq_len + 1 tokens, the '
      'reference params beside it.')
  _GRPO_PROMPT_TOKENS = flags.DEFINE_integer(
      'grpo_prompt_tokens', 0, 'With --grpo: tokens of the longest prompt (0: data.seq_len - '
      'grpo.max_new_tokens).')
  _SERVE = flags.DEFINE_bool(
      'serve', False, "The engine as serve runs it instead (jax_pretrain/engine/plan.py): its "
      'weights, KV cache (the prefix cache\'s memory), largest prefill and decode over the whole '
      'context, and whether they fit (--hlo: the decode\'s).')
  _SERVE_WORKDIR = flags.DEFINE_string(
      'serve_workdir', '', "With --serve: a run's workdir, whose config.json gives the model and "
      'seq_len (as serve --workdir loads it) instead of --config.')
  _SERVE_SLOTS = flags.DEFINE_integer('serve_slots', engine_core.SLOTS, "With --serve: serve's "
                                      '--slots (sequences decoded together, the KV cache\'s rows).')
  _SERVE_CONTEXT = flags.DEFINE_integer('serve_context', 0, "With --serve: serve's --context "
                                        "(tokens a sequence; 0: the run's seq_len).")
  _SERVE_CHUNK = flags.DEFINE_integer('serve_chunk', engine_core.CHUNK, "With --serve: serve's "
                                      '--chunk (tokens decoded a call).')
  _SERVE_KV_CACHE_DTYPE = cli.define_kv_cache_flag('serve_kv_cache_dtype')
  _MEMORY_GIB = flags.DEFINE_float(
      'memory_gib', None, "Device memory in GiB instead of the target's: a card of the same family "
      'with less memory (e.g. --target=a100-40 --memory_gib=24).')

  def _main() -> None:
    grpo, serve = _GRPO.value, _SERVE.value
    options = ({'prompt_tokens': _GRPO_PROMPT_TOKENS.value} if grpo else
               {'workdir': _SERVE_WORKDIR.value, 'slots': _SERVE_SLOTS.value,
                'context': _SERVE_CONTEXT.value, 'chunk': _SERVE_CHUNK.value,
                'kv_cache_dtype': _SERVE_KV_CACHE_DTYPE.value} if serve else None)
    plan_lib.main(cli.config_value(_CONFIG), _TARGET.value, _NUM_DEVICES.value,
                  program='grpo' if grpo else 'dpo' if _DPO.value else 'engine' if serve else '',
                  options=options, as_json=_JSON.value, hlo_path=_HLO.value,
                  memory_gib=_MEMORY_GIB.value)
  cli.run(_main)
