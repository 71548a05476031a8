"""Export a run's params as safetensors, with the model config beside them.

  python scripts/export.py --workdir=runs/x --out=export/x [--dtype=bfloat16] [--step=N]

Writes OUT/model.safetensors (one tensor per parameter, named by its path, e.g.
'layers.attn.wq' with the stacked layers axis first) and OUT/config.json (the model config and
the run's full resolved config). For a Hugging Face Llama directory use scripts/export_hf.py.
"""
import argparse
import json
import os
import sys

os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--workdir', required=True, help='the training run to export')
  parser.add_argument('--out', required=True, help='output directory')
  parser.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16'])
  parser.add_argument('--step', type=int, default=None, help='checkpoint step (default: latest)')
  args = parser.parse_args()

  # pylint: disable=g-import-not-at-top
  import jax
  import numpy as np
  from safetensors.numpy import save_file
  from jax_pretrain import train

  config, params, _ = train.load_trained(args.workdir, args.step, devices=jax.devices()[:1])
  dtype = np.dtype(jax.numpy.dtype(args.dtype))
  tensors = {'.'.join(str(k.key) for k in path): np.asarray(x).astype(dtype)
             for path, x in jax.tree_util.tree_leaves_with_path(params)}
  os.makedirs(args.out, exist_ok=True)
  save_file(tensors, os.path.join(args.out, 'model.safetensors'), metadata={'format': 'np'})
  with open(os.path.join(args.out, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump({'model': config.model.to_dict(), 'dtype': args.dtype,
               'run_config': json.loads(config.to_json_best_effort())}, f, indent=2)
  n = sum(t.size for t in tensors.values())
  print(f'wrote {len(tensors)} tensors ({n:,} parameters, {args.dtype}) to {args.out}')


if __name__ == '__main__':
  main()
