"""Checkpoints: exact resume after SIGTERM and SIGKILL, damaged directories, shape mismatches,
restoring across meshes, keep-last-plus-best, the non-finite guard, and a save that blocks only to
copy the state."""
import os
import shutil
import signal
import subprocess
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import hooks as hooks_lib
from jax_pretrain import pretrain
from jax_pretrain import state as state_lib
from jax_pretrain import train
from jax_pretrain import workdir as workdir_lib
from tests.conftest import ROOT
from tests.conftest import STEPS
from tests.conftest import build_setup
from tests.conftest import command
from tests.conftest import logged_losses
from tests.conftest import run_and_signal
from tests.conftest import subprocess_env


def test_sigterm_saves_exits_cleanly_and_resume_is_bitwise_exact(tmp_path, uninterrupted):
  out, rc = run_and_signal(tmp_path, signal.SIGTERM, 10)
  assert rc == 0, out
  assert 'received SIGTERM: saved step' in out
  stopped = max(logged_losses(tmp_path))
  assert stopped < STEPS, 'the signal came too late to test anything'
  resumed = subprocess.run(command(tmp_path), env=subprocess_env(), cwd=ROOT, capture_output=True,
                           text=True)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f'resuming from step {stopped}' in resumed.stdout
  assert logged_losses(tmp_path) == uninterrupted  # every step, bitwise


def test_sigkill_during_async_saves_loses_only_unsaved_steps(tmp_path, uninterrupted):
  # A save every step: the kill lands while one is being written.
  out, rc = run_and_signal(tmp_path, signal.SIGKILL, 15, '--config.checkpoint.every_steps=1')
  assert rc == -signal.SIGKILL, out
  complete = checkpoint_lib.Checkpointer(tmp_path, read_only=True)
  last = complete.latest_step()
  complete.close()
  assert last is not None and last >= 10
  shutil.move(tmp_path / 'metrics.jsonl', tmp_path / 'killed.jsonl')
  resumed = subprocess.run(command(tmp_path, '--config.checkpoint.every_steps=1'),
                           env=subprocess_env(), cwd=ROOT, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert f'resuming from step {last}' in resumed.stdout
  after = logged_losses(tmp_path)
  assert sorted(after) == list(range(last + 1, STEPS + 1))
  assert after == {s: uninterrupted[s] for s in after}


def small_config(steps=10, **checkpoint):
  c = config_lib.preset('test')
  c.train.steps = steps
  c.train.eval_every = 5
  c.checkpoint.every_steps = 5
  for k, v in checkpoint.items():
    c.checkpoint[k] = v
  return c


def test_damaged_and_partial_checkpoints_are_skipped(tmp_path, caplog):
  pretrain.train_and_evaluate(small_config(), str(tmp_path), devices=jax.devices()[:1])
  ckpt = tmp_path / 'checkpoints'
  assert sorted(int(p) for p in os.listdir(ckpt) if p.isdigit()) == [5, 10]
  # Step 10 loses its array data; a half-written step 15 is left behind under a temporary name.
  for root, _, files in os.walk(ckpt / '10' / 'state'):
    for f in files:
      if not f.startswith('_'):
        os.remove(os.path.join(root, f))
  (ckpt / '15.orbax-checkpoint-tmp-1234').mkdir()
  s = build_setup(small_config(), devices=jax.devices()[:1])
  checkpointer = checkpoint_lib.Checkpointer(tmp_path)
  step, state = checkpointer.restore_latest(s.abstract_state)
  checkpointer.close()
  assert step == 5 and int(state.step) == 5
  assert 'checkpoint' in caplog.text and 'damaged' in caplog.text
  assert os.path.isdir(ckpt / '10.damaged')  # kept for inspection, out of the way
  # The resumed run trains through step 10 again and saves it.
  pretrain.train_and_evaluate(small_config(), str(tmp_path), devices=jax.devices()[:1])
  assert sorted(int(p) for p in os.listdir(ckpt) if p.isdigit()) == [5, 10]


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
  pretrain.train_and_evaluate(small_config(steps=5), str(tmp_path / 'a'), devices=jax.devices()[:1])
  c = small_config(steps=10)
  c.model.mlp_dim = 256
  # Resuming: the config is compared with the checkpoint's before anything is read.
  with pytest.raises(config_lib.ConfigError, match=r'model.mlp_dim 128 -> 256 \(the checkpoint '
                     r'holds parameters'):
    pretrain.train_and_evaluate(c, str(tmp_path / 'a'), devices=jax.devices()[:1])
  # Starting from another run's params: their shapes are checked.
  c.checkpoint.restore_from = str(tmp_path / 'a')
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r"'layers/mlp/w_down' has shape \(2, 128, 64\) in the "
                           r'checkpoint but \(2, 256, 64\) in the config'):
    pretrain.train_and_evaluate(c, str(tmp_path / 'b'), devices=jax.devices()[:1])


@pytest.mark.parametrize('save_mesh, restore_mesh', [((1, 8, 1), (1, 1, 1)),
                                                     ((1, 1, 1), (2, 2, 2))])
def test_checkpoint_restores_onto_another_mesh(tmp_path, save_mesh, restore_mesh):
  def setup(mesh):
    c = small_config(steps=5)
    c.mesh.data, c.mesh.fsdp, c.mesh.tensor = mesh
    return c, jax.devices()[:int(np.prod(mesh))]

  c, devices = setup(save_mesh)
  pretrain.train_and_evaluate(c, str(tmp_path), devices=devices)
  saved = checkpoint_lib.Checkpointer(tmp_path)
  s = build_setup(*setup(save_mesh))
  _, state_a = saved.restore_latest(s.abstract_state)
  s_b = build_setup(*setup(restore_mesh))
  _, state_b = saved.restore_latest(s_b.abstract_state)
  saved.close()
  for a, b, sharding in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b),
                            jax.tree.leaves(s_b.state_shardings)):
    assert b.sharding == sharding
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_keeps_the_latest_and_the_best_by_eval_loss(tmp_path):
  checkpointer = checkpoint_lib.Checkpointer(tmp_path, keep=1, keep_best=2, async_save=False)
  state = {'x': jnp.zeros(3)}
  for step, loss in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 5.0), (5, 4.0)]:
    checkpointer.save(step, state, {}, {'eval/loss': loss})
  checkpointer.wait()
  assert checkpointer.all_steps() == [2, 3, 5]  # best two (1.0, 2.0) plus the latest
  checkpointer.close()


def test_restore_from_starts_a_new_run_from_another_runs_params(tmp_path):
  pretrain.train_and_evaluate(small_config(steps=5), str(tmp_path / 'a'), devices=jax.devices()[:1])
  params_a = workdir_lib.load(str(tmp_path / 'a'), devices=jax.devices()[:1]).params
  c = small_config(steps=5, restore_from=str(tmp_path / 'a'))
  c.optim.grad_clip = 0.0  # another optimizer structure: only the params carry over
  s = build_setup(c, devices=jax.devices()[:1])
  empty = checkpoint_lib.Checkpointer(tmp_path / 'b')
  state = train._initial_state(s, empty, is_main=False)  # noqa: SLF001
  empty.close()
  assert int(state.step) == 0
  for a, b in zip(jax.tree.leaves(params_a), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(float(jnp.abs(x).max()) == 0 for x in jax.tree.leaves(state.opt_state[0].mu))


def test_nonfinite_step_drops_the_update_and_counts_it():
  s = build_setup(small_config(), devices=jax.devices()[:1])
  state = state_lib.init_state(s)
  poisoned = state.params['layers']['mlp']['w_up'].at[0, 0, 0].set(jnp.nan)
  params = dict(state.params, layers=dict(state.params['layers'],
                                          mlp=dict(state.params['layers']['mlp'], w_up=poisoned)))
  state = state.replace(params=params)
  before = jax.tree.map(np.asarray, (state.params, state.opt_state))
  step = state_lib.jit_train_step(s, pad_id=258)
  tokens = jax.random.randint(jax.random.key(0), (16, 33), 0, 256)
  state, metrics = step(state, {'tokens': tokens})
  assert not np.isfinite(float(metrics['loss']))
  assert int(state.step) == 1 and int(state.nonfinite_count) == 1
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves((state.params, state.opt_state))):
    np.testing.assert_array_equal(a, np.asarray(b))


@pytest.mark.parametrize('mode, message', [('halt', 'non-finite loss or gradient norm'),
                                           ('skip', 'non-finite steps in a row')])
def test_nonfinite_run_halts_with_a_clear_message(tmp_path, mode, message):
  c = small_config(steps=20)
  c.optim.learning_rate = c.optim.min_learning_rate = 1e30  # blows the params up at once
  c.optim.warmup_steps = 1
  c.train.on_nonfinite = mode
  c.train.max_consecutive_skips = 3
  c.train.log_every = 1
  with pytest.raises(hooks_lib.NonFiniteError, match=message):
    pretrain.train_and_evaluate(c, str(tmp_path), devices=jax.devices()[:1])


def test_digests_are_the_weighted_sums_of_the_bits_and_need_no_array_of_the_whole_state():
  """checkpoint._digest_one (axis by axis) equals the definition on the flat bits: [sum b_i,
  sum b_i * (2i + 1)] mod 2**32, for the dtypes a state holds; its temporaries are one array's."""
  digest_one = checkpoint_lib._digest_one  # noqa: SLF001
  rng = np.random.default_rng(0)
  for shape, dtype in (((), np.int32), ((7,), np.float32), ((3, 5, 4), np.float32),
                       ((4, 6), jnp.bfloat16), ((70000, 70), np.float32), ((2, 3, 4, 5), np.int8)):
    x = np.asarray(jnp.asarray(rng.standard_normal(shape) * 1000).astype(dtype))
    bits = x.view(f'uint{x.dtype.itemsize * 8}').astype(np.uint64).ravel()
    weights = 2 * np.arange(bits.size, dtype=np.uint64) + 1
    expected = [int(bits.sum() % 2**32), int((bits * weights % 2**32).sum() % 2**32)]
    assert np.asarray(digest_one(x)).tolist() == expected, (shape, dtype)
  big = jax.ShapeDtypeStruct((64, 1024, 1024), jnp.float32)  # 256 MiB
  temp = digest_one.lower(big).compile().memory_analysis().temp_size_in_bytes
  assert temp <= 1.05 * 2**28, temp


def test_a_save_blocks_only_to_copy_the_state_and_restores_what_it_saved(tmp_path):
  """An asynchronous save of a 1 GB state returns before its files are written, having blocked
  for under 20% of the whole save (the digests' reductions are dispatched, not waited for: reading
  them before returning blocked for 24% of a 4 GB save on the dev CPU), and the checkpoint
  restores the same arrays (verified against the digests written in the background)."""
  rng = np.random.default_rng(0)  # (random bits: as incompressible as trained weights)
  state = {f'w{i}': jnp.asarray(rng.integers(0, 2**32, (1000, 62500), np.uint32).view(np.float32))
           for i in range(4)}
  assert sum(x.nbytes for x in state.values()) >= 1e9
  # The digests' program for this shape compiled (into the tests' persistent compilation cache):
  # a first save of a run also compiles it, once per array shape.
  digest_one = checkpoint_lib._digest_one  # noqa: SLF001
  digest_one.lower(jax.ShapeDtypeStruct((1000, 62500), jnp.float32)).compile()
  checkpointer = checkpoint_lib.Checkpointer(tmp_path)
  t0 = time.perf_counter()
  checkpointer.save(1, state, {})
  blocking = time.perf_counter() - t0
  assert not os.path.exists(tmp_path / checkpoint_lib.DIRECTORY / '1')  # (a temporary name)
  checkpointer.wait()
  whole = time.perf_counter() - t0
  assert blocking < 0.2 * whole, (blocking, whole)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                          state)
  step, restored = checkpointer.restore_latest(abstract)
  checkpointer.close()
  assert step == 1
  for name, x in state.items():  # (bits: NaN payloads included)
    np.testing.assert_array_equal(np.asarray(restored[name]).view(np.uint32),
                                  np.asarray(x).view(np.uint32))
