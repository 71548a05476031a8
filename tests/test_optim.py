"""Optimizer: the schedule, the weight-decay mask, and gradient accumulation."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import optim
from jax_pretrain import state as state_lib
from tests.conftest import build_setup


def resolved_test_config(**overrides):
  """The test preset with train.* or optim.* fields overridden (each goes to its group)."""
  c = config_lib.preset('test')
  for k, v in overrides.items():
    (c.optim if k in c.optim else c.train)[k] = v
  return c


def test_schedule_warmup_middle_and_end():
  c = resolved_test_config(steps=1000, warmup_steps=100, learning_rate=1e-3,
                           min_learning_rate=1e-4)
  lr = optim.learning_rate_schedule(c.optim, c.train.steps)
  assert float(lr(0)) == 0.0
  np.testing.assert_allclose(float(lr(50)), 0.5e-3, rtol=1e-6)  # linear warmup
  np.testing.assert_allclose(float(lr(100)), 1e-3, rtol=1e-6)  # end of warmup: the peak
  np.testing.assert_allclose(float(lr(550)), (1e-3 + 1e-4) / 2, rtol=1e-5)  # cosine midpoint
  np.testing.assert_allclose(float(lr(1000)), 1e-4, rtol=1e-6)  # end: the minimum


def test_weight_decay_mask_skips_norm_scales():
  params = {'embedding': jnp.zeros((8, 4)),
            'layers': {'attn': {'wq': jnp.zeros((2, 4, 2, 2))},
                       'attn_norm': {'scale': jnp.zeros((2, 4))}},  # scanned: [layers, d]
            'final_norm': {'scale': jnp.zeros((4,))}}
  mask = optim.weight_decay_mask(params)
  assert mask == {'embedding': True,
                  'layers': {'attn': {'wq': True}, 'attn_norm': {'scale': False}},
                  'final_norm': {'scale': False}}


def test_weight_decay_applies_only_where_masked():
  c = resolved_test_config(learning_rate=0.1, min_learning_rate=0.1, warmup_steps=0, steps=10,
                           weight_decay=0.5, grad_clip=0.0)
  tx = optim.make_optimizer(c.optim, c.train.steps)
  params = {'w': jnp.ones((2, 2)), 'norm': {'scale': jnp.ones((2,))}}
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  updates, _ = tx.update(zero_grads, tx.init(params), params)
  np.testing.assert_allclose(updates['w'], -0.1 * 0.5 * np.ones((2, 2)), rtol=1e-6)
  np.testing.assert_array_equal(updates['norm']['scale'], np.zeros(2))


@pytest.mark.parametrize('accum', [2, 4])
def test_accumulated_micro_batches_equal_one_large_batch(accum):
  batch_size = 16
  big = build_setup(resolved_test_config(batch_size=batch_size), devices=jax.devices()[:1])
  small = build_setup(resolved_test_config(batch_size=batch_size,
                                           micro_batch_size=batch_size // accum),
                      devices=jax.devices()[:1])
  assert small.run.grad_accum_steps == accum and big.run.grad_accum_steps == 1
  tokens = jax.random.randint(jax.random.key(0), (batch_size, 33), 0, 259)
  tokens = tokens.at[3, 20:].set(258)  # padding counts the same in both
  batch = {'tokens': tokens}
  with jax.default_matmul_precision('float32'):
    state_big, m_big = state_lib.jit_train_step(big, pad_id=258)(state_lib.init_state(big), batch)
    state_small, m_small = state_lib.jit_train_step(small, pad_id=258)(
        state_lib.init_state(small), batch)
  np.testing.assert_allclose(m_small['loss'], m_big['loss'], rtol=1e-6)
  np.testing.assert_allclose(m_small['grad_norm'], m_big['grad_norm'], rtol=1e-5)
  for a, b in zip(jax.tree.leaves(state_small.params), jax.tree.leaves(state_big.params)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_first_moments_halve_their_memory_and_train_like_float32():
  def run(mu_dtype):
    c = resolved_test_config()
    c.optim.mu_dtype = mu_dtype
    s = build_setup(c, devices=jax.devices()[:1])
    state, step = state_lib.init_state(s), state_lib.jit_train_step(s, pad_id=258)
    tokens = jax.random.randint(jax.random.key(0), (16, 33), 0, 256)
    losses = []
    for _ in range(8):
      state, m = step(state, {'tokens': tokens})
      losses.append(float(m['loss']))
    return s.abstract_state.opt_state[1][0], np.array(losses)

  adam_bf16, losses_bf16 = run('bfloat16')
  adam_f32, losses_f32 = run('float32')
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(adam_bf16.mu))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adam_bf16.nu))
  assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(adam_f32.mu))
  assert losses_bf16[-1] < losses_bf16[0] - 0.5
  np.testing.assert_allclose(losses_bf16, losses_f32, rtol=2e-2)
