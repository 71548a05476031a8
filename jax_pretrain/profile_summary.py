"""Device time a step by kind of work, from the trace a training run wrote (train.profile_steps):

  python -m jax_pretrain.profile_summary --workdir=WORKDIR

prints a Markdown table: matmul, attention forward and backward, recomputation, elementwise /
norm / rope, loss, optimizer, other, copies, collectives and idle, in ms a step and as a share of
the traced time a step (from the first kernel of the train step to its last, over the steps
traced).

Kernel names alone cannot tell a norm from rope from the loss, so each device event of the trace
(`perfetto_trace.json.gz`: jax.profiler's events carry the HLO instruction that launched them,
args 'hlo_op' and 'hlo_module') is joined with the compiled train step's HLO, which the trainer
writes beside the trace (`train_step.hlo.txt`, with `profile.json`: the steps traced). An
instruction's metadata op_name is its JAX name stack: Flax module paths (layers/attn/...),
`jvp(Transformer)` for the model's forward pass and `transpose(jvp(Transformer))` for its backward,
`jvp()` for the loss (computed outside the model), `rematted_computation` for the forward work
that the remat policy recomputes in the backward pass, and no jvp at all for the update (gradient
accumulation, clipping, AdamW). RULES classifies each event: the first rule that matches wins.

Where several kernels run at once (CUDA streams; the CPU's threads), the time counts once, for the
kind first in KINDS: copies and collectives count only while nothing else runs (their exposed
time). An event that contains others on the same thread (the CPU runtime's while loops) counts
only through them. Idle is the traced time with no event at all.
"""
import collections
import dataclasses
import glob
import gzip
import json
import os
import re

from absl import flags

from jax_pretrain import cli
from jax_pretrain import hlo
from jax_pretrain.errors import UserError

TRACE = 'perfetto_trace.json.gz'  # (jax.profiler's, under plugins/profile/DATE/)
PROGRAM = 'train_step.hlo.txt'  # the compiled train step's HLO, written by hooks.Profiler
INFO = 'profile.json'  # {'first_step', 'last_step', 'trace'}, written by hooks.Profiler

# The table's rows, in the order in which time that several kinds share is counted.
KINDS = ('matmul', 'attention forward', 'attention backward', 'recomputation',
         'elementwise / norm / rope', 'loss', 'optimizer', 'other', 'copies', 'collectives')

_ATTENTION = r'/attn/(vmap\(|dot_product_attention|flash_attention|pallas)'
# (kind, what is matched, pattern): 'kernel' is the event's name, 'hlo' the instruction's opcode
# (a custom call's target; a fusion's fused opcodes, or 'data movement' when they only move
# bytes), 'jax' its JAX name stack. Tried in order; the first match wins.
RULES = (
    ('collectives', 'kernel', r'(?i)nccl|all_?reduce|all_?gather|reduce_?scatter'),
    ('collectives', 'hlo', r'^(all-reduce|all-gather|reduce-scatter|all-to-all|collective-perm)'),
    ('copies', 'kernel', r'(?i)memcpy|memset'),
    ('copies', 'hlo', r'^(copy|copy-start|copy-done|data movement)\b'),
    ('recomputation', 'jax', r'rematted_computation'),
    ('attention backward', 'jax', rf'transpose\(.*{_ATTENTION}'),
    ('attention forward', 'jax', _ATTENTION),
    ('attention backward', 'kernel', r'(?i)(fmha|flash|sdpa|attention).*(bwd|bprop|backward)'),
    ('attention forward', 'kernel', r'(?i)fmha|flash|sdpa|attention'),
    ('matmul', 'hlo', r'\b(dot|convolution|__cublas\S*)\b'),
    ('matmul', 'kernel', r'(?i)gemm|nvjet|cutlass|xmma|cublas|matmul'),
    ('loss', 'jax', r'^(?!.*jvp\(Transformer\)).*jvp\('),
    ('elementwise / norm / rope', 'jax', r'jvp\(Transformer\)'),
    ('optimizer', 'jax', r'.'),  # (named, outside the forward and backward passes)
)
_CONTROL = {'while', 'conditional', 'call'}  # instructions whose events contain their bodies'


@dataclasses.dataclass(frozen=True)
class Op:
  """What a device event ran: its kernel's name, and its HLO instruction ('' where unknown)."""
  kernel: str
  hlo: str = ''
  jax: str = ''
  opcode: str = ''


def classify(op: Op) -> str | None:
  """The op's kind (RULES; 'other' where none matches), or None for control flow (a while loop's
  event, which contains its body's)."""
  if op.opcode in _CONTROL:
    return None
  for kind, field, pattern in RULES:
    if re.search(pattern, getattr(op, field)):
      return kind
  return 'other'


@dataclasses.dataclass
class Program:
  module: str  # the HLO module's name: the trace's hlo_module of its kernels
  ops: dict[str, tuple[str, str, str]]  # instruction name -> (hlo, jax, opcode) as in Op


def _op_name(instruction: hlo.Instruction) -> str:
  m = re.search(r'op_name="([^"]*)"', instruction.attrs)
  return m.group(1) if m else ''


def parse_program(text: str) -> Program:
  """The instructions of a compiled program's HLO text, as classify needs them."""
  module = re.match(r'HloModule\s+([\w.\-]+)', text)
  computations, _ = hlo.parse(text)

  def fused(name: str, seen: tuple = ()) -> tuple[set[str], str]:
    """The opcodes (custom-call targets) inside a fused computation, and its first op_name from
    the root up."""
    opcodes, jax_name = set(), ''
    for i in reversed(computations.get(name, [])):
      opcodes.add(_target(i) or i.opcode)
      jax_name = jax_name or _op_name(i)
      for called in i.called('calls') + i.called('to_apply'):
        if called not in seen:
          inner, inner_name = fused(called, seen + (name,))
          opcodes |= inner
          jax_name = jax_name or inner_name
    return opcodes, jax_name

  ops = {}
  for body in computations.values():
    for i in body:
      jax_name = _op_name(i)
      if i.opcode == 'fusion':
        opcodes, inner_name = fused(i.called('calls')[0]) if i.called('calls') else (set(), '')
        description = ('data movement' if opcodes <= hlo.MOVES else
                       'fusion ' + ' '.join(sorted(opcodes)))
        jax_name = jax_name or inner_name
      else:
        description = _target(i) or i.opcode
      ops[i.name] = (description, jax_name, i.opcode)
  return Program(module.group(1) if module else '', ops)


def _target(instruction: hlo.Instruction) -> str:
  m = re.search(r'custom_call_target="([^"]*)"', instruction.attrs)
  return m.group(1) if m else ''


@dataclasses.dataclass
class Event:
  start: float  # microseconds
  end: float
  lane: tuple  # (pid, tid): events on one lane nest, never overlap otherwise
  kind: str | None
  joined: bool  # its HLO instruction was found in the program


def device_events(trace: dict, program: Program) -> list[Event]:
  """The trace's device events, classified. On an accelerator: the events on its streams (a
  process named /device:..., threads named Stream... where there are any, not the lines derived
  from them such as 'XLA Ops'), where a kernel whose instruction is control flow (a command
  buffer's call) is known by its name alone. On the CPU: the host threads' events of the
  program's module, where control flow (a while loop) contains the events of its body."""
  events = trace['traceEvents']
  processes = {e['pid']: e['args']['name'] for e in events
               if e.get('ph') == 'M' and e.get('name') == 'process_name'}
  threads = {(e['pid'], e['tid']): e['args']['name'] for e in events
             if e.get('ph') == 'M' and e.get('name') == 'thread_name'}
  devices = {pid for pid, name in processes.items() if name.startswith('/device:')}
  streams = {lane for lane, name in threads.items() if lane[0] in devices and 'Stream' in name}
  out = []
  for e in events:
    if e.get('ph') != 'X':
      continue
    lane, args = (e['pid'], e['tid']), e.get('args', {})
    if devices:
      if lane[0] not in devices or (streams and lane not in streams):
        continue
    elif args.get('hlo_module') != program.module:
      continue
    op = _op(e['name'], args, program)
    if devices and op.opcode in _CONTROL:
      op = Op(op.kernel)
    start = float(e['ts'])
    out.append(Event(start, start + float(e.get('dur', 0)), lane, classify(op), bool(op.opcode)))
  return out


def _op(kernel: str, args: dict, program: Program) -> Op:
  """The event's Op: its kernel name, with its instruction where the program has it (hlo_op may
  name several, nested: the innermost it knows)."""
  if args.get('hlo_module', program.module) == program.module:
    for name in reversed(re.split(r'::|,|;', str(args.get('hlo_op', '')))):
      if name.strip() in program.ops:
        return Op(kernel, *program.ops[name.strip()])
  return Op(kernel)


def _exclusive(events: list[Event]) -> list[tuple[float, float, str]]:
  """(start, end, kind) pieces of time: each event less the events nested in it on its lane;
  control flow's (kind None) dropped."""
  lanes = collections.defaultdict(list)
  for e in events:
    lanes[e.lane].append(e)
  return [piece for lane in lanes.values() for piece in _lane_pieces(lane)]


def _lane_pieces(lane: list[Event]) -> list[tuple[float, float, str]]:
  pieces = []
  stack: list[list] = []  # [event, cursor]: the open events; each counted up to its cursor

  def count(until: float) -> None:
    event, cursor = stack[-1]
    if event.kind is not None and until > cursor:
      pieces.append((cursor, until, event.kind))
    stack[-1][1] = max(cursor, until)

  def pop() -> None:
    count(stack[-1][0].end)
    event = stack.pop()[0]
    if stack:
      stack[-1][1] = max(stack[-1][1], event.end)

  for e in sorted(lane, key=lambda e: (e.start, -e.end)):
    while stack and stack[-1][0].end <= e.start:
      pop()
    if stack:
      count(e.start)
    stack.append([e, e.start])
  while stack:
    pop()
  return pieces


def device_time(events: list[Event]) -> tuple[dict[str, float], float]:
  """({kind: microseconds}, the traced span in microseconds): every moment from the program's
  first joined event to its last counted once, for the first kind in KINDS running then, or as
  'idle'."""
  joined = [e for e in events if e.joined] or events
  if not joined:
    return {}, 0.0
  first, last = min(e.start for e in joined), max(e.end for e in joined)
  rank = {kind: i for i, kind in enumerate(KINDS)}
  changes: dict[float, list[int]] = collections.defaultdict(lambda: [0] * len(KINDS))
  for start, end, kind in _exclusive(events):
    start, end = max(start, first), min(end, last)
    if end > start:
      changes[start][rank[kind]] += 1
      changes[end][rank[kind]] -= 1
  times = sorted({first, last, *changes})  # (the span's ends: idle before the first event)
  running = [0] * len(KINDS)
  totals = dict.fromkeys((*KINDS, 'idle'), 0.0)
  for t, t_next in zip(times, times[1:]):
    running = [r + c for r, c in zip(running, changes.get(t, [0] * len(KINDS)))]
    kind = next((k for k, r in zip(KINDS, running) if r > 0), 'idle')
    totals[kind] += t_next - t
  return totals, last - first


@dataclasses.dataclass
class Summary:
  ms_per_step: dict[str, float]  # KINDS and 'idle'
  traced_ms_per_step: float
  steps: int
  trace: str
  by_name_share: float  # of the events' time: events the program's HLO does not name


def summarize(profile_dir: str, steps: int = 0) -> Summary:
  """The summary of the profile the trainer wrote to profile_dir (WORKDIR/profile); steps: how
  many steps it traced (0: as profile.json says)."""
  info_path, program_path = (os.path.join(profile_dir, name) for name in (INFO, PROGRAM))
  if not os.path.exists(program_path):
    raise UserError(f'{program_path} does not exist: run the trainer with '
                    '--config.train.profile_steps=START:STOP (it writes the trace, the program '
                    'and profile.json there).')
  info = {}
  if os.path.exists(info_path):
    with open(info_path, encoding='utf-8') as f:
      info = json.load(f)
  trace_path = (os.path.join(profile_dir, info['trace']) if 'trace' in info else
                max(glob.glob(os.path.join(profile_dir, 'plugins', 'profile', '*', TRACE)),
                    key=os.path.getmtime, default=''))
  if not trace_path or not os.path.exists(trace_path):
    raise UserError(f'no {TRACE} under {profile_dir}/plugins/profile: was the run stopped before '
                    'its last profiled step?')
  steps = steps or info.get('last_step', 0) - info.get('first_step', 1) + 1
  with open(program_path, encoding='utf-8') as f:
    program = parse_program(f.read())
  with gzip.open(trace_path, 'rt', encoding='utf-8') as f:
    events = device_events(json.load(f), program)
  totals, span = device_time(events)
  counted = [e for e in events if e.kind is not None]
  by_name = sum(e.end - e.start for e in counted if not e.joined)
  return Summary({k: v / 1e3 / steps for k, v in totals.items()}, span / 1e3 / steps, steps,
                 trace_path, by_name / max(sum(e.end - e.start for e in counted), 1e-9))


def markdown(s: Summary) -> str:
  """The table (and, where some events were known by their kernel's name alone, a line saying
  how much)."""
  lines = ['| kind | ms a step | share |', '|---|---|---|']
  for kind in (*KINDS, 'idle'):
    ms = s.ms_per_step.get(kind, 0.0)
    lines.append(f'| {kind} | {ms:,.1f} | {ms / max(s.traced_ms_per_step, 1e-9):.1%} |')
  lines.append(f'| traced | {s.traced_ms_per_step:,.1f} | 100% |')
  if s.by_name_share >= 0.01:
    lines.append(f'\n{s.by_name_share:.0%} of the events\' time is classified by kernel name '
                 'alone (no HLO instruction: command buffers? profile with '
                 'XLA_FLAGS=--xla_gpu_enable_command_buffer=).')
  return '\n'.join(lines)


def main():
  profile_dir = _PROFILE.value or os.path.join(_WORKDIR.value, 'profile')
  s = summarize(profile_dir, _STEPS.value)
  print(f'{s.trace}: device time a step, {s.steps} steps traced\n')
  print(markdown(s))


if __name__ == '__main__':
  _WORKDIR = flags.DEFINE_string('workdir', 'runs/default', 'The run whose profile to read.')
  _PROFILE = flags.DEFINE_string('profile', '', 'The profile directory (default WORKDIR/profile).')
  _STEPS = flags.DEFINE_integer('steps', 0, 'Steps the trace holds (0: as profile.json says).')
  cli.run(main)
