"""scripts/export.py writes every parameter as safetensors (fp32 exact, bf16 rounded) + config."""
import json
import subprocess
import sys

import jax
import numpy as np
from safetensors.flax import load_file

from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from jax_pretrain import workdir as workdir_lib
from tests.conftest import ROOT
from tests.conftest import subprocess_env


def test_export_writes_all_params_in_the_requested_dtype(tmp_path):
  c = config_lib.preset('test')
  c.train.steps, c.optim.warmup_steps = 2, 1
  pretrain.train_and_evaluate(c, str(tmp_path / 'run'), devices=jax.devices()[:1])
  params = workdir_lib.load(str(tmp_path / 'run'), devices=jax.devices()[:1]).params
  flat = {'.'.join(str(k.key) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_leaves_with_path(params)}
  for dtype in ('float32', 'bfloat16'):
    out = tmp_path / dtype
    subprocess.run([sys.executable, f'{ROOT}/scripts/export.py', f'--workdir={tmp_path / "run"}',
                    f'--out={out}', f'--dtype={dtype}'], check=True, env=subprocess_env(),
                   capture_output=True)
    tensors = load_file(str(out / 'model.safetensors'))
    assert set(tensors) == set(flat)
    for name, x in flat.items():
      assert tensors[name].dtype == np.dtype(jax.numpy.dtype(dtype)), name
      want = x if dtype == 'float32' else x.astype(jax.numpy.bfloat16)
      np.testing.assert_array_equal(np.asarray(tensors[name]), want)
    with open(out / 'config.json', encoding='utf-8') as f:
      assert json.load(f)['model']['num_layers'] == c.model.num_layers
