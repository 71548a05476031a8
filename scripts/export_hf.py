"""Exports a run's checkpoint as a Hugging Face Llama model directory.

  python scripts/export_hf.py --workdir=runs/x --out=hf/x [--step=N]

Writes config.json (LlamaForCausalLM), model.safetensors (float32), tokenizer.json and
tokenizer_config.json (from any of our text tokenizers; transformers is not needed). Load it with
transformers.AutoModelForCausalLM.from_pretrained('hf/x') and AutoTokenizer.from_pretrained('hf/x').
The mapping is jax_pretrain/hf.py.
"""
import os

from absl import flags

from jax_pretrain import cli

_WORKDIR, _STEP = cli.define_run_flags('Workdir of a training run.')
_OUT = flags.DEFINE_string('out', None, 'Output directory (created).', required=True)


def main():
  from jax_pretrain import hf
  for note in hf.export(_WORKDIR.value, _OUT.value, _STEP.value):
    print(f'note: {note}')
  print(f'wrote {", ".join(sorted(os.listdir(_OUT.value)))} to {_OUT.value}')


if __name__ == '__main__':
  cli.run(main)
