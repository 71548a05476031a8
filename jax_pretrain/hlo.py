"""What a compiled XLA program does per run, read from its optimized HLO text.

`compiled.cost_analysis()` is not available for programs compiled for a GPU without one (the
deviceless compile of jax_pretrain.plan), so this reads `compiled.as_text()` instead and walks its
call graph: every instruction counts as many times as its computation runs, i.e. times the trip
count of each enclosing while loop (the scan over layers, the scan over micro-batches); of a
conditional, its costliest branch (that of the usual steps where one is RARE_BRANCH's).

Per instruction (a kernel, of a kind: matmul, matmul_f32 (float32 operands: TF32 on NVIDIA GPUs),
matmul_fp8, attention, attention_backward, copy (only moves or fills memory: a copy or transpose,
a slice read or written in place, a zero-filled buffer), elementwise (any other fusion: the
elementwise and reduction work) or other (a custom call of unknown cost)) it counts
  FLOPs      dots (2 · output elements · contracted size), cuBLAS gemm custom calls, and cuDNN
             fused attention (forward 4·B·N·T·S·H, halved under a causal mask; backward 2.5×
             that: four matmuls plus recomputing the scores). Other custom calls (e.g. a
             Pallas/Triton kernel) are listed in `uncounted` and contribute nothing.
  HBM bytes  what each kernel reads and writes (operands + results), as XLA executes it: a slice
             or dynamic-slice of an operand reads only its slice, and a dynamic-update-slice or a
             scatter into an operand the kernel writes in place (its result is that buffer)
             writes only its updates.
  collectives by kind, with the bytes of the (unsharded) buffer each one reduces or gathers, and
             the size of its device groups.
All numbers are per device: the program is the one SPMD program every device runs.
"""
import collections
import dataclasses
import math
import re

import numpy as np

COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')

_DTYPE_BYTES = {
    'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's32': 4, 'u32': 4,
    'f32': 4, 's64': 8, 'u64': 8, 'f64': 8, 'c64': 8, 'c128': 16, 's4': 0.5, 'u4': 0.5,
    'f8e4m3fn': 1, 'f8e5m2': 1, 'f8e4m3fnuz': 1, 'f8e5m2fnuz': 1, 'f8e4m3b11fnuz': 1,
}
# A conditional's branch traced under jax.named_scope(RARE_BRANCH) runs on few of a run's steps
# (FP8's first step, state.py): what a step costs is its other branches' (the costliest).
RARE_BRANCH = 'rare_branch'
_ARRAY = re.compile(r'\b([a-z][a-z0-9]*)\[([0-9,]*)\]')
_INSTRUCTION = re.compile(r'^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$')
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$')
# Instructions that launch no kernel of their own (or only move control).
_FREE = {'parameter', 'constant', 'get-tuple-element', 'tuple', 'bitcast', 'while', 'conditional',
         'call', 'after-all', 'partition-id', 'replica-id', 'opt-barrier', 'add-dependency',
         'copy-start', 'copy-done', 'async-done', 'async-update', 'fusion-done', 'send', 'recv',
         'send-done', 'recv-done'}


@dataclasses.dataclass
class Instruction:
  name: str
  shape: str  # the result type as printed: 'bf16[8,128]{1,0}' or a tuple '(f32[2], s32[])'
  opcode: str
  operands: list[str]
  args: str  # the operand list as printed (a constant's value)
  attrs: str  # everything after the operand list

  def called(self, key: str) -> list[str]:
    """Computations named by attribute `key` (calls=, body=, to_apply=, branch_computations=)."""
    m = re.search(rf'\b{key}=(\{{[^}}]*\}}|%[\w.\-]+)', self.attrs)
    return re.findall(r'%([\w.\-]+)', m.group(1)) if m else []


def _split_top_level(text: str, open_index: int) -> tuple[str, int]:
  """The text inside the bracket at text[open_index] and the index just past its closing one."""
  depth = 0
  for i in range(open_index, len(text)):
    if text[i] in '([{':
      depth += 1
    elif text[i] in ')]}':
      depth -= 1
      if depth == 0:
        return text[open_index + 1:i], i + 1
  raise ValueError(f'unbalanced brackets in {text[:200]!r}')


def _parse_instruction(line: str) -> Instruction | None:
  m = _INSTRUCTION.match(line)
  if not m:
    return None
  name, rest = m.group(1), m.group(2)
  if rest.startswith('('):  # tuple result type
    inner, end = _split_top_level(rest, 0)
    shape, rest = f'({inner})', rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(' ')
  op = re.match(r'([\w\-]+)\(', rest)
  if not op:
    return None
  operands_text, end = _split_top_level(rest, op.end() - 1)
  operands = re.findall(r'%([\w.\-]+)', operands_text)
  return Instruction(name, shape, op.group(1), operands, operands_text, rest[end:])


def parse(text: str) -> tuple[dict[str, list[Instruction]], str]:
  """{computation name: its instructions}, and the entry computation's name."""
  computations: dict[str, list[Instruction]] = {}
  entry: str | None = None
  current: list[Instruction] | None = None
  for line in text.splitlines():
    if current is None:
      m = _COMPUTATION.match(line)
      if m:
        current = computations.setdefault(m.group(1), [])
        if line.startswith('ENTRY'):
          entry = m.group(1)
      continue
    if line.strip() == '}':
      current = None
      continue
    instruction = _parse_instruction(line)
    if instruction is not None:
      current.append(instruction)
  if entry is None:
    raise ValueError('no ENTRY computation in the HLO text')
  return computations, entry


def shape_bytes(shape: str) -> float:
  """Bytes of every array in a (possibly tuple) type string; layouts and comments are ignored."""
  total = 0.0
  for dtype, dims in _ARRAY.findall(re.sub(r'/\*.*?\*/', '', shape)):
    if dtype in _DTYPE_BYTES:
      total += _DTYPE_BYTES[dtype] * math.prod(int(d) for d in dims.split(',') if d)
  return total


def shape_dims(shape: str) -> list[int]:
  """Dimensions of the first array in a type string."""
  m = _ARRAY.search(shape)
  return [int(d) for d in m.group(2).split(',') if d] if m else []


def _attr(pattern: str, instruction: Instruction) -> str:
  """The first group of pattern in an attribute that every instruction of its kind has (a
  compare's direction, a custom call's target)."""
  m = re.search(pattern, instruction.attrs)
  if m is None:
    raise ValueError(f'{instruction.name}: no {pattern!r} in {instruction.attrs!r}')
  return m.group(1)


def trip_count(instruction: Instruction, computations, by_name) -> int | None:
  """A while loop's trip count: XLA's known_trip_count; else, for a loop XLA rotated or peeled
  (the collective pipeliner does), the one integer constant its condition compares the induction
  variable with (looking into the condition's fusions), minus the variable's constant start."""
  m = re.search(r'"known_trip_count":\{"n":"(\d+)"', instruction.attrs)
  if m:
    return int(m.group(1))
  compares: list[int | str] = []  # the condition's s32 constants and compare directions

  def scan(name):
    for i in computations.get(name, []):
      if i.opcode == 'constant' and i.shape.startswith('s32[]'):
        compares.append(int(i.args))
      elif i.opcode == 'compare':
        compares.append(_attr(r'direction=(\w+)', i))
      for c in i.called('calls'):
        scan(c)
  for cond in instruction.called('condition'):
    scan(cond)
  bounds = [x for x in compares if isinstance(x, int)]
  if len(bounds) != 1 or compares.count('LT') + compares.count('LE') != 1:
    return None
  index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', instruction.attrs)
  start = by_name.get(instruction.operands[0]) if instruction.operands else None
  if start is not None and start.opcode == 'tuple':
    start = by_name.get(start.operands[int(index.group(1)) if index else 0])
  while start is not None and start.opcode in ('copy', 'bitcast'):
    start = by_name.get(start.operands[0])
  first = int(start.args) if start is not None and start.opcode == 'constant' else 0
  return bounds[0] - first + ('LE' in compares)


def group_size_and_span(instruction: Instruction, devices_per_node: int) -> tuple[int, bool]:
  """(devices in each replica group, whether a group spans more than one node).

  Device ids are the program's logical ids, which the mesh lays out row-major; node = id //
  devices_per_node. Three printed forms: mesh['data'=8,'fsdp'=1] {'data'}, [2,4]<=[8] (iota,
  optionally transposed: [4,2]<=[2,4]T(1,0)), and explicit {{0,1},{2,3}}.
  """
  attrs = instruction.attrs
  m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
  if m:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    axes = re.findall(r"'([^']+)'", m.group(2))
    names = list(sizes)
    strides = {a: math.prod(sizes[b] for b in names[i + 1:]) for i, a in enumerate(names)}
    n = math.prod(sizes[a] for a in axes)
    last = sum((sizes[a] - 1) * strides[a] for a in axes)
    return n, last // devices_per_node > 0
  m = re.search(r'replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?', attrs)
  if m:
    groups = [int(x) for x in m.group(1).split(',')]
    ids = np.arange(math.prod(int(x) for x in m.group(2).split(',')))
    ids = ids.reshape([int(x) for x in m.group(2).split(',')])
    if m.group(3):
      ids = ids.transpose([int(x) for x in m.group(3).split(',')])
    first = ids.reshape(groups[0], -1)[0] if len(groups) == 2 else ids.reshape(-1)
    return len(first), len(set(int(i) // devices_per_node for i in first)) > 1
  m = re.search(r'replica_groups=\{\{([\d,]*)\}', attrs)
  if m and m.group(1):
    first = [int(x) for x in m.group(1).split(',')]
    return len(first), len(set(i // devices_per_node for i in first)) > 1
  return 1, False


@dataclasses.dataclass
class Collective:
  kind: str
  count: float = 0  # executions per program run
  bytes: float = 0.0  # per device: sum over executions of the unsharded buffer size
  wire_bytes: float = 0.0  # per device: what a ring algorithm sends, by group size
  cross_node_wire_bytes: float = 0.0  # the part of wire_bytes in groups that span nodes


@dataclasses.dataclass
class Kernel:
  """One launch site, with its cost per execution and how often it runs per program run."""
  name: str
  opcode: str
  kind: str  # the module docstring's: 'matmul', ..., 'copy', 'elementwise', 'other'
  flops: float
  hbm_bytes: float
  times: float


@dataclasses.dataclass
class Stats:
  flops: float = 0.0
  matmul_flops: float = 0.0  # FP8 and float32 ones included
  fp8_matmul_flops: float = 0.0
  # kernels of FP8 dots and GEMMs (launch sites, not times run; of a conditional, the branch
  # counted)
  fp8_matmuls: int = 0
  attention_flops: float = 0.0
  hbm_bytes: float = 0.0
  kernels: list[Kernel] = dataclasses.field(default_factory=list)
  collectives: dict[str, Collective] = dataclasses.field(
      default_factory=lambda: {k: Collective(k) for k in COLLECTIVES})
  # {custom-call target: times run}
  uncounted: collections.defaultdict[str, float] = dataclasses.field(
      default_factory=lambda: collections.defaultdict(float))
  unknown_trip_counts: int = 0

  def add(self, k: Kernel) -> None:
    """Counts a kernel's cost, times it runs, into the totals (and its kind's)."""
    self.kernels.append(k)
    self.flops += k.flops * k.times
    self.hbm_bytes += k.hbm_bytes * k.times
    if k.kind.startswith('matmul'):
      self.matmul_flops += k.flops * k.times
    if k.kind == 'matmul_fp8':
      self.fp8_matmul_flops += k.flops * k.times
    elif k.kind.startswith('attention'):
      self.attention_flops += k.flops * k.times


def _dot_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
  m = re.search(r'lhs_contracting_dims=\{([\d,]*)\}', instruction.attrs)
  lhs = shape_dims(shapes.get(instruction.operands[0], ''))
  contracted = math.prod(lhs[int(d)] for d in m.group(1).split(',') if d) if m and lhs else 1
  return 2.0 * math.prod(shape_dims(instruction.shape)) * contracted


def _dot_kind(instruction: Instruction, shapes: dict[str, str]) -> str:
  """'matmul_fp8' for a dot (or cuBLAS GEMM) of FP8 operands (model.fp8), 'matmul_f32' for one
  of float32 operands (TF32 GEMMs on NVIDIA GPUs), else 'matmul'."""
  operands = [shapes.get(o, '') for o in instruction.operands[:2]]
  if any(shape.startswith('f8') for shape in operands):
    return 'matmul_fp8'
  return 'matmul_f32' if all(shape.startswith('f32') for shape in operands) else 'matmul'


def _gemm_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
  m = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', instruction.attrs)
  lhs = shape_dims(shapes.get(instruction.operands[0], ''))
  dims = [int(d) for d in re.findall(r'\d+', m.group(1))] if m else []
  contracted = math.prod(lhs[d] for d in dims) if lhs else 1
  return 2.0 * math.prod(shape_dims(instruction.shape)) * contracted


def _attention_flops(instruction: Instruction, shapes: dict[str, str]) -> float:
  """cuDNN fused attention: q [B, T, N, H] and k [B, S, K, H] are its first two operands."""
  q = shape_dims(shapes.get(instruction.operands[0], ''))
  k = shape_dims(shapes.get(instruction.operands[1], ''))
  if len(q) != 4 or len(k) != 4:
    return 0.0
  forward = 4.0 * q[0] * q[1] * q[2] * q[3] * k[1]
  if '"mask_type":"CAUSAL"' in instruction.attrs.replace(' ', ''):
    forward /= 2
  return forward * (2.5 if _is_backward(instruction) else 1.0)


def _is_backward(instruction: Instruction) -> bool:
  return 'Backward' in _attr(r'custom_call_target="([^"]*)"', instruction)


def _custom_call_cost(instruction: Instruction, shapes) -> tuple[str, float] | None:
  m = re.search(r'custom_call_target="([^"]*)"', instruction.attrs)
  target = m.group(1) if m else ''
  if target.startswith('__cublas'):  # (e.g. __cublas$lt$matmul$f8: FP8 operands, scales folded)
    return _dot_kind(instruction, shapes), _gemm_flops(instruction, shapes)
  if target.startswith('__cudnn$fmha'):
    kind = 'attention_backward' if _is_backward(instruction) else 'attention'
    return kind, _attention_flops(instruction, shapes)
  return None


_SLICES = ('slice', 'dynamic-slice')
# What only moves data: a kernel of these alone (and of scalar index arithmetic) is a copy.
MOVES = {'parameter', 'constant', 'bitcast', 'reshape', 'copy', 'transpose', 'slice',
         'dynamic-slice', 'dynamic-update-slice', 'concatenate', 'pad', 'broadcast', 'tuple',
         'get-tuple-element', 'iota'}


def _is_copy(instruction: Instruction, computations) -> bool:
  """Whether a kernel only moves or fills memory (see the module docstring)."""
  if instruction.opcode not in ('fusion', 'fusion-start'):
    return instruction.opcode in MOVES
  called = instruction.called('calls')
  return all(i.opcode in MOVES or re.match(r'\w+\[\]', i.shape)
             for i in computations.get(called[0] if called else '', []))
_IN_PLACE = ('dynamic-update-slice', 'scatter')


def _written(out: Instruction, by_name: dict[str, Instruction]) -> float:
  """Bytes an in-place update writes: its updates (a dynamic-update-slice's operand 1; a scatter's
  operands after its indices)."""
  updates = out.operands[1:2] if out.opcode == 'dynamic-update-slice' else out.operands[2:]
  return sum(shape_bytes(by_name[u].shape) for u in updates if u in by_name)


def _fusion_bytes(instruction: Instruction, computations, shapes) -> float:
  """HBM traffic of a fused kernel: operands it reads, results it writes, where a parameter only
  sliced (statically or dynamically) reads its slices, and a dynamic-update-slice or scatter
  output into a parameter's buffer (in place) writes only its updates."""
  called = instruction.called('calls')
  body = computations.get(called[0], []) if called else []
  if not body:
    return sum(shape_bytes(shapes.get(o, '')) for o in instruction.operands) + shape_bytes(
        instruction.shape)
  by_name = {i.name: i for i in body}
  users = collections.defaultdict(list)
  for i in body:
    for o in i.operands:
      users[o].append(i)
  in_place = set()
  total = 0.0
  root = body[-1]
  outputs = [by_name[o] for o in root.operands] if root.opcode == 'tuple' else [root]
  for out in outputs:
    if out.opcode in _IN_PLACE and by_name.get(out.operands[0], out).opcode == 'parameter':
      in_place.add(out.operands[0])
      total += _written(out, by_name)
    else:
      total += shape_bytes(out.shape)
  for p in body:
    if p.opcode != 'parameter' or p.name in in_place:
      continue
    uses = users[p.name]
    if uses and all(u.opcode in _SLICES and u.operands[0] == p.name for u in uses):
      total += sum(shape_bytes(u.shape) for u in uses)
    else:
      total += shape_bytes(p.shape)
  return total


@dataclasses.dataclass(frozen=True)
class _Program:
  """A parsed program as `analyze` reads it: each computation's instructions, every instruction
  by name and its result type, and the two settings of the analysis."""
  computations: dict[str, list[Instruction]]
  by_name: dict[str, Instruction]
  shapes: dict[str, str]
  devices_per_node: int
  unknown_trips: int


def analyze(text: str, devices_per_node: int = 8, unknown_trips: int = 1) -> Stats:
  """Per-device FLOPs, HBM bytes, kernels and collectives of one run of the program in `text`.
  unknown_trips: how many times a while loop whose trip count the HLO does not say runs (e.g. a
  fori_loop over a traced bound; counted in Stats.unknown_trip_counts)."""
  computations, entry = parse(text)
  by_name = {i.name: i for body in computations.values() for i in body}
  shapes = {name: i.shape for name, i in by_name.items()}
  p = _Program(computations, by_name, shapes, devices_per_node, unknown_trips)
  stats = Stats()
  _walk(p, entry, 1.0, stats)
  return stats


def _walk(p: _Program, name: str, times: float, stats: Stats) -> None:
  """Adds to stats what computation `name` does when it runs `times` times: its kernels and
  collectives, and those of the computations it runs (loops times their trips)."""
  for i in p.computations.get(name, []):
    op = i.opcode
    base = op.removesuffix('-start')
    if base in COLLECTIVES:
      _collective(p, i, base, times, stats)
    elif op.endswith('-done') or op == 'async-update':
      continue
    elif op == 'async-start':
      for c in i.called('calls'):
        inner = [x for x in p.computations.get(c, []) if x.opcode in COLLECTIVES]
        for x in inner:
          _collective(p, x, x.opcode, times, stats)
        if not inner:
          _walk(p, c, times, stats)
    elif op == 'while':
      n = trip_count(i, p.computations, p.by_name)
      if n is None:
        stats.unknown_trip_counts += 1
        n = p.unknown_trips
      for body in i.called('body'):
        _walk(p, body, times * n, stats)
    elif op == 'conditional':
      branch = _costliest_branch(p, i)
      if branch is not None:
        _walk(p, branch, times, stats)
    elif op == 'call':
      for c in i.called('to_apply') or i.called('calls'):
        _walk(p, c, times, stats)
    elif op not in _FREE:
      _kernel(p, i, times, stats)


def _costliest_branch(p: _Program, i: Instruction) -> str | None:
  """The branch of a conditional with the most FLOPs + HBM bytes (what `analyze` counts of it),
  of those not traced under RARE_BRANCH (where another is)."""
  branches = i.called('branch_computations') or (
      i.called('true_computation') + i.called('false_computation'))
  usual = [b for b in branches if not _is_rare(p, b)]
  costs = []
  for b in usual or branches:
    sub = Stats()
    _walk(p, b, 1.0, sub)
    costs.append((sub.flops + sub.hbm_bytes, b))
  return max(costs)[1] if costs else None


def _is_rare(p: _Program, branch: str) -> bool:
  """Whether a conditional's branch was traced under jax.named_scope(RARE_BRANCH) (its
  instructions' op_name metadata says so)."""
  return any(f'/{RARE_BRANCH}/' in i.attrs for i in p.computations.get(branch, []))


def _collective(p: _Program, i: Instruction, kind: str, times: float, stats: Stats) -> None:
  """Adds a collective's executions, its buffer's bytes and a ring algorithm's wire bytes."""
  n, spans = group_size_and_span(i, p.devices_per_node)
  size = sum(shape_bytes(p.shapes.get(o, '')) for o in i.operands)
  if kind == 'all-gather':
    size *= n
  factor = {'all-reduce': 2 * (n - 1) / n, 'collective-permute': 1.0}.get(kind, (n - 1) / n)
  c = stats.collectives[kind]
  c.count += times
  c.bytes += size * times
  c.wire_bytes += factor * size * times
  if spans:
    c.cross_node_wire_bytes += factor * size * times


def _flops_inside(p: _Program, name: str, seen: tuple[str, ...] = ()) -> tuple[float, str]:
  """FLOPs and kind of a fusion body (dots inside it)."""
  flops, kind = 0.0, 'other'
  for i in p.computations.get(name, []):
    if i.opcode == 'dot':
      flops, kind = flops + _dot_flops(i, p.shapes), _dot_kind(i, p.shapes)
    elif i.opcode == 'custom-call':
      cost = _custom_call_cost(i, p.shapes)
      if cost:
        flops, kind = flops + cost[1], cost[0]
    elif i.opcode in ('fusion', 'call') and name not in seen:
      for c in i.called('calls') or i.called('to_apply'):
        f, k = _flops_inside(p, c, seen + (name,))
        flops, kind = flops + f, (k if k != 'other' else kind)
  return flops, kind


def _kernel(p: _Program, i: Instruction, times: float, stats: Stats) -> None:
  """Adds one launch site's kernel, of its kind, FLOPs and HBM bytes (a custom call of unknown
  cost to stats.uncounted)."""
  op = i.opcode
  kind, flops = 'other', 0.0
  if op == 'dot':
    kind, flops = _dot_kind(i, p.shapes), _dot_flops(i, p.shapes)
  elif op == 'custom-call':
    cost = _custom_call_cost(i, p.shapes)
    if cost:
      kind, flops = cost
    else:
      target = re.search(r'custom_call_target="([^"]*)"', i.attrs)
      stats.uncounted[target.group(1) if target else '?'] += times
  elif op in ('fusion', 'fusion-start'):
    for c in i.called('calls'):
      f, k = _flops_inside(p, c)
      flops, kind = flops + f, k
  if kind == 'other' and op != 'custom-call':
    kind = 'copy' if _is_copy(i, p.computations) else 'elementwise'
  stats.fp8_matmuls += kind == 'matmul_fp8'
  stats.add(Kernel(i.name, op, kind, flops, _kernel_bytes(p, i), times))


def _kernel_bytes(p: _Program, i: Instruction) -> float:
  """HBM bytes a kernel reads and writes (the module docstring's)."""
  op, size = i.opcode, lambda names: sum(shape_bytes(p.shapes.get(o, '')) for o in names)
  if op in ('fusion', 'fusion-start'):
    return _fusion_bytes(i, p.computations, p.shapes)
  if op == 'dynamic-update-slice':
    return 2 * size(i.operands[1:2])
  if op == 'scatter':  # in place: reads its indices and updates, writes the updates
    return size(i.operands[1:]) + size(i.operands[2:])
  if op in _SLICES:
    return 2 * shape_bytes(i.shape)
  return size(i.operands) + shape_bytes(i.shape)
