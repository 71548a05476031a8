"""The engine's loop: Engine puts the scheduler, the model runner and the output processor
together, runs them (generate, or run_forever in a thread of its own) and owns the failure policy.

A step: the scheduler admits waiting sequences into free slots and the runner prefills them; the
scheduler plans one decode call of every busy slot (up to `chunk` tokens each) and the runner
dispatches it; then the host reads the call dispatched at the step before, and the output
processor appends each row's tokens to its sequence; the slots of the sequences that ended are
freed for the next step. So the device never waits for the host: while it runs a call, the host
reads, detokenizes and reports the tokens of the one before and plans the next. The device stops a
row at EOS and at its max_new_tokens (runner.Rows): the next call, dispatched before the host knew,
runs it no further, and the host frees its slot at the read. A stop string or a cancellation is
found by the host: the call in flight still decodes that row, and its tokens are dropped. A slot
whose sequence has every token dispatched takes the next sequence at once (the device prefills it
after the calls before).

Constrained decoding (engine/grammar.py): while a busy sequence keeps a grammar, a decode call
runs one step, and the host reads the call before it first (no overlap): each constrained row's
mask (runner.masks) comes from its matcher after its last token, and a sequence whose grammar is
complete has ended (output.py) before the next call is planned. Free rows decode beside them,
one token a call, as they would alone.

Failures (run_forever, the server's loop): an exception in one sequence's host-side handling (its
detokenization, its stop strings, its on_update callback) fails that sequence only and is no
failure of the step (engine/output.py). A step that raises (a compiled prefill or decode, or the
host work between them) fails the sequences of that call, and the engine goes on with a fresh
cache; after MAX_FAILURES steps failed in a row (nothing decoded between them: the device or the
program is broken, not one request) run_forever gives up: it raises EngineFailed, for its caller
to exit. However run_forever ends (stop(), giving up), every sequence it held or that still waits
ends with 'error' and STOPPED, and submit refuses new ones (EngineStopped): nothing is left
waiting. A generate() that raises fails its sequences and leaves the engine as new (slots free,
nothing queued, a fresh cache), for the next call.
"""
from collections.abc import Callable

from absl import logging
from jax.sharding import Mesh

from jax_pretrain import model as model_lib
from jax_pretrain.engine import output as output_lib
from jax_pretrain.engine import runner as runner_lib
from jax_pretrain.engine import scheduler as scheduler_lib
from jax_pretrain.engine.sequence import STOPPED
from jax_pretrain.engine.sequence import Sequence

MAX_FAILURES = 3  # steps failing in a row after which run_forever gives up
# The engine's sizes by default, the server's too (serve's --slots and --chunk; plan --serve's):
SLOTS = 16  # sequences decoded together at most (the KV cache's rows)
CHUNK = 8  # decoding steps per call at most
PREFILL_TOKENS = 16384  # prompt tokens per device per prefill call at most


class EngineFailed(RuntimeError):
  """run_forever gave up: MAX_FAILURES steps failed in a row (the last one is the __cause__)."""


class Engine:
  """Continuous batching over a bounded KV cache (the package's docstring).

  Two ways to drive it: `generate(sequences)` runs them to the end in the calling thread (the
  harness, GRPO); `run_forever()` in a thread of its own serves sequences that any thread
  `submit`s (the server), calling each sequence's on_update from that thread.

  params: the model's (float32, stacked layers, on their devices) or None, set later with
  set_params; mesh: the devices that decode (default: those of the params, else the first
  device); slots: over all of them (rounded up to a multiple of the device count); chunk: decoding
  steps per call at most; prefill_tokens: prompt tokens per device per prefill call at most (its
  activations are [rows, P, mlp]); kv_cache_dtype: 'auto' (the compute dtype), 'fp8' or 'int8'
  (model.KV_CACHE_DTYPES: 8 bits with a scale per head and position); eos_ids: ids that end a
  sequence besides the tokenizer's EOS (a generation_config.json's: an instruct model's
  end-of-turn), ended as EOS ends it; prefix_cache: a new prompt reuses the keys and values of the
  longest cached prefix of it that a slot holds (engine/scheduler.py; new params forget them).
  """

  def __init__(self, model_config: model_lib.ModelConfig, params, tokenizer, *,
               slots: int = SLOTS, context: int, chunk: int = CHUNK,
               prefill_tokens: int = PREFILL_TOKENS,
               mesh: Mesh | None = None, kv_cache_dtype: str = 'auto',
               eos_ids: tuple[int, ...] = (), prefix_cache: bool = True):
    self.tokenizer = tokenizer
    self.runner = runner_lib.ModelRunner(model_config, params, tokenizer, slots=slots,
                                         context=context, chunk=chunk, mesh=mesh,
                                         kv_cache_dtype=kv_cache_dtype, eos_ids=eos_ids)
    r = self.runner
    self.model, self.mesh, self.devices, self.local_slots = r.model, r.mesh, r.devices, (
        r.local_slots)
    self.slots, self.context, self.chunk = r.slots, context, chunk
    self.scheduler = scheduler_lib.Scheduler(
        local_slots=r.local_slots, devices=r.devices, context=context, chunk=chunk,
        prefill_tokens=max(prefill_tokens, context), prefix_cache=prefix_cache)
    self.output = output_lib.OutputProcessor(tokenizer, runner_lib.end_ids(tokenizer, eos_ids))
    self._pending: tuple[scheduler_lib.Decode, list] | None = None  # dispatched, not read yet

  @property
  def params(self):
    """The runner's copy of the params (decoding_params), or None."""
    return self.runner.params

  @property
  def shapes(self) -> set[scheduler_lib.Shape]:
    """The shapes compiled so far (engine/programs.py)."""
    return set(self.runner.programs.ready)

  @property
  def tokens_generated(self) -> int:
    return self.output.tokens_generated

  def set_params(self, params) -> None:
    """Takes new params (the model's, or abstract ones for lowering; None frees the copy); the
    cached prefixes, the old params' keys and values, are forgotten."""
    self.runner.set_params(params)
    self.scheduler.prefix.forget()

  def warmup(self, background: bool = False,
             report: Callable[[str], None] = lambda line: None) -> None:
    """Compiles the programs that cover every call, then the others that traffic asks for
    (Scheduler.programs): in a background thread with `background`, else before it returns; no
    call waits for a compile from then on (engine/programs.py). report: a progress line per
    program (the count, the time so far, an ETA)."""
    self.runner.programs.warmup(*self.scheduler.programs(), background=background, report=report)

  def submit(self, seq: Sequence) -> None:
    """Queues a sequence (thread-safe). Its prompt and max_new_tokens must fit the context; once
    the engine is stopped (stop(), or run_forever ended) raises EngineStopped."""
    if not self.scheduler.submit(seq):
      output_lib.finish(seq, 'length')

  def cancel(self, sequences: list[Sequence]) -> None:
    """Cancels sequences (thread-safe): those still waiting leave the queue and end now
    ('cancelled'), those decoding at the engine's next chunk."""
    for seq in sequences:
      seq.cancelled = True
    for seq in self.scheduler.withdraw(sequences):
      output_lib.finish(seq, 'cancelled')

  @property
  def queued(self) -> int:
    """Sequences waiting for a slot (read from any thread: the server's backpressure)."""
    return len(self.scheduler.waiting)

  @property
  def stopped(self) -> bool:
    """Whether stop() was called or run_forever ended: submit refuses."""
    return self.scheduler.stopping

  def stats(self) -> dict:
    return {'slots': self.slots, 'devices': self.devices, 'context': self.context,
            **self.scheduler.stats(), 'compiled_shapes': len(self.shapes),
            'compiling_shapes': self.runner.programs.pending(),
            'prompts_prefilled': self.runner.prompts_prefilled,
            'cached_tokens': self.scheduler.prefix.cached_tokens,
            'tokens_generated': self.tokens_generated}

  def generate(self, sequences: list[Sequence]) -> list[Sequence]:
    """Decodes the sequences to their ends in this thread (no run_forever beside it). Should it
    raise (a step, a prompt that does not fit), every sequence it held or queued ends with
    'error' and the engine is left as new: its slots free, nothing waiting, a fresh cache."""
    try:
      for seq in sequences:
        self.submit(seq)
      while self.step():
        pass
    except BaseException as e:
      for seq in [*self._abandon(waiting=True), *sequences]:
        output_lib.fail(seq, f'{type(e).__name__}: {e}')
      raise
    return sequences

  def run_forever(self, max_failures: int = MAX_FAILURES) -> None:
    """Serves submitted sequences until stop(). A step that raises fails the sequences it held
    (their error: the exception's type and text; the traceback logged) and the engine goes on
    with a fresh cache; after max_failures such steps in a row (none succeeding between them) it
    gives up: raises EngineFailed. However it ends, the sequences it held or that still wait end
    with STOPPED, and submit refuses new ones."""
    failures = 0
    try:
      while self.scheduler.wait():
        try:
          self.step()
          failures = 0
        except Exception as e:  # fails the sequences of this call only
          failures += 1
          held = self._abandon()
          logging.exception('an engine step failed (%d in a row): its %d sequences fail',
                            failures, len(held))
          for seq in held:
            output_lib.fail(seq, f'{type(e).__name__}: {e}')
          if failures >= max_failures:
            raise EngineFailed(f'{failures} engine steps failed in a row') from e
    finally:
      self.runner.programs.stop(wait=False)  # (a shutdown does not wait for a compile)
      for seq in [*self.scheduler.stop(), *self._abandon()]:
        output_lib.fail(seq, STOPPED)

  def close(self, timeout: float | None = None) -> bool:
    """Ends the engine's own thread: the background compiler stops after the program it is
    compiling, and is joined, `timeout` seconds at most. Returns whether it ended: False while it
    is still inside XLA, where the interpreter's exit would abort the process (serve exits at
    once, without it). The engine still runs calls after it, compiling each at its first use."""
    return self.runner.programs.stop(wait=True, timeout=timeout)

  def stop(self) -> None:
    """Ends run_forever after its current step (thread-safe): the sequences still waiting fail
    now (STOPPED), the busy ones when that step ends; submit refuses new ones."""
    for seq in self.scheduler.stop():
      output_lib.fail(seq, STOPPED)

  def step(self) -> bool:
    """Admits waiting sequences into free slots and prefills them, dispatches the next decode call
    of the busy slots, then reads the call dispatched before it: the host's work on those tokens
    overlaps the device's on the next ones. Returns whether anything is left to do."""
    prefills, cancelled = self.scheduler.admit()
    for seq in cancelled:
      output_lib.finish(seq, 'cancelled')
    for prefill in prefills:
      self.runner.prefill(self.runner.fit(prefill))
    last, self._pending = self._pending, None
    if last is not None and self.scheduler.constrained():
      self._read(*last)  # (a grammar's next mask needs the token before: no overlap)
      last = None
    call = self.scheduler.decode()
    if call is not None:
      call = self.runner.fit(call)
      self._pending = call, self.runner.decode(call)
    if last is not None:
      self._read(*last)
    if self._pending is not None and all(seq.done for _, seq in self._pending[0].busy):
      self._pending = None  # (its tokens belong to no sequence any more: not read)
    return self._pending is not None or self.scheduler.has_work()

  def _read(self, call: scheduler_lib.Decode, out: list) -> None:
    """A decode call's tokens into its sequences; the slots of those that ended are freed. A
    sequence that ended at an earlier read (its slot may hold another one now) is skipped."""
    tokens_RxC, logprobs_RxC, *top = self.runner.read(out)
    for g, seq in call.busy:
      if seq.done:
        continue
      q = call.row(g)
      self.output.extend(seq, tokens_RxC[q, :call.steps], logprobs_RxC[q],
                         *((top[0][q], top[1][q]) if top and seq.alternatives else (None, None)))
      if seq.done:
        self.scheduler.free(g, seq)

  def _abandon(self, waiting: bool = False) -> list[Sequence]:
    """Drops the call in flight and the device's state (a failed call may have taken its donated
    buffers: the next starts afresh) and frees every slot (with `waiting`, empties the queue);
    returns the sequences the scheduler held (then those that waited), for the caller to end."""
    self._pending = None
    self.runner.reset()
    return self.scheduler.release(waiting)

  def score(self, tokens_BxT1, top_n: int = 0):
    """token_logprobs with the engine's params (on its devices)."""
    return self.runner.score(tokens_BxT1, top_n)

  def lower_prefill(self, rows: int, length: int, copies: int = 0):
    """ModelRunner.lower_prefill: the prefill call lowered on abstract shapes (plan.py)."""
    return self.runner.lower_prefill(rows, length, copies)

  def lower_decode(self, rows: int, live: int):
    """ModelRunner.lower_decode: the decode call lowered on abstract shapes (plan.py)."""
    return self.runner.lower_decode(rows, live)
