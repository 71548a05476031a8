"""A model small enough for unit tests: 2 layers × 64, grouped-query attention, float32."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 2, 64, 128
  c.model.num_heads, c.model.num_kv_heads = 4, 2
  c.model.vocab_size = 384
  c.model.dtype = 'float32'
  c.model.remat = 'none'
  c.data.train = 'embedded'  # the Python reference manual, shipped with Python
  c.data.seq_len = 32
  c.train.batch_size = 16
  c.train.steps = 20
  c.optim.warmup_steps = 4
  c.optim.learning_rate = 3e-3
  c.optim.min_learning_rate = 3e-4
  c.train.log_every = 5
  c.train.eval_every = 20
  c.train.eval_steps = 4
  c.train.sample_prompt = ''
  return c
