"""The hooks and the check every training program runs in the loop (loop.py), and `Context`,
what train.py's setup built for a program's hooks (train.Program.hooks).

  Checkpointing     saves (SAVE: every checkpoint.every_steps, at the end, at a stop) and the check
                    of a background save (AFTER_STEP); checkpoint_hooks(ctx)
  Profiler          a jax.profiler trace of train.profile_steps (BEFORE_STEP / AFTER_STEP);
                    profile_hooks(ctx)
  nonfinite_check   the loop's check of each step's metrics: train.on_nonfinite
"""
import contextlib
import dataclasses
import glob
import json
import os
from typing import Any, Callable, Generic, TypeVar

import jax

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import loop as loop_lib
from jax_pretrain import multihost
from jax_pretrain import profile_summary
from jax_pretrain.errors import UserError
from jax_pretrain.state import Setup
from jax_pretrain.step_logger import StepLogger


class NonFiniteError(UserError):
  """Training produced a non-finite loss or gradient norm and the config says to halt."""


class Checkpointing:
  """Checkpoints as hooks: a SAVE hook (every `every` steps, at the last step when save_final,
  and at a stop unless this step is saved already), an AFTER_STEP hook reporting a failed
  background save, and the final wait for a save in flight."""

  def __init__(self, checkpointer, config_json: dict, every: int, save_final: bool = True):
    self.checkpointer, self.config_json = checkpointer, config_json
    self.every, self.save_final = every, save_final
    self.last_saved = checkpointer.latest_step()

  def save(self, info: loop_lib.StepInfo) -> None:
    if info.step == self.last_saved:
      return
    self.checkpointer.save(info.step, info.state, self.config_json,
                           checkpoint_lib.scalars_for_ranking(info.scalars))
    self.last_saved = info.step

  def check(self, info: loop_lib.StepInfo) -> None:
    self.checkpointer.check()

  def hooks(self, check_every: int = 1) -> list[loop_lib.Hook]:
    """check_every: steps between checks of a background save (with several processes the check
    is a collective: every process must make it at the same steps)."""
    return [loop_lib.Hook(self.check, every=check_every, phase=loop_lib.AFTER_STEP,
                          name='checkpoint_check'),
            loop_lib.Hook(self.save, every=self.every, phase=loop_lib.SAVE,
                          at_last=self.save_final, at_stop=True, name='checkpoint',
                          finish=self.checkpointer.wait)]


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
  reads train.profile_steps) to `directory` (TensorBoard's profile plugin or Perfetto read it):
  the trace starts before step START is dispatched, once the steps before it are done, and stops
  once step STOP's state is computed, so it holds those steps alone. Beside it, for
  jax_pretrain.profile_summary: `program()` (the compiled step's HLO text) and which steps were
  traced. A run resumed past START traces nothing."""

  def __init__(self, directory: str, steps: tuple[int, int] | None,
               program: Callable[[], str] | None = None):
    self.directory, self.steps, self.program = directory, steps, program
    self.active, self.last_step = False, 0  # (the last step dispatched while tracing)

  def start(self, info: loop_lib.StepInfo) -> None:
    if self.steps and info.step == self.steps[0]:
      os.makedirs(self.directory, exist_ok=True)
      if self.program is not None and multihost.is_main():
        with open(os.path.join(self.directory, profile_summary.PROGRAM), 'w',
                  encoding='utf-8') as f:
          f.write(self.program())
      jax.block_until_ready(info.state)
      jax.profiler.start_trace(self.directory, create_perfetto_trace=True)  # + Perfetto json
      self.active = True

  def stop(self, info: loop_lib.StepInfo) -> None:
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
    if self.active:  # a stop signal (or a failure) after START, before STOP
      self._stop(self.last_step)

  def hooks(self) -> list[loop_lib.Hook]:
    if not self.steps:
      return []
    return [loop_lib.Hook(self.start, every=1, phase=loop_lib.BEFORE_STEP, name='profile_start'),
            loop_lib.Hook(self.stop, every=1, phase=loop_lib.AFTER_STEP, name='profile_stop',
                          finish=self.finish)]


DataT = TypeVar('DataT')
StepT = TypeVar('StepT')


@dataclasses.dataclass
class Context(Generic[DataT, StepT]):
  """What the setup built, for the hooks (see pretrain.Pretraining.hooks): the program's data
  (its open_data's) and step (its make_step's). `resources` closes the run's resources on every
  path: a hook that holds one registers its close there."""
  setup: Setup
  workdir: str
  data: DataT
  step: StepT
  checkpoints: Checkpointing
  logger: StepLogger
  start_step: int
  resources: contextlib.ExitStack
  update: Any = None  # the compiled update inside `step` (jax.stages.Compiled): its HLO, profiled

  @property
  def config(self) -> config_lib.Config:
    return self.setup.config


def checkpoint_hooks(ctx: Context) -> list[loop_lib.Hook]:
  """Saves (checkpoint.every_steps, the end, a stop) and the check of a background save, every
  step (with several processes, a collective: every train.log_every steps)."""
  check_every = 1 if jax.process_count() == 1 else ctx.config.train.log_every
  return ctx.checkpoints.hooks(check_every=check_every)


def profile_hooks(ctx: Context) -> list[loop_lib.Hook]:
  """train.profile_steps: a jax.profiler trace of those steps in WORKDIR/profile, with the
  compiled update's HLO (jax_pretrain.profile_summary reads both). A run that fails while tracing
  stops the trace as it closes."""
  program = ctx.update.as_text if ctx.update is not None else None
  profiler = Profiler(os.path.join(ctx.workdir, 'profile'),
                      config_lib.profile_steps(ctx.config.train), program)
  ctx.resources.callback(profiler.finish)
  return profiler.hooks()
