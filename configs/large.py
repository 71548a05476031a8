"""large: 24 layers × 1536, 12 heads of 128."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 24, 1536, 4096
  c.model.num_heads = c.model.num_kv_heads = 12
  c.train.batch_size = 256
  c.train.total_tokens = int(16e9)
  c.optim.warmup_tokens = int(500e6)
  c.optim.learning_rate = 2.5e-4
  c.optim.min_learning_rate = 2.5e-5
  return c
