"""GRPO (group relative policy optimization) with verifiable rewards: the objective.

Per prompt, G completions are sampled and scored (tasks.py); each completion's advantage is its
reward against its group's:

  A_i = (r_i - mean(r_group)) / (std(r_group, ddof=1) + ADVANTAGE_EPS)

(scale_rewards='group'; TRL's GRPOTrainer divides by torch's std, which is the ddof=1 one; tunix's
GRPO uses ddof=1 and 1e-6 — we take ddof=1 and 1e-6). The policy loss per completion token t is
the clipped importance-ratio objective (PPO's, as GRPO and TRL use it),

  ratio_t = exp(logp_t - logp_old_t)
  loss_t  = -min(ratio_t · A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) · A)
            + beta · (exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1)

where logp_old are the rollout's log-probabilities, and the KL penalty against the frozen initial
model uses the k3 estimator (Schulman's; TRL and tunix use it), only when beta > 0 (beta 0: no
reference model is held). Token-level aggregation (DAPO, TRL's loss_type 'dapo'): the sum of
loss_t over every completion token of the batch divided by their count, so long completions weigh
by their tokens. Defaults (TRL): beta 0.0, epsilon 0.2 (epsilon_high = epsilon), scale_rewards
'group'.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_pretrain import engine as engine_lib

ADVANTAGE_EPS = 1e-6


def group_advantages(rewards_PxG: jax.Array, scale: str = 'group') -> jax.Array:
  """Advantages of P groups of G completions: reward minus the group mean, over the group's std
  (ddof=1) with scale='group', or unscaled with scale='none'."""
  rewards_PxG = rewards_PxG.astype(jnp.float32)
  centered_PxG = rewards_PxG - jnp.mean(rewards_PxG, axis=1, keepdims=True)
  if scale == 'none':
    return centered_PxG
  return centered_PxG / (jnp.std(rewards_PxG, axis=1, keepdims=True, ddof=1) + ADVANTAGE_EPS)


def objective(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_B: jax.Array,
              mask_BxT: jax.Array, ref_logp_BxT: jax.Array | None = None, *,
              epsilon: float = 0.2, epsilon_high: float | None = None,
              beta: float = 0.0) -> tuple[jax.Array, dict]:
  """(loss, metrics) of the formula above: B completions (rows), T token positions; mask_BxT 1 at
  completion tokens (prompt and padding 0). logp_BxT is differentiated; the rest are constants."""
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  mask_BxT = mask_BxT.astype(jnp.float32)
  a_Bx1 = advantages_B.astype(jnp.float32)[:, None]
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  unclipped_BxT = ratio_BxT * a_Bx1
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - epsilon, 1.0 + epsilon_high) * a_Bx1
  per_token_BxT = -jnp.minimum(unclipped_BxT, clipped_BxT)
  tokens = jnp.maximum(jnp.sum(mask_BxT), 1.0)
  metrics = {'clip_fraction': jnp.sum((clipped_BxT < unclipped_BxT) * mask_BxT) / tokens}
  if beta:
    delta_BxT = ref_logp_BxT - logp_BxT
    kl_BxT = jnp.exp(delta_BxT) - delta_BxT - 1.0
    per_token_BxT = per_token_BxT + beta * kl_BxT
    metrics['kl'] = jnp.sum(kl_BxT * mask_BxT) / tokens
  loss = jnp.sum(per_token_BxT * mask_BxT) / tokens
  return loss, metrics


@dataclasses.dataclass
class Rollouts:
  """num_samples completions of each prompt, as a training batch: rows grouped by prompt."""
  tokens_BxT1: np.ndarray  # int32: prompt, completion, then pad_id
  mask_BxT: np.ndarray  # float32: 1 where the target tokens_BxT1[:, t + 1] is a completion token
  logp_BxT: np.ndarray  # float32: the rollout's log-probability of each such target (else 0)
  completions: list[str]


def rollouts(eng, prompts: list[list[int]], num_samples: int, *, max_new_tokens: int,
             temperature: float, seed: int, pad_id: int) -> Rollouts:
  """Samples num_samples completions of each prompt with the engine (KV-cached, batched; sample
  k of prompt p uses the seed and stream k, so a run's rollouts are reproducible) and keeps
  each sampled token's log-probability. (The engine drops EOS from a completion, and its
  log-probability with it: a completion's last target is its last text token.)"""
  sequences = eng.generate([
      engine_lib.Sequence(prompt=list(prompt), max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=seed + p, stream=k)
      for p, prompt in enumerate(prompts) for k in range(num_samples)])
  width = max(len(s.prompt) + len(s.tokens) for s in sequences)
  tokens = np.full((len(sequences), width), pad_id, np.int32)
  mask = np.zeros((len(sequences), width - 1), np.float32)
  logp = np.zeros((len(sequences), width - 1), np.float32)
  for b, s in enumerate(sequences):
    start, end = len(s.prompt), len(s.prompt) + len(s.tokens)
    tokens[b, :end] = s.prompt + s.tokens
    mask[b, start - 1:end - 1] = 1.0  # target t is token t + 1
    logp[b, start - 1:end - 1] = s.logprobs
  return Rollouts(tokens, mask, logp, [s.text for s in sequences])
