"""model.fp8: the dense projections in FP8 (delayed scaling in the train step, current scaling
elsewhere), checked on the CPU against float64 and against the bfloat16 model, its amax histories
through accumulation, meshes and a resume, and in the compiled H100 program (deviceless)."""
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


def test_a_delayed_scale_rounds_like_e4m3_and_records_the_amaxes_as_its_gradient():
  rng = np.random.default_rng(1)
  x = rng.standard_normal((64, 128))
  w = rng.standard_normal((128, 96)) * 0.05
  g = rng.standard_normal((64, 96)) * 1e-3  # (far below 1: a scale of 1 would flush it to zero)
  history = np.zeros((2, fp8.HISTORY), np.float32)
  history[0, 3], history[1, 7] = np.abs(x).max(), np.abs(g).max()  # the largest in the window
  y, vjp = jax.vjp(lambda x, w, h: fp8.dense(x, w, history=h), jnp.asarray(x, jnp.float32),
                   jnp.asarray(w, jnp.float32), jnp.asarray(history))
  dx, dw, amaxes = vjp(jnp.asarray(g, jnp.float32))
  for got, want in ((y, x @ w), (dx, g @ w.T), (dw, x.T @ g)):
    assert 2e-3 < _relative_error(got, want) < 2**-4
  np.testing.assert_allclose(np.asarray(amaxes)[:, 0], [np.abs(x).max(), np.abs(g).max()],
                             rtol=1e-6)
  assert not np.asarray(amaxes)[:, 1:].any()


def _fp8_step(micro_batch_size: int, devices, mesh_data: int = 1):
  """The test preset with FP8, one step on a fixed batch: the state after it."""
  c = config_lib.preset('test')
  c.model.fp8, c.model.attention = True, 'xla'
  c.train.micro_batch_size, c.mesh.data = micro_batch_size, mesh_data
  s = build_setup(c, devices)
  state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
  tokens = np.random.default_rng(0).integers(0, 256, (16, 33)).astype(np.int32)
  return step(state, {'tokens': jax.device_put(tokens, s.batch_sharding)})[0]


def test_the_amax_histories_take_the_maximum_over_micro_batches_and_devices_never_the_sum():
  whole = _fp8_step(16, jax.devices()[:1])
  recorded = jax.tree.map(lambda h: np.asarray(h)[..., 0], whole.fp8)
  assert all(x.min() > 0 for x in jax.tree.leaves(recorded))  # every projection recorded both
  for micro_batch_size, devices, data in ((4, jax.devices()[:1], 1), (4, jax.devices()[:2], 2)):
    split = _fp8_step(micro_batch_size, devices, data)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a)[..., 0], b, rtol=1e-5),
                 split.fp8, recorded)
    jax.tree.map(lambda h: np.testing.assert_array_equal(np.asarray(h)[..., 1:], 0), split.fp8)


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
