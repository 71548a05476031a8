"""GRPO's objective and the shapes of its update: what plan.py compiles and the program trains.

The defaults are TRL's GRPOTrainer's (1.16: trl/trainer/grpo_config.py and grpo_trainer.py), and
tests/test_grpo.py checks the loss, the advantages, the log-probabilities and every parameter's
gradient against TRL's own code on an exported model. Per prompt, G completions are sampled and
scored; each completion's advantage is its reward against its group's:

  A_i = (r_i - mean(r_group)) / (std(r_group, ddof=1) + ADVANTAGE_EPS)

(scale_rewards='group'; TRL divides by torch's std, the ddof=1 one, + 1e-4, a constant of its
code; tunix uses ddof=1 and 1e-6). The policy loss per completion token t is the clipped
importance-ratio objective (PPO's, as GRPO and TRL use it), with the KL penalty against the
frozen initial model as TRL computes it by default (use_bias_correction_kl=True, from DeepSeek-V3.2:
the k3 estimator times the ratio, so that its gradient is the unbiased reverse-KL one),

  ratio_t = exp(logp_t - logp_old_t)
  loss_t  = -min(ratio_t · A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) · A)
            + beta · ratio_t · (exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1)

(grpo.use_bias_correction_kl=False drops that ratio_t: k3 alone, tunix's and TRL's before it; the
value is the same where the ratio is 1, the gradient is not: the corrected one adds
beta · k3_t · d logp_t.) The KL term is there only when beta > 0 (beta 0: no reference model is
held; with beta > 0 the initial params are held in the policy's shardings and score each batch
once). Token-level aggregation (DAPO, TRL's default loss_type 'dapo'): the sum of loss_t over
every completion token of the batch divided by their count (TRL's num_items_in_batch, the
generation batch's completion tokens over all processes), so long completions weigh by their
tokens. Defaults (TRL's GRPOConfig): beta 0.0, epsilon 0.2 (epsilon_high 0: = epsilon),
scale_rewards 'group', temperature 1.0, num_iterations 1, use_bias_correction_kl True; the guide's
learning rate 1e-5 and 16 samples (configs/grpo.py).

logp is that of the distribution the rollouts sample, softmax(logits / temperature) over the whole
vocabulary, as TRL scores it (its fused LM head divides the logits by the temperature; at
temperature 1, the model's own); logp_ref too.

logp_old, the log-probability of the policy that sampled, at the update's precision. With one
update per rollout batch (num_iterations=1, TRL's and tunix's default) the policy that sampled is
the one being updated, so logp_old is this forward's own log-probability, held constant (the
re-score with the training forward that the ratio needs, at no extra pass; TRL does the same:
per_token_logps.detach()): the ratio is 1 in value and the gradient is the policy gradient
A · d logp. With num_iterations = μ > 1 the batch is reused for μ updates (each one optimizer
step over the whole batch, as TRL's μ iterations over its generation batch), and logp_old is
scored once, before the first, by a separate forward of the batch with the params that sampled
(the reference model's scoring function, on the policy's params): the first update's ratio is 1
up to the two programs' rounding, the later ones' move away from 1 and clipping acts
(train/clip_fraction). A separate pass, not the first update's forward kept: the train step
returns sums over its micro-batches, not per-token arrays, and TRL scores old_per_token_logps
the same way (a no-grad forward when the batch is generated). The pass costs a forward of the
batch per rollout, a third of an update, only when μ > 1.

The rollout's own log-probabilities (the engine's, over the ids it may sample) are compared
with the training forward's: train/logp_mismatch, the mean absolute gap per completion token.
The EOS that ends a completion is one of its trained tokens, so that a policy learns to stop.

The rollout correction (grpo.rollout_correction; TRL's vLLM importance sampling, on by default
in TRL 1.16: trl/trainer/grpo_trainer.py, _generate_and_score_completions and compute_loss):
the rollouts were sampled by the engine, whose distribution is not quite the training forward's,
so the policy term of loss_t is multiplied by a constant weight w (the KL term is not),

  d_t = logp_train_t - logp_rollout_t             (0 off the completion tokens)
  ratio = exp(sum_t d_t) for the completion ('sequence_*'), exp(d_t) per token ('token_*')
  w = clip(ratio, min, max) ('*_truncate') | ratio inside [min, max], else 0 ('*_mask')
  loss_t = w · -min(ratio_t · A, clip(ratio_t, ...) · A) + beta · (the KL term)

with TRL's defaults: 'sequence_mask', max 3.0, no min (TRL's None; ours 0). logp_train is the
log-probability of the params that sampled, from the training forward, held constant: this
forward's own with one update a batch, the scored logp_old with num_iterations > 1 (TRL's
old_per_token_logps, scored when the batch is generated), so w is the same for the μ updates.
Both sides are temperature-1 log-probabilities, the engine's scale (what train/logp_mismatch
compares): at grpo.temperature 1 (the default) TRL's ratio exactly; at another temperature TRL
compares the tempered ones (vLLM's processed_logprobs), which the engine does not report, and
ours is that of the temperature-1 distributions. Logged: the weight's mean, min and max (over
completion tokens, or completions with 'sequence_*': TRL's sampling/importance_sampling_ratio)
and the share of them outside [min, max] (clipped or masked).
"""
import dataclasses

import jax
import jax.numpy as jnp

from jax_pretrain import config as config_lib
from jax_pretrain import engine as engine_lib
from jax_pretrain import model as model_lib
from jax_pretrain import state as state_lib
from jax_pretrain.grpo import config as grpo_config

ADVANTAGE_EPS = 1e-4  # TRL's (grpo_trainer.py: advantages / (std_rewards + 1e-4)); tunix: 1e-6


def group_advantages(rewards_PxG: jax.Array, scale: str = 'group') -> jax.Array:
  """Advantages of P groups of G completions: reward minus the group mean, over the group's std
  (ddof=1) with scale='group', or unscaled with scale='none'."""
  rewards_PxG = rewards_PxG.astype(jnp.float32)
  centered_PxG = rewards_PxG - jnp.mean(rewards_PxG, axis=1, keepdims=True)
  if scale == 'none':
    return centered_PxG
  return centered_PxG / (jnp.std(rewards_PxG, axis=1, keepdims=True, ddof=1) + ADVANTAGE_EPS)


@dataclasses.dataclass(frozen=True)
class Correction:
  """The rollout correction (the module docstring): mode, one of grpo_config.ROLLOUT_CORRECTIONS
  but 'none'; the weight's bounds, 0 for none."""
  mode: str = 'sequence_mask'
  low: float = 0.0
  high: float = 3.0

  @classmethod
  def of(cls, g: grpo_config.GrpoConfig) -> 'Correction | None':
    """The grpo group's correction (None: rollout_correction='none')."""
    if g.rollout_correction == 'none':
      return None
    return cls(g.rollout_correction, g.rollout_correction_min, g.rollout_correction_max)


def rollout_weights(train_logp_BxT: jax.Array, rollout_logp_BxT: jax.Array,
                    mask_BxT: jax.Array, c: Correction) -> tuple[jax.Array, jax.Array]:
  """(the weight w of the module docstring, whether its ratio lay outside [low, high]): float32
  and bool, [B, 1] with 'sequence_*' (a completion's), [B, T] with 'token_*'. TRL's formula
  (grpo_trainer.py, _generate_and_score_completions: vllm_importance_sampling_ratio)."""
  diff_BxT = (train_logp_BxT - rollout_logp_BxT) * mask_BxT
  sequence = c.mode.startswith('sequence_')
  ratio = jnp.exp(jnp.sum(diff_BxT, axis=-1, keepdims=True) if sequence else diff_BxT)
  high = c.high or jnp.inf
  outside = (ratio < c.low) | (ratio > high)
  if c.mode.endswith('_truncate'):
    return jnp.clip(ratio, c.low, high), outside
  return jnp.where(outside, 0.0, ratio), outside


def correction_stats(weight: jax.Array, outside: jax.Array, mask_BxT: jax.Array):
  """({rollout_weight, rollout_outside, rollout_units} sums, {rollout_weight_max},
  {rollout_weight_min}) over the weight's units: the completion tokens, or with a weight a
  completion ([B, 1]) the completions (rows with tokens). The means are the sums over units."""
  if weight.shape[-1] == 1:
    unit = jnp.sum(mask_BxT, axis=-1, keepdims=True) > 0
  else:
    unit = mask_BxT > 0
  sums = {'rollout_weight': jnp.sum(jnp.where(unit, weight, 0.0)),
          'rollout_outside': jnp.sum(unit & outside).astype(jnp.float32),
          'rollout_units': jnp.sum(unit).astype(jnp.float32)}
  return (sums, {'rollout_weight_max': jnp.max(jnp.where(unit, weight, -jnp.inf))},
          {'rollout_weight_min': jnp.min(jnp.where(unit, weight, jnp.inf))})


def token_terms(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_BxT: jax.Array,
                ref_logp_BxT: jax.Array | None = None, *, epsilon: float,
                epsilon_high: float = 0.0, beta: float = 0.0, bias_correction_kl: bool = True,
                rollout_weight: jax.Array | None = None):
  """Per token: (loss_t of the formula above, whether the clipped branch is the smaller one, and
  the KL term that beta multiplies, or None when beta is 0). advantages_BxT: each token's
  completion's advantage. The KL term is k3 × ratio with bias_correction_kl (TRL's default), k3
  alone without: like TRL's `kl` metric, it is the term the loss holds. epsilon_high 0: epsilon.
  rollout_weight ([B, T] or [B, 1]): the rollout correction's w, on the policy term alone."""
  epsilon_high = epsilon_high or epsilon
  a_BxT = advantages_BxT.astype(jnp.float32)
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  unclipped_BxT = ratio_BxT * a_BxT
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - epsilon, 1.0 + epsilon_high) * a_BxT
  per_token_BxT = -jnp.minimum(unclipped_BxT, clipped_BxT)
  if rollout_weight is not None:  # (TRL: before the KL term is added)
    per_token_BxT = per_token_BxT * rollout_weight
  kl_BxT = None
  if beta:
    assert ref_logp_BxT is not None  # (beta > 0 scores against the reference model)
    delta_BxT = ref_logp_BxT - logp_BxT
    kl_BxT = jnp.exp(delta_BxT) - delta_BxT - 1.0
    if bias_correction_kl:
      kl_BxT = kl_BxT * ratio_BxT
    per_token_BxT = per_token_BxT + beta * kl_BxT
  return per_token_BxT, clipped_BxT < unclipped_BxT, kl_BxT


def masked_sums(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_BxT: jax.Array,
                mask_BxT: jax.Array, ref_logp_BxT: jax.Array | None = None,
                **terms) -> tuple[jax.Array, jax.Array, dict]:
  """(loss_t summed over the completion tokens (mask_BxT 1), their count, {clip_fraction[, kl]}
  summed over them); terms: token_terms' keywords."""
  per_token_BxT, clipped_BxT, kl_BxT = token_terms(logp_BxT, old_logp_BxT, advantages_BxT,
                                                   ref_logp_BxT, **terms)
  sums = {'clip_fraction': jnp.sum(clipped_BxT * mask_BxT)}
  if kl_BxT is not None:
    sums['kl'] = jnp.sum(kl_BxT * mask_BxT)
  return jnp.sum(per_token_BxT * mask_BxT), jnp.sum(mask_BxT), sums


def objective(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_B: jax.Array,
              mask_BxT: jax.Array, ref_logp_BxT: jax.Array | None = None, *,
              epsilon: float, epsilon_high: float = 0.0, beta: float = 0.0,
              bias_correction_kl: bool = True,
              rollout_weight: jax.Array | None = None) -> tuple[jax.Array, dict]:
  """(loss, metrics) of the formula above: B completions (rows), T token positions; mask_BxT 1 at
  completion tokens (prompt and padding 0). logp_BxT is differentiated; the rest are constants
  (rollout_weight: the correction's w, rollout_weights')."""
  a_BxT = jnp.broadcast_to(advantages_B.astype(jnp.float32)[:, None], logp_BxT.shape)
  loss_sum, count, sums = masked_sums(
      logp_BxT, old_logp_BxT, a_BxT, mask_BxT.astype(jnp.float32), ref_logp_BxT, epsilon=epsilon,
      epsilon_high=epsilon_high, beta=beta, bias_correction_kl=bias_correction_kl,
      rollout_weight=rollout_weight)
  tokens = jnp.maximum(count, 1.0)
  return loss_sum / tokens, {k: v / tokens for k, v in sums.items()}


def make_loss_fn(model, beta: float, temperature: float = 1.0, bias_correction_kl: bool = True,
                 *, epsilon: float, epsilon_high: float = 0.0,
                 correction: Correction | None = None):
  """The train step's loss (state.make_train_step's loss_fn): (params, batch) -> (the per-token
  loss summed over completion tokens, (their count, {clip_fraction, logp_mismatch[, kl]} sums,
  maxima, minima)); with a rollout correction (None: none, as TRL without vLLM), the loss's
  policy term times its weight, whose statistics (correction_stats) join the sums, maxima and
  minima.

  batch: 'tokens' int32 [B, T+1]; float32 [B, T] 'mask' (1 where target t is a completion
  token), 'advantages' (its completion's advantage), 'rollout_logp' (the engine's log-probability
  of it, at temperature 1), with beta > 0 'ref_logp' (the initial model's, at `temperature`), and
  with num_iterations > 1 'old_logp' (the sampling params', at `temperature`: logp_old) and, with
  a correction at a temperature other than 1, 'old_logp_at_one' (theirs at temperature 1).
  logp is that of the sampling distribution, softmax(logits / temperature), as TRL scores it;
  without 'old_logp', logp_old is this forward's own, held constant (see the module docstring).
  The mismatch and the correction compare temperature-1 log-probabilities, the engine's scale."""
  temperatures = (temperature,) if temperature == 1.0 else (temperature, 1.0)

  def loss_fn(params, batch):
    logp_BxT, *untempered = state_lib.target_logprobs(model, params, batch, temperatures)
    held_BxT = jax.lax.stop_gradient(logp_BxT)
    at_one_BxT = jax.lax.stop_gradient(untempered[0]) if untempered else held_BxT
    mask_BxT = batch['mask']
    weight, maxima, minima, extra = None, {}, {}, {}
    if correction is not None:
      weight, outside = rollout_weights(_sampler_logp(batch, at_one_BxT, temperature),
                                        batch['rollout_logp'], mask_BxT, correction)
      extra, maxima, minima = correction_stats(weight, outside, mask_BxT)
    loss_sum, count, sums = masked_sums(
        logp_BxT, batch.get('old_logp', held_BxT), batch['advantages'], mask_BxT,
        batch.get('ref_logp'), epsilon=epsilon, epsilon_high=epsilon_high, beta=beta,
        bias_correction_kl=bias_correction_kl, rollout_weight=weight)
    sums['logp_mismatch'] = jnp.sum(jnp.abs(at_one_BxT - batch['rollout_logp']) * mask_BxT)
    return loss_sum, (count, {**sums, **extra}, maxima, minima)
  return loss_fn


def _sampler_logp(batch: dict, at_one_BxT: jax.Array, temperature: float) -> jax.Array:
  """The params that sampled: their temperature-1 log-probabilities from the training forward
  (the correction's logp_train): with num_iterations > 1 those scored before the first update
  ('old_logp' at temperature 1, else 'old_logp_at_one'), else this forward's own."""
  if 'old_logp_at_one' in batch:
    return batch['old_logp_at_one']
  if 'old_logp' in batch and temperature == 1.0:
    return batch['old_logp']
  return at_one_BxT


def scorer(s: state_lib.Setup, temperatures: tuple[float, ...]):
  """score(params, fp8 histories, batch) -> (float32 [B, T], one a temperature): each target's
  log-probability at each temperature (the sampling one first), jitted for params in the
  policy's shardings, micro-batch by micro-batch as the train step goes (no gradient, so no more
  memory than its forward), with the train step's forward: its weights (with_compute_weights)
  and, with model.fp8, its delayed scales from the amax histories (the train state's; None
  without FP8), so that the first update's ratio is 1 (with empty histories, a run's first step
  from params without them, each scales from the tensors themselves: the scorer from each
  micro-batch, the update from each data-parallel device's part of it). It scores the reference
  model's logp_ref (at its run's histories) and, with num_iterations > 1, the sampling policy's
  logp_old (and old_logp_at_one: score_temperatures)."""
  A = s.run.grad_accum_steps

  def score(params, histories, batch):
    weights = model_lib.with_compute_weights(s.model.config, params, histories)

    def one(tokens_MxT1):
      return state_lib.target_logprobs(s.model, weights, {'tokens': tokens_MxT1}, temperatures)
    tokens_BxT1 = batch['tokens']
    B, T1 = tokens_BxT1.shape
    logp_AxMxT = jax.lax.map(one, tokens_BxT1.reshape(B // A, A, T1).swapaxes(0, 1))
    return tuple(x.swapaxes(0, 1).reshape(B, T1 - 1) for x in logp_AxMxT)
  return jax.jit(score, in_shardings=(s.state_shardings.params, s.state_shardings.fp8,
                                      s.batch_sharding),
                 out_shardings=s.batch_sharding)


def score_temperatures(g: grpo_config.GrpoConfig) -> tuple[float, ...]:
  """The scorer's temperatures: the sampling one, and 1 where the rollout correction needs the
  sampling params' temperature-1 log-probabilities apart (num_iterations > 1 at another
  temperature: 'old_logp_at_one')."""
  if g.temperature != 1.0 and g.num_iterations > 1 and g.rollout_correction != 'none':
    return (g.temperature, 1.0)
  return (g.temperature,)


def check_batch(c: grpo_config.GrpoTrainConfig) -> None:
  """A step's completions (train.batch_size) make whole groups (grpo.num_samples each)."""
  if c.train.batch_size % c.grpo.num_samples:
    raise config_lib.ConfigError(
        f'train.batch_size={c.train.batch_size} (completions a step) is not a multiple of '
        f'grpo.num_samples={c.grpo.num_samples} (completions a prompt).')


def update_loss_fn(s: state_lib.Setup):
  """The update's loss for the resolved config (make_loss_fn with its beta, temperature, KL
  correction, clip range and rollout correction)."""
  g = grpo_config.of(s.config).grpo
  return make_loss_fn(s.model, g.beta, g.temperature, g.use_bias_correction_kl,
                      epsilon=g.epsilon, epsilon_high=g.epsilon_high,
                      correction=Correction.of(g))


def update_batch(s: state_lib.Setup, width: int) -> dict:
  """The update's batch, abstract (ShapeDtypeStructs in the batch sharding): batch_size rows of
  `width` tokens (make_loss_fn says what each array holds)."""
  c = grpo_config.of(s.config)
  B, T = c.train.batch_size, width - 1
  row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=s.batch_sharding)
  batch = {'tokens': row((B, T + 1), jnp.int32), 'mask': row((B, T), jnp.float32),
           'advantages': row((B, T), jnp.float32), 'rollout_logp': row((B, T), jnp.float32)}
  if c.grpo.beta:
    batch['ref_logp'] = row((B, T), jnp.float32)
  if c.grpo.num_iterations > 1:
    batch['old_logp'] = row((B, T), jnp.float32)
  if len(score_temperatures(c.grpo)) > 1:
    batch['old_logp_at_one'] = row((B, T), jnp.float32)
  return batch


def update_width(c: grpo_config.GrpoTrainConfig, longest_prompt: int) -> int:
  """Tokens per row of the update: room for the longest prompt + grpo.max_new_tokens, such that
  the model's inputs (all but the last token) are a multiple of 8 long (cuDNN's fused attention
  trains on no odd length), and at most data.seq_len of them."""
  inputs = -(-(longest_prompt + c.grpo.max_new_tokens - 1) // 8) * 8
  return min(inputs, c.data.seq_len) + 1


def rollout_slots(c: grpo_config.GrpoTrainConfig) -> int:
  """Completions the engine decodes at once over all devices (its KV cache's rows):
  grpo.rollout_slots, or all of a step's."""
  return c.grpo.rollout_slots or c.train.batch_size


def engine_context(c: grpo_config.GrpoTrainConfig, longest_prompt: int) -> int:
  """Tokens per row of the engine's cache: the longest prompt + grpo.max_new_tokens (what a
  completion can reach), not data.seq_len."""
  return longest_prompt + c.grpo.max_new_tokens


def engine_cache_bytes(c: grpo_config.GrpoTrainConfig, longest_prompt: int,
                       num_devices: int) -> float:
  """Bytes a device holds of the engine's cache (kept between rollouts, so beside the update)."""
  return engine_lib.cache_bytes(c.model, rollout_slots(c), engine_context(c, longest_prompt),
                                num_devices, c.grpo.kv_cache_dtype)


