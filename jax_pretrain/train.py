"""The training loop: state created in its shardings, one jitted train step, eval, logging.

Flow: resolve config -> mesh -> model/optimizer -> abstract state (eval_shape) -> shardings ->
jit(init, out_shardings) -> AOT-compile the step -> loop { prefetched batch -> step -> log N-1 }.
"""
import dataclasses
import json
import os
import queue
import threading
import time
from typing import Any

import flax
import flax.linen as nn
import jax
from jax.experimental import multihost_utils
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
from jax_pretrain import metrics as metrics_lib
from jax_pretrain import model as model_lib
from jax_pretrain import optim
from jax_pretrain import sample as sample_lib
from jax_pretrain import sharding
from jax_pretrain import signals


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  nonfinite_count: jax.Array  # steps whose update was dropped for a non-finite loss or grad norm
  consecutive_nonfinite: jax.Array  # of those, how many in a row up to now


class NonFiniteError(RuntimeError):
  """Training produced a non-finite loss or gradient norm and the config says to halt."""


def make_loss_fn(model: nn.Module, pad_id: int):
  """(params, tokens [B, T+1]) -> (sum of next-token NLL over non-pad targets, their count).

  Sums, not means, so that micro-batches and data-parallel shards combine exactly.
  """
  def loss_fn(params, tokens_BxT1):
    inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
    logits_BxTxV = model.apply({'params': params}, inputs_BxT).astype(jnp.float32)
    logz_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    # A masked sum, not take_along_axis: XLA's SPMD partitioner aborts on that gather when the
    # vocabulary is split over 'tensor' inside the train step's shard_map.
    is_target_BxTxV = targets_BxT[..., None] == jnp.arange(logits_BxTxV.shape[-1])
    target_logit_BxT = jnp.sum(jnp.where(is_target_BxTxV, logits_BxTxV, 0.0), axis=-1)
    weights_BxT = (targets_BxT != pad_id).astype(jnp.float32)
    return jnp.sum((logz_BxT - target_logit_BxT) * weights_BxT), jnp.sum(weights_BxT)
  return loss_fn


def make_train_step(model, optimizer, schedule, *, grad_accum_steps: int, pad_id: int,
                    mesh=None):
  """A pure (state, batch) -> (state, metrics) function; jit it once.

  Gradients are reduced across data-parallel replicas once per optimizer step, not once per
  micro-batch: the accumulation runs under a shard_map over the 'data' axis, where each replica
  sums its own micro-batches' float32 gradients, and one psum follows the loop. 'fsdp' and
  'tensor' stay with the compiler (GSPMD): FSDP gathers each layer's weights, and reduce-scatters
  their gradients, per micro-batch, which is what keeps its memory at 1/fsdp of the state.
  """
  loss_and_grad = jax.value_and_grad(make_loss_fn(model, pad_id), has_aux=True)

  def local_sums(params, tokens_BxT1):
    """(loss sum, target count, float32 grads) over this replica's rows, micro-batch by
    micro-batch. Micro-batch a takes rows a, a+A, a+2A, ...: every device keeps its own rows."""
    B, T1 = tokens_BxT1.shape
    micro_AxMxT1 = tokens_BxT1.reshape(B // grad_accum_steps, grad_accum_steps, T1)
    micro_AxMxT1 = sharding.constrain(micro_AxMxT1.swapaxes(0, 1), (None, 'batch', None), mesh)

    def accumulate(carry, tokens_MxT1):
      (loss_i, weight_i), grads_i = loss_and_grad(params, tokens_MxT1)
      loss_sum, weight, grads = carry
      return (loss_sum + loss_i, weight + weight_i, jax.tree.map(jnp.add, grads, grads_i)), None

    zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32),
             jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params))
    sums, _ = jax.lax.scan(accumulate, zeros, micro_AxMxT1)
    return sums

  def data_parallel_sums(params, tokens_BxT1):
    # check_vma=False: no implicit psum per micro-batch for the replicated params; the one
    # reduction is this explicit psum, in float32.
    return jax.lax.psum(local_sums(params, tokens_BxT1), 'data')

  if mesh is not None and mesh.shape['data'] > 1:  # (XLA rejects a psum over a 1-device axis)
    sums_fn = jax.shard_map(data_parallel_sums, mesh=mesh, in_specs=(jax.P(), jax.P('data')),
                            out_specs=jax.P(), axis_names={'data'}, check_vma=False)
  else:
    sums_fn = local_sums

  def train_step(state: TrainState, batch):
    loss_sum, weight, grads = sums_fn(state.params, batch['tokens'])
    weight = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g / weight, grads)
    loss, grad_norm = loss_sum / weight, optax.tree.norm(grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    # A non-finite loss or gradient drops the whole update: params and moments stay as they were.
    # An elementwise select, not lax.cond: XLA fuses it into the update and writes in place,
    # where a cond kept a second copy of the whole state alive.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state.params, state.opt_state))
    new_state = state.replace(
        step=state.step + 1, params=params, opt_state=opt_state,
        nonfinite_count=state.nonfinite_count + (~finite).astype(jnp.int32),
        consecutive_nonfinite=jnp.where(finite, 0, state.consecutive_nonfinite + 1))
    metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': schedule(state.step),
               'nonfinite_count': new_state.nonfinite_count,
               'consecutive_nonfinite': new_state.consecutive_nonfinite}
    return new_state, metrics

  return train_step


def make_eval_step(model, pad_id: int):
  loss_fn = make_loss_fn(model, pad_id)
  return lambda params, batch: loss_fn(params, batch['tokens'])


@dataclasses.dataclass
class Setup:
  """Everything built from the config before the first step."""
  config: ml_collections.ConfigDict
  run: config_lib.RunShape
  mesh: Any
  model: model_lib.Transformer
  optimizer: optax.GradientTransformation
  schedule: optax.Schedule
  state_shardings: TrainState
  batch_sharding: Any
  abstract_state: TrainState
  init_fn: Any  # rng -> TrainState with fresh params
  new_state_fn: Any  # params -> TrainState at step 0 with a fresh optimizer


def build(config: ml_collections.ConfigDict, devices=None) -> Setup:
  """Resolves the config, builds mesh, model and optimizer, and the abstract sharded state."""
  devices = jax.devices() if devices is None else devices
  config, run = config_lib.resolve(config, len(devices), device=devices[0])
  mesh = sharding.make_mesh(run.mesh_shape, devices)
  model = model_lib.Transformer(config_lib.model_config(config), mesh=mesh)
  optimizer = optim.make_optimizer(config.train, config.optim.mu_dtype)
  schedule = optim.learning_rate_schedule(config.train)
  # Init traces the model once (the forward pass is dead code XLA drops); the batch must split
  # over the data-parallel devices, since fused attention runs under shard_map.
  dummy_BxT = jnp.zeros((run.mesh_shape[0] * run.mesh_shape[1], config.data.seq_len), jnp.int32)

  def new_state(params):
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, opt_state=optimizer.init(params),
                      nonfinite_count=zero, consecutive_nonfinite=zero)

  def init_fn(rng):
    return new_state(nn.meta.unbox(model.init(rng, dummy_BxT)['params']))

  rng = jax.random.key(config.train.seed)
  boxed = jax.eval_shape(lambda r: model.init(r, dummy_BxT)['params'], rng)
  logical_specs = nn.get_partition_spec(boxed)
  param_shardings = jax.tree.map(lambda spec: sharding.named_sharding(mesh, tuple(spec)),
                                 logical_specs, is_leaf=lambda x: isinstance(x, jax.P))
  abstract = jax.eval_shape(init_fn, rng)
  replicated = sharding.replicated(mesh)
  opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, abstract.opt_state,
                                        param_shardings,
                                        transform_non_params=lambda _: replicated)
  state_shardings = TrainState(step=replicated, params=param_shardings, opt_state=opt_shardings,
                               nonfinite_count=replicated, consecutive_nonfinite=replicated)
  return Setup(config=config, run=run, mesh=mesh, model=model, optimizer=optimizer,
               schedule=schedule, state_shardings=state_shardings,
               batch_sharding=sharding.named_sharding(mesh, ('batch', None)),
               abstract_state=checkpoint_lib.abstract_with_shardings(abstract, state_shardings),
               init_fn=init_fn, new_state_fn=new_state)


def load_config(workdir: str) -> ml_collections.ConfigDict:
  """The resolved config a run saved in its workdir, over today's defaults (configs/base.py), so
  that runs saved before a field existed still load."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.exists(path):
    raise FileNotFoundError(f'{path} not found: is {workdir!r} the workdir of a training run?')
  from configs import base  # pylint: disable=g-import-not-at-top
  config = base.get_config()
  with open(path, encoding='utf-8') as f:
    saved = json.load(f)
  for group, fields in saved.items():
    if group in config and isinstance(fields, dict):
      config[group].update(fields)
  return config


def load_trained(workdir: str, step: int | None = None, devices=None):
  """(config, params, setup) of a run's latest (or given) checkpoint, on this machine's devices.

  The mesh is rebuilt for the devices at hand (data-parallel over all of them), and the attention
  falls back to 'xla' where the run used a GPU-only kernel and this machine has no GPU.
  """
  config = load_config(workdir)
  config.mesh.data, config.mesh.fsdp, config.mesh.tensor = -1, 1, 1
  config.train.micro_batch_size = config.train.eval_batch_size = 0  # re-derived for these devices
  devices = jax.devices() if devices is None else devices
  if devices[0].platform != 'gpu':
    config.model.attention = 'xla'
  s = build(config, devices)
  checkpointer = checkpoint_lib.Checkpointer(workdir, read_only=True)
  try:
    _, params = checkpointer.restore_params(s.abstract_state.params, step)
  finally:
    checkpointer.close()
  return s.config, params, s


def init_state(s: Setup) -> TrainState:
  """Creates the state directly in its shardings: no host ever holds the full model."""
  init = jax.jit(s.init_fn, out_shardings=s.state_shardings)
  return init(jax.random.key(s.config.train.seed))


def jit_train_step(s: Setup, pad_id: int):
  step = make_train_step(s.model, s.optimizer, s.schedule,
                         grad_accum_steps=s.run.grad_accum_steps, pad_id=pad_id, mesh=s.mesh)
  return jax.jit(step, in_shardings=(s.state_shardings, s.batch_sharding),
                 out_shardings=(s.state_shardings, sharding.replicated(s.mesh)),
                 donate_argnums=(0,))


def jit_eval_step(s: Setup, pad_id: int):
  return jax.jit(make_eval_step(s.model, pad_id),
                 in_shardings=(s.state_shardings.params, s.batch_sharding),
                 out_shardings=sharding.replicated(s.mesh))


def abstract_batch(s: Setup, batch_size: int):
  return {'tokens': jax.ShapeDtypeStruct((batch_size, s.config.data.seq_len + 1), jnp.int32,
                                         sharding=s.batch_sharding)}


class Prefetcher:
  """Reads host batches in a background thread and puts them on the devices ahead of use.

  Yields (global device batch, the data iterator's state after that batch), so a checkpoint
  records the state of what was consumed, not of what was prefetched.
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
        state = self._iterator.get_state()
        device = {k: jax.make_array_from_process_local_data(self._sharding, v)
                  for k, v in host.items()}
        self._queue.put((device, state))
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


def evaluate(eval_step, params, batches, batch_sharding) -> float:
  """Mean next-token loss over the eval set; one host sync at the end."""
  loss_sum, weight = jnp.zeros(()), jnp.zeros(())
  for batch in batches:
    device_batch = jax.make_array_from_process_local_data(batch_sharding, batch['tokens'])
    l, w = eval_step(params, {'tokens': device_batch})
    loss_sum, weight = loss_sum + l, weight + w
  loss_sum, weight = jax.device_get((loss_sum, weight))
  return float(loss_sum / max(weight, 1.0))


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
      f'{c.train.warmup_steps:,} ({c.train.warmup_tokens:,} tokens)',
      f'grad accumulation {run.grad_accum_steps} micro-batches of {c.train.micro_batch_size} '
      f'per device',
      f'mesh              data={run.mesh_shape[0]} fsdp={run.mesh_shape[1]} '
      f'tensor={run.mesh_shape[2]} on {s.mesh.size} × {s.mesh.devices.flat[0].device_kind}',
      f'attention         {m.attention}, remat {m.remat}',
      f'precision         compute {m.dtype}, params and optimizer {m.param_dtype}',
  ] + [f'chosen            {choice}' for choice in run.choices])


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
    scalars = {'train/loss': m['loss'], 'train/ppl': float(np.exp(min(m['loss'], 50.0))),
               'train/lr': m['lr'], 'train/grad_norm': m['grad_norm'],
               'train/tokens': step * self._tokens_per_step,
               'train/nonfinite_skips': m['nonfinite_count'],
               'perf/tokens_per_sec': tokens_per_sec, 'perf/step_time': step_time,
               'perf/mfu': mfu}
    self.write(step, scalars)
    if jax.process_index() == 0:
      mfu_text = f' | MFU {mfu:.1%}' if mfu is not None else ''
      skips = f' | skipped {m["nonfinite_count"]}' if m['nonfinite_count'] else ''
      print(f'step {step}/{self._steps} | loss {m["loss"]:.4f} | lr {m["lr"]:.2e} | '
            f'grad_norm {m["grad_norm"]:.3f} | {tokens_per_sec:,.0f} tok/s | '
            f'{step_time:.3f} s/step{mfu_text}{skips} | '
            f'ETA {_format_eta((self._steps - step) * step_time)}', flush=True)
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


def _initial_state(s: Setup, checkpointer, data, is_main: bool) -> TrainState:
  """This workdir's latest checkpoint, else restore_from's params, else fresh parameters."""
  restored = checkpointer.restore_latest(s.abstract_state)
  if restored is not None:
    step, state, data_state = restored
    data.train.set_state(data_state)
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
    return jax.jit(s.new_state_fn, out_shardings=s.state_shardings)(params)
  return init_state(s)


def run_eval(eval_step, params, data, s: Setup, logger: StepLogger, step: int) -> dict:
  loss = evaluate(eval_step, params, data.eval_batches(), s.batch_sharding)
  scalars = {'eval/loss': loss, 'eval/ppl': float(np.exp(min(loss, 50.0)))}
  logger.write(step, scalars)
  if jax.process_index() == 0:
    print(f'eval at step {step} | loss {loss:.4f} | ppl {scalars["eval/ppl"]:.2f}', flush=True)
  return scalars


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str,
                       devices=None) -> dict[str, float]:
  """Trains per the config, writing logs and checkpoints to workdir; returns the last metrics."""
  from jax_pretrain import plan  # pylint: disable=g-import-not-at-top  (plan builds on this module)
  devices = jax.devices() if devices is None else devices
  config, fitted = plan.fit_micro_batch(config, devices)  # train.micro_batch_size=0 on a GPU
  s = build(config, devices)
  config, t, ck = s.config, s.config.train, s.config.checkpoint
  is_main = jax.process_index() == 0
  data = data_lib.build(config, jax.process_index(), jax.process_count())
  pad_id = data.tokenizer.pad_id
  if is_main:
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
      f.write(config.to_json_best_effort(indent=2, sort_keys=True) + '\n')
    print(describe(s, model_lib.count_params(s.abstract_state.params)), flush=True)
    if fitted:
      print(f'chosen            {fitted}', flush=True)

  checkpointer = checkpoint_lib.Checkpointer(workdir, keep=ck.keep, keep_best=ck.keep_best,
                                             async_save=ck.async_save)
  state = _initial_state(s, checkpointer, data, is_main)
  step, skips_at_start = (int(x) for x in jax.device_get((state.step, state.nonfinite_count)))

  t0 = time.perf_counter()
  train_step = jit_train_step(s, pad_id).lower(
      s.abstract_state, abstract_batch(s, t.batch_size)).compile()
  eval_step = jit_eval_step(s, pad_id)
  if is_main:
    print(f'compiled train step in {time.perf_counter() - t0:.1f}s', flush=True)

  writer = metrics_lib.MetricWriter(workdir, enabled=is_main)
  logger = StepLogger(s, writer, step)
  stop = signals.StopSignal(check_every=t.log_every)
  data_state = data.train.get_state()  # before the prefetch thread starts moving the iterator
  prefetcher = Prefetcher(data.train, s.batch_sharding)
  config_json = json.loads(config.to_json_best_effort())
  last_saved = checkpointer.latest_step()
  try:
    while step < t.steps:
      batch, data_state = next(prefetcher)
      state, metrics = train_step(state, batch)
      step += 1
      # Step - 1's metrics, read while this step runs.
      _check_finite(logger.flush(), t, last_saved, skips_at_start)
      if step % t.log_every == 0 or step == t.steps:
        logger.record(step, metrics)
      eval_due = step % t.eval_every == 0 or step == t.steps
      save_due = bool(ck.every_steps and step % ck.every_steps == 0) or (
          step == t.steps and ck.save_final)
      stopping = stop.requested(step)
      if eval_due or save_due or stopping:
        # Never evaluate or save a state before checking the steps that led to it.
        logger.record(step, metrics)
        _check_finite(logger.flush(), t, last_saved, skips_at_start)
        eval_metrics = run_eval(eval_step, state.params, data, s, logger, step) if eval_due else {}
        if save_due or (stopping and last_saved != step):
          checkpointer.save(step, state, data_state, config_json,
                            checkpoint_lib.scalars_for_ranking(eval_metrics))
          last_saved = step
        logger.pause()
      if stopping:
        checkpointer.wait()
        if is_main:
          print(f'received {stop.name}: saved step {step} to {checkpointer.directory}; run the '
                'same command to resume.', flush=True)
        return logger.latest
    _check_finite(logger.flush(), t, last_saved, skips_at_start)
  finally:
    stop.restore()
    prefetcher.close()
    data.train.close()  # stops grain's worker processes, if any
    checkpointer.close()
    writer.close()

  if t.sample_prompt and t.sample_tokens > 0:
    params = state.params
    if jax.process_count() > 1:  # a collective: every process takes part, process 0 samples
      params = multihost_utils.process_allgather(params, tiled=True)
    if is_main:
      text = sample_lib.generate_text(config_lib.model_config(config), params, data.tokenizer,
                                      t.sample_prompt, t.sample_tokens, seed=t.seed)
      print(f'sample: {t.sample_prompt!r} -> {text!r}', flush=True)
  return logger.latest
