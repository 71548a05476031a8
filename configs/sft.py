"""Supervised fine-tuning of a trained run on prompt/completion (or chat) JSONL (docs/data.md):

  python -m jax_pretrain.main --config=configs/sft.py --workdir=runs/sft \
      --config.checkpoint.restore_from=runs/default --config.data.train=data/sft.jsonl

The model is the embedded default's (configs/default.py); for another run, name it after the
file, `--config=configs/sft.py:runs/xl`, and the model group and seq_len come from that run's
config.json (and checkpoint.restore_from is set to it). The params load with a fresh optimizer;
only completion tokens are trained on; examples are packed into seq_len rows with attention kept
inside each example.
"""
from jax_pretrain import config


def get_config(run: str = ''):
  c = config.defaults()
  default = config.preset('default')
  c.model, c.data.seq_len = default.model, default.data.seq_len
  if run:
    config.fine_tune(c, run, 'configs/sft.py')
  c.model.attention = 'auto'  # cuDNN or XLA: both mask attention between packed examples
  c.data.format = 'sft'
  c.data.train = ''            # required: JSONL of {"prompt", "completion"} or {"messages"}
  c.data.val_ratio = 0.05      # the last 5% of the examples are held out for eval
  c.train.batch_size = 32
  c.train.steps = 200
  c.train.log_every = 10
  c.train.eval_every = 50
  c.train.eval_steps = 10
  c.train.sample_prompt = ''   # prompts are the data's own
  # A tenth of the default's pretraining peak, no weight decay (TRL's SFTConfig: 0.0). For
  # models of a billion parameters and more, 1e-5 to 2e-5 (TRL's default 2e-5) is usual.
  c.optim.learning_rate = 2e-4
  c.optim.min_learning_rate = 2e-5
  c.optim.warmup_steps = 10
  c.optim.weight_decay = 0.0
  c.checkpoint.every_steps = 100
  return c
