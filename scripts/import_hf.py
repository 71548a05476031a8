"""Imports a local Hugging Face Llama checkpoint as a run, to sample from, evaluate, or continue
pretraining.

  python scripts/import_hf.py --hf=path/to/llama --workdir=runs/y [--config=configs/default.py \
      --config.data.train=... --config.train.steps=...]

Reads config.json and model.safetensors (or its shards) from --hf, and writes into --workdir:
  checkpoints/0   the params (float32) in a step-0 train state with a fresh optimizer
  tokenizer/      the checkpoint's tokenizer.json (special tokens from its tokenizer_config.json)
                  or tokenizer.model, or --config.data.tokenizer, with its chat template
                  (chat_template.jinja or tokenizer_config.json's), which serve and SFT render
  config.json     the run config: --config (default configs/default.py, with overrides) with
                  config.model taken from the checkpoint
  config.py       that config as a config file, with checkpoint.restore_from=--workdir, so that
                  `python -m jax_pretrain.main --config=runs/y/config.py --workdir=runs/z`
                  continues pretraining from the imported params (fresh optimizer and data order)
Everything is checked before a weight is read (config.json, tokenizer, config, tensor names and
shapes); then the tensors are streamed, one at a time. The mapping is jax_pretrain/hf.py.
"""
import os

from absl import flags

from jax_pretrain import cli

_HF = flags.DEFINE_string('hf', None, 'Local Hugging Face model directory.', required=True)
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory to create.', required=True)
_CONFIG = cli.define_config(
    'default.py', 'Config for everything but the model (which comes from the checkpoint); '
    'overridable with --config.group.field=value.', lock=False)

_CONFIG_PY = '''"""The run config of a model imported by scripts/import_hf.py: training with it
starts from the imported params. Override fields as usual: --config.data.train=...
--config.train.steps=...
"""
import os

from jax_pretrain import workdir


def get_config():
  return workdir.load_config(os.path.dirname(os.path.abspath(__file__)))
'''


def main():
  from jax_pretrain import hf
  run = hf.import_run(_HF.value, _WORKDIR.value, cli.config_value(_CONFIG))
  with open(os.path.join(_WORKDIR.value, 'config.py'), 'w', encoding='utf-8') as f:
    f.write(_CONFIG_PY)
  m = run.config.model
  print(f'imported {_HF.value}: {m.num_layers} layers × d_model {m.d_model}, {m.num_heads} heads '
        f'({m.num_kv_heads} kv) × {m.head_dim}, mlp {m.mlp_dim}, vocab {m.vocab_size} (tokenizer: '
        f'{run.tokenizer.vocab_size} ids), '
        f'{"tied" if m.tie_embeddings else "untied"} embeddings -> {_WORKDIR.value}')
  print(f'continue pretraining: python -m jax_pretrain.main --config={_WORKDIR.value}/config.py '
        '--config.data.train=... --workdir=runs/NEW')


if __name__ == '__main__':
  cli.run(main)
