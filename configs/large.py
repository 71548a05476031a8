"""large: 24 layers × 1536, 12 heads of 128."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 24, 1536, 4096
  c.model.num_heads = c.model.num_kv_heads = 12
  c.train.batch_size = 256
  c.train.total_tokens = int(16e9)
  c.train.warmup_tokens = int(500e6)
  c.train.learning_rate = 2.5e-4
  c.train.min_learning_rate = 2.5e-5
  return c
