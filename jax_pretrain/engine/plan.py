"""Serving's plan: the engine as `serve` runs it, compiled for a device this machine does not have,
and what it would hold and do there: `python -m jax_pretrain.plan --serve` (this module registers
its plan with plan.py, as grpo/plan.py registers GRPO's; it also holds what both compile of the
engine: `call_plan`, `Vocabulary`).

For a config (--config=configs/xlarge.py: a preset's model; --serve_workdir=RUN: a run's
config.json, as serve loads it) and serve's sizes (--serve_slots, --serve_context,
--serve_chunk, --serve_kv_cache_dtype, their defaults serve's own), per device:
  weights       the engine's copy of the params (runner.decoding_params: every matrix in the
                compute dtype), whole on every device;
  KV cache      keys and values of the device's slots × context positions, every layer (in the
                compute dtype, or 8 bits with a float32 scale per head and position), and each
                slot's last logits and token counts: the runner's state (abstract_state);
  prefix cache  none of its own: a finished sequence's slot keeps its keys and values for the next
                prompt that starts with them (automatic prefix caching), so it holds at most
                slots × context tokens, a conversation of the context's length a slot;
  loading       the float32 params as serve loads them and the engine's copy made from them, at
                once (serve frees the float32 ones after);
  prefill       the largest call of each kind the warmup compiles (its covering programs,
                Scheduler.programs: at most prefill_tokens prompt tokens a device, and their keys
                and values copied into every other slot), its memory (XLA's buffer assignment:
                the weights and the state are its arguments) and roofline per prompt token;
  decode        every slot over the whole context (`chunk` steps), its memory and its roofline
                per step (each sequence's time per token) and tokens/s over the slots.
The largest of these must fit the memory JAX may use on the device (runtime.MEM_FRACTION of it);
if not, the report ends with an error line naming the sizes to lower. Over --num_devices the
engine splits the slots and the cache over the devices, each with a whole copy of the weights (as
GRPO's rollouts run it; serve itself decodes on one device).
"""
import dataclasses
import time

import jax.numpy as jnp

from jax_pretrain import config as config_lib
from jax_pretrain import fp8
from jax_pretrain import gpu_targets
from jax_pretrain import memory
from jax_pretrain import model as model_lib
from jax_pretrain import plan as plan_lib
from jax_pretrain import state as state_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.engine import core
from jax_pretrain.engine import scheduler as scheduler_lib


class Vocabulary:
  """What the engine reads of a tokenizer, for a plan without one: the ids it may sample and EOS
  (values, not shapes)."""

  def __init__(self, vocab_size: int):
    self.vocab_size, self.pad_id, self.eos_id = vocab_size, -1, -1


def call_plan(eng: core.Engine, shape: scheduler_lib.Shape, target: gpu_targets.Target,
              alongside: dict[str, float], tokens: int, hlo_path: str | None = None) -> dict:
  """The engine's call of this shape (a PrefillShape or DecodeShape, per device) lowered on
  abstract params and state, compiled for the target, and reported (plan.call_report: memory with
  `alongside` beside it, collectives, roofline; tokens: what one call processes over the devices;
  a decode's steps, a traced count, taken as its `chunk`). hlo_path: the compiled program's HLO
  text is written there."""
  t0 = time.perf_counter()
  # The decode holds a sort (sampling's top-k/top-p branch): CUB's sort asks the GPU at compile
  # time, which a machine without one lacks ('invalid device ordinal'); XLA's own compiles.
  compiled = eng.runner.lower(shape).compile(
      compiler_options=None if target.file is None else {'xla_gpu_enable_cub_radix_sort': False})
  if hlo_path:
    with open(hlo_path, 'w', encoding='utf-8') as f:
      f.write(compiled.as_text())
  trips = eng.chunk if isinstance(shape, scheduler_lib.DecodeShape) else 1
  return plan_lib.call_report(compiled, target, alongside, tokens, time.perf_counter() - t0,
                              unknown_trips=trips)


def plan(config, target: str = 'h100', num_devices: int = 1, hlo_path: str | None = None,
         memory_gib: float | None = None, *, workdir: str = '', slots: int = core.SLOTS,
         context: int = 0, chunk: int = core.CHUNK, kv_cache_dtype: str = 'auto') -> dict:
  """Serving's plan (the module docstring) of `config` (a ConfigDict or Config; with workdir,
  that run's config.json instead) for `num_devices` of `target`, with serve's sizes (context 0:
  the run's data.seq_len): {'serve': the sizes and each device's bytes, 'prefills': the largest
  prefill of each kind, 'decode': the decode of every slot over the whole context, each
  plan.call_report's dict, 'fits', and 'error': the error line's message when it does not fit,
  else None}. hlo_path: the decode's HLO text.

  Raises plan.PlanError (no CUDA plugin, too few CPU devices), config.ConfigError and
  workdir.WorkdirError."""
  if workdir:
    config = workdir_lib.load_config(workdir)
  given = workdir_lib.for_devices(config_lib.typed(config))  # as serve loads a run
  t = plan_lib.target_of(target, memory_gib)
  devices = plan_lib.devices_for(t, num_devices)
  c, run = config_lib.resolve(given, len(devices), device=devices[0])
  s = state_lib.build(c, run, devices)
  context = context or c.data.seq_len
  if slots < 1 or context < 1 or chunk < 1:
    raise plan_lib.PlanError(f'--serve_slots={slots}, --serve_context={context} and '
                             f'--serve_chunk={chunk} must each be >= 1.')
  eng = core.Engine(c.model, fp8.merge(s.abstract_state.params, s.abstract_state.fp8),
                    Vocabulary(c.model.vocab_size), slots=slots, context=context, chunk=chunk,
                    mesh=s.mesh, kv_cache_dtype=kv_cache_dtype)
  state = eng.runner.abstract_state()
  weights, kv = memory.device_bytes(eng.params), memory.device_bytes(state.cache)
  load = (memory.device_bytes(s.abstract_state.params) + weights) / memory.GIB
  held = {'serve': sizes(eng, c.model, kv_cache_dtype),
          'params': model_lib.count_params(s.abstract_state.params),
          'weights_gib': weights / memory.GIB, 'kv_cache_gib': kv / memory.GIB,
          'slot_state_gib': (memory.device_bytes(state) - kv) / memory.GIB,
          'load_gib': load}
  covering = eng.scheduler.programs()[0]
  prefills = [call_plan(eng, x, t, {}, x.rows * x.length * eng.devices) | _shape(x)
              for x in _largest_prefills(covering)]
  decode_shape = scheduler_lib.DecodeShape(eng.local_slots, context)
  decode = call_plan(eng, decode_shape, t, {}, eng.slots * chunk, hlo_path) | _shape(decode_shape)
  need = max([load] + [p['total_memory_gib'] for p in prefills + [decode]])
  usable = decode['usable_memory_gib']
  r = {**held, 'target': t.name, 'device_kind': t.device_kind, 'num_devices': eng.devices,
       'prefills': prefills, 'decode': decode, 'need_gib': need, 'usable_memory_gib': usable,
       'device_memory_gib': decode['device_memory_gib'], 'fits': need <= usable}
  return {**r, 'error': None if r['fits'] else _error(r)}


def sizes(eng: core.Engine, model: model_lib.ModelConfig, kv_cache_dtype: str) -> dict:
  """The engine's sizes, and the prefix cache's capacity: the slots' positions, its keys and
  values those the slots keep."""
  return {'slots': eng.slots, 'devices': eng.devices, 'slots_per_device': eng.local_slots,
          'context': eng.context, 'chunk': eng.chunk,
          'prefill_tokens': eng.scheduler.prefill_tokens, 'kv_cache_dtype': kv_cache_dtype,
          'kv_storage_dtype': model_lib.kv_storage_dtype(model, kv_cache_dtype).name,
          'compute_dtype': jnp.dtype(model.compute_dtype).name,
          'kv_bytes_per_token': model_lib.kv_bytes_per_token(model, kv_cache_dtype),
          'prefix_cache_tokens': eng.slots * eng.context,
          'prefix_cache_tokens_per_device': eng.local_slots * eng.context,
          'prefix_cache_conversations': eng.slots}


def _shape(shape: scheduler_lib.Shape) -> dict:
  """A call's shape as the report's fields (a prefill's rows, length, copies (and whether after a
  cached prefix); a decode's rows, live)."""
  return dataclasses.asdict(shape)


def _largest_prefills(covering: list) -> list:
  """Of the warmup's covering programs, the prefill of each kind (plain, after a cached prefix)
  whose call computes the most: most prompt tokens, then the longest prompts (attention's
  scores grow with the length)."""
  kinds: dict[object, scheduler_lib.PrefillShape] = {}
  for x in covering:
    if isinstance(x, scheduler_lib.PrefillShape):
      kind = getattr(x, 'prefix', False)
      best = kinds.get(kind)
      if best is None or (x.rows * x.length, x.length) > (best.rows * best.length, best.length):
        kinds[kind] = x
  return list(kinds.values())


def _error(r: dict) -> str:
  """The error line's message of a plan that does not fit: what is needed, and what to lower."""
  s = r['serve']
  need, usable = r['need_gib'], r['usable_memory_gib']
  where = f'{r["num_devices"]} × {r["device_kind"]} ({r["target"]})'
  if r['load_gib'] >= max([p['total_memory_gib'] for p in r['prefills']]
                          + [r['decode']['total_memory_gib']]):
    return (f'serving needs {_size(need)} a device on {where}, more than the {_size(usable)} '
            'usable, to load the model: its float32 params and the engine\'s copy of them, '
            'whatever the slots (each device holds the whole weights): a card with more memory '
            '(--target, --memory_gib) or a smaller model.')
  lower = [f'--serve_slots={s["slots"]}', f'--serve_context={s["context"]}']
  if s['kv_cache_dtype'] == 'auto':
    lower.append('--serve_kv_cache_dtype=int8 (or fp8)')
  return (f'serving needs {_size(need)} a device on {where}, more than the {_size(usable)} '
          f'usable: lower {", ".join(lower[:-1])} or {lower[-1]} (serve\'s --slots, --context, '
          '--kv_cache_dtype), or plan more devices (--num_devices: the slots split over them).')


def _size(gib: float) -> str:
  """GiB as the report prints them: MiB below a tenth of one."""
  return f'{gib:,.2f} GiB' if gib >= 0.1 else f'{gib * 1024:,.1f} MiB'


def format_report(r: dict) -> str:
  """`plan`'s dict as the report `python -m jax_pretrain.plan --serve` prints."""
  s = r['serve']
  lines = [
      f'target       {r["num_devices"]} × {r["device_kind"]} ({r["target"]})',
      f'serving      {r["params"]:,} parameters; {s["slots"]} slots × {s["context"]:,} tokens over '
      f'{s["devices"]} device{"s" if s["devices"] > 1 else ""} ({s["slots_per_device"]} each), '
      f'chunk {s["chunk"]}, prefill at '
      f'most {s["prefill_tokens"]:,} prompt tokens a device',
      f'weights      the engine\'s {s["compute_dtype"]} copy: {_size(r["weights_gib"])} a device '
      '(whole on each)',
      f'KV cache     {s["kv_cache_dtype"]} ({s["kv_storage_dtype"]}, {s["kv_bytes_per_token"]:,} '
      f'bytes a position): {_size(r["kv_cache_gib"])} a device ({s["slots_per_device"]} slots × '
      f'{s["context"]:,} positions), + {_size(r["slot_state_gib"])} of the slots\' logits and '
      'token counts',
      f'prefix cache the KV cache\'s slots, no memory of its own: {s["prefix_cache_tokens"]:,} '
      f'tokens at most ({s["prefix_cache_tokens_per_device"]:,} a device), '
      f'{s["prefix_cache_conversations"]} conversations of {s["context"]:,} tokens',
      f'loading      {_size(r["load_gib"])} a device: the float32 params and the engine\'s copy '
      'while it is made']
  for p in r['prefills']:
    what = (f'{p["rows"]} prompts × {p["length"]:,} tokens a device'
            + (' after cached prefixes' if p.get('prefix') else '')
            + f', their keys and values into {p["copies"]} more slots (the largest call)')
    line = plan_lib.call_line('prefill', p, what)
    if p['call_s'] is not None:
      line += f'; {p["call_s"] / (p["rows"] * p["length"]) * 1e6:.1f} µs a prompt token'
    lines.append(line)
  d = r['decode']
  line = plan_lib.call_line('decode', d, f'{d["rows"]} slots a device × {s["chunk"]} steps over '
                            f'{d["live"]:,} positions (the whole context)')
  if d['call_s'] is not None:
    line += f'; {d["call_s"] / s["chunk"] * 1e3:.2f} ms a step (each sequence\'s time a token)'
  lines.append(line)
  lines.append(f'memory       the largest: {_size(r["need_gib"])} a device of '
               f'{_size(r["usable_memory_gib"])} usable ({_size(r["device_memory_gib"])} '
               f'device): {"fits" if r["fits"] else "DOES NOT FIT"}'
               + ('; roofline: compiled, not measured' if d['call_s'] is not None else ''))
  return '\n'.join(lines)


PLAN = plan_lib.register(plan_lib.ProgramPlan('engine', plan, format_report))
