"""The engine's scheduler without a model: which slot each sequence takes, which waits, and the
shapes of the calls that run them."""
import itertools
import sys
import threading
import time

import pytest

from jax_pretrain.engine import programs
from jax_pretrain.engine import scheduler as scheduler_lib
from jax_pretrain.engine.scheduler import DecodeShape
from jax_pretrain.engine.scheduler import PrefillShape
from jax_pretrain.engine.sequence import Sequence


def _scheduler(local_slots=2, devices=2, context=128, chunk=8, prefill_tokens=128):
  return scheduler_lib.Scheduler(local_slots=local_slots, devices=devices, context=context,
                                 chunk=chunk, prefill_tokens=prefill_tokens)


_FIRST = itertools.count(1)


def _seq(length: int, new: int = 10, like: Sequence | None = None, **kw) -> Sequence:
  """A sequence of a prompt of its own (or of `like`'s prompt)."""
  prompt = list(like.prompt) if like else [next(_FIRST)] * length
  return Sequence(prompt=prompt, max_new_tokens=new, **kw)


def test_sequences_take_the_lowest_free_slot_over_the_devices_in_turn_and_the_rest_wait():
  s = _scheduler()
  seqs = [_seq(n) for n in (3, 20, 5, 40, 7)]
  for seq in seqs:
    assert s.submit(seq)
  prefills, cancelled = s.admit()
  assert cancelled == []
  # Slot g = device × 2 + local index: local index 0 on each device first.
  assert s.busy == [seqs[0], seqs[2], seqs[1], seqs[3]] and list(s.waiting) == [seqs[4]]
  # One prefill per length bucket (16, 32, 64): each device's (local slot, prompt, sequence).
  assert [p.shape for p in prefills] == [PrefillShape(rows=2, length=16, copies=0),
                                         PrefillShape(1, 32, 0), PrefillShape(1, 64, 0)]
  assert prefills[0].slots == (((0, 0, seqs[0]), (1, 1, seqs[2])), ())
  assert prefills[1].slots == ((), ((0, 0, seqs[1]),))
  assert prefills[2].slots == ((), ((1, 0, seqs[3]),))
  assert s.stats() == {'busy': 4, 'waiting': 1}

  s.free(1, seqs[2])  # it ended: the waiting one takes its slot
  prefills, _ = s.admit()
  assert s.busy[1] is seqs[4] and not s.waiting
  assert [(p.shape, p.slots) for p in prefills] == [(PrefillShape(1, 16, 0),
                                                     (((1, 0, seqs[4]),), ()))]


def test_a_prefill_holds_at_most_prefill_tokens_a_device():
  s = _scheduler(local_slots=8, devices=1, context=64, prefill_tokens=64)
  assert (s.most_rows(16), s.most_rows(32), s.most_rows(64)) == (4, 2, 1)
  for _ in range(7):
    s.submit(_seq(12))
  prefills, _ = s.admit()
  assert [(p.shape, len(p.slots[0])) for p in prefills] == [(PrefillShape(4, 16, 0), 4),
                                                            (PrefillShape(4, 16, 0), 3)]


def test_the_sequences_of_one_prompt_share_a_device_and_its_prefill():
  """GRPO's completions of a prompt (a request's n choices): admitted together, they go to the
  device of the first while it has a free slot; the prompt is run once, the others copy it."""
  s = _scheduler(local_slots=4, devices=2)
  a, b = [_seq(5)], [_seq(9)]
  a += [_seq(5, like=a[0], stream=k) for k in (1, 2)]
  b += [_seq(9, like=b[0], stream=k) for k in (1, 2)]
  lone = _seq(7)
  for seq in [*a, *b, lone]:
    s.submit(seq)
  prefills, _ = s.admit()
  # a on device 0 (slots 0, 1, 2), b on device 1 (4, 5, 6), the last where the next free slot is.
  assert s.busy == [*a, lone, *b, None]
  (call,) = prefills  # (all pad to 16 tokens)
  # Each device runs 2 prompts at most and copies 2 of them into 2 more slots.
  assert call.shape == PrefillShape(rows=2, length=16, copies=2)
  assert call.slots == (((0, 0, a[0]), (1, 0, a[1]), (2, 0, a[2]), (3, 1, lone)),
                        ((0, 0, b[0]), (1, 0, b[1]), (2, 0, b[2])))
  # A group larger than a device's free slots goes on on the next device.
  s = _scheduler(local_slots=2, devices=2)
  group = [_seq(5)]
  group += [_seq(5, like=group[0], stream=k) for k in (1, 2)]
  for seq in group:
    s.submit(seq)
  (call,), _ = s.admit()
  assert s.busy == [group[0], group[1], group[2], None]
  assert call.shape == PrefillShape(rows=1, length=16, copies=1)


def test_a_decode_call_covers_the_busy_slots_and_their_longest_row():
  s = _scheduler(local_slots=8, devices=1, context=128, chunk=8)
  assert s.decode() is None
  short, long_ = _seq(5, new=3), _seq(30, new=20, temperature=1.0, top_p=0.9)
  for seq in (short, long_):
    s.submit(seq)
  s.admit()
  call = s.decode()
  assert call is not None
  assert call.busy == ((0, short), (1, long_)) and (call.row(0), call.row(1)) == (0, 1)
  # 2 rows (slots 0 and 1), 8 steps (long_ has 20 to go), over 30 + 8 positions: the bucket 48.
  assert (call.shape, call.steps, call.top_n) == (DecodeShape(rows=2, live=48), 8, 0)
  # short has all its tokens once this call has run: its slot takes the next sequence now; it is
  # held as finishing until its end is read.
  assert s.busy[:2] == [None, long_] and s.dispatched[1] == 8 and s.finishing == [short]
  assert s.stats() == {'busy': 2, 'waiting': 0}
  s.free(0, short)
  assert s.finishing == [] and s.busy[:2] == [None, long_]
  alternatives = _seq(5, new=4, alternatives=True)
  s.submit(alternatives)
  s.submit(_seq(5, new=10))
  s.admit()
  call = s.decode()
  # long_'s next 8 tokens, after the 8 in flight: 30 + 16 positions.
  assert call is not None and (call.shape, call.steps, call.top_n) == (
      DecodeShape(4, 48), 8, scheduler_lib.TOP_N)
  assert [g for g, _ in call.busy] == [0, 1, 2] and s.busy[0] is None
  call = s.decode()
  assert call is not None and [g for g, _ in call.busy] == [1, 2]
  assert (call.shape, call.steps, call.top_n) == (DecodeShape(4, 64), 4, 0)
  assert s.decode() is None and s.busy == [None] * 8 and len(s.finishing) == 3
  assert s.has_work() and len(s.release()) == 3 and not s.has_work()


def test_rows_of_a_call_over_several_devices():
  s = _scheduler(local_slots=4, devices=2)
  seqs = [_seq(3) for _ in range(3)]
  for seq in seqs:
    s.submit(seq)
  s.admit()  # slots 0 (device 0), 4 (device 1), 1 (device 0)
  call = s.decode()
  assert call is not None and call.shape.rows == 2
  assert [(g, call.row(g)) for g, _ in call.busy] == [(0, 0), (1, 1), (4, 2)]


def test_cancelled_sequences_are_not_admitted():
  s = _scheduler()
  gone, kept = _seq(3), _seq(3)
  s.submit(gone)
  s.submit(kept)
  gone.cancelled = True
  prefills, cancelled = s.admit()
  assert cancelled == [gone] and s.busy[0] is kept and sum(len(x) for x in prefills[0].slots) == 1


def test_submit_checks_the_context():
  s = _scheduler(context=32)
  with pytest.raises(ValueError, match='do not fit the context of 32'):
    s.submit(_seq(30, new=3))
  with pytest.raises(ValueError):
    s.submit(_seq(0))
  assert not s.submit(_seq(3, new=0)) and not s.waiting  # nothing to decode: the caller ends it


def test_stop_wakes_the_loop_returns_the_waiting_and_refuses_new_sequences():
  s = _scheduler()
  woke = []
  thread = threading.Thread(target=lambda: woke.append(s.wait()))
  thread.start()  # nothing to do: it waits
  s.submit(queued := _seq(4))
  thread.join(10)
  assert woke == [True]  # work came
  assert s.stop() == [queued] and not s.waiting
  assert not s.wait()  # stopped: the loop ends
  with pytest.raises(scheduler_lib.EngineStopped):
    s.submit(_seq(3))


def test_release_frees_every_slot():
  s = _scheduler()
  seqs = [_seq(3) for _ in range(3)]
  for seq in seqs:
    s.submit(seq)
  s.admit()
  assert s.release() == [seqs[0], seqs[2], seqs[1]] and s.busy == [None] * 4
  more = [_seq(3) for _ in range(6)]
  for seq in more:
    s.submit(seq)
  s.admit()
  assert s.release(waiting=True) == [more[0], more[2], more[1], more[3], *more[4:]]
  assert s.busy == [None] * 4 and not s.waiting


def test_a_warmup_compiles_few_programs_and_the_first_ones_cover_every_call():
  """128 slots × 256 tokens: 150 programs (327 when sampling's variants were programs of their
  own; 116 before the prefills with a copy into every slot), of which the first 6 can run any
  call that admission and decoding make; a prefill with copies, the one of its rows and length
  with a copy into every slot."""
  s = _scheduler(local_slots=128, devices=1, context=256, prefill_tokens=16384)
  covering, rest = s.programs()
  assert covering == [PrefillShape(128, 16, 128), PrefillShape(128, 32, 128),
                      PrefillShape(128, 64, 128), PrefillShape(128, 128, 128),
                      PrefillShape(64, 256, 128), DecodeShape(128, 256)]
  assert len(rest) == 2 * (8 * 4 + 7) - 5 + 8 * 9 - 1 and not set(covering) & set(rest)
  calls = []
  for n in (1, 3, 40, 100, 200):
    for k in range(300):  # some of them sharing the prompt of the one before (n choices)
      like = s.waiting[-1] if k % 4 == 0 and s.waiting else None
      s.submit(_seq(1 + k % n, new=1 + k % 50, like=like))
    while s.has_work():
      calls += s.admit()[0]
      call = s.decode()
      if call is not None:
        calls.append(call)
        for g, seq in call.busy:
          if s.busy[g] is not seq:  # every token dispatched: it ends
            s.free(g, seq)
  shapes = {call.shape for call in calls}
  assert {s.kind for s in shapes} == {'prefill', 'decode'} and any(
      s.copies for s in shapes if isinstance(s, PrefillShape))
  for shape in shapes:
    assert any(c.covers(shape) for c in covering), shape
    assert shape in rest or shape in covering or isinstance(shape, PrefillShape) and (
        PrefillShape(shape.rows, shape.length, s.local_slots) in rest + covering), shape


def test_a_shape_covers_the_shapes_of_its_kind_no_larger_in_any_field_and_costs_rows_x_tokens():
  prefill, decode = PrefillShape(rows=4, length=32, copies=2), DecodeShape(rows=4, live=32)
  assert prefill.covers(prefill) and prefill.covers(PrefillShape(1, 16, 0))
  assert not prefill.covers(PrefillShape(8, 16, 0)) and not prefill.covers(PrefillShape(1, 64, 0))
  assert not prefill.covers(PrefillShape(1, 16, 4))
  assert decode.covers(DecodeShape(4, 24)) and not decode.covers(DecodeShape(8, 16))
  assert not decode.covers(DecodeShape(2, 48))
  assert not prefill.covers(DecodeShape(1, 16)) and not decode.covers(PrefillShape(1, 16, 0))
  assert prefill.cost() == (128, (4, 32, 2, False)) and decode.cost() == (128, (4, 32))
  assert min([PrefillShape(2, 64, 0), PrefillShape(4, 16, 4), PrefillShape(4, 16, 2)],
             key=lambda s: s.cost()) == PrefillShape(4, 16, 2)
  # Hashable, equal by value, never equal across kinds; printed as the warmup reports them.
  assert len({prefill, PrefillShape(4, 32, 2), decode, DecodeShape(4, 32)}) == 2
  assert (str(prefill), str(decode)) == ('prefill 4 32 2', 'decode 4 32')


def test_a_dry_run_makes_the_calls_that_the_engine_makes():
  """Scheduler.dry_run (plan.py's GRPO rollout) against the scheduler driven as Engine.step
  drives it: admit, decode, then read the call before (its tokens to their sequences, the
  sequences with all their tokens freed), no sequence ending early."""
  s = _scheduler(local_slots=4, devices=2, context=64, chunk=8, prefill_tokens=64)
  workload = [(5, 12, 3), (20, 30, 1), (9, 3, 4), (40, 20, 2), (3, 1, 1), (17, 9, 5), (2, 40, 1)]
  dry = s.dry_run(workload)
  assert not s.has_work()  # (a scheduler of its own)
  for length, new, n in workload:
    first = _seq(length, new)
    for k in range(n):
      s.submit(_seq(length, new, like=first, stream=k) if k else first)
  calls: list = []
  pending = None
  while True:
    calls += s.admit()[0]
    last, pending = pending, s.decode()
    if pending is not None:
      calls.append(pending)
    if last is not None:
      for g, seq in last.busy:
        seq.tokens += [0] * last.steps
        if len(seq.tokens) >= seq.max_new_tokens:
          seq.finish_reason = 'length'
          s.free(g, seq)
    if pending is None and not s.has_work():
      break
  summary = lambda calls: [
      (c.shape, c.steps, [g for g, _ in c.busy]) if isinstance(c, scheduler_lib.Decode) else
      (c.shape, [[(j, i) for j, i, _ in x] for x in c.slots]) for c in calls]
  assert summary(dry) == summary(calls)
  decodes = [c for c in calls if isinstance(c, scheduler_lib.Decode)]
  assert len(decodes) > len(workload) and len({c.shape for c in decodes}) > 3
  # The dry run's sequences: the workload's, each decoding its max_new_tokens.
  assert sorted((len(seq.prompt), seq.max_new_tokens) for c in dry
                if isinstance(c, scheduler_lib.Prefill) for x in c.slots for _, _, seq in x) == (
      sorted((length, new) for length, new, n in workload for _ in range(n)))


def test_after_a_warmup_a_call_runs_as_its_smallest_ready_cover_and_its_own_compiles_first():
  compiled, started, gate = [], threading.Event(), threading.Event()

  def compile(shape):
    if compiled:  # the background compiler's: held until the test lets it go
      started.set()
      gate.wait()
    compiled.append(shape)
    return shape

  p = programs.Programs(compile)
  assert p.fit(DecodeShape(2, 16)) == DecodeShape(2, 16)  # before a warmup: compiled at the call
  lines = []
  p.warmup([DecodeShape(8, 64)], [DecodeShape(4, 32), DecodeShape(2, 16), DecodeShape(8, 32)],
           background=True, report=lines.append)
  assert compiled == [DecodeShape(8, 64)] and p.warm
  started.wait()  # compiling DecodeShape(4, 32)
  assert p.pending() == 3
  assert p.fit(DecodeShape(1, 20)) == DecodeShape(8, 64)  # the only cover ready
  gate.set()
  p.join()
  # The shape traffic asked for goes next.
  assert compiled == [DecodeShape(8, 64), DecodeShape(4, 32), DecodeShape(1, 20),
                      DecodeShape(2, 16), DecodeShape(8, 32)]
  assert lines[-1].startswith('warmup: 5/5 programs compiled (decode 8 32)')
  assert p.fit(DecodeShape(1, 20)) == DecodeShape(1, 20) and p.pending() == 0
  assert p.fit(DecodeShape(3, 17)) == DecodeShape(4, 32)  # the smallest cover, its own queued
  p.join()
  assert compiled[-1] == DecodeShape(3, 17) and p.pending() == 0


def test_calls_fitted_while_the_background_compiler_adds_programs_never_fail():
  """The engine thread fits calls (reading the ready programs) while the compiler thread adds
  them: many times, with the interpreter switching threads as often as it can."""
  def compile(shape):
    time.sleep(1e-5)  # (as XLA does, the compiler gives up the GIL while it compiles)
    return shape

  p = programs.Programs(compile)
  p.warmup([DecodeShape(4096, 4096)], [DecodeShape(r, 1) for r in range(1, 1000)],
           background=True, report=lambda line: None)
  calls = [DecodeShape(1 + i % 1000, 2 + i // 1000) for i in range(5000)]  # each a new shape
  switch = sys.getswitchinterval()
  sys.setswitchinterval(1e-6)
  try:
    fitted = [p.fit(call) for call in calls]
  finally:
    sys.setswitchinterval(switch)
    p.stop()
  assert all(f.covers(call) for f, call in zip(fitted, calls))


def _warm(compile) -> programs.Programs:
  """Programs after a warmup of one covering decode (nothing left in the background)."""
  p = programs.Programs(compile)
  p.warmup([DecodeShape(8, 64)], [], background=True, report=lambda line: None)
  return p


def test_a_shape_that_cannot_compile_is_tried_once_and_its_calls_run_as_a_cover():
  tried = []

  def compile(shape):
    tried.append(shape)
    if shape == DecodeShape(2, 16):
      raise RuntimeError('cannot compile')
    return shape

  p = _warm(compile)
  for _ in range(50):
    assert p.fit(DecodeShape(2, 16)) == DecodeShape(8, 64)
    p.join()
  assert tried == [DecodeShape(8, 64), DecodeShape(2, 16)] and p.pending() == 0


def test_a_shape_queued_as_the_background_compiler_ends_starts_it_again(monkeypatch):
  """The compiler's thread has looked at its queue for the last time but not ended yet when a
  call queues a new shape: that shape is compiled all the same (the window held open)."""
  looked, go = threading.Event(), threading.Event()
  run = programs.Programs._run  # noqa: SLF001

  def ending(self):
    run(self)
    if threading.current_thread().name == 'engine-compiler' and not looked.is_set():
      looked.set()  # past its last look at the queue, still alive
      go.wait(60)

  monkeypatch.setattr(programs.Programs, '_run', ending)
  p = _warm(lambda shape: shape)
  assert p.fit(DecodeShape(2, 16)) == DecodeShape(8, 64)  # starts the compiler
  assert looked.wait(60)
  assert p.fit(DecodeShape(4, 16)) == DecodeShape(8, 64)  # queued in the window
  go.set()
  deadline = time.monotonic() + 60
  while DecodeShape(4, 16) not in p.ready:
    assert time.monotonic() < deadline, 'the shape queued in the window was never compiled'
    time.sleep(0.01)
  assert p.pending() == 0


def test_a_prefill_with_copies_runs_as_the_warm_one_of_its_rows_and_length_and_compiles_nothing():
  """Its own program would be lowered under traffic (holding the GIL); padded copies write
  nothing, so the warmup's prefill of the same rows and length with a copy into every slot runs
  it as well."""
  s = _scheduler(local_slots=4, devices=1, context=64, prefill_tokens=64)
  covering, rest = s.programs()
  assert PrefillShape(1, 16, 4) in rest and PrefillShape(1, 32, 4) in rest
  p = programs.Programs(lambda shape: shape)
  p.warmup(covering, rest, background=False, report=lambda line: None)
  first = _seq(20)
  for seq in (first, _seq(0, like=first), _seq(0, like=first)):
    s.submit(seq)
  [call] = s.admit()[0]
  assert call.shape == PrefillShape(1, 32, 2)
  assert p.fit(call.shape) == PrefillShape(1, 32, 4) and p.pending() == 0


def test_prompts_sharing_a_cached_prefix_reuse_it_within_prefill_tokens_of_attended_positions():
  """Prefix caching without a model: a finished sequence's slot holds its prompt; five prompts
  sharing its first 40 tokens reuse 32 of them (whole blocks), the first in that slot, the others
  copying its row; a prefix prefill's row counts as the context's positions (its attention reads
  them): 256 // 128 = 2 prompts a call."""
  s = scheduler_lib.Scheduler(local_slots=8, devices=1, context=128, chunk=8, prefill_tokens=256,
                              prefix_cache=True)
  assert (s.most_rows(16), s.most_rows(16, prefix=True)) == (8, 2)
  system = [5] * 40
  first = Sequence(prompt=[*system, 1], max_new_tokens=4)
  s.submit(first)
  assert [p.shape for p in s.admit()[0]] == [PrefillShape(1, 64, 0)]
  s.free(0, first)
  seqs = [Sequence(prompt=[*system, k, k, k], max_new_tokens=4) for k in range(2, 7)]
  for seq in seqs:
    s.submit(seq)
  prefills, _ = s.admit()
  assert [q.cached_tokens for q in seqs] == [32] * 5 and s.busy[:5] == seqs
  assert [(p.shape, len(p.slots[0]), p.sources) for p in prefills] == [
      (PrefillShape(2, 16, 0, prefix=True), 2, ((0, 0),)),
      (PrefillShape(2, 16, 0, prefix=True), 2, ((0, 0),)),
      (PrefillShape(1, 16, 0, prefix=True), 1, ((0,),))]


def test_the_prefix_cache_places_new_prompts_within_the_rows_decoding_runs():
  """8 slots each holding a cached prompt, freed from the last to the first (slot 7's the least
  recently used): two new prompts that match none take slots 0 and 1, so their decode calls run
  2 rows, not slot 7's 8 as recency alone would choose; with slots 2-3 taken again, a new one
  takes slot 0 (of the fewest rows), though slot 1 is the least recently used."""
  s = scheduler_lib.Scheduler(local_slots=8, devices=1, context=128, chunk=8, prefill_tokens=1024,
                              prefix_cache=True)
  old = [Sequence(prompt=[k] * 20, max_new_tokens=4) for k in range(1, 9)]
  for seq in old:
    s.submit(seq)
  s.admit()
  assert s.busy == old
  for g in reversed(range(8)):
    s.free(g, old[g])
  new = [Sequence(prompt=[k] * 20, max_new_tokens=4) for k in (20, 21)]
  for seq in new:
    s.submit(seq)
  s.admit()
  assert s.busy[:2] == new and s.decode().shape.rows == 2
  s.free(1, new[1])
  s.free(0, new[0])
  again = [Sequence(prompt=[*old[g].prompt, 9], max_new_tokens=4) for g in (2, 3)]
  for seq in again:
    s.submit(seq)
  s.admit()
  assert s.busy[2:4] == again  # (their cached prefixes reused in place: 4 rows decoding)
  third = Sequence(prompt=[22] * 20, max_new_tokens=4)
  s.submit(third)
  s.admit()
  assert s.busy[0] is third
