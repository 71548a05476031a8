"""medium: 24 layers × 1024, 16 heads of 64."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 24, 1024, 2816
  c.model.num_heads = c.model.num_kv_heads = 16
  c.train.batch_size = 128
  c.train.total_tokens = int(8e9)
  c.optim.warmup_tokens = int(200e6)
  return c
