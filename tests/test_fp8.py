"""model.fp8: the dense projections in FP8 (per-tensor current scaling), checked on the CPU against
float64 and against the bfloat16 model, and in the compiled H100 program (deviceless)."""
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import fp8
from jax_pretrain import plan
from jax_pretrain import state as state_lib
from tests.conftest import build_setup
from tests.test_plan import requires_plugin


def _relative_error(a, b):
  return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


def test_fp8_projection_and_its_gradients_round_like_e4m3():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((4, 16, 128))
  w = rng.standard_normal((128, 4, 32)) * 0.05
  g = rng.standard_normal((4, 16, 4, 32))
  y, vjp = jax.vjp(lambda x, w: fp8.dense(x, w), jnp.asarray(x, jnp.float32),
                   jnp.asarray(w, jnp.float32))
  dx, dw = vjp(jnp.asarray(g, jnp.float32))
  # float64 references of y = x·w and its gradients.
  y_ref = np.einsum('btd,dnh->btnh', x, w)
  dx_ref, dw_ref = np.einsum('btnh,dnh->btd', g, w), np.einsum('btd,btnh->dnh', x, g)
  # e4m3 keeps 3 mantissa bits (relative rounding <= 2^-4 per element): errors of that size, not
  # zero (the operands really are rounded) and not larger.
  for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref)):
    assert 2e-3 < _relative_error(got, want) < 2**-4


def _losses(fp8_on: bool, steps: int = 10) -> np.ndarray:
  c = config_lib.preset('test')
  c.model.fp8, c.model.dtype, c.model.attention = fp8_on, 'bfloat16', 'xla'
  c.train.steps = steps
  s = build_setup(c, jax.devices()[:1])
  state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
  rng, losses = np.random.default_rng(0), []
  for _ in range(steps):
    tokens = rng.integers(0, 256, (16, 33)).astype(np.int32)
    state, metrics = step(state, {'tokens': jax.device_put(tokens, s.batch_sharding)})
    losses.append(float(metrics['loss']))
  return np.array(losses)


def test_fp8_training_follows_the_bfloat16_run():
  bf16, with_fp8 = _losses(False), _losses(True)
  assert not np.array_equal(bf16, with_fp8)  # the FP8 path ran
  np.testing.assert_allclose(with_fp8, bf16, rtol=0.01)


def test_fp8_on_a_gpu_without_fp8_matmuls_is_one_config_error():
  a100 = types.SimpleNamespace(platform='gpu', device_kind='NVIDIA A100-SXM4-80GB',
                               compute_capability='8.0')
  c = config_lib.preset('test')
  c.model.fp8, c.model.attention = True, 'xla'
  with pytest.raises(config_lib.ConfigError, match=r'model\.fp8=True needs .* 8\.0'):
    config_lib.resolve(c, 1, device=a100)


@requires_plugin
def test_xlarge_fp8_on_h100_runs_its_projections_as_fp8_matmuls():
  c = config_lib.preset('xlarge')
  c.model.fp8 = True
  c.train.micro_batch_size = 8
  r = plan.plan(c, target='h100', num_devices=1)
  # 7 projections per layer, each a forward and two backward matmuls (XLA may merge some that
  # share an operand); everything but the embedding and the head: about 96% of the matmul FLOPs.
  assert r['fp8_matmuls'] >= 14
  assert 0.9 < r['fp8_matmul_flops_per_step'] / r['matmul_flops_per_step'] < 0.99
  assert r['fits']
