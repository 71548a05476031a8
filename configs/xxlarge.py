"""xxlarge: 32 layers × 2560, 20 heads of 128, mlp 6912 (2.62B parameters, tied 32k embeddings).

The 2.7B size of the users' guides (GPT-Neo/Pythia-2.7B proportions: 32 × 2560) in Llama form.
About 0.5M tokens per step (256 × 2048) and 50B tokens (~20 tokens per parameter). On two A100
40 GB the trainer's fit chooses the mesh and remat itself (mesh.fsdp and model.remat automatic):
data parallelism fits no sequence, so it takes fsdp=2 with remat full (parameters and optimizer
state split over both cards; full remat lets 8 sequences per card fit instead of 1, so FSDP gathers
the weights 16 times a step instead of 128): 32.6 GiB of 35.5 usable, ~17.5k tokens/s (python -m
jax_pretrain.plan --config=configs/xxlarge.py --target=a100-40 --num_devices=2; compiled, not
measured).
"""
from jax_pretrain import config


def get_config():
  c = config.defaults()
  c.model.num_layers, c.model.d_model, c.model.mlp_dim = 32, 2560, 6912
  c.model.num_heads = c.model.num_kv_heads = 20
  c.train.batch_size = 256
  c.train.total_tokens = int(50e9)
  c.optim.warmup_tokens = int(1e9)
  c.optim.learning_rate = 1.6e-4
  c.optim.min_learning_rate = 1.6e-5
  return c
