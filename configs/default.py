"""The embedded default: a small byte-level model trained on the CPU in a few minutes on the
Python reference manual (pydoc_data.topics, shipped with Python). No network needed."""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 4, 192, 512
  c.model.num_heads = c.model.num_kv_heads = 4
  c.model.vocab_size = 384  # byte tokenizer: 256 bytes + BOS/EOS/PAD, padded to a multiple of 128
  c.model.dtype = 'float32'  # the CPU has no fast bf16 matmuls
  c.model.remat = 'none'
  c.data.train = 'embedded'  # the Python reference manual, shipped with Python
  c.data.seq_len = 128
  c.train.batch_size = 32
  c.train.steps = 200
  c.optim.warmup_steps = 20
  c.optim.learning_rate = 2e-3
  c.optim.min_learning_rate = 1e-4
  c.optim.weight_decay = 0.1
  c.train.log_every = 25
  c.train.eval_every = 100
  c.train.eval_steps = 10
  c.train.sample_prompt = 'The for statement '
  c.train.sample_tokens = 160
  return c
