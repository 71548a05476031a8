"""Restoring through faults injected into real checkpoints read by the installed orbax and
tensorstore (checkpoint_errors sorts what they raise): only real damage sets a checkpoint aside
(files deleted, cut short or altered); an I/O error, a permission, a device out of memory stops
with one line and moves nothing (in the trainer: exit status 1, that line last, no thread left
running to abort the exit); a transient I/O error is tried again; a workdir whose every
checkpoint is damaged stops instead of starting over; an unreadable saved config is never a
silent skip of the resume check."""
import glob
import inspect
import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import checkpoint_errors
from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from tests.conftest import ROOT
from tests.conftest import command
from tests.conftest import subprocess_env

STEPS = (1, 2)


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch):
  monkeypatch.setattr(checkpoint_lib, 'RETRY_DELAYS', (0.01, 0.01, 0.01))


def _state(step: int) -> dict:
  """A small state, different at each step; 'w' is large enough for a data file of its own."""
  return {'params': {'w': jax.random.normal(jax.random.key(step), (300, 100)),
                     'b': jnp.arange(10, dtype=jnp.int32) + step}}


ABSTRACT = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                   sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])),
    jax.eval_shape(_state, 0))


@pytest.fixture
def workdir(tmp_path):
  """A workdir with complete checkpoints of steps 1 and 2 (config {'step': STEP})."""
  checkpointer = checkpoint_lib.Checkpointer(tmp_path, async_save=False)
  for step in STEPS:
    checkpointer.save(step, _state(step), {'step': step})
  checkpointer.close()
  return tmp_path


def listing(workdir) -> list[str]:
  return sorted(os.listdir(workdir / 'checkpoints'))


def restore(workdir):
  """What the trainer does on start: the saved config, then the state (train.py)."""
  checkpointer = checkpoint_lib.Checkpointer(workdir)
  try:
    latest = checkpointer.latest_config()
    restored = checkpointer.restore_latest(ABSTRACT)
  finally:
    checkpointer.close()
  return latest, restored


def _largest_data_file(step_dir) -> str:
  files = [f for f in glob.glob(os.path.join(step_dir, 'state', '**', 'd', '*'), recursive=True)
           if os.path.isfile(f)]
  return max(files, key=os.path.getsize)


def _btree_file(step_dir) -> str:
  [path] = glob.glob(os.path.join(step_dir, 'state', 'd', '*'))
  return path


def _alter_digest(step_dir) -> str:
  path = os.path.join(step_dir, 'digests', 'metadata')
  with open(path, encoding='utf-8') as f:
    digests = json.load(f)
  digests['params/w'][0] += 1
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(digests, f)
  return path


def _damage(path: str, how: str) -> None:
  if how == 'delete':
    os.remove(path)
  elif how == 'truncate':
    with open(path, 'r+b') as f:
      f.truncate(os.path.getsize(path) // 2)
  elif how == 'overwrite':  # bytes at the start of a compressed chunk
    with open(path, 'r+b') as f:
      f.seek(20)
      f.write(bytes(range(0, 256, 7)))
  elif how == 'rmtree':
    shutil.rmtree(path)
  elif how == 'unreadable':  # reading it fails in the kernel: EIO
    os.remove(path)
    os.symlink('/proc/self/mem', path)
  elif how == 'loop':  # opening it fails: ELOOP
    os.remove(path)
    os.symlink(path, path)


# (file of step 2, what is done to it, the error orbax/tensorstore raise for it: type, text).
# Measured with orbax-checkpoint 0.12.8 and tensorstore 0.1.86; a change of theirs shows here.
DAMAGE = [
    (_largest_data_file, 'delete', ValueError, 'Truncated Zstd-compressed stream'),
    (_largest_data_file, 'truncate', ValueError, 'OUT_OF_RANGE: '),
    (_largest_data_file, 'overwrite', ValueError, 'ZSTD_decompressStream() failed'),
    (lambda d: os.path.join(d, 'state', 'manifest.ocdbt'), 'delete', ValueError, 'NOT_FOUND: '),
    (lambda d: os.path.join(d, 'state', 'manifest.ocdbt'), 'truncate', ValueError, 'DATA_LOSS: '),
    (_btree_file, 'delete', ValueError, 'NOT_FOUND: '),
    (lambda d: os.path.join(d, 'state', '_METADATA'), 'truncate', json.JSONDecodeError, ''),
    (lambda d: os.path.join(d, 'state', 'array_metadatas', 'process_0'), 'truncate',
     json.JSONDecodeError, ''),
    (lambda d: os.path.join(d, 'state'), 'rmtree', FileNotFoundError, 'state directory is missing'),
    (lambda d: os.path.join(d, 'digests', 'metadata'), 'delete', FileNotFoundError, 'not found'),
    (lambda d: os.path.join(d, 'digests', 'metadata'), 'truncate', json.JSONDecodeError, ''),
    (_alter_digest, 'altered', checkpoint_lib.DamagedCheckpoint, 'does not match the digest'),
    (lambda d: os.path.join(d, 'config', 'metadata'), 'delete', FileNotFoundError, 'not found'),
    (lambda d: os.path.join(d, 'config', 'metadata'), 'truncate', json.JSONDecodeError, ''),
    (lambda d: os.path.join(d, 'digests'), 'rmtree', KeyError, 'was not found in the checkpoint'),
    (lambda d: os.path.join(d, 'config'), 'rmtree', KeyError, 'was not found in the checkpoint'),
]


KIND = checkpoint_errors.kind  # (observe replaces it)


def observe(monkeypatch, after=lambda error: None) -> list:
  """Records what orbax raised for each failed read (as checkpoint_errors.kind sees it), calling
  after(error) once it is sorted (a test mends the fault there)."""
  seen = []

  def recorded(error):
    seen.append(checkpoint_errors.unwrapped(error))
    result = KIND(error)
    after(error)
    return result
  monkeypatch.setattr(checkpoint_errors, 'kind', recorded)
  return seen


@pytest.mark.parametrize('find, how, error_type, text', DAMAGE,
                         ids=[f'{i}-{how}' for i, (_, how, _, _) in enumerate(DAMAGE)])
def test_damaged_files_set_the_step_aside_and_the_previous_one_is_used(workdir, monkeypatch, caplog,
                                                                       find, how, error_type,
                                                                       text):
  path = find(str(workdir / 'checkpoints' / '2'))
  if how != 'altered':
    _damage(path, how)
  seen = observe(monkeypatch)
  (config_step, config), (step, state) = restore(workdir)
  # (A damaged state is found after the config was read: the run is checked against step 2's.)
  expected = 1 if '/2/config' in path else 2
  assert (config_step, config, step) == (expected, {'step': expected}, 1)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(1))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert listing(workdir) == ['1', '2.damaged']
  # What orbax raised: read once, or twice for a file not found (after a new listing).
  error = seen[0]
  reads = 2 if KIND(error) == 'missing' else 1
  assert [type(e) for e in seen] == [type(error)] * reads
  assert type(error) is error_type and text in str(error), repr(error)[:500]
  [warning] = [r.getMessage() for r in caplog.records if 'is damaged' in r.getMessage()]
  assert '/checkpoints/2 is damaged (' in warning and 'trying the previous one' in warning
  assert len(warning) < 1000  # the cause, not tensorstore's whole spec


# In a fresh process, so that what Python prints at exit is seen: a directory, a DAMAGE index.
# Three workdirs damaged alike, restored one after the other: the tracebacks come from a race
# (not every failed read leaves one), three restores make one likely. A program, so the output
# policy every entry point installs first.
_RESTORE_DAMAGED = """
import pathlib, sys
from jax_pretrain import cli
cli.output_policy()
from tests import test_checkpoint_faults as t
find, how, _, _ = t.DAMAGE[int(sys.argv[2])]
for n in range(3):
  workdir = pathlib.Path(sys.argv[1]) / str(n)
  checkpointer = t.checkpoint_lib.Checkpointer(workdir, async_save=False)
  for step in t.STEPS:
    checkpointer.save(step, t._state(step), {'step': step})
  checkpointer.close()
  step_dir = str(workdir / 'checkpoints' / '2')
  find(step_dir) if how == 'altered' else t._damage(find(step_dir), how)
  assert t.restore(workdir)[1] is not None
"""


# The two damages after which orbax's abandoned reads print tracebacks (at exit: an exception in a
# coroutine, with a page of tensorstore's spec; asyncio's 'Event loop is closed').
@pytest.mark.parametrize('case', [i for i, (find, how, _, _) in enumerate(DAMAGE)
                                  if (find, how) in ((_largest_data_file, 'truncate'),
                                                     (_btree_file, 'delete'))])
def test_a_damaged_step_set_aside_is_one_warning_line_and_nothing_else(tmp_path, case):
  out = subprocess.run([sys.executable, '-c', _RESTORE_DAMAGED, str(tmp_path), str(case)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  lines = out.stderr.strip().splitlines()
  assert len(lines) == 3 and all('checkpoints/2 is damaged' in line for line in lines), \
      out.stderr[-3000:]


def test_every_checkpoint_damaged_stops_naming_them_and_never_starts_over(workdir, capsys):
  for step in STEPS:
    _damage(str(workdir / 'checkpoints' / str(step) / 'state' / 'manifest.ocdbt'), 'truncate')
  message = (r'every checkpoint in .*/checkpoints is damaged and was set aside \(1.damaged, '
             r'2.damaged, kept for inspection\), so the run does not start over on its own. To '
             r'train from step 0, use a new --workdir, or move the .damaged directories out of '
             r'.*/checkpoints\.$')
  checkpointer = checkpoint_lib.Checkpointer(workdir)
  with pytest.raises(checkpoint_lib.CheckpointError, match=message):
    checkpointer.restore_latest(ABSTRACT)
  checkpointer.close()
  assert listing(workdir) == ['1.damaged', '2.damaged']
  # The same command again: only .damaged steps left, still no fresh start (the trainer's path).
  c = config_lib.preset('test')
  c.train.steps = 5
  with pytest.raises(checkpoint_lib.CheckpointError, match=message):
    pretrain.train_and_evaluate(c, str(workdir), devices=jax.devices()[:1])
  assert 'step 1/' not in capsys.readouterr().out
  assert not os.path.exists(workdir / 'metrics.jsonl')
  assert listing(workdir) == ['1.damaged', '2.damaged']


@pytest.mark.parametrize('find, how, cause', [
    (lambda d: os.path.join(d, 'config', 'metadata'), 'unreadable', '[Errno 5] Input/output error'),
    (_largest_data_file, 'loop', 'Too many levels of symbolic links (errno 40)'),
])
def test_a_transient_io_error_is_tried_again_and_the_restore_succeeds(workdir, monkeypatch, caplog,
                                                                      find, how, cause):
  """An I/O error (Python's OSError reading a JSON item, tensorstore's os_error_code reading an
  array) that is gone when the read is tried again."""
  path = find(str(workdir / 'checkpoints' / '2'))
  os.rename(path, f'{path}.kept')
  _damage(shutil.copy(f'{path}.kept', path), how)
  seen = observe(monkeypatch, after=lambda _: os.path.exists(f'{path}.kept') and os.replace(
      f'{path}.kept', path))
  (config_step, _), (step, state) = restore(workdir)
  assert (config_step, step) == (2, 2) and len(seen) == 1
  np.testing.assert_array_equal(np.asarray(state['params']['w']),
                                np.asarray(_state(2)['params']['w']))
  assert listing(workdir) == ['1', '2']
  [warning] = [r.getMessage() for r in caplog.records if 'trying again' in r.getMessage()]
  what = 'reading the config of' if '/config/' in path else 'restoring'
  assert warning == (f'{what} checkpoint {workdir}/checkpoints/2: {cause}; trying again in 0.01 s '
                     '(try 1 of 4).')


@pytest.mark.parametrize('find', [
    lambda d: os.path.join(d, 'config', 'metadata'),  # orbax: FileNotFoundError
    lambda d: os.path.join(d, 'state', 'manifest.ocdbt'),  # tensorstore: NOT_FOUND
    _btree_file,  # tensorstore: NOT_FOUND of a byte range
])
def test_a_file_not_found_once_is_read_again_after_a_new_listing_and_nothing_is_set_aside(
    workdir, monkeypatch, caplog, find):
  """A network file system's client may answer from a stale cache: a file not found is read
  again, after the checkpoints and the step's directories were listed again, before any step is
  set aside (here the file comes back with the new listing)."""
  path = find(str(workdir / 'checkpoints' / '2'))
  os.rename(path, f'{path}.elsewhere')
  seen = observe(monkeypatch)
  reload = ocp.CheckpointManager.reload

  def listed_again(self):
    if os.path.exists(f'{path}.elsewhere'):
      os.rename(f'{path}.elsewhere', path)
    reload(self)
  monkeypatch.setattr(ocp.CheckpointManager, 'reload', listed_again)
  (config_step, _), (step, state) = restore(workdir)
  assert (config_step, step) == (2, 2) and [KIND(e) for e in seen] == ['missing']
  np.testing.assert_array_equal(np.asarray(state['params']['b']),
                                np.asarray(_state(2)['params']['b']))
  assert listing(workdir) == ['1', '2']
  [warning] = [r.getMessage() for r in caplog.records if 'listed again' in r.getMessage()]
  assert ' checkpoint ' + f'{workdir}/checkpoints/2: read after its directories were listed ' \
         'again (a file was not found at first: ' in warning


def test_a_step_gone_between_the_listing_and_its_read_is_not_set_aside(workdir, monkeypatch,
                                                                       tmp_path_factory):
  """Another program moved the newest step away while it was being read: the one before is
  restored, and nothing is renamed (there is nothing to set aside)."""
  elsewhere = tmp_path_factory.mktemp('elsewhere')
  restore_ = ocp.CheckpointManager.restore

  def moved_away(self, step, *args, **kwargs):
    if step == 2 and (workdir / 'checkpoints' / '2').exists():
      shutil.move(workdir / 'checkpoints' / '2', elsewhere / '2')
    return restore_(self, step, *args, **kwargs)
  monkeypatch.setattr(ocp.CheckpointManager, 'restore', moved_away)
  (config_step, _), (step, _) = restore(workdir)
  assert (config_step, step) == (1, 1) and listing(workdir) == ['1']


def test_a_persistent_io_error_stops_after_the_retries_and_moves_nothing(workdir, monkeypatch):
  _damage(_largest_data_file(str(workdir / 'checkpoints' / '2')), 'loop')
  seen = observe(monkeypatch)
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    restore(workdir)
  assert str(e.value) == (
      f'restoring checkpoint {workdir}/checkpoints/2 failed: Too many levels of symbolic links '
      '(errno 40). No checkpoint was moved or deleted; it failed 4 times over 0.03 s: check the '
      'file system (disk, mount, network) and run the same command to resume.')
  assert len(seen) == 4  # step 1 is not tried: it is not what the user asked to resume
  assert listing(workdir) == ['1', '2']


def _out_of_memory():
  """What a device out of memory raises: XLA's own error, for an allocation it cannot make."""
  jnp.zeros(2**50, jnp.uint8).block_until_ready()


def test_a_device_out_of_memory_stops_at_once_in_one_line_and_moves_nothing(workdir, monkeypatch):
  """The restore runs out of device memory where orbax puts an array's bytes on the device."""
  put = jax.device_put

  def out_of_memory(x, *args, **kwargs):
    if '/orbax/' in inspect.currentframe().f_back.f_code.co_filename:  # (a restored array's bytes)
      _out_of_memory()
    return put(x, *args, **kwargs)
  monkeypatch.setattr(jax, 'device_put', out_of_memory)
  seen = observe(monkeypatch)
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    restore(workdir)
  checkpoints = f'{workdir}/checkpoints'
  assert str(e.value) == (
      f'restoring checkpoint {checkpoints}/2 failed: JaxRuntimeError: RESOURCE_EXHAUSTED: Out of '
      f'memory allocating {2**50} bytes. No checkpoint was moved or deleted; fix the cause and '
      f'run the same command to resume (if this checkpoint itself cannot be read, move '
      f'{checkpoints}/2 out of {checkpoints} to resume from the one before).')
  assert len(seen) == 1  # not retried
  assert listing(workdir) == ['1', '2']


# A restore by a process that may not read a file of the checkpoint (root reads every file: it
# runs without the capabilities that let it).
_RESTORE_UNREADABLE = """
import os, pathlib, sys
from jax_pretrain import cli
cli.output_policy()
from jax_pretrain import checkpoint
from tests import test_checkpoint_faults as t
path = t._largest_data_file(sys.argv[1] + '/checkpoints/2')
os.chmod(path, 0)
try:
  t.restore(pathlib.Path(sys.argv[1]))
except checkpoint.CheckpointError as e:
  print(e)
"""


def test_a_permission_denied_stops_at_once_in_one_line_and_moves_nothing(workdir):
  without_root = (['setpriv', '--bounding-set=-dac_override,-dac_read_search'] if os.geteuid() == 0
                  else [])
  out = subprocess.run([*without_root, sys.executable, '-c', _RESTORE_UNREADABLE, str(workdir)],
                       cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 0 and out.stderr == '', out.stderr[-3000:]
  checkpoints = f'{workdir}/checkpoints'
  assert out.stdout == (
      f'restoring checkpoint {checkpoints}/2 failed: Permission denied (errno 13). No checkpoint '
      'was moved or deleted; fix the cause and run the same command to resume (if this checkpoint '
      f'itself cannot be read, move {checkpoints}/2 out of {checkpoints} to resume from the one '
      'before).\n')
  assert listing(workdir) == ['1', '2']


# The trainer resumed in a fresh process, as users run it (python -c: this, then the arguments),
# its restore running out of device memory (where orbax puts an array's bytes on the device) once
# the checkpoint digests' programs are compiling in their background thread
# (Checkpointer.prepare). The compiles are made to last seconds (more digest programs, of shapes
# new to the compile cache), so the restore's error leaves the main thread while one is in flight
# in XLA, and orbax abandons the checkpoint's other reads.
_RESUME_OUT_OF_MEMORY = """
import inspect, random, runpy, sys, threading, time
import jax
import numpy as np
from jax_pretrain import checkpoint
from tests import test_checkpoint_faults as t

compiling = threading.Event()
compile_digests = checkpoint._compile_digests

def slow_compile_digests(abstract_tree):
  compiling.set()
  compile_digests(abstract_tree)
  start = time.monotonic()
  while time.monotonic() - start < 5:
    shape = (random.randrange(1000, 10**6), 3, 2)
    checkpoint._digest_one.lower(jax.ShapeDtypeStruct(shape, np.float32)).compile()

put = jax.device_put

def out_of_memory(x, *args, **kwargs):
  if '/orbax/' in inspect.currentframe().f_back.f_code.co_filename:  # (a restored array's bytes)
    compiling.wait(60)
    t._out_of_memory()
  return put(x, *args, **kwargs)

checkpoint._compile_digests = slow_compile_digests
jax.device_put = out_of_memory
sys.argv[0] = 'jax_pretrain.main'
runpy.run_module('jax_pretrain.main', run_name='__main__', alter_sys=True)
"""


def test_a_failed_restore_while_the_digests_compile_exits_1_after_its_one_line(tmp_path):
  """Before: the digests' compile thread was a daemon, killed inside XLA when the interpreter
  exited after the error line: 'terminate called after throwing an instance of', 'Fatal Python
  error: Aborted', status 134 (or a segmentation fault). Now the Checkpointer joins it; and
  what orbax's abandoned reads print comes to nothing (the entry point's output policy)."""
  args = command(tmp_path, '--config.train.steps=2', '--config.optim.warmup_steps=1')
  subprocess.run(args, check=True, env=subprocess_env(), cwd=ROOT, capture_output=True,
                 timeout=300)
  assert listing(tmp_path) == ['2']
  out = subprocess.run([sys.executable, '-c', _RESUME_OUT_OF_MEMORY, *args[3:]], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  tail = out.stderr[-3000:]
  for text in ('Fatal Python error', 'terminate called', 'Aborted', 'Segmentation fault',
               'Traceback', 'Exception ignored', 'tensorstore'):
    assert text not in out.stderr, tail
  assert out.returncode == 1, tail
  lines = out.stderr.strip().splitlines()
  assert [line for line in lines if line.startswith('error:')] == lines[-1:], tail
  assert lines[-1].startswith(f'error: restoring checkpoint {tmp_path}/checkpoints/2 failed: '
                              'JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory'), tail
  assert listing(tmp_path) == ['2']


def test_an_unreadable_config_stops_the_run_before_anything_is_written(workdir, monkeypatch):
  _damage(str(workdir / 'checkpoints' / '2' / 'config' / 'metadata'), 'unreadable')
  seen = observe(monkeypatch)
  c = config_lib.preset('test')
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r'^reading the config of checkpoint .*/checkpoints/2 failed: '
                           r'\[Errno 5\] Input/output error\. No checkpoint was moved'):
    pretrain.train_and_evaluate(c, str(workdir), devices=jax.devices()[:1])
  assert len(seen) == 4 and listing(workdir) == ['1', '2']
  assert not os.path.exists(workdir / 'config.json')  # nothing written for this run


def test_a_damaged_config_is_set_aside_and_the_resume_is_checked_against_the_previous_one(
    tmp_path):
  """Before: a config that could not be read skipped the resume check (a changed seed went
  through); now the step is damaged, and the previous step's config refuses the change."""
  c = config_lib.preset('test')
  c.train.steps, c.train.eval_every, c.checkpoint.every_steps = 10, 5, 5
  pretrain.train_and_evaluate(c, str(tmp_path), devices=jax.devices()[:1])
  _damage(str(tmp_path / 'checkpoints' / '10' / 'config' / 'metadata'), 'truncate')
  c.train.seed = 1
  with pytest.raises(config_lib.ConfigError, match='train.seed 0 -> 1'):
    pretrain.train_and_evaluate(c, str(tmp_path), devices=jax.devices()[:1])
  assert listing(tmp_path) == ['10.damaged', '5']


@pytest.mark.parametrize('damage, cause', [
    ('array', 'OUT_OF_RANGE: '), ('metadata', ''), ('state', 'its state directory is missing')])
def test_restore_params_of_a_damaged_checkpoint_names_it_in_one_line(workdir, damage, cause):
  """Another run's params (--init, restore_from, GRPO's reference, workdir.load): damaged arrays,
  a truncated _METADATA or no state directory at all are one CheckpointError naming the step."""
  step_dir = str(workdir / 'checkpoints' / '2')
  if damage == 'array':
    _damage(_largest_data_file(step_dir), 'truncate')
  elif damage == 'metadata':
    _damage(os.path.join(step_dir, 'state', '_METADATA'), 'truncate')
  else:
    shutil.rmtree(os.path.join(step_dir, 'state'))
  checkpointer = checkpoint_lib.Checkpointer(workdir, read_only=True)
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=rf'checkpoint .*/checkpoints/2 is damaged: {cause}.*Use another step '
                           r'\(--step\) or re-export it\.$'):
    checkpointer.restore_params(ABSTRACT['params'], step=2)
  checkpointer.close()
  assert listing(workdir) == ['1', '2']  # another run's checkpoints are only read
