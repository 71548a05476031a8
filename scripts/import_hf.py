"""Imports a local Hugging Face Llama checkpoint as a run, to sample from, evaluate, or continue
pretraining.

  python scripts/import_hf.py --hf=path/to/llama --workdir=runs/y [--config=configs/default.py \
      --config.data.train=... --config.train.steps=...]

Reads config.json and model.safetensors (or its shards) from --hf, and writes into --workdir:
  checkpoints/0   the params (float32) in a step-0 train state with a fresh optimizer
  config.json     the run config: --config (default configs/default.py, with overrides) with
                  config.model taken from the checkpoint
  config.py       that config as a config file, with checkpoint.restore_from=--workdir, so that
                  `python -m jax_pretrain.main --config=runs/y/config.py --workdir=runs/z`
                  continues pretraining from the imported params (fresh optimizer and data order)
  tokenizer.model the checkpoint's sentencepiece tokenizer, when it has one (set as data.tokenizer)
The mapping is jax_pretrain/hf.py.
"""
import json
import os
import shutil
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _ROOT)

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
from ml_collections import config_flags

_HF = flags.DEFINE_string('hf', None, 'Local Hugging Face model directory.', required=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory to create.', required=True)
_CONFIG = config_flags.DEFINE_config_file(
    'config', os.path.join(_ROOT, 'configs', 'default.py'),
    'Config for everything but the model (which comes from the checkpoint); overridable with '
    '--config.group.field=value.', lock_config=False)

_CONFIG_PY = '''"""The run config of a model imported by scripts/import_hf.py: training with it starts
from the imported params. Override fields as usual: --config.data.train=... --config.train.steps=...
"""
import json
import os

import ml_collections


def get_config():
  with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), 'config.json'),
            encoding='utf-8') as f:
    return ml_collections.ConfigDict(json.load(f))
'''


def main(argv):
  from jax_pretrain import cli  # pylint: disable=g-import-not-at-top
  cli.start(argv)
  import jax  # pylint: disable=g-import-not-at-top
  from jax_pretrain import checkpoint as checkpoint_lib  # pylint: disable=g-import-not-at-top
  from jax_pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from jax_pretrain import hf  # pylint: disable=g-import-not-at-top
  from jax_pretrain import train  # pylint: disable=g-import-not-at-top
  from jax_pretrain.data import tokenizer as tokenizer_lib  # pylint: disable=g-import-not-at-top

  workdir = os.path.abspath(_WORKDIR.value)
  if os.path.exists(os.path.join(workdir, 'checkpoints')):
    raise app.UsageError(f'{workdir} already holds checkpoints; import into a new workdir.')
  hf_config, tensors = hf.load(_HF.value)
  config = _CONFIG.value
  config.model.update(hf.model_fields(hf_config))
  os.makedirs(workdir, exist_ok=True)
  sp_model = os.path.join(_HF.value, 'tokenizer.model')
  if not config.data.tokenizer and os.path.isfile(sp_model):
    config.data.tokenizer = os.path.join(workdir, 'tokenizer.model')
    shutil.copyfile(sp_model, config.data.tokenizer)
  config.checkpoint.restore_from = workdir

  params = hf.from_hf(tensors, config_lib.model_config(config))
  if config.data.tokenizer:
    # A pad id that the sentencepiece model lacks is appended after its pieces: give the embedding
    # room for it (zero rows: pad is only ever an ignored target; sampling never picks it).
    needed = tokenizer_lib.load(config.data.tokenizer).vocab_size
    if needed > config.model.vocab_size:
      params = _grow_vocab(params, -(-needed // 128) * 128)
      print(f'note: vocab_size {config.model.vocab_size} -> {params["embedding"].shape[0]}, to '
            f'hold the tokenizer\'s {needed} ids')
      config.model.vocab_size = params['embedding'].shape[0]

  s = train.build(config, jax.devices()[:1])
  state = jax.jit(s.new_state_fn, out_shardings=s.state_shardings)(params)
  with open(os.path.join(workdir, 'config.json'), 'w', encoding='utf-8') as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True) + '\n')
  with open(os.path.join(workdir, 'config.py'), 'w', encoding='utf-8') as f:
    f.write(_CONFIG_PY)
  checkpointer = checkpoint_lib.Checkpointer(workdir, async_save=False)
  try:
    checkpointer.save(0, state, {}, json.loads(config.to_json_best_effort()))
  finally:
    checkpointer.close()
  m = config.model
  print(f'imported {_HF.value}: {m.num_layers} layers × d_model {m.d_model}, {m.num_heads} heads '
        f'({m.num_kv_heads} kv) × {m.head_dim}, mlp {m.mlp_dim}, vocab {m.vocab_size}, '
        f'{"tied" if m.tie_embeddings else "untied"} embeddings -> {workdir}')
  print(f'continue pretraining: python -m jax_pretrain.main --config={workdir}/config.py '
        '--config.data.train=... --workdir=runs/NEW')


def _grow_vocab(params, vocab_size: int):
  import numpy as np  # pylint: disable=g-import-not-at-top
  def grow(x, axis):
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, vocab_size - x.shape[axis])
    return np.pad(x, pad)
  params = dict(params, embedding=grow(params['embedding'], 0))
  if 'lm_head' in params:
    params['lm_head'] = grow(params['lm_head'], 1)
  return params


if __name__ == '__main__':
  app.run(main)
