"""The training loop: a step function, and hooks that run at their cadences in a fixed order.

The loop owns order and timing; a trainer brings its step, its metrics and its hooks. Per step:

  BEFORE_STEP hooks (profiling starts) -> state, metrics = step_fn(state, next(batches)) ->
  AFTER_STEP hooks (a failed background save reported, profiling stops) -> step N-1's metrics read
  (while step N runs) and checked -> this step's metrics recorded (once) where they are logged
  (every log_every steps, the last step) or read at once:
  at a step where an EVAL, SAVE or AFTER_SAVE hook is due, or where a stop signal arrived:
    this step's metrics read and checked first (never evaluate or save a state before checking
    the steps that led to it) -> EVAL hooks -> SAVE hooks -> AFTER_SAVE hooks (lm_eval: after the
    save, so that a failing task costs no training).
  A stop signal (signals.StopSignal) finishes the step, runs the hooks with at_stop (the save) and
  their `finish`, and `run` returns None. At the last step the hooks with at_last run; then the
  last metrics are checked, every hook's `finish` runs (the final save completes), then END hooks
  (the end-of-run sample), and `run` returns the state.

A hook returns a dict of scalars or None; EVAL hooks' scalars reach the later hooks of the same
step as `info.scalars` (the checkpoint ranks by them).

A second trainer uses it with its own step and hooks (hooks.py holds the trainer's):

  from jax_pretrain import hooks as hooks_lib
  from jax_pretrain import loop as loop_lib

  ckpt = hooks_lib.Checkpointing(checkpointer, config_json, every=c.checkpoint.every_steps,
                                 save_final=c.checkpoint.save_final)
  lp = loop_lib.Loop(rl_step, total_steps=c.train.steps, log_every=c.train.log_every,
                     metrics=my_logger,  # record(step, device_metrics) / flush() / pause()
                     stop=signals.StopSignal(),
                     checks=[hooks_lib.nonfinite_check(c.train, ckpt)])
  lp.add_hook(task_accuracy, every=c.train.eval_every, phase=loop_lib.EVAL, at_last=True)
  for hook in ckpt.hooks(check_every=1):
    lp.add(hook)
  state = lp.run(state, data.Prefetcher(host_batches, batch_sharding), start_step)
  # None: a stop signal ended the run after saving step lp.step.

train.py, pretrain.py (pretrain.Pretraining.hooks lists a pretraining run's hooks) and
grpo/program.py are the worked examples.
"""
import dataclasses
from typing import Any, Callable

BEFORE_STEP = 'before_step'
AFTER_STEP = 'after_step'
EVAL = 'eval'
SAVE = 'save'
AFTER_SAVE = 'after_save'
END = 'end'
PHASES = (BEFORE_STEP, AFTER_STEP, EVAL, SAVE, AFTER_SAVE, END)
_READS_STATE = (EVAL, SAVE, AFTER_SAVE)  # their state is checked before they run


@dataclasses.dataclass
class StepInfo:
  """What a hook sees. BEFORE_STEP: `step` is the step about to run, `metrics` None."""
  step: int
  state: Any
  metrics: Any = None  # this step's device metrics
  last: bool = False  # step == total_steps
  stopping: bool = False  # a stop signal ends the run after this step
  scalars: dict = dataclasses.field(default_factory=dict)  # from this step's earlier hooks


@dataclasses.dataclass
class Hook:
  """fn(info) -> dict of scalars or None, in `phase`, at steps that are multiples of `every`
  (0: none), and, where asked, at the last step (at_last: an eval or save at the end) and at a
  stop (at_stop: the save). END hooks run once, after the last step. `finish()`, if given, runs
  when the loop ends (a stop or the last step), before END hooks."""
  fn: Callable[[StepInfo], dict | None]
  every: int = 0
  phase: str = EVAL
  at_last: bool = False
  at_stop: bool = False
  name: str = ''
  finish: Callable[[], None] | None = None

  def __post_init__(self):
    if self.phase not in PHASES:
      raise ValueError(f'hook phase {self.phase!r} is not one of {PHASES}')
    self.name = self.name or getattr(self.fn, '__name__', repr(self.fn))

  def due(self, step: int, last: bool = False, stopping: bool = False) -> bool:
    return bool((self.every and step % self.every == 0) or (last and self.at_last)
                or (stopping and self.at_stop))


class _NoMetrics:
  def record(self, step, device_metrics):
    pass

  def flush(self):
    return None

  def pause(self):
    pass


class Loop:
  """Runs step_fn from a start step to total_steps with the hooks (see the module docstring).

  metrics: an object with record(step, device_metrics) (keep them: called at most once a step,
  after the previous record was flushed), flush() -> dict or None (read what was kept, one step
  late, and log it) and pause() (time outside steps is not step time).
  checks: callables on each flushed dict (e.g. nonfinite_check), raising to end the run.
  stop: a signals.StopSignal (requested(step, previous step's metrics), step, name), or None.
  """

  def __init__(self, step_fn, total_steps: int, *, log_every: int = 1, metrics=None, stop=None,
               checks=()):
    self.step_fn, self.total_steps, self.log_every = step_fn, total_steps, log_every
    self.metrics = metrics if metrics is not None else _NoMetrics()
    self.stop, self.checks = stop, list(checks)
    self.hooks: list[Hook] = []
    self.step = 0  # the last step completed (for messages after an exception)

  def add(self, hook: Hook) -> Hook:
    self.hooks.append(hook)
    return hook

  def add_hook(self, fn, every: int = 0, phase: str = EVAL, **kwargs) -> Hook:
    return self.add(Hook(fn, every=every, phase=phase, **kwargs))

  def _run_hooks(self, hooks, info: StepInfo) -> None:
    for hook in hooks:
      scalars = hook.fn(info)
      if scalars:
        info.scalars.update(scalars)

  def _check(self, flushed) -> None:
    if flushed is not None:
      for check in self.checks:
        check(flushed)

  def _finish(self) -> None:
    for hook in self.hooks:
      if hook.finish is not None:
        hook.finish()

  def run(self, state, batches, step: int):
    """Steps from `step` to total_steps; returns the final state, or None when a stop signal
    ended the run (after its at_stop hooks: the state saved)."""
    by_phase = {p: [h for h in self.hooks if h.phase == p] for p in PHASES}
    self.step = step
    if self.stop is not None:
      self.stop.step = step + 1
    previous = None  # the last step's metrics (the stop signal waits for them: signals.py)
    while step < self.total_steps:
      self._run_hooks([h for h in by_phase[BEFORE_STEP] if h.due(step + 1)], StepInfo(step + 1,
                                                                                      state))
      state, metrics = self.step_fn(state, next(batches))
      step += 1
      self.step = step
      info = StepInfo(step, state, metrics, last=step == self.total_steps)
      self._run_hooks([h for h in by_phase[AFTER_STEP] if h.due(step, info.last)], info)
      self._check(self.metrics.flush())  # step - 1's metrics, read while this step runs
      info.stopping = self.stop is not None and self.stop.requested(step, previous)
      previous = metrics
      due = {p: [h for h in by_phase[p] if h.due(step, info.last, info.stopping)]
             for p in _READS_STATE}
      reads_state = info.stopping or any(due.values())
      if step % self.log_every == 0 or info.last or reads_state:
        self.metrics.record(step, metrics)
      if reads_state:  # this step's metrics read and checked now, before the hooks
        self._check(self.metrics.flush())
        for phase in _READS_STATE:
          self._run_hooks(due[phase], info)
        self.metrics.pause()
      if info.stopping:
        self._finish()
        return None
    self._check(self.metrics.flush())
    self._finish()
    self._run_hooks(by_phase[END], StepInfo(step, state, last=True))
    return state
