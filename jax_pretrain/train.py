"""The training loop: prefetched batches -> the jitted step -> logs, evals, checkpoints.

Flow: data.open_sources -> state.build (config, mesh, model, optimizer, shardings) -> restore or
init the state -> AOT-compile the step -> loop { prefetched batch -> step -> log step N-1 -> eval,
save, stop signals } -> final sample.
"""
import contextlib
import queue
import threading
import time

from absl import logging
import jax
import ml_collections

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
from jax_pretrain import metrics as metrics_lib
from jax_pretrain import model as model_lib
from jax_pretrain import multihost
from jax_pretrain import plan
from jax_pretrain import runtime
from jax_pretrain import sample as sample_lib
from jax_pretrain import signals
from jax_pretrain import state as state_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.errors import UserError
from jax_pretrain.state import Setup
from jax_pretrain.state import TrainState


class NonFiniteError(UserError):
  """Training produced a non-finite loss or gradient norm and the config says to halt."""


class Prefetcher:
  """Reads host batches in a background thread and puts them on the devices ahead of use.

  Yields global device batches, in order.
  """

  def __init__(self, iterator, batch_sharding, depth: int = 2):
    self._iterator, self._sharding = iterator, batch_sharding
    self._queue: queue.Queue = queue.Queue(maxsize=depth)
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def _run(self):
    try:
      while not self._stop.is_set():
        host = next(self._iterator)
        self._queue.put({k: jax.make_array_from_process_local_data(self._sharding, v)
                         for k, v in host.items()})
    except Exception as e:  # pylint: disable=broad-except  (re-raised in the consumer)
      self._queue.put(e)

  def __next__(self):
    item = self._queue.get()
    if isinstance(item, Exception):
      raise item
    return item

  def close(self):
    self._stop.set()
    while self._thread.is_alive():
      try:
        self._queue.get_nowait()
      except queue.Empty:
        self._thread.join(timeout=0.1)


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
      + runtime.describe(s.mesh.devices.flat[0].platform))


class StepLogger:
  """Turns step metrics into scalars, the console line and the writers, one step late.

  `record(step, metrics)` keeps the device arrays of a logged step; they are read (`flush`) after
  the next step has been dispatched, so logging never waits for the device to go idle.
  """

  def __init__(self, s: Setup, writer: metrics_lib.MetricWriter, start_step: int):
    c = s.config
    self._writer, self._steps = writer, c.train.steps
    self._tokens_per_step = s.run.tokens_per_step
    self._flops_per_token = model_lib.flops_per_token(config_lib.model_config(c), c.data.seq_len)
    self._num_devices = s.mesh.size
    self._peak = metrics_lib.peak_flops_per_device(s.mesh.devices.flat[0].device_kind,
                                                   c.train.peak_flops)
    self._pending = None
    self._last_time, self._last_step = time.perf_counter(), start_step
    self.latest: dict[str, float] = {}

  def record(self, step: int, device_metrics) -> None:
    self._pending = (step, device_metrics)

  def pause(self) -> None:
    """Time spent outside training steps (eval, a blocking save) is not step time."""
    self._last_time = time.perf_counter()

  def flush(self) -> dict | None:
    if self._pending is None:
      return None
    step, device_metrics = self._pending
    self._pending = None
    m = jax.device_get(device_metrics)
    now = time.perf_counter()
    step_time = (now - self._last_time) / max(step - self._last_step, 1)
    self._last_time, self._last_step = now, step
    tokens_per_sec = self._tokens_per_step / step_time
    mfu = metrics_lib.mfu(self._flops_per_token, tokens_per_sec, self._num_devices, self._peak)
    scalars = {'train/loss': m['loss'], 'train/ppl': metrics_lib.perplexity(m['loss']),
               'train/lr': m['lr'], 'train/grad_norm': m['grad_norm'],
               'train/tokens': step * self._tokens_per_step,
               'train/nonfinite_skips': m['nonfinite_count'],
               'perf/tokens_per_sec': tokens_per_sec, 'perf/step_time': step_time,
               'perf/mfu': mfu}
    if 'loss_scale' in m:  # float16 runs: dynamic loss scaling (state.LossScale)
      scalars.update({'train/loss_scale': m['loss_scale'],
                      'train/loss_scale_skips': m['loss_scale_skips']})
    self.write(step, scalars)
    mfu_text = f' | MFU {mfu:.1%}' if mfu is not None else ''
    skips = f' | skipped {m["nonfinite_count"]}' if m['nonfinite_count'] else ''
    multihost.log(f'step {step}/{self._steps} | loss {m["loss"]:.4f} | lr {m["lr"]:.2e} | '
                  f'grad_norm {m["grad_norm"]:.3f} | {tokens_per_sec:,.0f} tok/s | '
                  f'{step_time:.3f} s/step{mfu_text}{skips} | '
                  f'ETA {_format_eta((self._steps - step) * step_time)}')
    return {'step': step, **m}

  def write(self, step: int, scalars: dict) -> None:
    self._writer.write(step, scalars)
    self.latest.update({k: v for k, v in scalars.items() if v is not None})


def _check_finite(m: dict | None, t: ml_collections.ConfigDict, last_checkpoint: int | None,
                  count_at_start: int):
  """Halts per train.on_nonfinite; the bad updates were never applied, so the state is good.

  consecutive_nonfinite is read at logged steps (and before every eval and save), so with 'skip' a
  streak is caught when it is still running at one of those steps.
  """
  if m is None:
    return
  kept = (f'The last checkpoint (step {last_checkpoint}) is intact.' if last_checkpoint is not None
          else 'No checkpoint was written yet.')
  if t.on_nonfinite == 'halt' and m['nonfinite_count'] > count_at_start:
    raise NonFiniteError(
        f'non-finite loss or gradient norm by step {m["step"]} (loss {m["loss"]}, grad_norm '
        f'{m["grad_norm"]}); the bad update was not applied. {kept} Lower the learning rate, '
        'check the data, or set --config.train.on_nonfinite=skip.')
  if m['consecutive_nonfinite'] > t.max_consecutive_skips:
    raise NonFiniteError(
        f'{m["consecutive_nonfinite"]} non-finite steps in a row by step {m["step"]} (more than '
        f'train.max_consecutive_skips={t.max_consecutive_skips}). {kept}')


def _claim(workdir: str):
  """Process 0 takes the workdir's lock (see workdir.claim); every process learns whether it did,
  so that all stop together. Returns what to close at the end."""
  lock, error = contextlib.nullcontext(), None
  if multihost.is_main():
    try:
      lock = workdir_lib.claim(workdir)
    except workdir_lib.WorkdirError as e:
      error = e
  if jax.process_count() > 1:
    ok = multihost.from_main(error is None)
    if not ok and error is None:
      error = workdir_lib.WorkdirError(f'process 0 could not claim {workdir}: see its message.')
  if error is not None:
    raise error
  return lock


def _resume_changes(config: ml_collections.ConfigDict, checkpointer) -> dict:
  """The resolved config's changes against the checkpoint the run will resume from, or {} for a
  new run; raises ConfigError for changes that do not fit it. Reads only its config."""
  latest = checkpointer.latest_step()
  saved = checkpointer.saved_config(latest) if latest is not None else None
  return config_lib.resume_changes(saved, config) if saved else {}


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


def _compile(s: Setup, pad_id: int):
  t0 = time.perf_counter()
  train_step = state_lib.jit_train_step(s, pad_id).lower(
      s.abstract_state, state_lib.abstract_batch(s, s.config.train.batch_size)).compile()
  multihost.log(f'compiled train step in {time.perf_counter() - t0:.1f}s')
  return train_step


def run_eval(eval_step, params, data, s: Setup, logger: StepLogger, step: int) -> dict:
  nll, count = state_lib.summed_loss(eval_step, params, data.eval_batches(), s.batch_sharding)
  loss = nll / max(count, 1.0)
  scalars = {'eval/loss': loss, 'eval/ppl': metrics_lib.perplexity(loss)}
  logger.write(step, scalars)
  multihost.log(f'eval at step {step} | loss {loss:.4f} | ppl {scalars["eval/ppl"]:.2f}')
  return scalars


def run_lm_eval(params, tokenizer, s: Setup, logger: StepLogger, step: int) -> None:
  """train.lm_eval_tasks through lm-evaluation-harness, logged as lm_eval/TASK/METRIC. A failure
  (a task's download, a task the model cannot run) is a warning: training goes on."""
  from jax_pretrain import lm_eval as lm_eval_lib  # pylint: disable=g-import-not-at-top
  params = multihost.gather(params, on_device=True)  # every process takes part, 0 evaluates
  if multihost.is_main():
    t0 = time.perf_counter()
    try:
      scalars = lm_eval_lib.evaluate_during_training(s.config, params, tokenizer)
    except Exception as e:  # pylint: disable=broad-except  (the harness raises many kinds)
      logging.warning('lm_eval at step %d failed, training goes on: %s: %s', step,
                      type(e).__name__, str(e).splitlines()[0] if str(e) else '')
      return
    logger.write(step, scalars)
    shown = ' | '.join(f'{k[len("lm_eval/"):]} {v:.4f}' for k, v in scalars.items())
    multihost.log(f'lm_eval at step {step} | {shown} ({time.perf_counter() - t0:.1f}s)')


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       devices=None) -> dict[str, float]:
  """Trains per the config, writing logs and checkpoints to workdir; returns the last metrics.

  Cheap checks come first (config, data sources, the workdir's lock, the config against the
  checkpoint's); then the micro-batch is chosen (GPUs), the state restored, the data loaded and the
  step compiled, each interruptible by a stop signal; then the loop, and a sample from the final
  model.
  """
  sources = data_lib.open_sources(config)
  devices = jax.devices() if devices is None else devices
  vocab = sources.tokenizer.vocab_size
  resolved, _ = config_lib.resolve(config, len(devices), device=devices[0],
                                   tokenizer_vocab_size=vocab)  # every field checked, nothing built
  is_main = multihost.is_main()
  if resolved.train.lm_eval_tasks:  # a misspelt task fails now, not after the first steps
    from jax_pretrain import lm_eval as lm_eval_lib  # pylint: disable=g-import-not-at-top
    lm_eval_lib.check_tasks(resolved.train)
  with _claim(workdir):
    t, ck = resolved.train, resolved.checkpoint
    stop = signals.StopSignal(check_every=t.log_every)
    checkpointer = checkpoint_lib.Checkpointer(workdir, keep=ck.keep, keep_best=ck.keep_best,
                                               async_save=ck.async_save)
    aborted = False
    try:
      _resume_changes(resolved, checkpointer)  # refuses a change that does not fit, before work
      # train.micro_batch_size=0 on a GPU: a few compiles choose it.
      config, fitted = stop.wait('choosing the micro-batch', plan.fit_micro_batch, config, devices)
      s = state_lib.build(config, devices, vocab)
      config, t = s.config, s.config.train
      changes = _resume_changes(config, checkpointer)
      for field, (before, after) in changes.items():
        multihost.log(f'config change on resume: {field} {before!r} -> {after!r}')
      multihost.log(describe(s, model_lib.count_params(s.abstract_state.params)))
      if fitted:
        multihost.log(f'chosen            {fitted}')
      state = stop.wait('restoring', _initial_state, s, checkpointer, is_main)
      step = int(jax.device_get(state.step))
      if is_main:  # only once the restore succeeded
        workdir_lib.write_config(workdir, config)
        workdir_lib.save_tokenizer(workdir, sources.tokenizer)
        workdir_lib.record_launch(workdir, step, changes)
      data = stop.wait('loading the data', data_lib.build, config, sources, jax.process_index(),
                       jax.process_count(), step)
      try:
        train_step = stop.wait('compiling', _compile, s, sources.tokenizer.pad_id)
        writer = metrics_lib.MetricWriter(workdir, enabled=is_main, start_step=step,
                                          config=config_lib.as_dict(config))
        try:
          logger = StepLogger(s, writer, step)
          state = _loop(s, state, step, data, train_step, checkpointer, stop, logger)
        finally:
          writer.close()
      finally:
        data.train.close()  # stops grain's worker processes, if any
    except signals.Stopped as e:
      multihost.log(f'{e}; nothing new to save. {checkpointer.last_complete()}')
      return {}
    except KeyboardInterrupt:
      aborted = True
      raise
    finally:
      stop.restore()
      if not aborted:  # a second Ctrl-C aborts at once: no waiting for a save in flight
        checkpointer.close()

  if state is not None and t.sample_prompt and t.sample_tokens > 0:
    params = multihost.gather(state.params)  # every process takes part, process 0 samples
    if is_main:
      text = sample_lib.generate_text(config_lib.model_config(config), params, sources.tokenizer,
                                      t.sample_prompt, t.sample_tokens, seed=t.seed)
      multihost.log(f'sample: {t.sample_prompt!r} -> {text!r}')
  return logger.latest


def _loop(s: Setup, state, step: int, data, train_step, checkpointer, stop,
          logger: StepLogger):
  """Steps from `step` to train.steps, with evals, saves and stop signals; returns the final
  state, or None when a stop signal ended the run (its state saved)."""
  t, ck = s.config.train, s.config.checkpoint
  eval_step = state_lib.jit_eval_step(s, data.tokenizer.pad_id)
  config_json = config_lib.as_dict(s.config)
  last_saved = checkpointer.latest_step()
  skips_at_start = int(jax.device_get(state.nonfinite_count))
  stop.step = step + 1
  prefetcher = Prefetcher(data.train, s.batch_sharding)
  try:
    while step < t.steps:
      state, metrics = train_step(state, next(prefetcher))
      step += 1
      if jax.process_count() == 1 or step % t.log_every == 0:  # (a collective with several)
        checkpointer.check()  # a background save that failed: reported within a step
      # Step - 1's metrics, read while this step runs.
      _check_finite(logger.flush(), t, last_saved, skips_at_start)
      if step % t.log_every == 0 or step == t.steps:
        logger.record(step, metrics)
      eval_due = step % t.eval_every == 0 or step == t.steps
      save_due = bool(ck.every_steps and step % ck.every_steps == 0) or (
          step == t.steps and ck.save_final)
      stopping = stop.requested(step)
      lm_eval_due = bool(t.lm_eval_tasks) and (
          step % t.lm_eval_every == 0 or step == t.steps if t.lm_eval_every else eval_due)
      if eval_due or save_due or stopping or lm_eval_due:
        # Never evaluate or save a state before checking the steps that led to it.
        logger.record(step, metrics)
        _check_finite(logger.flush(), t, last_saved, skips_at_start)
        eval_metrics = run_eval(eval_step, state.params, data, s, logger, step) if eval_due else {}
        if save_due or (stopping and last_saved != step):
          checkpointer.save(step, state, config_json,
                            checkpoint_lib.scalars_for_ranking(eval_metrics))
          last_saved = step
        if lm_eval_due:  # after the save: a failing task costs no training
          run_lm_eval(state.params, data.tokenizer, s, logger, step)
        logger.pause()
      if stopping:
        checkpointer.wait()
        multihost.log(f'received {stop.name}: saved step {step} to {checkpointer.directory}; run '
                      'the same command to resume.')
        return None
    _check_finite(logger.flush(), t, last_saved, skips_at_start)
    checkpointer.wait()  # the final save is complete (or its failure reported) before returning
    return state
  except KeyboardInterrupt:
    multihost.log(f'aborted by a second Ctrl-C after step {step}, without saving. '
                  f'{checkpointer.last_complete()}')
    raise
  finally:
    prefetcher.close()
