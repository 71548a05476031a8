"""DPO's objective and the shapes of its update: what the program trains and its tests check.

The definitions are TRL's DPOTrainer's (1.16: trl/trainer/dpo_trainer.py, _compute_loss), and
tests/test_dpo.py checks the loss, every logged metric and every parameter's gradient against
TRL's own code on an exported model. A pair is a prompt x with a chosen completion y_w and a
rejected one y_l; a completion's log-probability is the SUM of its tokens' (TRL's
per_token_logps.sum(dim=1) over the completion mask), under the policy (logp) and the frozen
reference model (ref_logp):

  chosen_logratio   = logp(y_w | x) - ref_logp(y_w | x)
  rejected_logratio = logp(y_l | x) - ref_logp(y_l | x)
  delta             = chosen_logratio - rejected_logratio

and a pair's loss, by dpo.loss_type (beta: dpo.beta, ls: dpo.label_smoothing):

  sigmoid  -log σ(beta · delta)                                   (DPO; TRL's default)
  hinge    max(0, 1 - beta · delta)                                (SLiC)
  ipo      (chosen_logratio / |y_w| - rejected_logratio / |y_l| - 1 / (2 beta))²
           (IPO with TRL's length normalisation: each log-ratio over its completion's tokens)
  robust   (-(1 - ls) log σ(beta · delta) + ls · log σ(-beta · delta)) / (1 - 2 ls)
           (robust DPO; ls the chance that a label is flipped, in [0, 0.5))

TRL 1.16 reads label_smoothing in robust alone (its sigmoid has none), so the config refuses
it elsewhere. The loss is the mean over pairs, and dpo.rpo_alpha > 0 adds alpha times the
chosen completions' NLL, TRL's loss_type ['sigmoid', 'sft'] with loss_weights [1, alpha] (RPO;
TRL before 1.0 called it rpo_alpha): -(sum of the chosen completions' token log-probabilities)
/ (their token count), over the step's batch. (TRL takes that token mean over each micro-batch
of each device and averages them; over the whole batch, ours is the same whatever the mesh and
micro-batch, and TRL's where the batch is one micro-batch.)

Logged, with TRL's names: rewards/chosen = beta · chosen_logratio and rewards/rejected = beta ·
rejected_logratio (their means over the pairs), rewards/accuracies (the share of pairs whose
chosen reward is the larger, strictly), rewards/margins (the mean of their difference),
logps/chosen and logps/rejected (the policy's completion log-probabilities' means), and the loss.

The update's batch, B pairs a step (train.batch_size counts pairs):
  tokens     int32 [B, 2L]     prompt + chosen padded to L, then prompt + rejected padded to L:
                               the loss reads them as 2B rows of L (a pair's two sequences
                               are neighbours, so a micro-batch and a device hold whole pairs)
  mask       float32 [B, 2(L-1)]  1 where target t of that sequence is a completion token
  ref_logps  float32 [B, 2]    the reference model's (chosen, rejected) completion log-probs
  pairs      float32 [B, 1]    1 for a pair, 0 for a padding row (the eval's last batch)
  rpo_scale  float32 [B, 1]    (rpo_alpha > 0) the batch's pairs / its chosen completion tokens:
                               the NLL's sum times it, over the pairs, is its token mean
"""
import jax
import jax.numpy as jnp

from jax_pretrain import model as model_lib
from jax_pretrain import state as state_lib
from jax_pretrain.dpo import config as dpo_config

# The metrics a step and the eval report (TRL's names), the means over the pairs.
METRICS = ('rewards/chosen', 'rewards/rejected', 'rewards/accuracies', 'rewards/margins',
           'logps/chosen', 'logps/rejected')


def pair_losses(logps_Bx2: jax.Array, ref_logps_Bx2: jax.Array, lengths_Bx2: jax.Array, *,
                loss_type: str, beta: float, label_smoothing: float = 0.0) -> jax.Array:
  """Each pair's loss (float32 [B]) from the policy's and the reference's (chosen, rejected)
  completion log-probabilities and the completions' token counts (ipo's normalisation)."""
  logratios_Bx2 = logps_Bx2 - ref_logps_Bx2
  delta_B = logratios_Bx2[:, 0] - logratios_Bx2[:, 1]
  if loss_type == 'sigmoid':
    return -jax.nn.log_sigmoid(beta * delta_B)
  if loss_type == 'hinge':
    return jax.nn.relu(1.0 - beta * delta_B)
  if loss_type == 'ipo':
    avg_Bx2 = logratios_Bx2 / jnp.maximum(lengths_Bx2, 1.0)
    return (avg_Bx2[:, 0] - avg_Bx2[:, 1] - 1.0 / (2.0 * beta)) ** 2
  if loss_type == 'robust':
    ls = label_smoothing
    return ((-(1.0 - ls) * jax.nn.log_sigmoid(beta * delta_B)
             + ls * jax.nn.log_sigmoid(-beta * delta_B)) / (1.0 - 2.0 * ls))
  raise ValueError(f'unknown loss_type {loss_type!r}; one of {dpo_config.LOSS_TYPES}')


def pair_metrics(logps_Bx2: jax.Array, ref_logps_Bx2: jax.Array, beta: float) -> dict:
  """Each pair's METRICS (float32 [B] each), constants (no gradient flows through them)."""
  logps_Bx2 = jax.lax.stop_gradient(logps_Bx2)
  rewards_Bx2 = beta * (logps_Bx2 - ref_logps_Bx2)
  return {'rewards/chosen': rewards_Bx2[:, 0], 'rewards/rejected': rewards_Bx2[:, 1],
          'rewards/accuracies': (rewards_Bx2[:, 0] > rewards_Bx2[:, 1]).astype(jnp.float32),
          'rewards/margins': rewards_Bx2[:, 0] - rewards_Bx2[:, 1],
          'logps/chosen': logps_Bx2[:, 0], 'logps/rejected': logps_Bx2[:, 1]}


def sequence_logps(model, params, batch) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(completion log-probabilities float32 [B, 2], completion token counts [B, 2], the chosen
  completions' token log-probabilities summed [B]) of a batch's pairs (its tokens and mask;
  the module docstring's layout): one forward over its 2B sequences."""
  tokens_BxW = batch['tokens']
  B, W = tokens_BxW.shape
  tokens_2BxL = tokens_BxW.reshape(2 * B, W // 2)
  logp_2BxT = state_lib.target_logprobs(model, params, {'tokens': tokens_2BxL})[0]
  mask_2BxT = batch['mask'].reshape(2 * B, -1)
  logps_Bx2 = jnp.sum(logp_2BxT * mask_2BxT, axis=-1).reshape(B, 2)
  return logps_Bx2, jnp.sum(mask_2BxT, axis=-1).reshape(B, 2), logps_Bx2[:, 0]


def make_loss_fn(model, *, loss_type: str = 'sigmoid', beta: float = 0.1,
                 label_smoothing: float = 0.0, rpo_alpha: float = 0.0):
  """The train step's loss (state.make_train_step's loss_fn): (params, batch) -> (the pairs'
  losses summed (+ rpo_alpha × the chosen NLL times rpo_scale), (the pairs' count, METRICS
  summed over the pairs)); the step divides both by the count over the whole batch."""
  def loss_fn(params, batch):
    logps_Bx2, lengths_Bx2, chosen_B = sequence_logps(model, params, batch)
    ref_Bx2 = batch['ref_logps']
    pairs_B = batch['pairs'][:, 0]
    losses_B = pair_losses(logps_Bx2, ref_Bx2, lengths_Bx2, loss_type=loss_type, beta=beta,
                           label_smoothing=label_smoothing)
    loss_sum = jnp.sum(losses_B * pairs_B)
    if rpo_alpha:
      loss_sum = loss_sum + rpo_alpha * jnp.sum(-chosen_B * batch['rpo_scale'][:, 0] * pairs_B)
    sums = {k: jnp.sum(v * pairs_B) for k, v in pair_metrics(logps_Bx2, ref_Bx2, beta).items()}
    return loss_sum, (jnp.sum(pairs_B), sums)
  return loss_fn


def update_loss_fn(s: state_lib.Setup):
  """The update's loss for the resolved config (make_loss_fn with its dpo group's values)."""
  d = dpo_config.of(s.config).dpo
  return make_loss_fn(s.model, loss_type=d.loss_type, beta=d.beta,
                      label_smoothing=d.label_smoothing, rpo_alpha=d.rpo_alpha)


def scorer(s: state_lib.Setup):
  """score(params, batch) -> float32 [B, 2]: the (chosen, rejected) completion log-probabilities
  of a batch's pairs (its tokens and mask), jitted for params in the policy's shardings,
  micro-batch by micro-batch as the train step goes (no gradient: no more memory than its
  forward). It scores the reference model's ref_logps, each step from the held reference
  params or once before training (dpo.precompute_ref_logps)."""
  A = s.run.grad_accum_steps

  def score(params, batch):
    def one(micro):
      return sequence_logps(s.model, params, micro)[0]
    split = lambda x: x.reshape(x.shape[0] // A, A, x.shape[1]).swapaxes(0, 1)
    logps_AxMx2 = jax.lax.map(one, {k: split(batch[k]) for k in ('tokens', 'mask')})
    return logps_AxMx2.swapaxes(0, 1).reshape(-1, 2)
  return jax.jit(score, in_shardings=(s.state_shardings.params, s.batch_sharding),
                 out_shardings=s.batch_sharding)


def update_batch(s: state_lib.Setup, batch_size: int, length: int, rpo: bool) -> dict:
  """The update's batch, abstract (ShapeDtypeStructs in the batch sharding): batch_size pairs of
  two sequences of `length` tokens (the module docstring says what each array holds)."""
  row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=s.batch_sharding)
  B, L = batch_size, length
  batch = {'tokens': row((B, 2 * L), jnp.int32), 'mask': row((B, 2 * (L - 1)), jnp.float32),
           'ref_logps': row((B, 2), jnp.float32), 'pairs': row((B, 1), jnp.float32)}
  if rpo:
    batch['rpo_scale'] = row((B, 1), jnp.float32)
  return batch


def evaluator(s: state_lib.Setup, loss_fn):
  """evaluate(params, batch) -> (loss sum, pairs, METRICS sums) of loss_fn (make_loss_fn's) over
  a batch, micro-batch by micro-batch as the train step goes, without a gradient: the held-out
  pairs' eval/ scalars are these sums over their batches, divided by the pairs."""
  A = s.run.grad_accum_steps

  def evaluate(params, batch):
    split = lambda x: x.reshape(x.shape[0] // A, A, x.shape[1]).swapaxes(0, 1)
    loss_A, (pairs_A, sums_A) = jax.lax.map(lambda micro: loss_fn(params, micro),
                                            jax.tree.map(split, batch))
    return jnp.sum(loss_A), jnp.sum(pairs_A), jax.tree.map(jnp.sum, sums_A)
  return jax.jit(evaluate, in_shardings=(s.state_shardings.params, s.batch_sharding))


def reference_bytes(c: dpo_config.DpoTrainConfig) -> float:
  """Bytes of the held reference params, whole (at most what a device holds of them: a mesh
  shards them as the policy's); 0 with dpo.precompute_ref_logps (none is held)."""
  if c.dpo.precompute_ref_logps:
    return 0.0
  model = model_lib.Transformer(c.model)
  shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32)))
  return float(model_lib.count_params(shapes['params']) * c.model.master_dtype.itemsize)
