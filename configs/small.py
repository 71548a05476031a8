"""small: 16 layers × 768, 12 heads of 64."""
from configs import base


def get_config():
  c = base.get_config()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 16, 768, 2048
  c.model.num_heads = c.model.num_kv_heads = 12
  c.train.total_tokens = int(3e9)
  c.train.warmup_tokens = int(100e6)
  c.train.learning_rate = 6e-4
  c.train.min_learning_rate = 6e-5
  return c
