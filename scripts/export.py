"""Export a run's params as safetensors, with the model config beside them.

  python scripts/export.py --workdir=runs/x --out=export/x [--dtype=bfloat16] [--step=N]

Writes OUT/model.safetensors (one tensor per parameter, named by its path, e.g.
'layers.attn.wq' with the stacked layers axis first) and OUT/config.json (the model config and
the run's full resolved config). For a Hugging Face Llama directory use scripts/export_hf.py.
"""
import json
import os

from absl import flags

from jax_pretrain import cli

_WORKDIR, _STEP = cli.define_run_flags('The training run to export.')
_OUT = flags.DEFINE_string('out', None, 'Output directory.', required=True)
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16'], 'Tensor dtype.')


def main():
  import jax
  import numpy as np
  from safetensors.numpy import save_file

  from jax_pretrain import config as config_lib
  from jax_pretrain import workdir

  run = workdir.load(_WORKDIR.value, _STEP.value, devices=jax.devices()[:1])
  dtype = np.dtype(jax.numpy.dtype(_DTYPE.value))
  tensors = {'.'.join(str(k.key) for k in path): np.asarray(x).astype(dtype)
             for path, x in jax.tree_util.tree_leaves_with_path(run.params)}
  os.makedirs(_OUT.value, exist_ok=True)
  save_file(tensors, os.path.join(_OUT.value, 'model.safetensors'), metadata={'format': 'np'})
  with open(os.path.join(_OUT.value, 'config.json'), 'w', encoding='utf-8') as f:
    run_config = config_lib.as_dict(run.config)
    json.dump({'model': run_config['model'], 'dtype': _DTYPE.value, 'run_config': run_config}, f,
              indent=2)
  n = sum(t.size for t in tensors.values())
  print(f'wrote {len(tensors)} tensors ({n:,} parameters, {_DTYPE.value}) to {_OUT.value}')


if __name__ == '__main__':
  cli.run(main)
