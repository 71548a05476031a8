"""AdamW with linear warmup then cosine decay, clipping by global norm, and a decay mask."""
import jax
import jax.numpy as jnp
import ml_collections
import optax


def learning_rate_schedule(t: ml_collections.ConfigDict) -> optax.Schedule:
  """0 -> learning_rate linearly over warmup_steps, then cosine down to min_learning_rate at steps.

  optax's decay_steps counts the warmup too, so it is the whole run.
  """
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=t.learning_rate, warmup_steps=t.warmup_steps,
      decay_steps=t.steps, end_value=t.min_learning_rate)


def weight_decay_mask(params):
  """True where weight decay applies: matrices, not norm scales (1-D per layer, even when the
  scanned stack makes them [layers, d_model])."""
  def decays(path, x):
    name = getattr(path[-1], 'key', str(path[-1]))
    return name != 'scale' and x.ndim >= 2
  return jax.tree_util.tree_map_with_path(decays, params)


def make_optimizer(t: ml_collections.ConfigDict,
                   mu_dtype: str = 'float32') -> optax.GradientTransformation:
  """t: the train config group; mu_dtype: config.optim.mu_dtype."""
  adamw = optax.adamw(learning_rate_schedule(t), b1=t.b1, b2=t.b2, eps=t.eps,
                      weight_decay=t.weight_decay, mask=weight_decay_mask,
                      mu_dtype=jnp.dtype(mu_dtype))
  if t.grad_clip > 0:
    return optax.chain(optax.clip_by_global_norm(t.grad_clip), adamw)
  return adamw
