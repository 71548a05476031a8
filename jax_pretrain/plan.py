"""Compiles the real train step for a GPU this machine does not have, and says what it would do.

  python -m jax_pretrain.plan --config=configs/xlarge.py [--config.x=y ...] \\
      --target=h100|a100-80|a100-40|cpu [--num_devices=8] [--json]

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
               a step time and tokens/s that are estimates, not measurements (no autotuning ran).
Targets: gpu_targets.TARGETS. 'cpu' compiles for this machine's CPU devices (no roofline).
"""
import dataclasses
import os
import time

from absl import flags

from jax_pretrain import cli
from jax_pretrain import gpu_targets
from jax_pretrain import memory
from jax_pretrain.errors import UserError


class PlanError(UserError):
  """The plan cannot be made here (e.g. jax's CUDA plugin is missing); the message says why."""


def devices_for(target: gpu_targets.Target, num_devices: int) -> list:
  """Compile-only devices of a GPU target (nodes of 8), or this process's CPU devices."""
  import jax  # noqa: PLC0415
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


@dataclasses.dataclass
class Roofline:
  compute_s: float  # kernels: max(FLOPs / speed, HBM bytes / bandwidth), summed
  communication_s: float  # collectives: wire bytes / link (or network) bandwidth

  @property
  def step_s(self) -> float:
    """No overlap of communication with compute: an upper bound on the roofline's step."""
    return self.compute_s + self.communication_s


def roofline(stats, target: gpu_targets.Target) -> Roofline | None:
  if target.matmul_flops is None:
    return None
  forward, both = target.cudnn_attention_flops
  # The backward kernel alone, from forward and forward+backward (2.5× and 3.5× forward's FLOPs).
  backward = 2.5 / (3.5 / both - 1.0 / forward)
  speed = {'matmul': target.matmul_flops, 'attention': forward, 'attention_backward': backward,
           'matmul_fp8': target.fp8_matmul_flops or target.matmul_flops}
  compute = sum(k.times * max(k.flops / speed.get(k.kind, target.matmul_flops),
                              k.hbm_bytes / target.hbm_bandwidth) for k in stats.kernels)
  link = gpu_targets.COLLECTIVE_EFFICIENCY * target.link_bandwidth
  network = gpu_targets.COLLECTIVE_EFFICIENCY * target.network_bandwidth
  communication = sum((c.wire_bytes - c.cross_node_wire_bytes) / link
                      + c.cross_node_wire_bytes / network
                      for c in stats.collectives.values())
  return Roofline(compute, communication)


def report(s, compiled, target: gpu_targets.Target, compile_s: float | None = None,
           choices=()) -> dict:
  """The plan of a compiled step (see the module docstring), as a JSON-ready dict."""
  # (imported here: importing them starts jax, which `main` configures first)
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import hlo  # noqa: PLC0415
  from jax_pretrain import model as model_lib  # noqa: PLC0415
  from jax_pretrain import runtime  # noqa: PLC0415
  c, run = s.config, s.run
  n = s.mesh.size
  stats = hlo.analyze(compiled.as_text(), target.devices_per_node)
  m = compiled.memory_analysis()
  peak = memory.peak_bytes(compiled)
  usable = runtime.mem_fraction() * target.device_memory if target.file else target.device_memory
  flops_per_token = model_lib.flops_per_token(config_lib.model_config(c), c.data.seq_len)
  model_flops = flops_per_token * run.tokens_per_step / n
  r = roofline(stats, target)
  tokens_per_s = run.tokens_per_step / r.step_s if r else None
  return {
      'target': target.name,
      'device_kind': target.device_kind,
      'num_devices': n,
      'mesh': dict(zip(('data', 'fsdp', 'tensor'), run.mesh_shape)),
      'params': model_lib.count_params(s.abstract_state.params),
      'attention': c.model.attention,
      'remat': c.model.remat,
      'micro_batch_size': c.train.micro_batch_size,
      'grad_accum_steps': run.grad_accum_steps,
      'tokens_per_step': run.tokens_per_step,
      'choices': list(run.choices) + list(choices),
      'peak_memory_gib': peak / memory.GIB,
      'argument_gib': m.argument_size_in_bytes / memory.GIB,
      'temp_gib': m.temp_size_in_bytes / memory.GIB,
      'device_memory_gib': target.device_memory / memory.GIB,
      'usable_memory_gib': usable / memory.GIB,
      'fits': peak <= usable,
      'compute_flops_per_step': stats.flops,
      'matmul_flops_per_step': stats.matmul_flops,
      'fp8_matmul_flops_per_step': stats.fp8_matmul_flops,
      'fp8_matmuls': stats.fp8_matmuls,
      'attention_flops_per_step': stats.attention_flops,
      'model_flops_per_step': model_flops,
      'flops_ratio': stats.flops / model_flops,
      'hbm_bytes_per_step': stats.hbm_bytes,
      'uncounted_kernels': dict(stats.uncounted),
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


def plan(config, target: str = 'h100', num_devices: int = 1, hlo_path: str | None = None,
         memory_gib: float | None = None) -> dict:
  """Compiles the train step of `config` for `num_devices` of `target`; returns `report`'s dict
  (and writes the compiled HLO text to hlo_path if given). memory_gib: plan for a card of the
  target's family with this much memory (e.g. 24 for an RTX 3090 against the A100 program).

  Raises PlanError (no CUDA plugin, too few CPU devices) and config.ConfigError.
  """
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  t = gpu_targets.TARGETS[target]
  if memory_gib:
    t = dataclasses.replace(t, memory_override=memory_gib * memory.GIB)
  devices = devices_for(t, num_devices)
  resolved, run = config_lib.resolve(config, len(devices), device=devices[0])
  resolved, run, fitted = memory.fit_micro_batch(config, resolved, run, devices, t)
  t0 = time.perf_counter()
  s, compiled = memory.compile_step(resolved, run, devices)
  compile_s = time.perf_counter() - t0
  if hlo_path:
    with open(hlo_path, 'w', encoding='utf-8') as f:
      f.write(compiled.as_text())
  return report(s, compiled, t, compile_s, [fitted] if fitted else [])


def _gb(x: float) -> str:
  return f'{x / 1e9:,.2f} GB'


def format_report(r: dict) -> str:
  mesh = ' '.join(f'{k}={v}' for k, v in r['mesh'].items())
  lines = [
      f'target       {r["num_devices"]} × {r["device_kind"]} ({r["target"]}), mesh {mesh}',
      f'model        {r["params"]:,} parameters; {r["tokens_per_step"]:,} tokens per step',
      f'settings     attention {r["attention"]}, remat {r["remat"]}, micro-batch '
      f'{r["micro_batch_size"]} × {r["grad_accum_steps"]} accumulation steps per device',
  ] + [f'chosen       {x}' for x in r['choices']] + [
      f'memory       {r["peak_memory_gib"]:.1f} GiB peak per device (arguments '
      f'{r["argument_gib"]:.1f}, temporaries {r["temp_gib"]:.1f}) of {r["usable_memory_gib"]:.1f} '
      f'GiB usable ({r["device_memory_gib"]:.1f} GiB device): '
      f'{"fits" if r["fits"] else "DOES NOT FIT"}',
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
  counts, sizes = r['collective_counts_per_step'], r['collective_bytes_per_step']
  moved = [f'{k} {counts[k]:g} × = {_gb(sizes[k])}' for k in sizes if counts[k]]
  lines.append(f'collectives  per device per step: {"; ".join(moved) if moved else "none"}')
  if r['step_s'] is not None:
    lines.append(
        f'roofline     {r["step_s"]:.3f} s per step (kernels {r["compute_s"]:.3f} s, collectives '
        f'{r["communication_s"]:.3f} s, not overlapped) -> {r["tokens_per_s"]:,.0f} tokens/s, MFU '
        f'{r["mfu"]:.1%}: compiled, not measured')
  if r['compile_s'] is not None:
    lines.append(f'compiled in  {r["compile_s"]:.1f} s on this machine')
  return '\n'.join(lines)


def main():
  f = flags.FLAGS
  # After flags: the runtime settings precede jax's backend.
  import json  # noqa: PLC0415

  from jax_pretrain import runtime  # noqa: PLC0415
  runtime.configure(cache=False)
  import jax  # noqa: PLC0415
  if not os.environ.get('JAX_PLATFORMS'):
    # A GPU target compiles without a GPU; with CUDA among the platforms, a machine without one
    # fails the CUDA plugin's driver check, while the plugin still compiles with the CPU platform.
    jax.config.update('jax_platforms', 'cpu')
  if f.target == 'cpu':
    jax.config.update('jax_num_cpu_devices', f.num_devices)
  result = plan(cli.config_value(_CONFIG), f.target, f.num_devices, f.hlo, f.memory_gib)
  print(json.dumps(result, indent=1) if f.json else format_report(result), flush=True)


if __name__ == '__main__':
  # Flags only when run as a program: the trainer and the benchmarks import this module.
  _CONFIG = cli.define_config('xlarge.py', 'Preset (configs/*.py); fields are overridden with '
                              '--config.group.field=value.')
  flags.DEFINE_enum('target', 'h100', list(gpu_targets.TARGETS), 'Device to compile for.')
  flags.DEFINE_integer('num_devices', 1, 'Devices (8 per node for a GPU target; the mesh comes '
                       'from the config, data=-1 by default).')
  flags.DEFINE_bool('json', False, 'Print one JSON object instead of the report.')
  flags.DEFINE_string('hlo', None, 'Also write the compiled program (HLO text) to this file.')
  flags.DEFINE_float('memory_gib', None, "Device memory in GiB instead of the target's: a card of "
                     'the same family with less memory (e.g. --target=a100-40 --memory_gib=24).')
  cli.run(main)
