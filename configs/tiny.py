"""tiny: 12 layers × 512, 8 heads of 64 (55.3M parameters with the 32k vocabulary); base.py's model."""
from configs import base


def get_config():
  c = base.get_config()
  c.train.total_tokens = int(1.5e9)
  c.train.warmup_tokens = int(50e6)
  c.train.learning_rate = 6e-4
  c.train.min_learning_rate = 6e-5
  return c
