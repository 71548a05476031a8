"""The programs of a GRPO step compiled for a device this machine does not have, and what they
would do: `python -m jax_pretrain.plan --grpo` (this module registers its plan with plan.py).

For --grpo_prompt_tokens-token prompts (default: the longest that leave room for
grpo.max_new_tokens in data.seq_len):
  update       the train step with grpo.objective's loss on its update_batch (batch_size rows of
               the prompt + max_new_tokens, rounded up to 8), reported as plan.report reports the
               trainer's, its micro-batch chosen as the trainer chooses it
               (memory.fit_micro_batch, with room left for the engine's cache);
  scoring      with grpo.beta > 0 (logp_ref) and with grpo.num_iterations > 1 (logp_old), a
               forward of the update's rows without gradient (grpo.objective.scorer), once each
               a step;
  rollout      the engine's calls (engine/) as GRPO makes them: its compute-dtype copy of the
               params on every device, its KV cache of grpo.rollout_slots rows × (prompt +
               max_new_tokens) split over the devices; the largest prefill call a step's rollout
               makes (its scheduler's: each prompt run once, its keys and values copied into the
               slots of its other grpo.num_samples - 1 completions) and the prefill FLOPs of a
               step, and a decode call of every slot (`chunk` steps) at each live length a
               rollout reaches, each with its memory and roofline;
  estimate     the step's roofline time (the rollout, its scoring passes and num_iterations
               updates), and the decode's HBM bytes per generated token beside the least it could
               read (the weights once a step, the live cache once).
Each program's memory counts what stays on the device beside its own buffers while it runs: the
engine's cache (kept between rollouts) during the update, the train state during the rollout,
and with grpo.beta > 0 the reference params (a copy of the params in their shardings).
"""
import collections
import dataclasses
import time

from jax_pretrain import config as config_lib
from jax_pretrain import engine as engine_lib
from jax_pretrain import fp8
from jax_pretrain import gpu_targets
from jax_pretrain import memory
from jax_pretrain import model as model_lib
from jax_pretrain import plan as plan_lib
from jax_pretrain import state as state_lib
from jax_pretrain.engine import plan as engine_plan
from jax_pretrain.engine import runner as runner_lib
from jax_pretrain.engine import scheduler as scheduler_lib
from jax_pretrain.grpo import config as grpo_config
from jax_pretrain.grpo import objective
from jax_pretrain.grpo import rollout


@dataclasses.dataclass(frozen=True)
class Step:
  """What every program of the plan shares: the config as given and resolved, the target and its
  devices, the longest prompt, the update's rows' width and the engine's cache per device."""
  given: config_lib.Config
  config: grpo_config.GrpoTrainConfig
  run: config_lib.RunShape
  target: gpu_targets.Target
  devices: list
  prompt_tokens: int
  width: int
  cache: float


@dataclasses.dataclass(frozen=True)
class Update:
  """The compiled update and what the rollout reads of it: the state (abstract), its config as
  fitted, its bytes per device and the reference params held beside every program (grpo.beta >
  0), and the reports of the update and the scoring pass (None without one)."""
  s: state_lib.Setup
  config: grpo_config.GrpoTrainConfig
  params_bytes: float
  state_bytes: float
  reference: dict[str, float]
  report: dict
  score: dict | None


@dataclasses.dataclass(frozen=True)
class Rollout:
  """The engine's calls of a step's rollout: the engine (abstract), its weights' bytes per
  device, the largest prefill's report, the prefill calls and the prompts they run, each live
  bucket's decode report (ascending) and the waves of slots that make them."""
  engine: engine_lib.Engine
  weights: float
  prefill: dict
  prefill_calls: int
  prompts_prefilled: int
  decodes: list[dict]
  waves: int
  kv_cache_dtype: str


def plan(config, target: str = 'h100', num_devices: int = 1, hlo_path: str | None = None,
         memory_gib: float | None = None, prompt_tokens: int = 0) -> dict:
  """Compiles the programs of a GRPO step of `config` (the module docstring) for `num_devices` of
  `target`, for prompts of at most prompt_tokens tokens (0: data.seq_len - grpo.max_new_tokens):
  {'grpo': the step's shapes and what each device holds, 'update': plan.report's dict of the
  update, 'prefill' and 'decode': plan.call_report's dicts of the engine's largest prefill and its
  decode call at the longest live context, 'decode_by_live': each live bucket's, 'score': the
  scoring pass's with the calls a step makes (None without one), 'rollout': `estimate`'s,
  'kv_cache': kv_cache_comparison's (the 16-bit and the 8-bit cache's decode and rollout)}.
  hlo_path: the update's HLO text; memory_gib: as plan.plan takes it.

  Raises plan.PlanError (no CUDA plugin, too few CPU devices, prompts that leave no room, an
  update that cuDNN's attention does not compile) and config.ConfigError.
  """
  step = resolve_step(config, target, num_devices, memory_gib, prompt_tokens)
  u = update(step, hlo_path)
  c = step.config
  g, B = c.grpo, c.train.batch_size
  r = rollout_calls(step, u, g.kv_cache_dtype)
  eng = r.engine
  return {
      'grpo': {'num_samples': g.num_samples, 'prompts_per_step': B // g.num_samples,
               'completions_per_step': B, 'prompt_tokens': step.prompt_tokens,
               'max_new_tokens': g.max_new_tokens, 'width': step.width, 'beta': g.beta,
               'num_iterations': g.num_iterations,
               'rollout_slots': eng.slots, 'devices': eng.devices,
               'slots_per_device': eng.local_slots,
               'context': objective.engine_context(c, step.prompt_tokens), 'chunk': eng.chunk,
               'params_gib': u.params_bytes / memory.GIB,
               'engine_params_gib': r.weights / memory.GIB,
               'engine_cache_gib': step.cache / memory.GIB, 'kv_cache_dtype': g.kv_cache_dtype,
               'reference_gib': u.params_bytes / memory.GIB if g.beta else 0.0},
      'update': u.report,
      'prefill': r.prefill,
      'decode': {'rows': eng.local_slots, 'steps': eng.chunk, **r.decodes[-1]},
      'decode_by_live': r.decodes,
      'score': u.score,
      'rollout': estimate(step, u, r),
      'kv_cache': kv_cache_comparison(step, u, r),
  }


def resolve_step(config, target: str, num_devices: int, memory_gib: float | None,
                 prompt_tokens: int) -> Step:
  """The step's config resolved for the target's devices, and its shapes, checked: a config with
  the grpo group, prompts that leave room for grpo.max_new_tokens in data.seq_len."""
  config, c, run, t, devices = plan_lib.resolve_program(
      config, 'grpo', grpo_config.GrpoTrainConfig, target, num_devices, memory_gib)
  resolved = grpo_config.of(c)
  g, T = resolved.grpo, resolved.data.seq_len
  objective.check_batch(resolved)
  prompt_tokens = prompt_tokens or T - g.max_new_tokens
  if prompt_tokens < 1 or prompt_tokens + g.max_new_tokens > T:
    raise plan_lib.PlanError(f'--grpo_prompt_tokens={prompt_tokens} with grpo.max_new_tokens='
                             f'{g.max_new_tokens} do not fit data.seq_len={T}.')
  return Step(config, resolved, run, t, devices, prompt_tokens,
              width=objective.update_width(resolved, prompt_tokens),
              cache=objective.engine_cache_bytes(resolved, prompt_tokens, len(devices)))


def update(step: Step, hlo_path: str | None = None) -> Update:
  """The update as train.train chooses it for GRPO (grpo.program.GRPO's: its own rows and loss,
  its micro-batch fitted with room left for the engine's cache), compiled and reported, and the
  scoring pass. hlo_path: the update's HLO text."""
  batch = lambda s: objective.update_batch(s, step.width)
  try:
    resolved, run, fitted = memory.fit_micro_batch(
        step.given, step.config, step.run, step.devices, step.target, alongside=step.cache,
        batch=batch, loss=objective.update_loss_fn)
    t0 = time.perf_counter()
    s, compiled = memory.compile_step(resolved, run, step.devices, batch=batch,
                                      loss=objective.update_loss_fn)
  except NotImplementedError as e:
    if step.config.model.attention != 'cudnn':
      raise
    raise plan_lib.PlanError(
        f"the GRPO update does not compile with model.attention='cudnn' (rows of {step.width} "
        f'tokens: {step.width - 1} inputs): {e}; --config.model.attention=xla plans it.') from None
  compile_s = time.perf_counter() - t0
  if hlo_path:
    with open(hlo_path, 'w', encoding='utf-8') as f:
      f.write(compiled.as_text())
  params = memory.device_bytes(s.abstract_state.params)
  state_bytes = memory.device_bytes(s.abstract_state)
  reference = {'reference params': params} if resolved.grpo.beta else {}
  report = plan_lib.report(s, compiled, step.target, compile_s, fitted,
                           tokens_per_step=resolved.train.batch_size * step.width,
                           seq_len=step.width, alongside={'engine cache': step.cache, **reference})
  return Update(s, resolved, params, state_bytes, reference, report,
                _score(step, s, resolved.grpo, params, state_bytes))


def _score(step: Step, s, g: grpo_config.GrpoConfig, params: float,
           state_bytes: float) -> dict | None:
  """The scoring pass (a forward of the update's rows without gradient): once a step with beta >
  0 (logp_ref) and once with num_iterations > 1 (logp_old); None without either. Beside it the
  engine's cache and the state but the params it scores (its argument): the train state with the
  reference's, the rest of it with the policy's (and the reference params, if held): the same
  total either way."""
  scorings = int(g.beta > 0) + int(g.num_iterations > 1)
  if not scorings:
    return None
  t0 = time.perf_counter()
  compiled = objective.scorer(s, objective.score_temperatures(g)).lower(
      s.abstract_state.params, s.abstract_state.fp8, objective.update_batch(s, step.width)
  ).compile()
  beside = ({'train state': state_bytes} if g.beta else
            {'train state less params': state_bytes - params})
  return {'calls_per_step': scorings, **plan_lib.call_report(
      compiled, step.target, {**beside, 'engine cache': step.cache},
      step.config.train.batch_size * step.width, time.perf_counter() - t0)}


def scheduled_calls(eng: engine_lib.Engine, prompts: int, num_samples: int, prompt_tokens: int,
                    max_new_tokens: int) -> tuple[list, dict[int, int]]:
  """A GRPO step's rollout as the engine's scheduler makes it (Scheduler.dry_run): `prompts`
  distinct prompts of prompt_tokens tokens, num_samples completions each (together, as
  rollout.rollouts submits them), every one max_new_tokens long: a wave of slots at a time, each
  wave making the same decode calls (its completions start and end together). Returns the prefill
  calls (scheduler.Prefill) and {live bucket: the step's decode calls}."""
  calls = eng.scheduler.dry_run([(prompt_tokens, max_new_tokens, num_samples)] * prompts)
  decodes = collections.Counter(c.shape.live for c in calls
                                if isinstance(c, scheduler_lib.Decode))
  return [c for c in calls if isinstance(c, scheduler_lib.Prefill)], dict(decodes)


def rollout_calls(step: Step, u: Update, kv_cache_dtype: str) -> Rollout:
  """The engine's calls of a step's rollout with this KV cache (engine.kv_cache_dtype), compiled
  with the train state beside them (its params copy is theirs): the largest prefill, and a decode
  of every slot at each live bucket.
  The completions of one prompt share its prefill: the prompt is run once and its keys and values
  copied into the slots of the others (of its wave, on its device)."""
  c, s, t = u.config, u.s, step.target
  g, B = c.grpo, c.train.batch_size
  # (with model.fp8, the amax histories beside the params: the rollouts run at their scales)
  eng = engine_lib.Engine(c.model, fp8.merge(s.abstract_state.params, s.abstract_state.fp8),
                          engine_plan.Vocabulary(c.model.vocab_size),
                          slots=objective.rollout_slots(c),
                          context=objective.engine_context(c, step.prompt_tokens),
                          chunk=rollout.ROLLOUT_CHUNK, mesh=s.mesh,
                          kv_cache_dtype=kv_cache_dtype)
  during = {'train state': u.state_bytes, **u.reference}
  prefills, decodes = scheduled_calls(eng, B // g.num_samples, g.num_samples, step.prompt_tokens,
                                      g.max_new_tokens)
  largest = max((p.shape for p in prefills), key=lambda x: (x.rows * x.length, x.copies))
  prefill_report = {'rows': largest.rows, 'length': largest.length, 'copies': largest.copies,
                    **engine_plan.call_plan(eng, largest, t, during,
                                            largest.rows * largest.length * eng.devices)}
  waves = -(-B // eng.slots)
  decode_reports = [
      {'live': live, 'calls_per_wave': calls // waves, **engine_plan.call_plan(
          eng, scheduler_lib.DecodeShape(eng.local_slots, live), t, during,
          eng.slots * eng.chunk)}
      for live, calls in sorted(decodes.items())]
  return Rollout(eng, memory.device_bytes(eng.params), prefill_report, len(prefills),
                 sum(len({i for _, i, _ in x}) for p in prefills for x in p.slots),
                 decode_reports, waves, kv_cache_dtype)


def estimate(step: Step, u: Update, r: Rollout) -> dict:
  """The step's calls and roofline time, at most (every completion decodes max_new_tokens, a wave
  of `slots` at a time): the rollout, its scoring passes and num_iterations updates (None without
  a roofline); and the decode's HBM bytes per generated token (decode_bytes)."""
  g = u.config.grpo
  rollout_s = None
  if r.decodes[-1]['call_s'] is not None:
    rollout_s = (r.waves * sum(d['calls_per_wave'] * d['call_s'] for d in r.decodes)
                 + r.prefill_calls * r.prefill['call_s'])
  scoring_s = (0.0 if u.score is None else None if u.score['call_s'] is None
               else u.score['calls_per_step'] * u.score['call_s'])
  update_s = u.report['step_s']
  step_s = None
  if rollout_s is not None and scoring_s is not None and update_s is not None:
    step_s = rollout_s + scoring_s + g.num_iterations * update_s
  return {'decode_calls': r.waves * sum(d['calls_per_wave'] for d in r.decodes),
          'prefill_calls': r.prefill_calls, 'prompts_prefilled': r.prompts_prefilled,
          'prefill_flops': r.prefill_calls * r.prefill['compute_flops_per_call'],
          'rollout_s': rollout_s, 'update_s': update_s, 'updates_per_step': g.num_iterations,
          'scoring_s': scoring_s, 'step_s': step_s,
          'generation_share': rollout_s / step_s if step_s else None,
          **decode_bytes(step, u, r)}


def decode_bytes(step: Step, u: Update, r: Rollout) -> dict[str, float]:
  """HBM bytes per generated token and device: the compiled decode calls' ('bytes_per_token')
  against the least a step must read ('ideal_bytes_per_token': the engine's weights once, and
  each row's live keys and values once, at the cache's bytes a position)."""
  eng, g = r.engine, u.config.grpo
  position = model_lib.kv_bytes_per_token(u.config.model, r.kv_cache_dtype)
  tokens = eng.local_slots * g.max_new_tokens  # a wave's, per device
  compiled = sum(d['calls_per_wave'] * d['hbm_bytes_per_call'] for d in r.decodes)
  ideal = sum(r.weights + eng.local_slots * (step.prompt_tokens + i + 1) * position
              for i in range(g.max_new_tokens))
  # A check of the count: no decode call can read less than the weights once a step.
  weights = min(d['hbm_bytes_per_call'] / (eng.chunk * r.weights) for d in r.decodes)
  return {'bytes_per_token': compiled / tokens, 'ideal_bytes_per_token': ideal / tokens,
          'call_bytes_over_weights': weights}


def kv_cache_comparison(step: Step, u: Update, r: Rollout) -> dict:
  """The rollout with the other kind of KV cache than grpo.kv_cache_dtype's (beside 'auto':
  'int8'; beside an 8-bit one: 'auto'), both summarized: {kind: its decode at the longest live
  context (tokens/s, temp GiB), rollout_s and bytes per generated token}."""
  other = rollout_calls(step, u, 'int8' if r.kv_cache_dtype == 'auto' else 'auto')

  def summary(x: Rollout) -> dict:
    longest = x.decodes[-1]
    return {'decode_tokens_per_s': longest['tokens_per_s'], 'decode_temp_gib': longest['temp_gib'],
            'rollout_s': estimate(step, u, x)['rollout_s'], **decode_bytes(step, u, x),
            'cache_gib': runner_lib.cache_bytes(
                u.config.model, x.engine.slots, x.engine.context, x.engine.devices,
                x.kv_cache_dtype) / memory.GIB}
  return {x.kv_cache_dtype: summary(x) for x in (r, other)}


def format_report(r: dict) -> str:
  """`plan`'s dict as the report `python -m jax_pretrain.plan --grpo` prints."""
  g, u, ro = r['grpo'], r['update'], r['rollout']
  lines = plan_lib.format_report(u).splitlines()
  at = next(i for i, line in enumerate(lines) if line.startswith('memory'))
  lines[at:at] = [
      f'grpo         {g["prompts_per_step"]} prompts × {g["num_samples"]} completions a step, '
      f'prompts of at most {g["prompt_tokens"]:,} tokens + {g["max_new_tokens"]:,} new, beta '
      f'{g["beta"]}' + (f', {g["num_iterations"]} updates a rollout batch'
                        if g['num_iterations'] > 1 else ''),
      f'update       the train step with grpo\'s loss on {g["completions_per_step"]} rows of '
      f'{g["width"]:,} tokens:']
  p = r['prefill']
  lines += [
      f'rollout      the engine: {g["rollout_slots"]} slots × {g["context"]:,} tokens over '
      f'{g["devices"]} devices ({g["slots_per_device"]} each): KV cache '
      f'{g["engine_cache_gib"]:.1f} GiB and bf16 weights {g["engine_params_gib"]:.1f} GiB per '
      'device',
      plan_lib.call_line('prefill', p, f'{p["rows"]} prompts × {p["length"]:,} tokens a device' + (
          f' and their keys and values into {p["copies"]} more slots' if p['copies'] else '') +
          f' (the largest call; {ro["prefill_calls"]} a step, {ro["prompts_prefilled"]} prompts '
          f'run once for {g["completions_per_step"]} completions: at most '
          f'{ro["prefill_flops"] / 1e12:,.1f} TFLOP a step)')]
  lines += [plan_lib.call_line('decode', d, f'{g["slots_per_device"]} slots a device × '
                                f'{g["chunk"]} steps over {d["live"]:,} positions '
                                f'({d["calls_per_wave"]} calls a wave)')
            for d in r['decode_by_live']]
  lines.append(f'             per generated token and device the decode reads '
               f'{plan_lib.gb_text(ro["bytes_per_token"])}; the least it could: '
               f'{plan_lib.gb_text(ro["ideal_bytes_per_token"])} (bf16 weights once a step, each '
               f'row\'s live keys and values once): '
               f'{ro["bytes_per_token"] / ro["ideal_bytes_per_token"]:.2f}×')
  kinds = r['kv_cache']
  base = kinds['auto']
  for kind, k in kinds.items():
    line = f'KV cache     {kind}: {k["cache_gib"]:.1f} GiB a device; decode'
    if k['decode_tokens_per_s'] is not None:
      line += f' {k["decode_tokens_per_s"]:,.0f} tokens/s,'
    line += (f' temp {k["decode_temp_gib"]:.2f} GiB, {plan_lib.gb_text(k["bytes_per_token"])} '
             'a token')
    if k['rollout_s'] is not None:
      line += f', rollout {k["rollout_s"]:.2f} s'
      if kind != 'auto' and base['rollout_s']:
        line += (f' ({k["decode_tokens_per_s"] / base["decode_tokens_per_s"]:.2f}× the decode, '
                 f'{k["rollout_s"] / base["rollout_s"]:.2f}× the rollout of auto\'s)')
    lines.append(line + (' (used: grpo.kv_cache_dtype)' if kind == g['kv_cache_dtype'] else ''))
  if r['score']:
    sc = r['score']
    lines.append(plan_lib.call_line(
        'scoring', sc, f'a forward of the {g["completions_per_step"]} rows, '
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


PLAN = plan_lib.register(plan_lib.ProgramPlan('grpo', plan, format_report))
