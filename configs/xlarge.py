"""xlarge: 32 layers × 1920, 15 heads of 128 (1.479B parameters, tied 32k embeddings).

About 0.5M tokens per step (256 × 2048) and 30B tokens (~20 tokens per parameter).
"""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 32, 1920, 5120
  c.model.num_heads = c.model.num_kv_heads = 15
  c.train.batch_size = 256
  c.train.total_tokens = int(30e9)
  c.optim.warmup_tokens = int(1e9)
  c.optim.learning_rate = 2e-4
  c.optim.min_learning_rate = 2e-5
  return c
