"""A training run's setup, then the loop (loop.py), for a Program: what one kind of training
brings (its data, its step, its metrics, its hooks).

  train.train(config, workdir, program, devices=None)

Flow: program.open_sources -> config.resolve (the run's one resolve; everything after it takes the
resolved config and its RunShape) -> program.check(resolved, sources) -> claim the workdir -> the
config against the checkpoint's -> memory.fit_micro_batch (train.micro_batch_size=0 on a GPU: the
program's update, program.abstract_batch and loss_fn, with program.alongside's memory beside it;
where one sequence per device does not fit, also an automatic mesh.fsdp and model.remat) ->
state.build -> restore (or restore_from, or init) the state -> program.open_data -> the update
compiled (AOT) -> program.make_step around it -> loop.Loop(step, metrics=program.logger, stop
signals, the non-finite check) with program.hooks(hooks.Context) -> its run over program.batches.
What the run opens (the workdir's lock, the signal handlers, the checkpointer, the data, the
writers, the prefetch and clock threads, a trace) is closed by one ExitStack, on every path.
Pretraining and SFT are pretrain.Pretraining (its hooks: evaluation, checkpointing, lm_eval, the
end-of-run sample, profiling); GRPO is grpo.program.GRPO (rollouts through the engine in its
step). This module imports nothing that runs after training (lm_eval, sample, engine, serve).
"""
import contextlib
import dataclasses
import time
from typing import Any, Callable, Generic, Iterator, Protocol, TypeVar, cast

import jax
import ml_collections

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
from jax_pretrain import hooks as hooks_lib
from jax_pretrain import loop as loop_lib
from jax_pretrain import memory
from jax_pretrain import metrics as metrics_lib
from jax_pretrain import model as model_lib
from jax_pretrain import multihost
from jax_pretrain import runtime
from jax_pretrain import signals
from jax_pretrain import state as state_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.state import Setup
from jax_pretrain.state import TrainState
from jax_pretrain.step_logger import StepLogger


def describe(s: Setup, num_params: int) -> str:
  c, run, m = s.config, s.run, s.config.model
  return '\n'.join([
      f'parameters        {num_params:,} ({num_params / 1e6:.1f}M)',
      f'model             {m.num_layers} layers × d_model {m.d_model}, {m.num_heads} heads '
      f'({m.num_kv_heads} kv) × {m.head_dim}, mlp {m.mlp_dim}, vocab {m.vocab_size}',
      f'tokens per step   {run.tokens_per_step:,} ({c.train.batch_size} × {c.data.seq_len})',
      f'steps             {c.train.steps:,} ({c.train.total_tokens:,} tokens), warmup '
      f'{c.optim.warmup_steps:,} ({c.optim.warmup_tokens:,} tokens)',
      f'grad accumulation {run.grad_accum_steps} micro-batches of {c.train.micro_batch_size} '
      f'per device',
      f'mesh              data={run.mesh_shape[0]} fsdp={run.mesh_shape[1]} '
      f'tensor={run.mesh_shape[2]} on {s.mesh.size} × {s.mesh.devices.flat[0].device_kind}',
      f'attention         {m.attention}, remat {m.remat}',
      f'precision         compute {m.dtype}, params and optimizer {m.param_dtype}',
  ] + [f'chosen            {choice}' for choice in run.choices]
      + runtime.settings(s.mesh.devices.flat[0].platform))


def _on_main(workdir: str, fn, *args):
  """fn(*args) on process 0 (the workdir's lock, its history: see workdir.claim, check_history);
  every process learns whether it raised a WorkdirError, so that all stop together. Returns fn's
  result (None on the other processes)."""
  result, error = None, None
  if multihost.is_main():
    try:
      result = fn(*args)
    except workdir_lib.WorkdirError as e:
      error = e
  if jax.process_count() > 1:
    ok = multihost.from_main(error is None)
    if not ok and error is None:
      error = workdir_lib.WorkdirError(f'process 0 stopped at {workdir}: see its message.')
  if error is not None:
    raise error
  return result


def _saved_config(checkpointer) -> dict | None:
  """The config of the checkpoint the run will resume from, or None for a new run. A step whose
  config file is damaged is set aside (the previous one is checked), and any other failure to
  read it stops the run (Checkpointer.latest_config): a resume is never left unchecked."""
  latest = checkpointer.latest_config()
  return latest[1] if latest is not None else None


def _initial_state(s: Setup, checkpointer, is_main: bool) -> TrainState:
  """This workdir's latest checkpoint that restores, else restore_from's params, else fresh
  parameters."""
  restored = checkpointer.restore_latest(s.abstract_state)
  if restored is not None:
    step, state = restored
    if is_main:
      print(f'resuming from step {step} ({checkpointer.directory})', flush=True)
    return state
  source = s.config.checkpoint.restore_from
  if source:
    other = checkpoint_lib.Checkpointer(source, read_only=True)
    try:
      step, params = other.restore_params(s.abstract_state.params)
      histories = other.restore_fp8(s.abstract_state.fp8, step)
    finally:
      other.close()
    if is_main:
      print(f'starting from the params of {other.directory} step {step} (fresh optimizer and '
            f'data order{"; its FP8 amax histories" if histories is not None else ""})',
            flush=True)
    state = state_lib.state_from_params(s, params)
    # With model.fp8, the run's FP8 scales go on from the source's amax histories where it has
    # them (Transformer Engine's checkpoints keep them too): its first steps, and an engine
    # (GRPO's rollouts) at them, run at the scales the source model was trained at.
    return state if histories is None else dataclasses.replace(state, fp8=histories)
  return state_lib.init_state(s)


def compile_step(s: Setup, pad_id: int, abstract_batch, loss_fn=None):
  """The train step (state.jit_train_step) compiled ahead of time for this batch."""
  t0 = time.perf_counter()
  train_step = state_lib.jit_train_step(s, pad_id, loss_fn).lower(s.abstract_state,
                                                                  abstract_batch).compile()
  multihost.log(f'compiled train step in {time.perf_counter() - t0:.1f}s')
  return train_step


class Tokenizer(Protocol):
  """What the setup reads of the run's tokenizer (data.tokenizer's kinds)."""

  @property
  def vocab_size(self) -> int: ...

  @property
  def pad_id(self) -> int: ...


class Sources(Protocol):
  """A program's sources (its open_sources'): the run's tokenizer, which the config is resolved
  with and the workdir keeps."""

  @property
  def tokenizer(self) -> Tokenizer: ...


class Batches(Iterator[Any], Protocol):
  """An iterator the run closes when it ends (grain's worker processes, a prefetch thread)."""

  def close(self) -> None: ...


class Data(Protocol):
  """A program's data (its open_data'): `train`, what its batches are drawn from."""

  @property
  def train(self) -> Batches: ...


SourcesT = TypeVar('SourcesT', bound=Sources)
DataT = TypeVar('DataT', bound=Data)
StepT = TypeVar('StepT', bound=Callable)


class Program(Generic[SourcesT, DataT, StepT]):
  """What one kind of training brings to `train`: what differs between pretraining/SFT (these
  defaults; pretrain.Pretraining adds its hooks) and GRPO (grpo/program.py). `train` calls each
  method once, in this order, and passes each what the earlier ones produced (nothing passes
  through self): open_sources -> check -> updates_per_step, abstract_batch, loss_fn, alongside
  (the step that will run and what stays beside it: the micro-batch fit and the compile use
  them) -> open_data -> make_step (around the compiled update) -> batches, logger -> hooks.
  Its sources, data and step are the Sources, Data and (state, batch) -> (state, metrics) that
  the type parameters are bound to."""

  def open_sources(self, config: config_lib.Config) -> SourcesT:
    """Before the config is resolved (config: as given): the data's sources, with the run's
    `tokenizer`."""
    return cast(SourcesT, data_lib.open_sources(config))  # (pretraining's: data_lib.Sources)

  def check(self, resolved: config_lib.Config, sources: SourcesT) -> None:
    """Cheap checks of the resolved config against the sources, before any work."""

  def updates_per_step(self, resolved: config_lib.Config) -> int:
    """Optimizer updates a step makes (GRPO: grpo.num_iterations on each rollout batch). The
    schedule counts updates, so its lengths are stretched by this (optim.learning_rate_schedule);
    the state's step counts updates, so the loop resumes at state.step / this."""
    return 1

  def abstract_batch(self, s: Setup, sources: SourcesT) -> dict:
    """The update's batch, abstract (ShapeDtypeStructs in the batch sharding): what the train
    step is compiled for, by the micro-batch fit and for the run."""
    return state_lib.abstract_batch(s, s.config.train.batch_size)

  def loss_fn(self, s: Setup) -> Callable | None:
    """The train step's loss (state.make_train_step's loss_fn); None: the next-token loss."""
    return None

  def alongside(self, resolved: config_lib.Config, sources: SourcesT,
                num_devices: int) -> float:
    """Bytes per device that stay allocated beside the train step (the micro-batch fit leaves
    room for them)."""
    return 0.0

  def open_data(self, resolved: config_lib.Config, sources: SourcesT, step: int) -> DataT:
    """The data, positioned after `step` steps."""
    return cast(DataT, data_lib.open_batches(resolved, cast(data_lib.Sources, sources),
                                             jax.process_index(), jax.process_count(), step))

  def make_step(self, s: Setup, data: DataT, update) -> StepT:
    """The loop's step, (state, batch) -> (state, metrics), around `update` (the train step
    compiled for abstract_batch with loss_fn): here the update itself."""
    return update

  def batches(self, s: Setup, data: DataT) -> Batches:
    """What the step takes, one item a step."""
    return data_lib.Prefetcher(data.train, s.batch_sharding)

  def logger(self, s: Setup, writer: metrics_lib.MetricWriter, step: int) -> StepLogger:
    return StepLogger(s, writer, step)

  def hooks(self, ctx: hooks_lib.Context[DataT, StepT]) -> list[loop_lib.Hook]:
    return []


def train(config: config_lib.Config | ml_collections.ConfigDict, workdir: str,
          program: Program[SourcesT, DataT, StepT], devices=None) -> dict[str, float]:
  """Trains per the config (a config file's ConfigDict, with the command line's overrides; or a
  Config) and the program, writing logs and checkpoints to workdir; returns the last logged
  scalars ({} when a stop signal came before the first step).

  Cheap checks come first (config, data sources, program.check(resolved config), the workdir's
  lock, the config against the checkpoint's); then the micro-batch is chosen (GPUs), the state
  restored, the data loaded and the step compiled, each interruptible by a stop signal; then the
  loop. Everything opened on the way is closed when the run ends, however it ends.
  """
  config = config_lib.typed(config)  # (as given: a field that does not exist is refused here)
  sources = program.open_sources(config)
  devices = jax.devices() if devices is None else devices
  # The run's one resolve: every field checked, nothing built.
  resolved, run_shape = config_lib.resolve(config, len(devices), device=devices[0],
                                           tokenizer_vocab_size=sources.tokenizer.vocab_size)
  program.check(resolved, sources)
  with contextlib.ExitStack() as resources:
    claim = _on_main(workdir, workdir_lib.claim, workdir)
    if claim is not None:  # (process 0's lock)
      resources.enter_context(claim)
    if not resolved.checkpoint.start_over:  # a history without checkpoints: no silent restart
      _on_main(workdir, workdir_lib.check_history, workdir)  # (before any write)
    checkpointer = _open_checkpointer(resources, workdir, resolved.checkpoint)
    stop = signals.StopSignal()
    resources.callback(stop.restore)
    try:
      s, state, step = _restore(config, resolved, run_shape, devices, program, sources, workdir,
                                checkpointer, stop)
      data = stop.wait('loading the data', _open_data, resources, program, s.config, sources,
                       step)
      update = stop.wait('compiling', compile_step, s, sources.tokenizer.pad_id,
                         program.abstract_batch(s, sources), program.loss_fn(s))
    except signals.Stopped as e:
      multihost.log(f'{e}; nothing new to save. {checkpointer.last_complete()}')
      return {}
    return _run_loop(resources, program, s, data, update, state, step, workdir, checkpointer,
                     stop)


def _open_checkpointer(resources: contextlib.ExitStack, workdir: str,
                       ck: config_lib.CheckpointConfig) -> checkpoint_lib.Checkpointer:
  """The run's Checkpointer, closed (its save in flight and its compiles waited for) when the
  run ends, except after a second Ctrl-C, which aborts at once."""
  checkpointer = checkpoint_lib.Checkpointer(workdir, keep=ck.keep, keep_best=ck.keep_best,
                                             async_save=ck.async_save)

  def close(exc_type, exc, traceback) -> None:
    if exc_type is not KeyboardInterrupt:
      checkpointer.close()
  resources.push(close)
  return checkpointer


def _restore(config: config_lib.Config, resolved: config_lib.Config,
             run_shape: config_lib.RunShape, devices, program: Program[SourcesT, Any, Any],
             sources: SourcesT, workdir: str,
             checkpointer: checkpoint_lib.Checkpointer,
             stop: signals.StopSignal) -> tuple[Setup, TrainState, int]:
  """(Setup, state, step): the config against the checkpoint's (a change that does not fit it
  refused before any work), the micro-batch fit, state.build, then the state restored (or
  restore_from's params, or fresh); the run's config, tokenizer and launch written once it
  restored."""
  saved = _saved_config(checkpointer)
  changes = config_lib.resume_changes(saved, resolved) if saved else {}
  # train.micro_batch_size=0 on a GPU: a few compiles choose it (and the FSDP and remat where
  # they are automatic and the state does not fit as resolved).
  resolved, run_shape, fitted = stop.wait(
      'choosing the micro-batch', memory.fit_micro_batch, config, resolved, run_shape,
      devices, None, program.alongside(resolved, sources, len(devices)),
      lambda s: program.abstract_batch(s, sources), program.loss_fn)
  if fitted and saved:
    changes = config_lib.resume_changes(saved, resolved)  # with what the fit chose
  updates = program.updates_per_step(resolved)
  s = state_lib.build(resolved, dataclasses.replace(run_shape, updates_per_step=updates), devices)
  checkpointer.prepare(s.abstract_state)  # (the first save's programs, in the background)
  for field, (before, after) in changes.items():
    multihost.log(f'config change on resume: {field} {before!r} -> {after!r}')
  multihost.log(describe(s, model_lib.count_params(s.abstract_state.params)))
  for line in fitted:
    multihost.log(f'chosen            {line}')
  is_main = multihost.is_main()
  state = stop.wait('restoring', _initial_state, s, checkpointer, is_main)
  step = int(jax.device_get(state.step)) // updates  # (checkpoints: at whole steps)
  if is_main:  # only once the restore succeeded
    workdir_lib.write_config(workdir, resolved)
    workdir_lib.save_tokenizer(workdir, sources.tokenizer)
    workdir_lib.record_launch(workdir, step, changes)
  return s, state, step


def _open_data(resources: contextlib.ExitStack, program: Program[SourcesT, DataT, Any],
               resolved: config_lib.Config, sources: SourcesT, step: int) -> DataT:
  """program.open_data, its close registered as it opens (a stop signal while it loads discards
  the result: the data is closed all the same)."""
  data = program.open_data(resolved, sources, step)
  resources.callback(data.train.close)  # stops grain's worker processes, if any
  return data


def _run_loop(resources: contextlib.ExitStack, program: Program[Any, DataT, StepT], s: Setup,
              data: DataT, update,
              state: TrainState, step: int, workdir: str,
              checkpointer: checkpoint_lib.Checkpointer,
              stop: signals.StopSignal) -> dict[str, float]:
  """The loop over program.batches with the program's step, logger and hooks, from `step`;
  returns the last logged scalars."""
  c = s.config
  train_step = program.make_step(s, data, update)
  writer = metrics_lib.MetricWriter(workdir, enabled=multihost.is_main(), start_step=step,
                                    config=config_lib.as_dict(c))
  resources.callback(writer.close)
  batches = program.batches(s, data)
  resources.callback(batches.close)
  logger = program.logger(s, writer, step)
  resources.callback(logger.close)
  checkpoints = hooks_lib.Checkpointing(checkpointer, config_lib.as_dict(c),
                                        every=c.checkpoint.every_steps,
                                        save_final=c.checkpoint.save_final)
  skips_at_start = int(jax.device_get(state.nonfinite_count))
  lp = loop_lib.Loop(train_step, c.train.steps, log_every=c.train.log_every, metrics=logger,
                     stop=stop,
                     checks=[hooks_lib.nonfinite_check(c.train, checkpoints, skips_at_start)])
  ctx = hooks_lib.Context(s, workdir, data, train_step, checkpoints, logger, step, resources,
                          update)
  for hook in program.hooks(ctx):
    lp.add(hook)
  try:
    final = lp.run(state, batches, step)
  except KeyboardInterrupt:
    multihost.log(f'aborted by a second Ctrl-C after step {lp.step}, without saving. '
                  f'{checkpointer.last_complete()}')
    raise
  if final is None:
    multihost.log(f'received {stop.name}: saved step {lp.step} to {checkpointer.directory}; '
                  'run the same command to resume.')
  return logger.latest
