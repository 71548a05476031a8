r"""Writes a random Llama checkpoint of a real model's shape (config.json + bfloat16 safetensors
shards), without transformers or torch: to measure scripts/import_hf.py on a large model.

  python scripts/random_hf_checkpoint.py --shape llama-3.2-1b --out /tmp/llama1b
  /usr/bin/time -v python scripts/import_hf.py --hf=/tmp/llama1b --workdir=/tmp/llama1b-run \
      --config.data.tokenizer=byte 2>&1 | grep 'Maximum resident'

Tensors are made and written one shard (--shard-gb) at a time; their names and shapes are what
jax_pretrain/hf.py reads (the transformers agreement tests check those against transformers).
"""
import argparse
import json
import os

import ml_dtypes
import numpy as np

from jax_pretrain import cli

# config.json of the released models (rope scaling, vocabulary and all).
SHAPES = {
    'llama-3.2-1b': dict(
        hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        max_position_embeddings=131072, rope_theta=500000.0,
        rope_scaling={'rope_type': 'llama3', 'factor': 32.0, 'low_freq_factor': 1.0,
                      'high_freq_factor': 4.0, 'original_max_position_embeddings': 8192}),
    'smollm-135m': dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
        max_position_embeddings=2048, rope_theta=10000.0),
}


def main() -> None:
  cli.output_policy()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--shape', default='llama-3.2-1b', choices=sorted(SHAPES))
  p.add_argument('--out', required=True)
  p.add_argument('--shard-gb', type=float, default=1.0, help='largest shard, in GB')
  a = p.parse_args()
  with cli.user_errors():
    from safetensors.numpy import save_file

    from jax_pretrain import config as config_lib
    from jax_pretrain import hf
    hf_config = dict(architectures=['LlamaForCausalLM'], model_type='llama', hidden_act='silu',
                     rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=1, torch_dtype='bfloat16',
                     **SHAPES[a.shape])
    config = config_lib.preset('default')
    config.model.update(hf.model_fields(hf_config))
    shapes = hf.expected_tensors(config_lib.typed(config).model, hf_config['vocab_size'])
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, 'config.json'), 'w', encoding='utf-8') as f:
      json.dump(hf_config, f, indent=2)
    rng, shard, weight_map, size = np.random.default_rng(0), {}, {}, 0
    names = list(shapes)
    for k, name in enumerate(names):
      shard[name] = (rng.standard_normal(shapes[name], np.float32) * 0.02).astype(
          ml_dtypes.bfloat16)
      size += shard[name].nbytes
      if size > a.shard_gb * 1e9 or k == len(names) - 1:
        file = f'model-{len(set(weight_map.values())) + 1:05d}.safetensors'
        save_file(shard, os.path.join(a.out, file), metadata={'format': 'pt'})
        weight_map.update(dict.fromkeys(shard, file))
        shard, size = {}, 0
    with open(os.path.join(a.out, 'model.safetensors.index.json'), 'w', encoding='utf-8') as f:
      json.dump({'weight_map': weight_map}, f, indent=2)
  n = sum(int(np.prod(s)) for s in shapes.values())
  print(f'wrote {a.out}: {a.shape}, {n:,} parameters in {len(set(weight_map.values()))} '
        f'bfloat16 shards ({n * 4 / 1e9:.2f} GB as float32)')


if __name__ == '__main__':
  main()
