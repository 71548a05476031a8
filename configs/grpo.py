"""GRPO fine-tuning of a trained run on a verifiable task (jax_pretrain/grpo/):

  python -m jax_pretrain.grpo --workdir=runs/grpo --init=runs/sft --task=data/task/train.jsonl \
      --eval_task=data/task/heldout.jsonl

--init=RUN is `--config=configs/grpo.py:RUN`: the model group and seq_len come from that run's
config.json and its params load with a fresh optimizer (`configs/grpo.py:PRESET`, e.g. xlarge:
that preset's model, to plan a GRPO step with python -m jax_pretrain.plan --grpo). The defaults
are the guide's (16 completions a prompt, learning rate 1e-5) and TRL's (beta 0, temperature 1.0,
rewards scaled by the group's std, the bias-corrected KL, one update a rollout batch, the
rollouts' importance-sampling correction: the grpo group's defaults); train.batch_size counts
completions: 8 prompts a step.
"""
from jax_pretrain import config
from jax_pretrain.grpo import config as grpo_config


def get_config(run: str = ''):
  c = grpo_config.defaults()
  if run:
    config.fine_tune(c, run, 'configs/grpo.py')
  c.grpo.num_samples = 16
  c.grpo.max_new_tokens = 64
  c.train.batch_size = 128     # completions a step: 128 / 16 = 8 prompts
  c.train.steps = 200
  c.train.log_every = 1
  c.train.eval_every = 50
  c.train.sample_prompt = ''
  c.optim.learning_rate = 1e-5  # the guide's; TRL's GRPOConfig default is 1e-6
  c.optim.min_learning_rate = 1e-5  # constant after warmup
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.checkpoint.every_steps = 50
  c.checkpoint.keep_best = 0   # GRPO has no eval loss to rank by
  return c
