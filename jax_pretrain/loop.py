"""The training loop: a step function, and hooks that run at their cadences in a fixed order.

The loop owns order and timing; a trainer brings its step and its hooks. Per step:

  BEFORE_STEP hooks (profiling starts) -> state, metrics = step_fn(state, next(batches)) ->
  AFTER_STEP hooks (a failed background save reported, profiling stops) -> step N-1's metrics read
  (while step N runs) and checked -> every log_every steps this step's metrics kept for reading.
  At a step where an EVAL, SAVE or AFTER_SAVE hook is due, or where a stop signal arrived:
    this step's metrics read and checked first (never evaluate or save a state before checking
    the steps that led to it) -> EVAL hooks -> SAVE hooks -> AFTER_SAVE hooks (lm_eval: after the
    save, so that a failing task costs no training).
  A stop signal (signals.StopSignal) finishes the step, runs the hooks with at_stop (the save) and
  their `finish`, and `run` returns None. At the last step the hooks with at_last run; then the
  last metrics are checked, every hook's `finish` runs (the final save completes), then END hooks
  (the end-of-run sample), and `run` returns the state.

A hook returns a dict of scalars or None; EVAL hooks' scalars reach the later hooks of the same
step as `info.scalars` (the checkpoint ranks by them).

A second trainer (fine-tuning) uses it with its own step and hooks:

  from jax_pretrain import loop as loop_lib

  ckpt = loop_lib.Checkpointing(checkpointer, config_json, every=c.checkpoint.every_steps,
                                save_final=c.checkpoint.save_final)
  lp = loop_lib.Loop(rl_step, total_steps=c.train.steps, log_every=c.train.log_every,
                     metrics=my_logger,  # record(step, device_metrics) / flush() / pause()
                     stop=signals.StopSignal(),
                     checks=[loop_lib.nonfinite_check(c.train, ckpt)])
  lp.add_hook(task_accuracy, every=c.train.eval_every, phase=loop_lib.EVAL)
  for hook in ckpt.hooks(check_every=1):
    lp.add(hook)
  state = lp.run(state, data.Prefetcher(host_batches, batch_sharding), start_step)
  # None: a stop signal ended the run after saving step lp.step.

train.StepLogger serves as `metrics` for any step whose metrics hold loss, lr, grad_norm and
nonfinite_count (it writes train/*, perf/* and the console line); nonfinite_check reads the
flushed dict's step, loss, grad_norm, nonfinite_count and consecutive_nonfinite. train.py and
pretrain.py (pretrain.Pretraining.hooks lists a pretraining run's hooks) and grpo/program.py are the
worked examples.
"""
import dataclasses
import glob
import json
import os
from typing import Any, Callable

import jax

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import multihost
from jax_pretrain import profile_summary
from jax_pretrain.errors import UserError

BEFORE_STEP = 'before_step'
AFTER_STEP = 'after_step'
EVAL = 'eval'
SAVE = 'save'
AFTER_SAVE = 'after_save'
END = 'end'
PHASES = (BEFORE_STEP, AFTER_STEP, EVAL, SAVE, AFTER_SAVE, END)
_READS_STATE = (EVAL, SAVE, AFTER_SAVE)  # their state is checked before they run


class NonFiniteError(UserError):
  """Training produced a non-finite loss or gradient norm and the config says to halt."""


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
  (0: none), at the last step when at_last, and at a stop when at_stop. `finish()`, if given,
  runs when the loop ends (a stop or the last step), before END hooks."""
  fn: Callable[[StepInfo], dict | None]
  every: int = 0
  phase: str = EVAL
  at_last: bool = True
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

  metrics: an object with record(step, device_metrics) (keep them), flush() -> dict or None (read
  what was kept, one step late, and log it) and pause() (time outside steps is not step time).
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
      if step % self.log_every == 0 or info.last:
        self.metrics.record(step, metrics)
      info.stopping = self.stop is not None and self.stop.requested(step, previous)
      previous = metrics
      due = {p: [h for h in by_phase[p] if h.due(step, info.last, info.stopping)]
             for p in _READS_STATE}
      if info.stopping or any(due.values()):
        self.metrics.record(step, metrics)
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


class Checkpointing:
  """Checkpoints as hooks: a SAVE hook (every `every` steps, at the last step when save_final,
  and at a stop unless this step is saved already), an AFTER_STEP hook reporting a failed
  background save, and the final wait for a save in flight."""

  def __init__(self, checkpointer, config_json: dict, every: int, save_final: bool = True):
    self.checkpointer, self.config_json = checkpointer, config_json
    self.every, self.save_final = every, save_final
    self.last_saved = checkpointer.latest_step()

  def save(self, info: StepInfo) -> None:
    if info.step == self.last_saved:
      return
    self.checkpointer.save(info.step, info.state, self.config_json,
                           checkpoint_lib.scalars_for_ranking(info.scalars))
    self.last_saved = info.step

  def check(self, info: StepInfo) -> None:
    self.checkpointer.check()

  def hooks(self, check_every: int = 1) -> list[Hook]:
    """check_every: steps between checks of a background save (with several processes the check
    is a collective: every process must make it at the same steps)."""
    return [Hook(self.check, every=check_every, phase=AFTER_STEP, at_last=False,
                 name='checkpoint_check'),
            Hook(self.save, every=self.every, phase=SAVE, at_last=self.save_final, at_stop=True,
                 name='checkpoint', finish=self.checkpointer.wait)]


def nonfinite_check(t, checkpointing: Checkpointing | None, count_at_start: int = 0):
  """A check for Loop(checks=...): halts per train.on_nonfinite (t: the train group); the bad
  updates were never applied, so the state is good.

  consecutive_nonfinite is read at logged steps (and before every eval and save), so with 'skip'
  a streak is caught when it is still running at one of those steps.
  """
  def check(m: dict) -> None:
    last = checkpointing.last_saved if checkpointing is not None else None
    kept = (f'The last checkpoint (step {last}) is intact.' if last is not None
            else 'No checkpoint was written yet.')
    if t.on_nonfinite == 'halt' and m['nonfinite_count'] > count_at_start:
      raise NonFiniteError(
          f'non-finite loss or gradient norm by step {m["step"]} (loss {m["loss"]}, grad_norm '
          f'{m["grad_norm"]}); the bad update was not applied. {kept} Lower the learning rate, '
          'check the data, or set --config.train.on_nonfinite=skip.')
    if m['consecutive_nonfinite'] > t.max_consecutive_skips:
      raise NonFiniteError(
          f'{m["consecutive_nonfinite"]} non-finite steps in a row by step {m["step"]} (more '
          f'than train.max_consecutive_skips={t.max_consecutive_skips}). {kept}')
  return check


class Profiler:
  """Hooks writing a jax.profiler trace of steps START..STOP (both included; config.profile_steps
  reads train.profile_steps) to `directory`
  (TensorBoard's profile plugin or Perfetto read it): the trace starts before step START is
  dispatched, once the steps before it are done, and stops once step STOP's state is computed, so
  it holds those steps alone. Beside it, for jax_pretrain.profile_summary: `program()` (the compiled
  step's HLO text) and which steps were traced. A run resumed past START traces nothing."""

  def __init__(self, directory: str, steps: tuple[int, int] | None,
               program: Callable[[], str] | None = None):
    self.directory, self.steps, self.program = directory, steps, program
    self.active, self.last_step = False, 0  # (the last step dispatched while tracing)

  def start(self, info: StepInfo) -> None:
    if self.steps and info.step == self.steps[0]:
      os.makedirs(self.directory, exist_ok=True)
      if self.program is not None and multihost.is_main():
        with open(os.path.join(self.directory, profile_summary.PROGRAM), 'w',
                  encoding='utf-8') as f:
          f.write(self.program())
      jax.block_until_ready(info.state)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)  # + Perfetto json
      self.active = True

  def stop(self, info: StepInfo) -> None:
    if not self.active:
      return
    assert self.steps is not None  # start() activates only with steps
    self.last_step = info.step
    if info.step >= self.steps[1] or info.last:
      jax.block_until_ready(info.state)
      self._stop(info.step)
      multihost.log(f'profile of steps {self.steps[0]}..{info.step} written to {self.directory}')

  def _stop(self, last_step: int) -> None:
    jax.profiler.stop_trace()
    self.active = False
    traces = glob.glob(os.path.join(self.directory, 'plugins', 'profile', '*',
                                    profile_summary.TRACE))
    if traces and multihost.is_main():
      with open(os.path.join(self.directory, profile_summary.INFO), 'w', encoding='utf-8') as f:
        json.dump({'first_step': self.steps[0] if self.steps else 0, 'last_step': last_step,
                   'trace': os.path.relpath(max(traces, key=os.path.getmtime), self.directory)},
                  f)

  def finish(self) -> None:
    if self.active:  # a stop signal after START, before STOP
      self._stop(self.last_step)

  def hooks(self) -> list[Hook]:
    if not self.steps:
      return []
    return [Hook(self.start, every=1, phase=BEFORE_STEP, name='profile_start'),
            Hook(self.stop, every=1, phase=AFTER_STEP, name='profile_stop',
                 finish=self.finish)]
