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
signals, the non-finite check) with program.hooks(Context) -> its run over program.batches.
Pretraining and SFT are pretrain.Pretraining (its hooks: evaluation, checkpointing, lm_eval, the
end-of-run sample, profiling); GRPO is grpo.program.GRPO (rollouts through the engine in its
step). This module imports nothing that runs after training (lm_eval, sample, engine, serve).
"""
import concurrent.futures
import contextlib
import dataclasses
import os
import time
from typing import Any, Callable, Generic, TypeVar, cast

import jax
import ml_collections

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
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

NonFiniteError = loop_lib.NonFiniteError


def _format_eta(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  return f'{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}'


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


def _ready_at(device_metrics) -> float:
  """perf_counter once the arrays are computed (run on StepLogger's clock thread)."""
  jax.block_until_ready(device_metrics)
  return time.perf_counter()


class StepLogger:
  """Turns step metrics into scalars, the console line and the writers, one step late.

  `record(step, metrics)` keeps the device arrays of a logged step; they are read (`flush`) after
  the next step has been dispatched, so logging never waits for the device to go idle. `report`
  makes the scalars and the console line of the metrics read (a program's own logger overrides
  it: grpo.program.GRPOLogger).

  Speed: each line's tokens/s and step time are those of its own interval: from the moment the
  previous logged step's metrics were ready (or training resumed after `pause`: an eval, a save)
  to the moment this step's were. A thread waiting for the metrics takes that moment
  (`_ready_at`); the moment `flush` reads them varies: after the next step's dispatch, which
  blocks the host for most of a step where a step launches thousands of kernels (a GPU), or at
  once at an eval, save, stop or last step. Timed at the reads, those lines were off by up to a
  step (tests/test_loop.py; on an H100 a run's last line, at an eval, said 54,844 tokens/s where
  the others said 46,180).
  """

  def __init__(self, s: Setup, writer: metrics_lib.MetricWriter, start_step: int):
    c = s.config
    self._writer, self._steps = writer, c.train.steps
    self._tokens_per_step = s.run.tokens_per_step
    self._flops_per_token = model_lib.flops_per_token(c.model, c.data.seq_len)
    self._num_devices = s.mesh.size
    self._peak = metrics_lib.peak_flops_per_device(s.mesh.devices.flat[0].device_kind,
                                                   c.train.peak_flops)
    # (step, its metrics on the device, when they were ready: a Future of perf_counter)
    self._pending: tuple[int, Any, concurrent.futures.Future] | None = None
    self._clock = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='step_clock')
    self._last_time, self._last_step = time.perf_counter(), start_step
    self.latest: dict[str, float] = {}

  def record(self, step: int, device_metrics) -> None:
    if self._pending is None or self._pending[0] != step:
      self._pending = (step, device_metrics, self._clock.submit(_ready_at, device_metrics))

  def pause(self) -> None:
    """Time spent outside training steps (eval, a blocking save) is not step time: the next
    interval starts now (called with no step pending, the device idle)."""
    self._last_time = time.perf_counter()

  def flush(self) -> dict | None:
    if self._pending is None:
      return None
    step, device_metrics, ready = self._pending
    self._pending = None
    m = jax.device_get(device_metrics)
    now = ready.result()
    step_time = (now - self._last_time) / max(step - self._last_step, 1)
    self._last_time, self._last_step = now, step
    scalars, line = self.report(step, m, step_time)
    self.write(step, scalars)
    multihost.log(f'step {step}/{self._steps} | {line} | ETA '
                  f'{_format_eta((self._steps - step) * step_time)}')
    return {'step': step, **m}

  def report(self, step: int, m: dict, step_time: float) -> tuple[dict, str]:
    """(scalars, the console line's middle) of step metrics read from the device."""
    tokens_per_sec = self._tokens_per_step / step_time
    mfu = metrics_lib.mfu(self._flops_per_token, tokens_per_sec, self._num_devices, self._peak)
    scalars = {'train/loss': m['loss'], 'train/ppl': metrics_lib.perplexity(m['loss']),
               'train/lr': m['lr'], 'train/grad_norm': m['grad_norm'],
               'train/tokens': step * self._tokens_per_step,
               'train/nonfinite_skips': m['nonfinite_count'],
               'perf/tokens_per_sec': tokens_per_sec, 'perf/step_time': step_time,
               'perf/mfu': mfu}
    scalars.update(self.loss_scale_scalars(m))
    mfu_text = f' | MFU {mfu:.1%}' if mfu is not None else ''
    return scalars, (f'loss {m["loss"]:.4f} | lr {m["lr"]:.2e} | grad_norm {m["grad_norm"]:.3f} '
                     f'| {tokens_per_sec:,.0f} tok/s | {step_time:.3f} s/step{mfu_text}'
                     f'{self.skipped(m)}')

  @staticmethod
  def loss_scale_scalars(m: dict) -> dict:
    """float16 runs' dynamic loss scaling (state.LossScale): its scale and skipped steps."""
    if 'loss_scale' not in m:
      return {}
    return {'train/loss_scale': m['loss_scale'], 'train/loss_scale_skips': m['loss_scale_skips']}

  @staticmethod
  def skipped(m: dict) -> str:
    return f' | skipped {m["nonfinite_count"]}' if m['nonfinite_count'] else ''

  def write(self, step: int, scalars: dict) -> None:
    self._writer.write(step, scalars)
    self.latest.update({k: v for k, v in scalars.items() if v is not None})


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
    finally:
      other.close()
    if is_main:
      print(f'starting from the params of {other.directory} step {step} (fresh optimizer and '
            'data order)', flush=True)
    return state_lib.state_from_params(s, params)
  return state_lib.init_state(s)


def compile_step(s: Setup, pad_id: int, abstract_batch, loss_fn=None):
  """The train step (state.jit_train_step) compiled ahead of time for this batch."""
  t0 = time.perf_counter()
  train_step = state_lib.jit_train_step(s, pad_id, loss_fn).lower(s.abstract_state,
                                                                  abstract_batch).compile()
  multihost.log(f'compiled train step in {time.perf_counter() - t0:.1f}s')
  return train_step


SourcesT = TypeVar('SourcesT')
DataT = TypeVar('DataT')
StepT = TypeVar('StepT')


@dataclasses.dataclass
class Context(Generic[DataT, StepT]):
  """What the setup built, for the hooks (see pretrain.Pretraining.hooks): the program's data
  (its open_data's) and step (its make_step's)."""
  setup: Setup
  workdir: str
  data: DataT
  step: StepT
  checkpoints: loop_lib.Checkpointing
  logger: StepLogger
  start_step: int
  update: Any = None  # the compiled update inside `step` (jax.stages.Compiled): its HLO, profiled

  @property
  def config(self) -> config_lib.Config:
    return self.setup.config


class Program(Generic[SourcesT, DataT, StepT]):
  """What one kind of training brings to `train`: what differs between pretraining/SFT (these
  defaults; pretrain.Pretraining adds its hooks) and GRPO (grpo/program.py). `train` calls each
  method once, in this order, and passes each what the earlier ones produced (nothing passes
  through self): open_sources -> check -> updates_per_step, abstract_batch, loss_fn, alongside
  (the step that will run and what stays beside it: the micro-batch fit and the compile use
  them) -> open_data -> make_step (around the compiled update) -> batches, logger -> hooks."""

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

  def open_data(self, resolved: config_lib.Config, sources: SourcesT,
                step: int) -> DataT:
    """The data, positioned after `step` steps: `tokenizer`, `train` (an iterator with close())."""
    return cast(DataT, data_lib.open_batches(resolved, cast(data_lib.Sources, sources),
                                             jax.process_index(), jax.process_count(), step))

  def make_step(self, s: Setup, data: DataT, update) -> StepT:
    """The loop's step, (state, batch) -> (state, metrics), around `update` (the train step
    compiled for abstract_batch with loss_fn): here the update itself."""
    return update

  def batches(self, s: Setup, data: DataT):
    """What the step takes, one item a step (an iterator with close())."""
    return data_lib.Prefetcher(cast(data_lib.Data, data).train, s.batch_sharding)

  def logger(self, s: Setup, writer: metrics_lib.MetricWriter, step: int) -> StepLogger:
    return StepLogger(s, writer, step)

  def hooks(self, ctx: Context[DataT, StepT]) -> list[loop_lib.Hook]:
    return []


def run_eval(eval_step, params, data, s: Setup, logger: StepLogger, step: int) -> dict:
  nll, count = state_lib.summed_loss(eval_step, params, data.eval_batches(), s.batch_sharding)
  loss = nll / max(count, 1.0)
  scalars = {'eval/loss': loss, 'eval/ppl': metrics_lib.perplexity(loss)}
  logger.write(step, scalars)
  multihost.log(f'eval at step {step} | loss {loss:.4f} | ppl {scalars["eval/ppl"]:.2f}')
  return scalars


def eval_hook(ctx: Context) -> loop_lib.Hook:
  """The held-out loss every train.eval_every steps and at the end (eval/loss, eval/ppl)."""
  s = ctx.setup
  eval_step = state_lib.jit_eval_step(s, ctx.data.tokenizer.pad_id)

  def evaluate(info: loop_lib.StepInfo) -> dict:
    return run_eval(eval_step, info.state.params, ctx.data, s, ctx.logger, info.step)
  return loop_lib.Hook(evaluate, every=s.config.train.eval_every, phase=loop_lib.EVAL,
                       name='eval')


def checkpoint_hooks(ctx: Context) -> list[loop_lib.Hook]:
  """Saves (checkpoint.every_steps, the end, a stop) and the check of a background save, every
  step (with several processes, a collective: every train.log_every steps)."""
  check_every = 1 if jax.process_count() == 1 else ctx.config.train.log_every
  return ctx.checkpoints.hooks(check_every=check_every)


def profile_hooks(ctx: Context) -> list[loop_lib.Hook]:
  """train.profile_steps: a jax.profiler trace of those steps in WORKDIR/profile, with the
  compiled update's HLO (jax_pretrain.profile_summary reads both)."""
  program = ctx.update.as_text if ctx.update is not None else None
  return loop_lib.Profiler(os.path.join(ctx.workdir, 'profile'),
                           config_lib.profile_steps(ctx.config.train), program).hooks()


def train(config: config_lib.Config | ml_collections.ConfigDict, workdir: str, program: Program,
          devices=None) -> dict[str, float]:
  """Trains per the config (a config file's ConfigDict, with the command line's overrides; or a
  Config) and the program, writing logs and checkpoints to workdir; returns the last logged
  scalars ({} when a stop signal came before the first step).

  Cheap checks come first (config, data sources, program.check(resolved config), the workdir's
  lock, the config against the checkpoint's); then the micro-batch is chosen (GPUs), the state
  restored, the data loaded and the step compiled, each interruptible by a stop signal; then the
  loop.
  """
  config = config_lib.typed(config)  # (as given: a field that does not exist is refused here)
  sources = program.open_sources(config)
  devices = jax.devices() if devices is None else devices
  # The run's one resolve: every field checked, nothing built.
  resolved, run_shape = config_lib.resolve(config, len(devices), device=devices[0],
                                           tokenizer_vocab_size=sources.tokenizer.vocab_size)
  is_main = multihost.is_main()
  program.check(resolved, sources)
  with _on_main(workdir, workdir_lib.claim, workdir) or contextlib.nullcontext():
    ck = resolved.checkpoint
    if not ck.start_over:  # a history without checkpoints: no silent restart (before any write)
      _on_main(workdir, workdir_lib.check_history, workdir)
    stop = signals.StopSignal()
    checkpointer = checkpoint_lib.Checkpointer(workdir, keep=ck.keep, keep_best=ck.keep_best,
                                               async_save=ck.async_save)
    aborted = False
    lp = None
    try:
      saved = _saved_config(checkpointer)
      # Refuses a change that does not fit the checkpoint, before any work.
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
      s = state_lib.build(resolved, dataclasses.replace(run_shape, updates_per_step=updates),
                          devices)
      checkpointer.prepare(s.abstract_state)  # (the first save's programs, in the background)
      for field, (before, after) in changes.items():
        multihost.log(f'config change on resume: {field} {before!r} -> {after!r}')
      multihost.log(describe(s, model_lib.count_params(s.abstract_state.params)))
      for line in fitted:
        multihost.log(f'chosen            {line}')
      state = stop.wait('restoring', _initial_state, s, checkpointer, is_main)
      step = int(jax.device_get(state.step)) // updates  # (checkpoints: at whole steps)
      if is_main:  # only once the restore succeeded
        workdir_lib.write_config(workdir, resolved)
        workdir_lib.save_tokenizer(workdir, sources.tokenizer)
        workdir_lib.record_launch(workdir, step, changes)
      data = stop.wait('loading the data', program.open_data, resolved, sources, step)
      try:
        update = stop.wait('compiling', compile_step, s, sources.tokenizer.pad_id,
                           program.abstract_batch(s, sources), program.loss_fn(s))
        train_step = program.make_step(s, data, update)
        writer = metrics_lib.MetricWriter(workdir, enabled=is_main, start_step=step,
                                          config=config_lib.as_dict(resolved))
        batches = program.batches(s, data)
        try:
          logger = program.logger(s, writer, step)
          checkpoints = loop_lib.Checkpointing(checkpointer, config_lib.as_dict(resolved),
                                               every=ck.every_steps, save_final=ck.save_final)
          ctx = Context(s, workdir, data, train_step, checkpoints, logger, step, update)
          skips_at_start = int(jax.device_get(state.nonfinite_count))
          lp = loop_lib.Loop(train_step, resolved.train.steps, log_every=resolved.train.log_every,
                             metrics=logger, stop=stop,
                             checks=[loop_lib.nonfinite_check(resolved.train, checkpoints,
                                                              skips_at_start)])
          for hook in program.hooks(ctx):
            lp.add(hook)
          state = lp.run(state, batches, step)
          if state is None:
            multihost.log(f'received {stop.name}: saved step {lp.step} to '
                          f'{checkpointer.directory}; run the same command to resume.')
        finally:
          batches.close()
          writer.close()
      finally:
        data.train.close()  # stops grain's worker processes, if any
    except signals.Stopped as e:
      multihost.log(f'{e}; nothing new to save. {checkpointer.last_complete()}')
      return {}
    except KeyboardInterrupt:
      aborted = True
      if lp is not None:
        multihost.log(f'aborted by a second Ctrl-C after step {lp.step}, without saving. '
                      f'{checkpointer.last_complete()}')
      raise
    finally:
      stop.restore()
      if not aborted:  # a second Ctrl-C aborts at once: no waiting for a save in flight
        checkpointer.close()
  return logger.latest
