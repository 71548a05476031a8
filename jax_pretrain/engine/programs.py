"""The engine's compiled programs: one per call shape (scheduler.PrefillShape, DecodeShape: a
Prefill's or a Decode's), compiled ahead of time and kept.

Without a warmup a shape is compiled when a call first asks for it (the call waits). Warmup
(Engine.warmup) compiles the covering programs first (Scheduler.programs: per prompt length
bucket its largest prefill with every copy, and the decode of every slot over the whole context),
which can run any call padded (more rows, longer prompts, more copies, a wider window: padding
rows write nothing, pad positions are overwritten before they are read, masked positions weigh
nothing); then the others, in the background or before it returns. From then on no call waits for
a compile: a call whose own shape is not ready runs as the smallest ready program that covers it
(`fit`), and its shape goes to the front of the background compiler's queue (what traffic asks
for first); once compiled, calls of that shape run as themselves. A prefill with copies runs as
the warmed-up one of its rows and length with a copy into every slot (the padding copies write
nothing; the prompts' run is the same): its own shape is not compiled, as lowering a program holds
the GIL for a while (the server's event loop waits meanwhile). Padding changes the numbers
only by float rounding (other shapes sum in other orders).

The background compiler is one thread: it lowers and compiles one shape at a time (XLA compiles
outside the GIL) and reports its progress with an ETA. A shape that fails to compile is logged
once and never tried again (its calls keep running as a cover); a shape queued while the thread
is ending starts a new one (`_running` says whether one will still look at the queue).

Over several processes (a mesh whose devices belong to more than one) every process must run the
same program at each call, and what a background compiler has finished differs between them: there
the warmup compiles every program before it returns, and a call whose shape was not warmed up runs
as itself (compiled at the call, by every process alike), never as a cover chosen by timing.
"""
from collections.abc import Callable
import threading
import time
from typing import Any, TypeVar

from absl import logging

from jax_pretrain.engine.scheduler import DecodeShape
from jax_pretrain.engine.scheduler import PrefillShape
from jax_pretrain.engine.scheduler import Shape

ShapeT = TypeVar('ShapeT', PrefillShape, DecodeShape)


class Programs:
  """The compiled program of each shape (the module docstring). compile: lowers and compiles a
  shape (ModelRunner.lower(shape).compile)."""

  def __init__(self, compile: Callable[[Shape], Any], processes: int = 1):
    self._compile = compile
    self._processes = processes  # the mesh's (the module docstring: several, no background)
    self.ready: dict[Shape, Any] = {}
    self.warm = False  # after a warmup: calls never wait for a compile (fit)
    self._queue: list[Shape] = []  # shapes the background compiler is to compile, next first
    self._lock = threading.Condition()
    self._thread: threading.Thread | None = None
    self._running = False  # a background thread will look at the queue again (set under the lock)
    self._stopping = False
    self.failed: set[Shape] = set()  # shapes whose compile raised: not tried again
    self._report: Callable[[str], None] = lambda line: None
    self._done, self._total, self._t0 = 0, 0, 0.0
    self._compiling: Shape | None = None  # what the background compiler compiles now

  def get(self, shape: Shape):
    """The program of this shape, compiled now if it is not ready."""
    program = self.ready.get(shape)
    if program is None:
      program = self._compile(shape)
      self._add(shape, program)
    return program

  def _add(self, shape: Shape, program) -> None:
    """Makes a compiled program ready. `ready` is written only here, under the lock that `fit`
    reads it under (the background compiler's thread and the engine's share it)."""
    with self._lock:
      self.ready[shape] = program

  def fit(self, shape: ShapeT) -> ShapeT:
    """The shape a call of `shape` runs as: itself once ready (or when not warm: compiled at the
    call); else the smallest ready shape that covers it, and unless that one computes as much (a
    prefill padded in copies alone), it goes first in the queue."""
    if not self.warm or shape in self.ready or self._processes > 1:
      return shape
    with self._lock:
      ready = [s for s in self.ready if isinstance(s, type(shape)) and s.covers(shape)]
      cover = min(ready, key=lambda s: s.cost()) if ready else shape
      # A cover that computes as much (a prefill's rows and length: only copies padded, which
      # write nothing) is as good as the shape's own: not compiled, nothing lowered under traffic.
      if (shape != self._compiling and shape not in self.failed
          and (not ready or cover.cost()[0] > shape.cost()[0])):
        if shape in self._queue:
          self._queue.remove(shape)
        else:
          self._total += 1
        self._queue.insert(0, shape)
        self._start()
    return cover

  def warmup(self, covering: list[Shape], rest: list[Shape], background: bool,
             report: Callable[[str], None]) -> None:
    """Compiles `covering` now, then `rest` (in the background, or now), reporting each with the
    count, the time so far and an ETA; calls never wait for a compile from then on. Over several
    processes, all of them now (the module docstring)."""
    if background and self._processes > 1:
      report(f'warmup: the mesh spans {self._processes} processes, so every program compiles '
             'before serving (the same program on each at every call)')
      background = False
    self._report, self._done, self._t0 = report, 0, time.perf_counter()
    todo = [s for s in covering if s not in self.ready]
    later = [s for s in rest if s not in self.ready and s not in covering]
    self._total = len(todo) + len(later)
    for shape in todo + ([] if background else later):
      self._add(shape, self._compile(shape))
      self._progress(shape)
    self.warm = True
    if background and later:
      with self._lock:
        self._queue += later
        self._start()
      report(f'warmup: {len(todo)} covering programs ready in {self._elapsed():.1f}s (any call '
             f'runs padded to one); {len(later)} more compiling in the background')

  def pending(self) -> int:
    """Shapes queued for the background compiler (the one it is compiling included)."""
    return len(self._queue) + (self._compiling is not None)

  def stop(self, wait: bool = True, timeout: float | None = None) -> bool:
    """Stops the background compiler after the program it is compiling (`wait`: for it, timeout
    seconds at most); returns whether it has ended (False: still inside a compile)."""
    with self._lock:
      self._stopping = True
      self._queue.clear()
    if wait and self._thread is not None:
      self._thread.join(timeout)
    return self._thread is None or not self._thread.is_alive()

  def join(self) -> None:
    """Waits until the background compiler has compiled every queued shape."""
    while self._thread is not None and self._thread.is_alive():
      self._thread.join()

  def _start(self) -> None:
    """Starts the background compiler unless one runs that will look at the queue again (the
    caller holds the lock): not is_alive(), which a thread past its last look still is."""
    if not self._running and not self._stopping:
      self._running = True
      self._thread = threading.Thread(target=self._run, name='engine-compiler', daemon=True)
      self._thread.start()

  def _run(self) -> None:
    while True:
      with self._lock:
        if self._stopping or not self._queue:
          self._compiling, self._running = None, False
          return
        shape = self._compiling = self._queue.pop(0)
      if shape not in self.ready:
        try:
          self._add(shape, self._compile(shape))
        except Exception:  # noqa: BLE001 (its calls keep running as a cover)
          logging.exception('the engine could not compile %s: its calls run as a cover', shape)
          with self._lock:
            self.failed.add(shape)
          continue
        self._progress(shape)

  def _elapsed(self) -> float:
    return time.perf_counter() - self._t0

  def _progress(self, shape: Shape) -> None:
    self._done += 1
    s = self._elapsed()
    eta = s / self._done * max(0, self._total - self._done)
    self._report(f'warmup: {self._done}/{self._total} programs compiled '
                 f'({shape}), {s:.1f}s, ETA {eta:.0f}s')
