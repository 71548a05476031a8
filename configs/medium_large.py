"""medium_large: 20 layers × 1152, 18 heads of 64."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 20, 1152, 3072
  c.model.num_heads = c.model.num_kv_heads = 18
  c.train.batch_size = 128
  c.train.total_tokens = int(8e9)
  c.optim.warmup_tokens = int(200e6)
  return c
