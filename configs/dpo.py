"""DPO fine-tuning of a trained run (an SFT run, usually) on preference pairs (jax_pretrain/dpo/):

  python -m jax_pretrain.dpo --workdir=runs/dpo --init=runs/sft --config.data.train=prefs.jsonl

--init=RUN is `--config=configs/dpo.py:RUN`: the model group and seq_len come from that run's
config.json, its params load with a fresh optimizer, and they are the frozen reference model.
The defaults are TRL's DPOConfig's (loss_type sigmoid, beta 0.1, learning rate 1e-6, no weight
decay; the trainer's cosine decay to 0, where TRL's is linear); train.batch_size counts pairs.
"""
from jax_pretrain import config
from jax_pretrain.dpo import config as dpo_config


def get_config(run: str = ''):
  c = dpo_config.defaults()
  if run:
    config.fine_tune(c, run, 'configs/dpo.py')
  c.train.batch_size = 64      # pairs a step
  c.train.steps = 200
  c.train.log_every = 10
  c.train.eval_every = 50
  c.train.sample_prompt = ''
  c.data.val_ratio = 0.05      # held-out pairs for eval/rewards/accuracies
  c.optim.learning_rate = 1e-6  # TRL's DPOConfig
  c.optim.min_learning_rate = 0.0
  c.optim.warmup_steps = 0
  c.optim.weight_decay = 0.0
  c.checkpoint.every_steps = 50
  return c
