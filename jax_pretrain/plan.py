"""Compiles the real train step for a GPU this machine does not have, and says what it would do.

  python -m jax_pretrain.plan --config=configs/xlarge.py [--config.x=y ...] \\
      --target=h100|a100-80|a100-40|v100|rtx-a6000|cpu [--num_devices=8] [--json] \\
      [--memory_gib=24] [--grpo [--grpo_prompt_tokens=N]]

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
programs of a GRPO step (jax_pretrain/grpo/) instead, for --grpo_prompt_tokens-token prompts
(default: the longest that leave room for grpo.max_new_tokens in data.seq_len):
  update       the train step with grpo.objective's loss on its update_batch (batch_size rows of
               the prompt + max_new_tokens, rounded up to 8), reported as above, its micro-batch
               chosen as the trainer chooses it (memory.fit_micro_batch, with room left for the
               engine's cache);
  rollout      the engine's calls (engine/) as GRPO makes them: its compute-dtype copy of the
               params on every device, its KV cache of grpo.rollout_slots rows × (prompt +
               max_new_tokens) split over the devices; the largest prefill call a step's rollout
               makes (its scheduler's: each prompt run once, its keys and values copied into the
               slots of its other grpo.num_samples - 1 completions) and the prefill FLOPs of a
               step, and a decode call of every slot (`chunk` steps) at each live length a
               rollout reaches, each with its memory and roofline; the decode's HBM bytes per
               generated token
               beside the least it could read (the weights once a step, the live cache once).
Each program's memory counts what stays on the device beside its own buffers while it runs: the
engine's cache (kept between rollouts) during the update, the train state during the rollout,
and with grpo.beta > 0 the reference params (a copy of the params in their shardings).
  scoring      with grpo.beta > 0 (logp_ref) and with grpo.num_iterations > 1 (logp_old), a
               forward of the update's rows without gradient (grpo.objective.scorer), once each
               a step; the step's time counts them and num_iterations updates.
"""
import collections
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
  # (imported here: importing them starts jax, which `main` configures first)
  from jax_pretrain import hlo  # noqa: PLC0415
  from jax_pretrain import model as model_lib  # noqa: PLC0415
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
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  config = config_lib.typed(config)
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
  return report(s, compiled, t, compile_s, fitted)


class _Vocabulary:
  """What the engine reads of a tokenizer, for a plan without one: the ids it may sample and EOS
  (values, not shapes)."""

  def __init__(self, vocab_size: int):
    self.vocab_size, self.pad_id, self.eos_id = vocab_size, -1, -1


def call_report(compiled, target: gpu_targets.Target, alongside: dict[str, float], tokens: int,
                compile_s: float | None = None, unknown_trips: int = 1) -> dict:
  """Memory, collectives and roofline of one call of a compiled program other than the train
  step (the engine's prefill and decode), as a JSON-ready dict. alongside: as `report` takes it;
  tokens: what one call processes, for tokens/s; unknown_trips: the trips of a loop whose count
  is traced (the decode's steps)."""
  from jax_pretrain import hlo  # noqa: PLC0415
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


def rollout_calls(eng, prompts: int, num_samples: int, prompt_tokens: int,
                  max_new_tokens: int) -> tuple[list, dict[int, int]]:
  """A GRPO step's rollout as the engine's scheduler makes it (Scheduler.dry_run): `prompts`
  distinct prompts of prompt_tokens tokens, num_samples completions each (together, as
  rollout.rollouts submits them), every one max_new_tokens long: a wave of slots at a time, each
  wave making the same decode calls (its completions start and end together). Returns the prefill
  calls (scheduler.Prefill) and {live bucket: the step's decode calls}."""
  from jax_pretrain.engine import scheduler as scheduler_lib  # noqa: PLC0415
  calls = eng.scheduler.dry_run([(prompt_tokens, max_new_tokens, num_samples)] * prompts)
  decodes = collections.Counter(c.shape.live for c in calls
                                if isinstance(c, scheduler_lib.Decode))
  return [c for c in calls if isinstance(c, scheduler_lib.Prefill)], dict(decodes)


def grpo_plan(config, target: str = 'h100', num_devices: int = 1, prompt_tokens: int = 0,
              hlo_path: str | None = None, memory_gib: float | None = None) -> dict:
  """Compiles the programs of a GRPO step of `config` (the module docstring) for `num_devices` of
  `target`, for prompts of at most prompt_tokens tokens (0: data.seq_len - grpo.max_new_tokens):
  {'grpo': the step's shapes and what each device holds, 'update': `report`'s dict of the
  update, 'prefill' and 'decode': `call_report`'s dicts of the engine's largest prefill and its
  decode call at the longest live context, 'decode_by_live': each live bucket's, 'score': the
  scoring pass's with the calls a step makes (None without one), 'rollout': the calls a step
  makes at most, the prompts its prefills run and their FLOPs (per device, at most), their
  roofline time (the step's: the rollout, the scoring passes and
  num_iterations updates) and bytes per generated token}. hlo_path: the
  update's HLO text.

  Raises PlanError (no CUDA plugin, too few CPU devices, prompts that leave no room, an update
  that cuDNN's attention does not compile) and config.ConfigError.
  """
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import engine as engine_lib  # noqa: PLC0415
  from jax_pretrain import model as model_lib  # noqa: PLC0415
  from jax_pretrain.grpo import config as grpo_config  # noqa: PLC0415
  from jax_pretrain.grpo import objective  # noqa: PLC0415
  from jax_pretrain.grpo import rollout  # noqa: PLC0415
  config = config_lib.typed(config)
  if not isinstance(config, grpo_config.GrpoTrainConfig):
    raise PlanError('--grpo plans a GRPO step: give a config with the grpo group, e.g. '
                    '--config=configs/grpo.py:xlarge (a preset\'s model) or configs/grpo.py:RUN.')
  t = gpu_targets.TARGETS[target]
  if memory_gib:
    t = dataclasses.replace(t, memory_override=memory_gib * memory.GIB)
  devices = devices_for(t, num_devices)
  given, run = config_lib.resolve(config, len(devices), device=devices[0])
  resolved = grpo_config.of(given)
  g, B, T = resolved.grpo, resolved.train.batch_size, resolved.data.seq_len
  objective.check_batch(resolved)
  prompt_tokens = prompt_tokens or T - g.max_new_tokens
  if prompt_tokens < 1 or prompt_tokens + g.max_new_tokens > T:
    raise PlanError(f'--grpo_prompt_tokens={prompt_tokens} with grpo.max_new_tokens='
                    f'{g.max_new_tokens} do not fit data.seq_len={T}.')
  context = objective.engine_context(resolved, prompt_tokens)
  cache = objective.engine_cache_bytes(resolved, prompt_tokens, len(devices))
  # As train.train chooses it for GRPO (grpo.program.GRPO's update): the update's own rows and
  # loss, with room left for the engine's cache.
  width = objective.update_width(resolved, prompt_tokens)
  update_batch = lambda s: objective.update_batch(s, width)
  try:
    resolved, run, fitted = memory.fit_micro_batch(
        config, resolved, run, devices, t, alongside=cache, batch=update_batch,
        loss=objective.update_loss_fn)
    t0 = time.perf_counter()
    s, update = memory.compile_step(resolved, run, devices, batch=update_batch,
                                    loss=objective.update_loss_fn)
  except NotImplementedError as e:
    if resolved.model.attention != 'cudnn':
      raise
    raise PlanError(f"the GRPO update does not compile with model.attention='cudnn' (rows of "
                    f'{width} tokens: {width - 1} inputs): {e}; --config.model.attention=xla '
                    'plans it.') from None
  update_s = time.perf_counter() - t0
  eng = engine_lib.Engine(resolved.model, s.abstract_state.params,
                          _Vocabulary(resolved.model.vocab_size),
                          slots=objective.rollout_slots(resolved), context=context,
                          chunk=rollout.ROLLOUT_CHUNK, mesh=s.mesh,
                          kv_cache_dtype=g.kv_cache_dtype)
  params = memory.device_bytes(s.abstract_state.params)
  state_bytes = memory.device_bytes(s.abstract_state)
  reference = {'reference params': params} if g.beta else {}
  if hlo_path:
    with open(hlo_path, 'w', encoding='utf-8') as f:
      f.write(update.as_text())
  update_report = report(s, update, t, update_s, fitted,
                         tokens_per_step=B * width, seq_len=width,
                         alongside={'engine cache': cache, **reference})
  # The scoring pass (a forward of the batch without gradient): once with beta > 0 (logp_ref) and
  # once with num_iterations > 1 (logp_old), beside the engine's cache and the state but the params
  # it scores (its argument): the train state with the reference's, the rest of it with the
  # policy's (and the reference params, if held): the same total either way.
  scorings = int(g.beta > 0) + int(g.num_iterations > 1)
  score_report = None
  if scorings:
    t0 = time.perf_counter()
    score = objective.scorer(s, objective.score_temperatures(g)).lower(
        s.abstract_state.params, update_batch(s)).compile()
    beside = ({'train state': state_bytes} if g.beta else
              {'train state less params': state_bytes - params})
    score_report = call_report(score, t, {**beside, 'engine cache': cache}, B * width,
                               time.perf_counter() - t0)

  # The rollout: the train state stays beside the engine's calls (its params copy is theirs).
  during_rollout = {'train state': state_bytes, **reference}
  # The completions of one prompt share its prefill: the prompt is run once and its keys and
  # values copied into the slots of the others (of its wave, on its device).
  prefills, decodes = rollout_calls(eng, B // g.num_samples, g.num_samples, prompt_tokens,
                                    g.max_new_tokens)
  largest = max((p.shape for p in prefills), key=lambda s: (s.rows * s.length, s.copies))
  rows, length = largest.rows, largest.length
  t0 = time.perf_counter()
  prefill = eng.lower_prefill(rows, length, largest.copies).compile()
  prefill_report = call_report(prefill, t, during_rollout, rows * length * eng.devices,
                               time.perf_counter() - t0)
  prompts_run = sum(len({i for _, i, _ in x}) for p in prefills for x in p.slots)
  waves = -(-B // eng.slots)
  decode_reports = {}
  for live, calls in sorted(decodes.items()):
    t0 = time.perf_counter()
    # The decode holds a sort (sampling's top-k/top-p branch): CUB's sort asks the GPU at compile
    # time, which a machine without one lacks ('invalid device ordinal'); XLA's own compiles.
    decode = eng.lower_decode(eng.local_slots, live).compile(
        compiler_options=None if target == 'cpu' else {'xla_gpu_enable_cub_radix_sort': False})
    decode_reports[live] = {'live': live, 'calls_per_wave': calls // waves, **call_report(
        decode, t, during_rollout, eng.slots * eng.chunk, time.perf_counter() - t0,
        unknown_trips=eng.chunk)}
  longest = decode_reports[max(decode_reports)]

  # At most: every completion decodes max_new_tokens, a wave of `slots` at a time.
  decode_calls = waves * sum(d['calls_per_wave'] for d in decode_reports.values())
  prefill_calls = len(prefills)
  if longest['call_s'] is not None:
    rollout_s = (waves * sum(d['calls_per_wave'] * d['call_s'] for d in decode_reports.values())
                 + prefill_calls * prefill_report['call_s'])
  else:
    rollout_s = None
  # The whole step: the rollout, its scoring passes and num_iterations updates.
  scoring_s = (0.0 if score_report is None else None if score_report['call_s'] is None
               else scorings * score_report['call_s'])
  step_s = None
  if rollout_s is not None and scoring_s is not None and update_report['step_s'] is not None:
    step_s = rollout_s + scoring_s + g.num_iterations * update_report['step_s']
  # Bytes per generated token, per device: the compiled decode's against the least a step must
  # read (the bf16 weights once, and each row's live keys and values once).
  weights = memory.device_bytes(eng.params)
  kv_token = model_lib.kv_bytes_per_token(resolved.model, g.kv_cache_dtype)
  tokens = eng.local_slots * g.max_new_tokens  # a wave's, per device
  compiled_bytes = sum(d['calls_per_wave'] * d['hbm_bytes_per_call']
                       for d in decode_reports.values())
  ideal_bytes = sum(weights + eng.local_slots * (prompt_tokens + i + 1) * kv_token
                    for i in range(g.max_new_tokens))
  return {
      'grpo': {'num_samples': g.num_samples, 'prompts_per_step': B // g.num_samples,
               'completions_per_step': B, 'prompt_tokens': prompt_tokens,
               'max_new_tokens': g.max_new_tokens, 'width': width, 'beta': g.beta,
               'num_iterations': g.num_iterations,
               'rollout_slots': eng.slots, 'devices': eng.devices,
               'slots_per_device': eng.local_slots, 'context': context, 'chunk': eng.chunk,
               'params_gib': params / memory.GIB, 'engine_params_gib': weights / memory.GIB,
               'engine_cache_gib': cache / memory.GIB, 'kv_cache_dtype': g.kv_cache_dtype,
               'reference_gib': params / memory.GIB if g.beta else 0.0},
      'update': update_report,
      'prefill': {'rows': rows, 'length': length, 'copies': largest.copies, **prefill_report},
      'decode': {'rows': eng.local_slots, 'steps': eng.chunk, **longest},
      'decode_by_live': list(decode_reports.values()),
      'score': score_report and {'calls_per_step': scorings, **score_report},
      'rollout': {'decode_calls': decode_calls, 'prefill_calls': prefill_calls,
                  'prompts_prefilled': prompts_run,
                  'prefill_flops': prefill_calls * prefill_report['compute_flops_per_call'],
                  'rollout_s': rollout_s, 'update_s': update_report['step_s'],
                  'updates_per_step': g.num_iterations,
                  'scoring_s': scoring_s,
                  'step_s': step_s,
                  'generation_share': rollout_s / step_s if step_s else None,
                  'bytes_per_token': compiled_bytes / tokens,
                  'ideal_bytes_per_token': ideal_bytes / tokens},
  }


def _gb(x: float) -> str:
  return f'{x / 1e9:,.2f} GB'


def _memory(r: dict) -> str:
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


def format_report(r: dict) -> str:
  mesh = ' '.join(f'{k}={v}' for k, v in r['mesh'].items())
  lines = [
      f'target       {r["num_devices"]} × {r["device_kind"]} ({r["target"]}), mesh {mesh}',
      f'model        {r["params"]:,} parameters; {r["tokens_per_step"]:,} tokens per step',
      f'settings     attention {r["attention"]}, remat {r["remat"]}, micro-batch '
      f'{r["micro_batch_size"]} × {r["grad_accum_steps"]} accumulation steps per device',
  ] + [f'chosen       {x}' for x in r['choices']] + [
      f'memory       {_memory(r)}',
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
      + f' ({_gb(k["hbm_bytes"])})' for kind, k in r['kernels_by_kind'].items()))
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


def format_grpo_report(r: dict) -> str:
  g, u, ro = r['grpo'], r['update'], r['rollout']
  lines = format_report(u).splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith('memory'))
  lines[at:at] = [
      f'grpo         {g["prompts_per_step"]} prompts × {g["num_samples"]} completions a step, '
      f'prompts of at most {g["prompt_tokens"]:,} tokens + {g["max_new_tokens"]:,} new, beta '
      f'{g["beta"]}' + (f', {g["num_iterations"]} updates a rollout batch'
                        if g['num_iterations'] > 1 else ''),
      f'update       the train step with grpo\'s loss on {g["completions_per_step"]} rows of '
      f'{g["width"]:,} tokens:']

  def call(name, c, what):
    line = f'{name:<12} {what}: {_memory(c)}'
    if c['call_s'] is not None:
      line += (f'; roofline {c["call_s"]:.3f} s a call -> {c["tokens_per_s"]:,.0f} tokens/s')
    moved = [f'{k} {c["collective_counts_per_call"][k]:g} × = {_gb(v)}'
             for k, v in c['collective_bytes_per_call'].items() if v]
    if moved:
      line += f'; collectives {"; ".join(moved)} a call'
    return line + (f'; compiled in {c["compile_s"]:.1f} s' if c['compile_s'] is not None else '')

  p = r['prefill']
  lines += [
      f'rollout      the engine: {g["rollout_slots"]} slots × {g["context"]:,} tokens over '
      f'{g["devices"]} devices ({g["slots_per_device"]} each): KV cache '
      f'{g["engine_cache_gib"]:.1f} GiB and bf16 weights {g["engine_params_gib"]:.1f} GiB per '
      'device',
      call('prefill', p, f'{p["rows"]} prompts × {p["length"]:,} tokens a device' + (
          f' and their keys and values into {p["copies"]} more slots' if p['copies'] else '') +
          f' (the largest call; {ro["prefill_calls"]} a step, {ro["prompts_prefilled"]} prompts '
          f'run once for {g["completions_per_step"]} completions: at most '
          f'{ro["prefill_flops"] / 1e12:,.1f} TFLOP a step)')]
  lines += [call('decode', d, f'{g["slots_per_device"]} slots a device × {g["chunk"]} steps over '
                 f'{d["live"]:,} positions ({d["calls_per_wave"]} calls a wave)')
            for d in r['decode_by_live']]
  lines.append(f'             per generated token and device the decode reads '
               f'{_gb(ro["bytes_per_token"])}; the least it could: '
               f'{_gb(ro["ideal_bytes_per_token"])} (bf16 weights once a step, each row\'s live '
               f'keys and values once): {ro["bytes_per_token"] / ro["ideal_bytes_per_token"]:.2f}×')
  if r['score']:
    sc = r['score']
    lines.append(call('scoring', sc, f'a forward of the {g["completions_per_step"]} rows, '
                      f'{sc["calls_per_step"]} a step (' + ' and '.join(
                          (['logp_ref'] if g['beta'] else []) +
                          (['logp_old'] if g['num_iterations'] > 1 else [])) + ')'))
  if ro['step_s'] is not None:
    updates = (f'{ro["updates_per_step"]} × {ro["update_s"]:.2f} s of updates'
               if ro['updates_per_step'] > 1 else f'{ro["update_s"]:.2f} s of update')
    scoring = f' + {ro["scoring_s"]:.2f} s of scoring' if r['score'] else ''
    lines.append(
        f'step         at most {ro["decode_calls"]} decode and {ro["prefill_calls"]} prefill '
        f'calls (every completion to {g["max_new_tokens"]:,} tokens): {ro["rollout_s"]:.2f} s of '
        f'rollout{scoring} + {updates} = {ro["step_s"]:.2f} s, generating '
        f'{ro["generation_share"]:.0%}: roofline, compiled, not measured')
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
  if f.grpo:
    result = grpo_plan(cli.config_value(_CONFIG), f.target, f.num_devices, f.grpo_prompt_tokens,
                       f.hlo, f.memory_gib)
    text = format_grpo_report
  else:
    result = plan(cli.config_value(_CONFIG), f.target, f.num_devices, f.hlo, f.memory_gib)
    text = format_report
  print(json.dumps(result, indent=1) if f.json else text(result), flush=True)


if __name__ == '__main__':
  # Flags only when run as a program: the trainer and the benchmarks import this module.
  _CONFIG = cli.define_config('xlarge.py', 'Preset (configs/*.py); fields are overridden with '
                              '--config.group.field=value.')
  flags.DEFINE_enum('target', 'h100', list(gpu_targets.TARGETS), 'Device to compile for.')
  flags.DEFINE_integer('num_devices', 1, 'Devices (8 per node for a GPU target; the mesh comes '
                       'from the config: data=-1 and fsdp automatic by default, which the fit '
                       'raises where data parallelism fits no sequence).')
  flags.DEFINE_bool('json', False, 'Print one JSON object instead of the report.')
  flags.DEFINE_string('hlo', None, 'Also write the compiled program (HLO text) to this file.')
  flags.DEFINE_bool('grpo', False, "A GRPO step's programs instead (jax_pretrain/grpo/; a config "
                    'with the grpo group, e.g. --config=configs/grpo.py:xlarge): the update and '
                    "the engine's rollout calls (--hlo: the update's).")
  flags.DEFINE_integer('grpo_prompt_tokens', 0, 'With --grpo: tokens of the longest prompt (0: '
                       'data.seq_len - grpo.max_new_tokens).')
  flags.DEFINE_float('memory_gib', None, "Device memory in GiB instead of the target's: a card of "
                     'the same family with less memory (e.g. --target=a100-40 --memory_gib=24).')
  cli.run(main)
