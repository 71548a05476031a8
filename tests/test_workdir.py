"""A trained run, loaded from its workdir: config, params and tokenizer; runs written by older
versions (no tokenizer/ directory, optimizer fields in `train`) still load."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from jax_pretrain import state as state_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import tokenizer as tokenizer_lib


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp('run'))
  c = config_lib.preset('test')
  c.train.steps, c.optim.warmup_steps = 3, 1
  pretrain.train_and_evaluate(c, workdir, devices=jax.devices()[:1])
  return workdir


def test_load_gives_config_params_and_the_runs_tokenizer(run):
  trained = workdir_lib.load(run, devices=jax.devices()[:1])
  assert trained.step == 3 and trained.config.train.steps == 3
  assert isinstance(trained.tokenizer, tokenizer_lib.ByteTokenizer)
  assert trained.params['embedding'].shape == (384, 64)
  assert os.path.isfile(os.path.join(run, 'tokenizer', tokenizer_lib.RECORD_FILE))


def test_a_run_written_before_tokenizer_dir_and_optim_group_still_loads(run, tmp_path):
  old = str(tmp_path / 'old')
  shutil.copytree(run, old)
  shutil.rmtree(os.path.join(old, 'tokenizer'))
  with open(os.path.join(old, 'config.json'), encoding='utf-8') as f:
    saved = json.load(f)
  saved['train']['learning_rate'] = saved['optim'].pop('learning_rate')
  with open(os.path.join(old, 'config.json'), 'w', encoding='utf-8') as f:
    json.dump(saved, f)
  a = workdir_lib.load(run, devices=jax.devices()[:1])
  b = workdir_lib.load(old, devices=jax.devices()[:1])
  assert b.config.optim.learning_rate == a.config.optim.learning_rate
  assert b.tokenizer.identity == a.tokenizer.identity
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_directory_that_is_not_a_run_is_a_user_error(tmp_path):
  with pytest.raises(workdir_lib.WorkdirError, match='config.json not found'):
    workdir_lib.load(str(tmp_path))


def test_create_saves_the_state_a_fresh_optimizer_would_start_from(run, tmp_path):
  """create() writes the step-0 state from the host (np.zeros for the optimizer's moments): it
  restores equal to state_from_params, i.e. to optimizer.init."""
  trained = workdir_lib.load(run, devices=jax.devices()[:1])
  params = jax.tree.map(np.asarray, jax.device_get(trained.params))
  created = workdir_lib.create(str(tmp_path / 'new'), workdir_lib.load_config(run), params,
                               trained.tokenizer)
  checkpointer = checkpoint_lib.Checkpointer(str(tmp_path / 'new'), read_only=True)
  try:
    step, restored = checkpointer.restore_latest(created.setup.abstract_state)
  finally:
    checkpointer.close()
  fresh = state_lib.state_from_params(created.setup, params)
  assert step == 0
  for x, y in zip(jax.tree.leaves(restored), jax.tree.leaves(fresh), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with pytest.raises(workdir_lib.WorkdirError, match='already holds checkpoints'):
    workdir_lib.create(str(tmp_path / 'new'), workdir_lib.load_config(run), params,
                       trained.tokenizer)


def test_a_step_that_has_no_checkpoint_names_the_steps_there(run):
  with pytest.raises(checkpoint_lib.CheckpointError, match=r'no checkpoint of step 7 in .*; its '
                     r'steps are 3\.'):
    workdir_lib.load(run, step=7, devices=jax.devices()[:1])
