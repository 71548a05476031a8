"""float16 training on the CPU with dynamic loss scaling (state.LossScale): it trains like float32,
it keeps gradients that float16 alone loses, an overflow skips its step and halves the scale, and
the scale resumes bitwise."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from jax_pretrain import state as state_lib
from tests.conftest import build_setup
from tests.conftest import logged_losses


def small_config(dtype, steps=10, **overrides):
  c = config_lib.preset('test')
  c.model.dtype = dtype
  c.train.steps, c.train.log_every, c.train.eval_every = steps, 1, steps
  c.checkpoint.every_steps = 5
  for field, value in overrides.items():
    group, name = field.split('.')
    c[group][name] = value
  return c


def logged(workdir, key) -> dict[int, float]:
  with open(os.path.join(workdir, 'metrics.jsonl'), encoding='utf-8') as f:
    return {r['step']: r[key] for r in map(json.loads, f) if key in r}


def test_float16_with_loss_scaling_trains_like_float32(tmp_path):
  losses = {}
  for dtype in ('float32', 'float16'):
    pretrain.train_and_evaluate(small_config(dtype, steps=50), str(tmp_path / dtype),
                             devices=jax.devices()[:1])
    losses[dtype] = logged_losses(tmp_path / dtype)[50]
  assert abs(losses['float16'] - losses['float32']) < 0.02 * losses['float32'], losses
  scales = logged(tmp_path / 'float16', 'train/loss_scale')
  assert len(scales) == 50 and scales[1] == state_lib.LOSS_SCALE_INIT
  assert not logged(tmp_path / 'float32', 'train/loss_scale')  # float16 runs only


def _one_step(dtype, loss_scaling, weight, scale=state_lib.LOSS_SCALE_INIT):
  """(state before, state after, metrics) of one step on the test preset, every target weighted
  `weight` (the loss is normalized by the weights: the true gradient does not depend on it)."""
  s = build_setup(small_config(dtype), jax.devices()[:1])
  state = state_lib.init_state(s)
  if loss_scaling:
    state = state.replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(scale)))
  step = jax.jit(state_lib.make_train_step(s.model, s.optimizer, s.schedule, grad_accum_steps=1,
                                           pad_id=258, loss_scaling=loss_scaling))
  tokens = jax.random.randint(jax.random.key(0), (16, 33), 0, 256)
  batch = {'tokens': tokens, 'weights': jnp.full((16, 32), weight, jnp.float32)}
  before = jax.tree.map(np.asarray, state)
  after, metrics = step(state, batch)
  return before, after, jax.device_get(metrics)


def _first_moments(state) -> dict[str, float]:
  """{parameter: norm of AdamW's first moment}, after one step (1 - b1) × its gradient."""
  [adam] = [x for x in jax.tree.leaves(state.opt_state, is_leaf=lambda x: hasattr(x, 'mu'))
            if hasattr(x, 'mu')]
  return {jax.tree_util.keystr(path): float(np.linalg.norm(np.asarray(x)))
          for path, x in jax.tree_util.tree_leaves_with_path(adam.mu)}


def test_loss_scaling_keeps_the_gradients_float16_alone_loses():
  # Weights of 1e-6 (the loss is normalized by max(their sum, 1), so every gradient is 1e-6 of
  # the usual): the backward values fall below float16's smallest normal number (6e-5).
  reference = _first_moments(_one_step('float32', False, 1e-6)[1])
  unscaled = _first_moments(_one_step('float16', False, 1e-6)[1])
  scaled = _first_moments(_one_step('float16', True, 1e-6)[1])
  assert all(reference.values())
  lost = [name for name, norm in unscaled.items() if norm == 0]
  assert "['layers']['attn']['wq']" in lost, unscaled  # float16 alone: zero gradients
  for name, norm in scaled.items():
    assert abs(norm - reference[name]) < 0.1 * reference[name], (name, norm, reference[name])


def test_an_overflow_skips_the_step_halves_the_scale_and_changes_no_parameter():
  before, after, metrics = _one_step('float16', True, 1.0, scale=2.0 ** 100)
  assert np.isfinite(metrics['loss']) and not np.isfinite(metrics['grad_norm'])
  assert float(after.loss_scale.scale) == 2.0 ** 99
  assert int(after.loss_scale.skips) == 1 and int(after.loss_scale.good_steps) == 0
  assert int(after.nonfinite_count) == 0 and int(after.step) == 1  # not the NaN guard's
  for a, b in zip(jax.tree.leaves((before.params, before.opt_state)),
                  jax.tree.leaves((after.params, after.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))
  _, finite, _ = _one_step('float16', True, 1.0)
  assert int(finite.loss_scale.skips) == 0 and int(finite.loss_scale.good_steps) == 1


def test_float16_stop_and_resume_is_bitwise_exact_scale_included(tmp_path, monkeypatch):
  # A scale that overflows within a few steps and a growth every 2 steps: the resumed run must
  # carry the scale and its count of good steps to repeat the straight run.
  monkeypatch.setattr(state_lib, 'LOSS_SCALE_INIT', 2.0 ** 24)
  monkeypatch.setattr(state_lib, 'LOSS_SCALE_GROWTH_INTERVAL', 3)
  devices = jax.devices()[:1]
  pretrain.train_and_evaluate(small_config('float16', steps=12), str(tmp_path / 'a'), devices)
  pretrain.train_and_evaluate(small_config('float16', steps=5), str(tmp_path / 'b'), devices)
  pretrain.train_and_evaluate(small_config('float16', steps=12), str(tmp_path / 'b'), devices)
  for key in ('train/loss', 'train/loss_scale', 'train/loss_scale_skips'):
    assert logged(tmp_path / 'a', key) == logged(tmp_path / 'b', key), key
  scales = logged(tmp_path / 'a', 'train/loss_scale')
  assert len(set(scales.values())) > 2, scales  # it changed, both ways
  assert logged(tmp_path / 'a', 'train/loss_scale_skips')[12] > 0


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_other_dtypes_keep_no_loss_scale(dtype):
  s = build_setup(small_config(dtype), jax.devices()[:1])
  assert s.abstract_state.loss_scale is None


def test_a_float16_checkpoint_without_a_loss_scale_is_refused_with_one_clear_line(tmp_path):
  # Written as float16 runs were before loss scaling: the train state of every other dtype.
  pretrain.train_and_evaluate(small_config('float32', steps=5), str(tmp_path),
                           devices=jax.devices()[:1])
  s = build_setup(small_config('float16', steps=5), jax.devices()[:1])
  saved = checkpoint_lib.Checkpointer(tmp_path)
  with pytest.raises(checkpoint_lib.CheckpointError, match='has no loss scale.*restore_from'):
    saved.restore_latest(s.abstract_state)
  saved.close()


def test_a_non_finite_loss_is_the_guards_not_the_scalers():
  _, after, metrics = _one_step('float16', True, float('inf'))
  assert not np.isfinite(metrics['loss'])
  assert int(after.nonfinite_count) == 1 and int(after.loss_scale.skips) == 0


def test_the_logged_rate_is_the_one_applied_after_skipped_steps():
  """A skipped step (an overflow, or the non-finite guard) keeps the optimizer state, its schedule
  count included: the next update applies the rate the skipped one would have. The metrics' lr is
  that rate, schedule(count), not schedule(step); proof that it is the one applied: the run with
  two skips ends with the params of a run of only its two good steps, whose rates are the same."""
  s = build_setup(small_config('float16'), jax.devices()[:1])
  step = jax.jit(state_lib.make_train_step(s.model, s.optimizer, s.schedule, grad_accum_steps=1,
                                           pad_id=258, loss_scaling=True))
  tokens = jax.random.randint(jax.random.key(0), (16, 33), 0, 256)
  ones = jnp.ones((16, 32), jnp.float32)

  def run(kinds):
    state, lrs = state_lib.init_state(s), []
    for kind in kinds:  # 'good', 'overflow' (the scaler's skip), 'nonfinite' (the guard's)
      scale = 2.0 ** 100 if kind == 'overflow' else state_lib.LOSS_SCALE_INIT
      state = state.replace(loss_scale=state.loss_scale.replace(scale=jnp.float32(scale)))
      weights = ones * (jnp.inf if kind == 'nonfinite' else 1.0)
      state, metrics = step(state, {'tokens': tokens, 'weights': weights})
      lrs.append(float(metrics['lr']))
    return state, lrs

  skipped, lrs = run(['good', 'good', 'overflow', 'nonfinite', 'good'])
  assert int(skipped.loss_scale.skips) == 1 and int(skipped.nonfinite_count) == 1
  schedule = lambda n: float(s.schedule(n))
  # Steps 1-5 apply (or would apply) the rate of the updates counted before them: 0, 1, 2, 2, 2.
  # (rel: the step computes the schedule in its compiled code, rounded differently)
  assert lrs == pytest.approx([schedule(n) for n in (0, 1, 2, 2, 2)], rel=1e-6)
  for lr, n in zip(lrs[3:], (3, 4)):  # schedule(step), what was logged before
    assert lr != pytest.approx(schedule(n), rel=0.1)
  straight, straight_lrs = run(['good', 'good', 'good'])
  assert straight_lrs == [lrs[0], lrs[1], lrs[4]]
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(skipped.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
