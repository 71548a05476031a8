"""Exports a run's checkpoint as a Hugging Face Llama model directory.

  python scripts/export_hf.py --workdir=runs/x --out=hf/x [--step=N]

Writes config.json (LlamaForCausalLM), model.safetensors (float32) and the tokenizer files
(byte-level or sentencepiece; needs transformers installed). Load it with
transformers.AutoModelForCausalLM.from_pretrained('hf/x') and AutoTokenizer.from_pretrained('hf/x').
The mapping is jax_pretrain/hf.py.
"""
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags

_WORKDIR = flags.DEFINE_string('workdir', None, 'Workdir of a training run.', required=True)
_OUT = flags.DEFINE_string('out', None, 'Output directory (created).', required=True)
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: the latest).')


def main(argv):
  from jax_pretrain import cli  # pylint: disable=g-import-not-at-top
  cli.start(argv)
  import jax  # pylint: disable=g-import-not-at-top
  from jax_pretrain import config as config_lib  # pylint: disable=g-import-not-at-top
  from jax_pretrain import hf  # pylint: disable=g-import-not-at-top
  from jax_pretrain import sample  # pylint: disable=g-import-not-at-top
  from jax_pretrain import train  # pylint: disable=g-import-not-at-top
  config, params, _ = train.load_trained(_WORKDIR.value, _STEP.value, devices=jax.devices()[:1])
  notes = hf.save(_OUT.value, jax.device_get(params), config_lib.model_config(config),
                  max_position_embeddings=config.data.seq_len,
                  tokenizer=sample.load_tokenizer(config))
  for note in notes:
    print(f'note: {note}')
  print(f'wrote {", ".join(sorted(os.listdir(_OUT.value)))} to {_OUT.value}')


if __name__ == '__main__':
  app.run(main)
