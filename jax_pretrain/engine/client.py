"""The engine for an asyncio server (vLLM v1's AsyncLLM): the engine's supervised thread, and each
request's life on it, for the OpenAI layer (serve.py) to render.

  client = EngineClient(engine, max_queued=256)
  client.start()                                     # run_forever in a thread of its own
  request = client.submit(sequences, stream=True)    # on the event loop: QueueFull, Stopped
  async for update in request.updates(): ...         # Update: a sequence's new state
  request.cancel()                                   # its client went away
  client.give_up()                                   # the shutdown's deadline
  client.stop()

A request's life is one Request: its sequences; their Updates, which the engine's thread reports
(a snapshot of a sequence when reported: the engine goes on appending to it), the latest of each
sequence kept until the reader takes it (a slow reader's pending updates are merged: memory stays
bounded however far it falls behind); and its end: every sequence ended (updates() returns), one
failed (Failed: the engine logged why, and its text is no client's), the engine stopped before it
finished or the shutdown's deadline passed (Stopped), or the request was cancelled (its client
went away, or got its answer: its sequences still waiting leave the queue at once, giving their
places back; those decoding leave the engine at its next chunk). A report that comes after the
event loop closed (a step that outlived the shutdown) goes nowhere.

Backpressure: the sequences waiting for a slot, over all requests, are max_queued at most; a
request whose sequences would pass it is refused whole (QueueFull). submit checks and queues with
no await between: two requests on one event loop cannot both take the last places.

Health: not_running() says why the engine serves no request (it failed, it is stopping, its thread
ended), stalled_for() how long it has had work without generating a token (a step that hangs
raises nothing); the stall clock of an idle engine starts at a submit or a look.
"""
import asyncio
from collections.abc import AsyncIterator
from collections.abc import Callable
import dataclasses
import functools
import threading
import time
import weakref

from absl import logging

from jax_pretrain.engine.core import Engine
from jax_pretrain.engine.scheduler import EngineStopped
from jax_pretrain.engine.sequence import STOPPED
from jax_pretrain.engine.sequence import Sequence

JOIN_S = 2.0  # stop() waits this long at most for the engine's thread (a step may hang)
POLL_S = 1.0  # a request looks at its sequences this often, update or not


class QueueFull(Exception):
  """The queue has no room for a request's sequences."""


class Stopped(Exception):
  """The engine stopped (or the shutdown's deadline passed) before the request finished."""

  def __init__(self):
    super().__init__('the engine stopped before this request finished')


class Failed(Exception):
  """A sequence of the request failed; the message is the engine's error (for the log only)."""


@dataclasses.dataclass(frozen=True)
class Update:
  """A sequence's state when the engine reported it: which of the request's sequences (index),
  its text that later tokens will not change (Sequence.stable_text), its token count then and its
  finish reason. A stream sends one chunk per update, so the text arrives as it is decoded."""
  index: int
  seq: Sequence
  text: str
  n_tokens: int
  finish: str | None

  @classmethod
  def of(cls, index: int, seq: Sequence) -> 'Update':
    return cls(index, seq, seq.stable_text(), len(seq.tokens), seq.finish_reason)


class Request:
  """One request's sequences on the engine, from submit to their ends (the module docstring).
  stream: every update is reported, else only each sequence's end. withdraw: the engine's
  cancel (Engine.cancel)."""

  def __init__(self, sequences: list[Sequence], stream: bool,
               withdraw: Callable[[list[Sequence]], None] = lambda sequences: None):
    self.sequences, self.stream, self._withdraw = sequences, stream, withdraw
    self._loop = asyncio.get_running_loop()
    # Each sequence's latest update not yet taken by updates(), in the order of their first
    # arrival: a reader that falls behind finds one update per sequence (its whole state then),
    # never a queue of them each carrying the whole text so far.
    self._pending: dict[int, Update] = {}
    self._arrived = asyncio.Event()
    self._stopped = False
    for i, seq in enumerate(sequences):
      seq.on_update = functools.partial(self._reported, i)

  def _reported(self, index: int, seq: Sequence) -> None:
    """The sequences' callback, in the engine's thread."""
    if self.stream or seq.done:
      try:
        self._loop.call_soon_threadsafe(self._arrive, Update.of(index, seq))
      except RuntimeError:  # the event loop has closed (a step held past the shutdown): nobody
        pass  # waits for this request any more

  def _arrive(self, update: Update) -> None:
    self._pending[update.index] = update  # (a later update of a sequence replaces its last one)
    self._arrived.set()

  def give_up(self) -> None:
    """The shutdown's deadline (on the event loop): the request raises Stopped now."""
    self._stopped = True
    self._arrived.set()

  def cancel(self) -> None:
    """The request is over for its client (it went away, or it has its answer): its sequences
    report nothing more (which also frees the request without a garbage collection: no cycle
    through their callbacks is left), those still waiting leave the queue now (their places are
    free for the next request) and those decoding at their next chunk."""
    for seq in self.sequences:
      seq.on_update = None
    self._withdraw([seq for seq in self.sequences if not seq.done])

  async def _next(self) -> Update | None:
    """The next pending update (None: POLL_S passed without one). Raises Stopped after
    give_up."""
    if not self._pending and not self._stopped:
      self._arrived.clear()
      try:
        await asyncio.wait_for(self._arrived.wait(), POLL_S)
      except TimeoutError:
        pass
    if self._stopped:
      raise Stopped()
    if not self._pending:
      return None
    return self._pending.pop(next(iter(self._pending)))

  async def updates(self) -> AsyncIterator[Update]:
    """The updates, in order for each sequence (a reader that falls behind gets the latest
    state of each, the ones between merged), until every sequence has ended (an end: its update
    has finish). Raises Stopped when the engine stopped before a sequence ended or at give_up,
    Failed when one failed."""
    ended: set[int] = set()
    while len(ended) < len(self.sequences):
      event = await self._next()
      if event is None:  # no word: a sequence may have ended without one (its callback failed)
        event = next((Update.of(i, seq) for i, seq in enumerate(self.sequences)
                      if seq.done and i not in ended), None)
      if event is None or event.index in ended:
        continue
      if event.finish == 'error':
        raise Stopped() if event.seq.error == STOPPED else Failed(event.seq.error)
      if event.finish is not None:
        ended.add(event.index)
      yield event

  async def result(self) -> list[Sequence]:
    """The sequences, once every one has ended (updates()' exceptions)."""
    async for _ in self.updates():
      pass
    return self.sequences


class EngineClient:
  """The engine, run_forever in a thread of its own (started by start()), for requests submitted
  on an event loop; max_queued: the sequences waiting for a slot at most (the module docstring).
  Should the thread end on its own (the engine gave up after failing steps), the error is logged
  and kept (failure) and on_failure called (the server exits)."""

  def __init__(self, engine: Engine, *, max_queued: int):
    self.engine, self.max_queued = engine, max_queued
    self.failure: BaseException | None = None
    self.on_failure: Callable[[], None] = lambda: None
    self._thread = threading.Thread(target=self._run, name='engine', daemon=True)
    self._requests: weakref.WeakSet[Request] = weakref.WeakSet()  # (for give_up)
    # The engine's tokens_generated when last looked at, and since when it has not moved while
    # the engine had work (the time it was last seen to move, or idle).
    self._tokens, self._progress_at = -1, time.monotonic()

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    """Stops the engine: the sequences still waiting fail at once, those decoding after the
    current chunk (Stopped), and submit refuses new ones. Waits JOIN_S at most for the engine's
    thread (a daemon: a step that hangs does not keep the process)."""
    self.engine.stop()
    if self._thread.is_alive():
      self._thread.join(timeout=JOIN_S)

  def give_up(self) -> None:
    """The shutdown's deadline (on the event loop): stops the engine, and every request raises
    Stopped now, whether or not the engine's current step ever ends."""
    self.engine.stop()
    for request in list(self._requests):
      request.give_up()

  def queue_room(self) -> int:
    """Sequences the queue takes before a request is refused."""
    return self.max_queued - self.engine.queued

  def submit(self, sequences: list[Sequence], stream: bool) -> Request:
    """Queues a request's sequences (on the event loop), or none of them: QueueFull when they
    would take the queue past max_queued, Stopped once the engine is stopped."""
    self.stalled_for()  # an engine that was idle starts its stall clock now
    if len(sequences) > self.queue_room():
      raise QueueFull()
    request = Request(sequences, stream, self.engine.cancel)
    try:
      for seq in sequences:
        self.engine.submit(seq)
    except EngineStopped:
      request.cancel()
      raise Stopped() from None
    self._requests.add(request)
    return request

  def stalled_for(self) -> float:
    """Seconds the engine has had work without generating a token (0 while idle or moving)."""
    stats, now = self.engine.stats(), time.monotonic()
    if not (stats['busy'] or stats['waiting']) or stats['tokens_generated'] != self._tokens:
      self._tokens, self._progress_at = stats['tokens_generated'], now
    return now - self._progress_at

  def not_running(self) -> str | None:
    """Why the engine serves no request, or None while it does."""
    if self.failure is not None:
      return "the engine failed and stopped (the server's log says why)"
    if self.engine.stopped:
      return 'the server is stopping'
    if not self._thread.is_alive():
      return 'the engine is not running'
    return None

  def _run(self) -> None:
    try:
      self.engine.run_forever()
    except BaseException as e:  # noqa: BLE001  (logged, then the server exits)
      self.failure = e
      logging.exception('the engine stopped: %s', e)
      self.on_failure()
