"""The train state in its shardings, and the pure train and eval steps that transform it.

Flow: resolved config (config.resolve) -> mesh -> model/optimizer -> abstract state (eval_shape)
-> shardings -> jit(init, out_shardings). `build` returns all of it as a Setup; train.py runs the
loop, memory.py compiles the same step for a device it does not have (plan.py, the micro-batch
fit), workdir.py restores a run into it.
"""
import dataclasses
from typing import Any, cast

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import fp8
from jax_pretrain import hlo
from jax_pretrain import model as model_lib
from jax_pretrain import optim
from jax_pretrain import sharding
from jax_pretrain.kernels import logprobs

# Dynamic loss scaling (float16 compute only), with PyTorch's GradScaler defaults
# (torch.amp.GradScaler: init_scale 2**16, growth_factor 2.0, backoff_factor 0.5,
# growth_interval 2000; flax's DynamicScale uses the same numbers).
LOSS_SCALE_INIT = 2.0 ** 16
LOSS_SCALE_GROWTH = 2.0
LOSS_SCALE_BACKOFF = 0.5
LOSS_SCALE_GROWTH_INTERVAL = 2000
# Below this scale, non-finite gradients are not an overflow of the scaling but a blow-up: the
# non-finite guard's (train.on_nonfinite), not silently skipped for ever.
LOSS_SCALE_MIN = 1.0


@flax.struct.dataclass
class LossScale:
  """The dynamic loss scale of a float16 run: the loss is multiplied by `scale` before the
  backward pass and the gradients divided by it after; a step with non-finite gradients is
  skipped and halves it, LOSS_SCALE_GROWTH_INTERVAL finite steps in a row double it."""
  scale: jax.Array  # float32
  good_steps: jax.Array  # int32, finite steps since the scale last changed
  skips: jax.Array  # int32, steps skipped for overflowing gradients (a finite loss)

  @classmethod
  def initial(cls) -> 'LossScale':
    zero = jnp.zeros((), jnp.int32)
    return cls(scale=jnp.asarray(LOSS_SCALE_INIT, jnp.float32), good_steps=zero, skips=zero)

  def update(self, grads_finite: jax.Array, overflow: jax.Array) -> 'LossScale':
    good = jnp.where(grads_finite, self.good_steps + 1, 0)
    grow = good >= LOSS_SCALE_GROWTH_INTERVAL
    scale = jnp.where(grads_finite, jnp.where(grow, self.scale * LOSS_SCALE_GROWTH, self.scale),
                      self.scale * LOSS_SCALE_BACKOFF)
    return LossScale(scale=scale, good_steps=jnp.where(grow, 0, good),
                     skips=self.skips + overflow.astype(jnp.int32))


def uses_loss_scale(config: config_lib.Config) -> bool:
  """Whether this (resolved) config trains with dynamic loss scaling: float16 compute."""
  return config.model.dtype == 'float16'


@flax.struct.dataclass
class TrainState:
  step: jax.Array
  params: Any
  opt_state: Any
  nonfinite_count: jax.Array  # steps whose update was dropped for a non-finite loss or grad norm
  consecutive_nonfinite: jax.Array  # of those, how many in a row up to now
  loss_scale: LossScale | None = None  # float16 runs only (None: no leaves, as before)
  fp8: Any = None  # model.fp8 runs only: the projections' amax histories (fp8.histories)


def target_logprobs(model: nn.Module, params, batch,
                    temperatures: tuple[float, ...] = (1.0,)) -> tuple[jax.Array, ...]:
  """log p(tokens[:, t+1] | tokens[:, :t+1]) over the whole vocabulary, float32 [B, T], for
  batch {'tokens': int32 [B, T+1]} (optionally 'segments', see make_loss_fn): what the loss and
  GRPO's objective differentiate. One array per temperature, of the distribution at it
  (softmax(logits / temperature): what sampling at that temperature draws from), from one
  forward pass. The logits are computed a chunk of the sequence at a time and never held whole,
  nor is their gradient (kernels/logprobs.py)."""
  tokens_BxT1 = batch['tokens']
  inputs_BxT, targets_BxT = tokens_BxT1[:, :-1], tokens_BxT1[:, 1:]
  params = model_lib.layers_as_run(model.config, params)  # (the train step's already are)
  x_BxTxD, w_DxV = cast(tuple[jax.Array, jax.Array], model.apply(
      {'params': params}, inputs_BxT, segments_BxT=batch.get('segments'), logits=False))
  return logprobs.target_logprobs(x_BxTxD, w_DxV, targets_BxT, temperatures, model.mesh)


def make_loss_fn(model: nn.Module, pad_id: int):
  """(params, batch) -> (sum of next-token NLL over the weighted targets, the sum of weights).

  batch: {'tokens': int32 [B, T+1]} (pretraining: every non-pad target counts once), optionally
  with 'weights' (float32 [B, T], the weight of target t = tokens[:, t+1]; SFT: 1 on completion
  tokens, 0 on prompt tokens and padding) and 'segments' (int32 [B, T], packed examples:
  attention stays within a segment). A bare tokens array is taken as {'tokens': it}.
  Sums, not means, so that micro-batches and data-parallel shards combine exactly.
  """
  def loss_fn(params, batch):
    batch = batch if isinstance(batch, dict) else {'tokens': batch}
    nll_BxT = -target_logprobs(model, params, batch)[0]
    if 'weights' in batch:
      weights_BxT = batch['weights'].astype(jnp.float32)
    else:
      weights_BxT = (batch['tokens'][:, 1:] != pad_id).astype(jnp.float32)
    return jnp.sum(nll_BxT * weights_BxT), jnp.sum(weights_BxT)
  return loss_fn


def make_train_step(model, optimizer, schedule, *, grad_accum_steps: int, pad_id: int,
                    mesh=None, loss_scaling: bool = False, loss_fn=None):
  """A pure (state, batch) -> (state, metrics) function; jit it once.

  loss_fn: (params, batch) -> (loss summed over the batch's weighted targets, their weight) as
  make_loss_fn (the default) gives, or (loss sum, (weight, sums)) with a dict of further sums
  over the same targets (GRPO's clipped share, KL, mismatch), reported in the metrics divided by
  the weight, or (loss sum, (weight, sums, maxima, minima)) with two dicts more, reduced by their
  maximum and minimum over the micro-batches and replicas and reported as they are (GRPO's
  rollout weights). The optimizer steps on the gradient of loss sum / weight.

  loss_scaling (float16 runs; state.loss_scale is then a LossScale): each micro-batch's gradient is
  that of its mean loss × scale (see _local_sums), and the summed gradients are divided by the
  scale before clipping. Non-finite gradients with a finite loss (an overflow) skip the step like
  the non-finite guard does, but count in loss_scale.skips, not nonfinite_count.

  The step in three parts: the gradient sums over micro-batches and replicas (_gradient_sums),
  the guarded optimizer update (_guarded_update), and the step's metrics.
  """
  loss_with_sums = _with_sums(loss_fn or make_loss_fn(model, pad_id))
  sums_fn = _gradient_sums(model, loss_with_sums, grad_accum_steps, mesh,
                           given_sums=loss_fn is not None)

  def train_step(state: TrainState, batch):
    old_scale = state.loss_scale if loss_scaling else None  # (a LossScale where loss_scaling)
    scale = old_scale.scale if old_scale is not None else None
    loss_sum, (weight, sums, maxima, minima), grads, amaxes = sums_fn(state.params, state.fp8,
                                                                       batch, scale)
    weight = jnp.maximum(weight, 1.0)
    grads = jax.tree.map(lambda g: g / weight, grads)
    loss, grad_norm = loss_sum / weight, optax.tree.norm(grads)
    # FP8 clips an infinite gradient to its format's largest value: only the amax it recorded
    # tells, and the norm is then infinite, so the guard skips the step as without FP8.
    grad_norm = jnp.where(fp8.all_finite(amaxes), grad_norm, jnp.inf)
    new_state = _guarded_update(optimizer, state, grads, loss, grad_norm, amaxes, old_scale)
    # The rate this step's update used (dropped with it on a skip), from the optimizer's count.
    lr = optim.applied_learning_rate(schedule, state.opt_state)
    metrics = {'loss': loss, 'grad_norm': grad_norm, 'lr': lr,
               'nonfinite_count': new_state.nonfinite_count,
               'consecutive_nonfinite': new_state.consecutive_nonfinite,
               **{name: total / weight for name, total in sums.items()}, **maxima, **minima}
    if new_state.loss_scale is not None:
      metrics['loss_scale'] = new_state.loss_scale.scale
      metrics['loss_scale_skips'] = new_state.loss_scale.skips
    return new_state, metrics

  return train_step


def _with_sums(loss_fn):
  """loss_fn (make_train_step's) as (params, batch) -> (loss sum, (weight, sums, maxima,
  minima)): the dicts it leaves out, empty."""
  def loss_with_sums(params, batch):
    loss, aux = loss_fn(params, batch)
    aux = aux if isinstance(aux, tuple) else (aux,)
    return loss, (*aux, {}, {}, {})[:4]
  return loss_with_sums


def _gradient_sums(model, loss_with_sums, grad_accum_steps: int, mesh, given_sums: bool):
  """(params, fp8 histories, batch, loss scale or None) -> (loss sum, (weight, sums, maxima,
  minima), float32 grads, FP8 amaxes) over the whole batch.

  Gradients are reduced across data-parallel replicas once per optimizer step, not once per
  micro-batch: the accumulation (_local_sums) runs under a shard_map over the 'data' axis, where
  each replica sums its own micro-batches' float32 gradients, and one psum follows the loop.
  'fsdp' and 'tensor' stay with the compiler (GSPMD): FSDP gathers each layer's weights, and
  reduce-scatters their gradients, per micro-batch, which is what keeps its memory at 1/fsdp of
  the state."""
  local_sums = _local_sums(model, loss_with_sums, grad_accum_steps, mesh, given_sums)
  if mesh is None or mesh.shape['data'] == 1:  # (XLA rejects a psum over a 1-device axis)
    return local_sums

  def data_parallel_sums(params, histories, batch, scale):
    # check_vma=False: no implicit psum per micro-batch for the replicated params; the one
    # reduction is this explicit psum, in float32 (and the amaxes' maximum).
    loss_sum, (weight, sums, maxima, minima), grads, amaxes = local_sums(params, histories,
                                                                          batch, scale)
    loss_sum, weight, sums, grads = jax.lax.psum((loss_sum, weight, sums, grads), 'data')
    aux = (weight, sums, jax.lax.pmax(maxima, 'data'), jax.lax.pmin(minima, 'data'))
    return loss_sum, aux, grads, jax.lax.pmax(amaxes, 'data')
  return jax.shard_map(data_parallel_sums, mesh=mesh,
                       in_specs=(jax.P(), jax.P(), jax.P('data'), jax.P()),
                       out_specs=jax.P(), axis_names={'data'}, check_vma=False)


def _local_sums(model, loss_with_sums, grad_accum_steps: int, mesh, given_sums: bool):
  """(params, histories, batch, scale) -> (loss sum, (weight, sums, maxima, minima), float32
  grads, FP8 amaxes) over this replica's rows, micro-batch by micro-batch
  (_split_micro_batches). With model.fp8, histories are the amax histories (TrainState.fp8) that
  scale the FP8 matmuls, and the amaxes this step's: the maximum over the micro-batches
  (fp8.combine); else None and None.

  With a loss scale, the backward pass starts from scale × the micro-batch's mean loss (over its
  B/A·T target positions), the magnitude GradScaler's defaults are set for (PyTorch losses are
  means; the sum's gradients, B/A·T times larger, overflow float16 at the initial scale:
  BENCHMARKS.md); the summed float32 gradients are unscaled here, before the psum, the norm and
  the clipping."""
  # quantized: the FP8 weights for the step (fp8.prepare), beside the differentiated weights.
  loss_and_grad = jax.value_and_grad(
      lambda params, batch, quantized: loss_with_sums(fp8.merge(params, quantized), batch),
      has_aux=True)

  def scaled_loss(params, batch, quantized, factor):
    loss, aux = loss_with_sums(fp8.merge(params, quantized), batch)
    return loss * factor, (loss, aux)
  scaled_loss_and_grad = jax.value_and_grad(scaled_loss, has_aux=True)

  def local_sums(params, histories, batch, scale):
    factor = None
    if scale is not None:
      B, T1 = batch['tokens'].shape if isinstance(batch, dict) else batch.shape
      factor = scale / ((B // grad_accum_steps) * (T1 - 1))
    # Once, not per micro-batch: cast, and unrolled, each layer's apart (model.layers).
    weights = model_lib.with_compute_weights(model.config, params, histories)
    micro = jax.tree.map(lambda x: _split_micro_batches(x, grad_accum_steps, mesh), batch)
    aux_zeros = (_aux_zeros(loss_with_sums, params, micro) if given_sums
                 else (jnp.zeros((), jnp.float32), {}, {}, {}))  # (make_loss_fn's: a weight)
    zeros = (jnp.zeros((), jnp.float32), aux_zeros,
             jax.tree.map(lambda w: jnp.zeros(w.shape, jnp.float32), weights))
    gradient = _micro_batch_gradient(model, weights, histories, loss_and_grad,
                                     scaled_loss_and_grad, scale, factor)

    def accumulate(carry, micro_batch):
      loss_i, aux_i, grads_i = gradient(micro_batch)
      loss_sum, aux, grads = carry
      return (loss_sum + loss_i, _combine_aux(aux, aux_i),
              jax.tree_util.tree_map_with_path(fp8.combine, grads, grads_i)), None
    (loss_sum, aux, grads), _ = jax.lax.scan(accumulate, zeros, micro)
    grads, amaxes = model_lib.as_params(model.config, grads)  # (once a step)
    if factor is not None:
      grads = jax.tree.map(lambda g: g / factor, grads)
    return loss_sum, aux, grads, amaxes
  return local_sums


def _micro_batch_gradient(model, weights, histories, loss_and_grad, scaled_loss_and_grad, scale,
                          factor):
  """micro_batch -> (loss sum, aux, gradients of `weights`) of one micro-batch (_local_sums').

  FP8: the weights quantized once for all the step's micro-batches (fp8.prepare). While no history
  holds an amax (the first step), activations and gradients are scaled from themselves, which
  makes each quantization wait for its tensor's amax; on the other steps the delayed scales,
  which wait for none (BENCHMARKS.md): one lax.cond a micro-batch, whose first-step branch the
  compiled program's analysis leaves out of a step's cost (hlo.RARE_BRANCH)."""
  def gradient(micro_batch, quantized):
    if scale is None:
      (loss_i, aux_i), grads_i = loss_and_grad(weights, micro_batch, quantized)
    else:
      (_, (loss_i, aux_i)), grads_i = scaled_loss_and_grad(weights, micro_batch, quantized, factor)
    return loss_i, aux_i, grads_i
  if histories is None:
    return lambda micro_batch: gradient(micro_batch, {})
  # (the compute-dtype weights written once, which the quantizations below read: fused into them,
  # their amaxes read the float32 stack again)
  weights = jax.lax.optimization_barrier(weights)
  first, delayed = (fp8.prepare(weights, first_step, model.config.fp8_gradients,
                                model_lib.SAME_INPUT) for first_step in (True, False))
  empty = fp8.empty(histories)

  def first_step(micro_batch):
    with jax.named_scope(hlo.RARE_BRANCH):
      return gradient(micro_batch, first)
  return lambda micro_batch: jax.lax.cond(empty, first_step,
                                          lambda b: gradient(b, delayed), micro_batch)


def _split_micro_batches(x_BxT, grad_accum_steps: int, mesh):
  """[B, T] -> [A, B / A, T]: micro-batch a takes rows a, a+A, a+2A, ..., so that every device
  keeps its own rows."""
  B, T = x_BxT.shape
  x_AxMxT = x_BxT.reshape(B // grad_accum_steps, grad_accum_steps, T).swapaxes(0, 1)
  return sharding.constrain(x_AxMxT, (None, 'batch', None), mesh)


def _aux_zeros(loss_with_sums, params, micro) -> tuple:
  """The accumulation's start for a given loss_fn's (weight, sums, maxima, minima): zeros, and
  -inf and inf for the extremes, in the structure of an abstract trace of one micro-batch."""
  shapes = jax.eval_shape(lambda: loss_with_sums(params, jax.tree.map(lambda x: x[0], micro))[1])
  return tuple(jax.tree.map(lambda x, v=v: jnp.full(x.shape, v, jnp.float32), tree)
               for tree, v in zip(shapes, (0.0, 0.0, -jnp.inf, jnp.inf)))


def _guarded_update(optimizer, state: TrainState, grads, loss, grad_norm, amaxes,
                    old_scale: LossScale | None) -> TrainState:
  """The state after the optimizer's update, or with its params, moments and FP8 histories as
  they were where the loss or gradient norm is not finite (counted; with a loss scale, an
  overflow is the scaler's to skip and halve)."""
  updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
  params = optax.apply_updates(state.params, updates)
  # An elementwise select, not lax.cond: XLA fuses it into the update and writes in place,
  # where a cond kept a second copy of the whole state alive.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                   (params, opt_state), (state.params, state.opt_state))
  loss_scale, guarded = None, finite
  if old_scale is not None:
    # Overflowing gradients of a finite loss are the scaler's to skip (and halve the scale);
    # the non-finite guard counts (and halts on) a non-finite loss only.
    overflow = (jnp.isfinite(loss) & ~jnp.isfinite(grad_norm)
                & (old_scale.scale >= LOSS_SCALE_MIN))
    loss_scale = old_scale.update(jnp.isfinite(grad_norm), overflow)
    guarded = finite | overflow
  return dataclasses.replace(
      state,
      step=state.step + 1, params=params, opt_state=opt_state,
      fp8=None if amaxes is None else fp8.updated(state.fp8, amaxes, keep=~finite),
      nonfinite_count=state.nonfinite_count + (~guarded).astype(jnp.int32),
      consecutive_nonfinite=jnp.where(guarded, 0, state.consecutive_nonfinite + 1),
      loss_scale=loss_scale)


def _combine_aux(aux, aux_i):
  """Two micro-batches' (weight, sums, maxima, minima) as one: sums add, extremes extend."""
  (weight, sums, maxima, minima), (weight_i, sums_i, maxima_i, minima_i) = aux, aux_i
  return (weight + weight_i, jax.tree.map(jnp.add, sums, sums_i),
          jax.tree.map(jnp.maximum, maxima, maxima_i), jax.tree.map(jnp.minimum, minima, minima_i))


@dataclasses.dataclass
class Setup:
  """Everything built from the config before the first step."""
  config: config_lib.Config
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


def build(config: config_lib.Config, run: config_lib.RunShape, devices=None) -> Setup:
  """Builds mesh, model and optimizer, and the abstract sharded state, from a resolved config and
  its RunShape (config.resolve(config, len(devices), device=devices[0]): resolve first, once)."""
  devices = jax.devices() if devices is None else devices
  mesh = sharding.make_mesh(run.mesh_shape, devices)
  model = model_lib.Transformer(config.model, mesh=mesh)
  o, updates = config.optim, run.updates_per_step
  optimizer = optim.make_optimizer(o, config.train.steps, updates)
  schedule = optim.learning_rate_schedule(o, config.train.steps, updates)
  # Init traces the model once (the forward pass is dead code XLA drops); the batch must split
  # over the data-parallel devices, since fused attention runs under shard_map.
  dummy_BxT = jnp.zeros((run.mesh_shape[0] * run.mesh_shape[1], config.data.seq_len), jnp.int32)

  loss_scaling = uses_loss_scale(config)

  def fp8_histories(params):
    """model.fp8's amax histories of the projections."""
    return fp8.histories(params, model_lib.PROJECTIONS) if config.model.fp8 else None

  def new_state(params):
    zero = jnp.zeros((), jnp.int32)
    return TrainState(step=zero, params=params, opt_state=optimizer.init(params),
                      nonfinite_count=zero, consecutive_nonfinite=zero,
                      loss_scale=LossScale.initial() if loss_scaling else None,
                      fp8=fp8_histories(params))

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
  state_shardings = TrainState(  # (the state's tree, of shardings)
      step=replicated, params=param_shardings, opt_state=opt_shardings,  # type: ignore[arg-type]
      nonfinite_count=replicated, consecutive_nonfinite=replicated,  # type: ignore[arg-type]
      loss_scale=jax.tree.map(lambda _: replicated, abstract.loss_scale),
      fp8=jax.tree.map(lambda _: replicated, abstract.fp8))
  return Setup(config=config, run=run, mesh=mesh, model=model, optimizer=optimizer,
               schedule=schedule, state_shardings=state_shardings,
               batch_sharding=sharding.named_sharding(mesh, ('batch', None)),
               abstract_state=checkpoint_lib.abstract_with_shardings(abstract, state_shardings),
               init_fn=init_fn, new_state_fn=new_state)


def init_state(s: Setup) -> TrainState:
  """Fresh parameters, created directly in their shardings: no host ever holds the full model."""
  init = jax.jit(s.init_fn, out_shardings=s.state_shardings)
  return init(jax.random.key(s.config.train.seed))


def state_from_params(s: Setup, params) -> TrainState:
  """A step-0 state with these params and a fresh optimizer, in the state's shardings."""
  return jax.jit(s.new_state_fn, out_shardings=s.state_shardings)(params)


def host_zeros(shape, dtype) -> np.ndarray:
  """np.zeros whose data is 64-byte aligned, which jax.device_put onto a CPU device aliases
  instead of copying; like np.zeros, its pages take memory only once written."""
  nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
  raw = np.zeros(nbytes + 64, np.uint8)
  start = -raw.ctypes.data % 64
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def state_from_host_params(s: Setup, params) -> TrainState:
  """state_from_params for host (numpy) params on a CPU setup, to save without a second copy:
  the params (host_zeros filled in place: hf.read_params) and the fresh optimizer state (all
  zeros for AdamW: count, mu, nu; tests check it against optimizer.init) are aliased by the CPU
  device, and the untouched zeros take no memory. Elsewhere they are copied."""
  fresh = dataclasses.replace(jax.tree.map(lambda x: host_zeros(x.shape, x.dtype),
                                           dataclasses.replace(s.abstract_state, params=None)),
                              params=params)
  return jax.tree.map(lambda x, sharding: jax.device_put(x, sharding, may_alias=True), fresh,
                      s.state_shardings)


def jit_train_step(s: Setup, pad_id: int, loss_fn=None):
  """The train step (make_train_step) jitted in the state's and the batch's shardings, the state
  donated; loss_fn as make_train_step takes it (default: next-token NLL)."""
  step = make_train_step(s.model, s.optimizer, s.schedule,
                         grad_accum_steps=s.run.grad_accum_steps, pad_id=pad_id, mesh=s.mesh,
                         loss_scaling=uses_loss_scale(s.config), loss_fn=loss_fn)
  return jax.jit(step, in_shardings=(s.state_shardings, s.batch_sharding),
                 out_shardings=(s.state_shardings, sharding.replicated(s.mesh)),
                 donate_argnums=(0,))


def jit_eval_step(s: Setup, pad_id: int):
  """(params, batch) -> (NLL summed over the weighted targets, their count); see make_loss_fn."""
  loss_fn = make_loss_fn(s.model, pad_id)
  return jax.jit(loss_fn,
                 in_shardings=(s.state_shardings.params, s.batch_sharding),
                 out_shardings=sharding.replicated(s.mesh))


def abstract_batch(s: Setup, batch_size: int):
  """The batch the trainer feeds: tokens, and for packed SFT data (data.format='sft') the loss
  weights and segment ids (data/sft.py)."""
  T = s.config.data.seq_len
  batch = {'tokens': jax.ShapeDtypeStruct((batch_size, T + 1), jnp.int32,
                                          sharding=s.batch_sharding)}
  if s.config.data.format == 'sft':
    batch['weights'] = jax.ShapeDtypeStruct((batch_size, T), jnp.float32,
                                            sharding=s.batch_sharding)
    batch['segments'] = jax.ShapeDtypeStruct((batch_size, T), jnp.int32,
                                             sharding=s.batch_sharding)
  return batch


def summed_loss(eval_step, params, batches, batch_sharding) -> tuple[float, float]:
  """(NLL summed over the batches' non-pad targets, their count): one host sync at the end.

  batches: host arrays {'tokens': int32 [local B, T+1], ...}, this process's rows of each batch.
  """
  nll, count = jnp.zeros(()), jnp.zeros(())
  for batch in batches:
    device_batch = {k: jax.make_array_from_process_local_data(batch_sharding, v)
                    for k, v in batch.items()}
    batch_nll, batch_count = eval_step(params, device_batch)
    nll, count = nll + batch_nll, count + batch_count
  nll, count = jax.device_get((nll, count))
  return float(nll), float(count)
