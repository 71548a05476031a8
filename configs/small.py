"""small: 16 layers × 768, 12 heads of 64."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 16, 768, 2048
  c.model.num_heads = c.model.num_kv_heads = 12
  c.train.total_tokens = int(3e9)
  c.optim.warmup_tokens = int(100e6)
  c.optim.learning_rate = 6e-4
  c.optim.min_learning_rate = 6e-5
  return c
