"""The engine's scheduler: which sequence decodes in which slot, and the shape of each call. Plain
Python (no jax): tests drive it without a model (tests/test_engine_scheduler.py).

Slots: the KV cache has `local_slots` rows on each of `devices` devices; slot g = d × local_slots
+ j is device d's row j. A submitted sequence waits (first in, first out) until a slot is free; it
then takes the free slot of lowest local index, over the devices in turn (spreading the sequences
over the devices), is prefilled there and decodes with every other busy slot until it ends; its
slot is then free for the next one (continuous batching: sequences join and leave every call, so
a short request never waits for a long one to finish).

Shapes are bucketed, so that traffic does not recompile: a prefill pads its prompts to a power of
two tokens (MIN_BUCKET at least, the context at most) and its rows to a power of two, at most
`prefill_tokens` prompt tokens a device (most_rows); a decode call covers each device's first 1,
2, 4, ... slots, as many as cover the busy ones, with a live length (the positions its attention
reads) of a power of two or 1.5 × one that covers the longest busy row after the call's steps
(live_bucket). A call's steps (at most `chunk`; one while a busy sequence keeps a grammar) are
traced, not static, and so are sampling's variants (the top-k/top-p cut, the TOP_N alternatives):
one program per (rows, live).

Prefix caching (prefix_cache, vLLM's automatic prefix caching on this layout): a slot keeps the
keys and values of what it held after its sequence ends (`cached`: its prompt and every generated
token whose keys and values were written), until a new sequence takes it: a sequence that needs a
slot takes one of the fewest decode rows (PrefixCache.ranked), a never-used one first among those,
else the least recently used. A new prompt that starts with
BLOCK or more tokens of what a slot holds (the longest such prefix, in whole BLOCKs, at most its
length - 1: its last token is run for its logits) reuses them: it takes that slot when it is free,
or a free slot of that slot's device whose prefill first copies the row (a slot still decoding:
concurrent requests with one system prompt, n choices), and its prefill runs only the rest, at
its positions after the prefix (PrefillShape.prefix, a program of each rows × length; its
attention reads the row). The reused tokens are the sequence's `cached_tokens`. Among sequences
admitted together, one that reused a slot's prefix in place is a source of that prefix for the
others (its prefill writes only after it); what the others' prefills will write is not (they
have not run): identical prompts among them share one prefill as before (copies).

A call's shape (PrefillShape, DecodeShape) names the program that runs it (engine/programs.py);
dry_run gives the calls of a workload without a model (plan.py's GRPO rollout).
"""
import collections
import dataclasses
import os
import threading
from typing import ClassVar

from jax_pretrain.engine.sampling import TOP_N
from jax_pretrain.engine.sequence import Sequence

MIN_BUCKET = 16
BLOCK = MIN_BUCKET  # a reused cached prefix is a multiple of BLOCK tokens


class EngineStopped(RuntimeError):
  """submit after stop() or after run_forever ended: the engine takes no more sequences."""


def bucket(n: int, limit: int, smallest: int = 1) -> int:
  """The power of two >= n (and >= smallest), or limit when that is smaller: few distinct shapes."""
  return min(limit, max(smallest, 1 << (max(n, 1) - 1).bit_length()))


def live_bucket(n: int, context: int) -> int:
  """Positions a decode call's attention reads: the smallest power of two or 1.5 × a power of
  two that is >= n (MIN_BUCKET at least, the context at most): at most a third more than the
  longest row needs (half with powers of two alone), for twice the compiled shapes."""
  p = bucket(n, 1 << 62, MIN_BUCKET)
  return min(context, 3 * p // 4 if 3 * p // 4 >= n and p > MIN_BUCKET else p)


@dataclasses.dataclass(frozen=True)
class PrefillShape:
  """A prefill program's shape, per device: `rows` distinct prompts (a row of the batch each, run
  through the model once), each right-padded to `length` tokens, and `copies` more slots that take
  the keys and values of one of them. prefix: each prompt's tokens after a cached prefix (the
  module docstring's prefix caching), their attention over its row."""
  kind: ClassVar[str] = 'prefill'
  rows: int
  length: int
  copies: int
  prefix: bool = False

  def covers(self, other: 'Shape') -> bool:
    """Whether this program can run a call of shape `other` (padded): a prefill of the same kind
    with at least as many rows, tokens and copies."""
    return (isinstance(other, PrefillShape) and self.prefix == other.prefix
            and self.rows >= other.rows and self.length >= other.length
            and self.copies >= other.copies)

  def cost(self) -> tuple:
    """What a call of this shape computes, for picking the smallest cover: rows × tokens, then
    the rest."""
    return self.rows * self.length, (self.rows, self.length, self.copies, self.prefix)

  def __str__(self) -> str:
    """As the warmup's progress lines print it (engine/programs.py)."""
    return f'{self.kind} {self.rows} {self.length} {self.copies}' + (' prefix' if self.prefix
                                                                     else '')


@dataclasses.dataclass(frozen=True)
class DecodeShape:
  """A decode program's shape, per device: its first `rows` slots (a row of the batch each),
  attending over the `live` positions [0, live) of their cache rows. Its steps are traced, not
  part of the shape."""
  kind: ClassVar[str] = 'decode'
  rows: int
  live: int

  def covers(self, other: 'Shape') -> bool:
    """Whether this program can run a call of shape `other` (padded): a decode of at least as
    many rows over at least as many positions."""
    return isinstance(other, DecodeShape) and self.rows >= other.rows and self.live >= other.live

  def cost(self) -> tuple:
    """What a call of this shape computes, for picking the smallest cover: rows × tokens (the
    live positions), then the rest."""
    return self.rows * self.live, (self.rows, self.live)

  def __str__(self) -> str:
    """As the warmup's progress lines print it (engine/programs.py)."""
    return f'{self.kind} {self.rows} {self.live}'


Shape = PrefillShape | DecodeShape


@dataclasses.dataclass(frozen=True)
class Prefill:
  """One prefill call of `shape`; slots: device d's (local slot, index of its prompt among the
  device's rows, sequence), in order: the first slot of a prompt is where it is run, the others
  its copies. sources (a prefix shape's): device d's local slot whose row holds each prompt's
  cached prefix (its first seq.cached_tokens tokens), by the prompt's index."""
  shape: PrefillShape
  slots: tuple[tuple[tuple[int, int, Sequence], ...], ...]
  sources: tuple[tuple[int, ...], ...] = ()


@dataclasses.dataclass(frozen=True)
class Decode:
  """One decode call of `shape`: `steps` steps (at most the chunk); busy: the (slot, sequence)
  pairs it decodes; top_n: TOP_N when a row asks for the alternatives of its tokens (else 0)."""
  shape: DecodeShape
  steps: int
  top_n: int
  local_slots: int
  busy: tuple[tuple[int, Sequence], ...]

  def row(self, g: int) -> int:
    """The row of slot g in this call's gathered outputs (device d's slot j: d × rows + j)."""
    d, j = divmod(g, self.local_slots)
    return d * self.shape.rows + j


class PrefixCache:
  """What each slot's row holds for prefix caching (the module docstring): the tokens whose keys
  and values it holds from position 0, the sequence they are of (owner: None once lost), when it
  was last taken or freed (least recently used first), and the prompt tokens reused so far."""

  def __init__(self, slots: int, local_slots: int, enabled: bool):
    self.slots, self.local_slots, self.enabled = slots, local_slots, enabled
    self.cached: list[tuple[int, ...]] = [()] * slots
    self.owner: list[Sequence | None] = [None] * slots
    self.used = [0] * slots
    self._clock = 0
    self.cached_tokens = 0
    # The slots whose cached tokens start with these BLOCK tokens: a prompt's candidates (place).
    self._by_head: dict[tuple[int, ...], set[int]] = collections.defaultdict(set)

  def forget(self) -> None:
    """No slot holds a cached prefix any more (new params, a fresh cache)."""
    self.cached, self.owner = [()] * self.slots, [None] * self.slots
    self._by_head.clear()

  def _keep(self, g: int, tokens: tuple[int, ...]) -> None:
    """Slot g's row holds `tokens` from position 0 now."""
    if len(self.cached[g]) >= BLOCK:
      self._by_head[self.cached[g][:BLOCK]].discard(g)
    self.cached[g] = tokens
    if len(tokens) >= BLOCK:
      self._by_head[tokens[:BLOCK]].add(g)

  def taken(self, g: int, seq: Sequence) -> None:
    """seq is admitted into slot g (its prefill to come)."""
    self._clock += 1
    self.owner[g], self.used[g] = seq, self._clock

  def prefilled(self, g: int, seq: Sequence) -> None:
    """seq's prefill into slot g is dispatched: its prompt is a source for later admissions."""
    self._keep(g, tuple(seq.prompt))
    self.cached_tokens += seq.cached_tokens

  def ended(self, g: int, seq: Sequence) -> None:
    """seq, decoded in slot g (free now), ended: while no other sequence took the slot, its row
    keeps the prompt and the tokens whose keys and values were written (all but the last: the one
    that ended it on the device is not run; a failed one: nothing)."""
    if self.owner[g] is seq and seq.finish_reason != 'error':
      self._clock += 1
      self._keep(g, (*seq.prompt, *seq.tokens[:-1]))
      self.used[g] = self._clock

  def ranked(self, free: list[int]) -> list[int]:
    """The free slots in the order a sequence without a cached prefix takes them (place): with
    prefix caching, those of the fewest decode rows (the power of two over its local index that a
    decode call's rows round to, DecodeShape.rows) first and, among those, never used first, then
    the least recently used; without it, as given. A slot's rank does not change while it is free,
    so admit ranks once a round. So a slot taken for a cache's sake never makes the decode calls
    run more rows than the sequences need (by recency alone, 32 sequences in 128 slots spread over
    all of them: 128 rows a call, 3.5 x the CPU's work a token); the price: at low concurrency the
    cache keeps fewer prompts (the lowest slots' are evicted first)."""
    if not self.enabled:
      return list(free)
    L = self.local_slots
    return sorted(free, key=lambda g: (bucket(g % L + 1, L), bool(self.cached[g]), self.used[g]))

  def place(self, seq: Sequence, ranked: list[int],
            content: dict[int, tuple[int, ...]]) -> tuple[int, int, int]:
    """(slot, cached prefix length, its source slot) for a sequence whose prompt no other one
    admitted now has: the slot with the longest cached prefix of its prompt when it is free, or
    the first of that one's device in `ranked` (the free slots, ranked), else the first of all.
    content: what the slots admitted now keep (admit). Only the slots whose tokens start with
    the prompt's first BLOCK are compared with it (an index of them, not a pass over every slot:
    admitting 128 sequences into 128 cached slots took 11 ms of the engine thread's CPU)."""
    if not self.enabled:
      return ranked[0], 0, -1
    L = self.local_slots
    most = (len(seq.prompt) - 1) // BLOCK * BLOCK
    prompt = tuple(seq.prompt[:most])  # (what a cached prefix may cover)
    candidates = {g for g in self._by_head.get(prompt[:BLOCK], ()) if g not in content}
    candidates.update(g for g, tokens in content.items() if tokens[:BLOCK] == prompt[:BLOCK])
    matches = []
    for g in candidates if most else ():
      n = len(os.path.commonprefix([content.get(g, self.cached[g])[:most], prompt]))
      n = n // BLOCK * BLOCK
      if n:
        matches.append((-n, g not in ranked, g))
    for n, _, src in sorted(matches):
      if src in ranked:
        return src, -n, src
      on_device = next((g for g in ranked if g // L == src // L), -1)
      if on_device >= 0:
        return on_device, -n, src
    return ranked[0], 0, -1


class Scheduler:
  """Slots, the waiting queue, admission and the calls' shapes (the module docstring). submit,
  withdraw, stop and wait are thread-safe; the rest runs in the engine's thread."""

  def __init__(self, *, local_slots: int, devices: int, context: int, chunk: int,
               prefill_tokens: int, prefix_cache: bool = False):
    self.local_slots, self.devices, self.context, self.chunk = local_slots, devices, context, chunk
    self.slots = local_slots * devices
    self._by_index = [d * local_slots + j for j in range(local_slots) for d in range(devices)]
    self.prefill_tokens = prefill_tokens
    self.prefix_cache = prefix_cache
    self.prefix = PrefixCache(self.slots, local_slots, prefix_cache)
    self.busy: list[Sequence | None] = [None] * self.slots
    # Tokens of each busy slot's sequence that the decode calls dispatched so far will have made
    # (at most: it may end before), read or not.
    self.dispatched = [0] * self.slots
    # Sequences whose every token is dispatched and whose slot went to the next (decode()): held
    # here until they end (free), as the busy ones are, so that none is lost on a failure.
    self.finishing: list[Sequence] = []
    self.waiting: collections.deque[Sequence] = collections.deque()
    self.stopping = False
    self._wakeup = threading.Condition()

  def submit(self, seq: Sequence) -> bool:
    """Queues a sequence; False for one that asks for no new tokens (the caller ends it). Its
    prompt and max_new_tokens must fit the context; once stopped, raises EngineStopped."""
    if not seq.prompt or len(seq.prompt) + seq.max_new_tokens > self.context:
      raise ValueError(f'a prompt of {len(seq.prompt)} tokens and {seq.max_new_tokens} new tokens '
                       f'do not fit the context of {self.context} tokens')
    with self._wakeup:
      if self.stopping:
        raise EngineStopped('the engine is stopped: it takes no more sequences')
      if seq.max_new_tokens <= 0:
        return False
      self.waiting.append(seq)
      self._wakeup.notify()
      return True

  def wait(self) -> bool:
    """Blocks until there is work or stop(); returns False once stopped."""
    with self._wakeup:
      while not self.stopping and not self.has_work():
        self._wakeup.wait()
      return not self.stopping

  def stop(self) -> list[Sequence]:
    """Refuses new sequences from now on and wakes wait(); returns those that were waiting (no
    longer queued)."""
    with self._wakeup:
      self.stopping = True
      waiting = list(self.waiting)
      self.waiting.clear()
      self._wakeup.notify()
    return waiting

  def withdraw(self, sequences: list[Sequence]) -> list[Sequence]:
    """Takes those of these sequences that still wait out of the queue (their requests were
    cancelled: the places are free for others now, not when admit would reach them); returns
    them, for the caller to end."""
    with self._wakeup:
      gone = [seq for seq in sequences if seq in self.waiting]
      for seq in gone:
        self.waiting.remove(seq)
    return gone

  def release(self, waiting: bool = False) -> list[Sequence]:
    """Frees every slot (and with `waiting` empties the queue); returns the sequences they held
    and the finishing ones (then those that waited)."""
    with self._wakeup:
      held = [*self.finishing, *(seq for seq in self.busy if seq is not None)]
      self.busy, self.dispatched, self.finishing = [None] * self.slots, [0] * self.slots, []
      self.prefix.forget()
      if waiting:
        held += self.waiting
        self.waiting.clear()
    return held

  def free(self, g: int, seq: Sequence) -> None:
    """seq, decoded in slot g, ended: its slot is free (unless it went to the next already), its
    row a cached prefix (PrefixCache.ended)."""
    if self.busy[g] is seq:
      self.busy[g], self.dispatched[g] = None, 0
    elif seq in self.finishing:
      self.finishing.remove(seq)
    if self.busy[g] is None:
      self.prefix.ended(g, seq)

  def held(self, g: int) -> Sequence:
    """The sequence in slot g, which the caller knows is busy."""
    seq = self.busy[g]
    assert seq is not None, f'slot {g} is free'
    return seq

  def admit(self) -> tuple[list[Prefill], list[Sequence]]:
    """Moves waiting sequences into free slots (PrefixCache.place: with prefix caching the slot
    of a cached prefix, or one of its device's), but one whose prompt another one admitted now
    has goes to that one's device (its first free slot in PrefixCache.ranked's order), so that the
    prompt is prefilled once for both (GRPO's num_samples completions, a request's n choices).
    Returns the prefill calls of those admitted, a bucket of lengths at a time, and the waiting
    sequences found cancelled (no longer queued: the caller ends them)."""
    admitted: list[int] = []
    cancelled = []
    source: dict[int, int] = {}  # an admitted slot: the slot whose row holds its cached prefix
    # What an admitted slot's row keeps for the others admitted now: its cached prefix when that
    # was its own (its prefill writes after it), else nothing.
    content: dict[int, tuple[int, ...]] = {}
    with self._wakeup:
      free = self.prefix.ranked([g for g in self._by_index if self.busy[g] is None])
      # A prompt admitted now: its last device, its cached prefix's length and source.
      first: dict[tuple[int, ...], tuple[int, int, int]] = {}
      while free and self.waiting:
        seq = self.waiting.popleft()
        if seq.cancelled:
          cancelled.append(seq)
          continue
        prompt = tuple(seq.prompt)
        d, start, src = first.get(prompt, (-1, 0, -1))
        g = next((g for g in free if g // self.local_slots == d), -1)
        if g < 0:
          g, start, src = self.prefix.place(seq, free, content)
        free.remove(g)
        first[prompt] = g // self.local_slots, start, src
        self.busy[g], seq.cached_tokens = seq, start
        self.prefix.taken(g, seq)
        content[g] = prompt[:start] if src == g else ()
        if start:
          source[g] = src
        admitted.append(g)
      for g in admitted:
        self.prefix.prefilled(g, self.held(g))
    return self._prefills(admitted, source), cancelled

  def _prefills(self, admitted: list[int], source: dict[int, int]) -> list[Prefill]:
    """The prefill calls of the slots just admitted: a call per kind (a cached prefix or not) and
    bucket of the lengths they run (their prompts after the prefix), each device's distinct
    prompts in its rows (most_rows at most), their other sequences copies."""
    by_length = collections.defaultdict(list)
    for g in admitted:
      seq = self.held(g)
      by_length[g in source, bucket(len(seq.prompt) - seq.cached_tokens, self.context,
                                    MIN_BUCKET)].append(g)
    calls = []
    for (prefix, P_), slots in sorted(by_length.items()):
      # Each device's distinct prompts, each with its slots (the first: where it is run).
      per_device = []
      for d in range(self.devices):
        prompts: dict[tuple[int, ...], list[int]] = {}
        for g in slots:
          if g // self.local_slots == d:
            prompts.setdefault(tuple(self.held(g).prompt), []).append(g)
        per_device.append(list(prompts.values()))
      most = self.most_rows(P_, prefix)
      for start in range(0, max(len(x) for x in per_device), most):
        group = [x[start:start + most] for x in per_device]
        copies = max(sum(len(s) - 1 for s in x) for x in group)
        shape = PrefillShape(rows=bucket(max(len(x) for x in group), most), length=P_,
                             copies=bucket(copies, self.local_slots) if copies else 0,
                             prefix=prefix)
        calls.append(Prefill(shape, tuple(
            tuple((g % self.local_slots, i, self.held(g)) for i, s in enumerate(x) for g in s)
            for x in group), tuple(tuple(source[s[0]] % self.local_slots for s in x)
                                   for x in group) if prefix else ()))
    return calls

  def decode(self) -> Decode | None:
    """The next decode call of every busy slot (None: none is busy), its steps counted as
    dispatched. A slot whose sequence will have all its tokens once the call has run is free from
    now on: a sequence admitted there is prefilled after the call (the device runs calls in
    order), and the call's tokens still go to the sequence it decoded (Decode.busy)."""
    busy = tuple((g, seq) for g, seq in enumerate(self.busy) if seq is not None)
    if not busy:
      return None
    chunk = 1 if self.constrained() else self.chunk  # (a grammar's mask is for one token)
    steps = max(min(chunk, seq.max_new_tokens - self.dispatched[g]) for g, seq in busy)
    longest = max(len(seq.prompt) + self.dispatched[g] for g, seq in busy)
    for g, seq in busy:
      self.dispatched[g] = min(seq.max_new_tokens, self.dispatched[g] + steps)
      if self.dispatched[g] == seq.max_new_tokens:
        self.busy[g], self.dispatched[g] = None, 0
        self.finishing.append(seq)
    seqs = [seq for _, seq in busy]
    return Decode(
        DecodeShape(rows=bucket(max(g % self.local_slots for g, _ in busy) + 1, self.local_slots),
                    live=live_bucket(longest + steps, self.context)), steps=steps,
        top_n=TOP_N if any(s.alternatives for s in seqs) else 0, local_slots=self.local_slots,
        busy=busy)

  def constrained(self) -> bool:
    """Whether a busy slot's sequence keeps a grammar: then a decode call runs one step, and the
    engine reads the call before it first (its matcher's mask needs its last token)."""
    return any(seq is not None and seq.grammar is not None for seq in self.busy)

  def most_rows(self, P_: int, prefix: bool = False) -> int:
    """Prompts per device per prefill call at most for prompts padded to P_: a power of two that
    keeps the call within prefill_tokens (a prefix prefill's row counted as the context: its
    attention's scores are [rows, P_, context]), and no more than a device's slots need."""
    per_row = self.context if prefix else P_
    fitting = 1 << (max(1, self.prefill_tokens // per_row).bit_length() - 1)
    return min(fitting, bucket(self.local_slots, 1 << 30))

  def programs(self) -> tuple[list[Shape], list[Shape]]:
    """The programs a warmup compiles (engine/programs.py's shapes): those that cover every call
    (per prompt length, its largest prefill with a copy into every other slot; the decode of
    every slot over the whole context), then every other shape that traffic asks for without
    copies (a prefill's rows × length, a decode's rows × live) and each prefill's with a copy
    into every slot, smallest first (decodes first among those that compute as much). A prefill
    with copies (several sequences of one prompt) runs as the one of its rows and length with a
    copy into every slot (engine/programs.py: its own is never compiled under traffic). With
    prefix caching, each prefill's prefix shape too."""
    lengths = sorted({bucket(n, self.context, MIN_BUCKET) for n in range(1, self.context + 1)})
    kinds = (False, True) if self.prefix_cache else (False,)
    covering: list[Shape] = [PrefillShape(self.most_rows(P_, prefix), P_, self.local_slots, prefix)
                             for prefix in kinds for P_ in lengths]
    covering.append(DecodeShape(self.local_slots, self.context))
    rows = lambda most: sorted({bucket(n, most) for n in range(1, most + 1)})
    prefills: list[Shape] = [PrefillShape(N, P_, copies, prefix) for prefix in kinds
                             for P_ in lengths for N in rows(self.most_rows(P_, prefix))
                             for copies in (0, self.local_slots)]
    lives = sorted({live_bucket(n, self.context) for n in range(1, self.context + 1)})
    decodes: list[Shape] = [DecodeShape(R, live) for R in rows(self.local_slots) for live in lives]
    rest = sorted(prefills + decodes, key=lambda s: (s.cost()[0], s.kind, s.cost()[1]))
    return covering, [s for s in rest if s not in covering]

  def dry_run(self, workload: list[tuple[int, int, int]]) -> list[Prefill | Decode]:
    """The calls, in order, that a scheduler of these sizes makes from free slots for `workload`,
    without a model (plan.py: a GRPO step's rollout): (prompt tokens, max_new_tokens, sequences)
    per prompt, each a prompt of its own, submitted in order. It is driven as Engine.step drives
    it (admit, then decode), every sequence decoding its max_new_tokens (no EOS, stop string or
    cancellation): it ends with its last dispatched token."""
    s = Scheduler(local_slots=self.local_slots, devices=self.devices, context=self.context,
                  chunk=self.chunk, prefill_tokens=self.prefill_tokens)
    for i, (length, new, n) in enumerate(workload):
      for _ in range(n):
        s.submit(Sequence(prompt=[i] * length, max_new_tokens=new))
    calls: list[Prefill | Decode] = []
    while s.has_work():
      calls += s.admit()[0]
      call = s.decode()
      if call is not None:
        calls.append(call)
      s.finishing.clear()  # (they end at the read of their last call, which frees no slot)
    return calls

  def has_work(self) -> bool:
    """Whether a sequence is decoding (busy or finishing) or waiting."""
    return bool(self.waiting or self.finishing) or any(seq is not None for seq in self.busy)

  def stats(self) -> dict:
    return {'busy': len(self.finishing) + sum(s is not None for s in self.busy),
            'waiting': len(self.waiting)}
