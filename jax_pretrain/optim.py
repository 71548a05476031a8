"""AdamW with linear warmup then cosine decay, clipping by global norm, and a decay mask.

Everything is read from the resolved optim group (config.OptimConfig); the run's length is
train.steps.
"""
import jax
import jax.numpy as jnp
import optax

from jax_pretrain.config import OptimConfig


def learning_rate_schedule(o: OptimConfig, steps: int,
                           updates_per_step: int = 1) -> optax.Schedule:
  """0 -> learning_rate linearly over warmup_steps, then cosine down to min_learning_rate at steps.

  optax's decay_steps counts the warmup too, so it is the whole run. The schedule is a function of
  the optimizer's update count; with updates_per_step > 1 (GRPO's num_iterations: several updates
  on each rollout batch) both lengths are stretched by it, so that the curve over the run's steps
  stays the one warmup_steps and steps describe, whatever the updates a step.
  """
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=o.warmup_steps * updates_per_step,
      decay_steps=steps * updates_per_step, end_value=o.min_learning_rate)


def applied_learning_rate(schedule: optax.Schedule, opt_state) -> jax.Array:
  """The rate the optimizer applies at its next update: the schedule at the count that optax's
  scale_by_learning_rate keeps (ScaleByScheduleState in opt_state), not at the train step. A
  skipped step (the non-finite guard, a float16 overflow) keeps the old optimizer state, count
  included, so after skips the count is behind the step and the rates differ."""
  is_schedule_state = lambda x: isinstance(x, optax.ScaleByScheduleState)
  [count] = [x.count for x in jax.tree.leaves(opt_state, is_leaf=is_schedule_state)
             if is_schedule_state(x)]
  return schedule(count)


def weight_decay_mask(params):
  """True where weight decay applies: matrices, not norm scales (1-D per layer, even when the
  scanned stack makes them [layers, d_model])."""
  def decays(path, x):
    name = getattr(path[-1], 'key', str(path[-1]))
    return name != 'scale' and x.ndim >= 2
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(o: OptimConfig, steps: int,
                   updates_per_step: int = 1) -> optax.GradientTransformation:
  """o: the resolved optim group (Config.optim); steps: the run's steps (the schedule's
  length), each of updates_per_step optimizer updates (learning_rate_schedule)."""
  adamw = optax.adamw(learning_rate_schedule(o, steps, updates_per_step), b1=o.b1, b2=o.b2,
                      eps=o.eps, weight_decay=o.weight_decay, mask=weight_decay_mask,
                      mu_dtype=jnp.dtype(o.mu_dtype))
  if o.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(o.grad_clip), adamw)
  return adamw
