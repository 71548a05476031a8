"""tiny: 12 layers × 512, 8 heads of 64 (55.3M parameters, 32k vocabulary): the default model."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.train.total_tokens = int(1.5e9)
  c.optim.warmup_tokens = int(50e6)
  c.optim.learning_rate = 6e-4
  c.optim.min_learning_rate = 6e-5
  return c
