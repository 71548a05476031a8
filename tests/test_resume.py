"""A run is never lost, mixed up or silently changed: the workdir lock, the config checked against
the checkpoint on resume, save failures reported at once, verified checkpoints, metrics that hold
each step once, and Ctrl-C. (Plain kill-and-resume exactness: test_checkpoint.py.)"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import pretrain
from jax_pretrain import workdir as workdir_lib
from tests.conftest import ROOT
from tests.conftest import command
from tests.conftest import logged_losses
from tests.conftest import run_and_signal
from tests.conftest import subprocess_env


def small_config(steps=10, **overrides):
  c = config_lib.preset('test')
  c.train.steps, c.train.eval_every, c.checkpoint.every_steps, c.train.log_every = steps, 5, 5, 1
  for field, value in overrides.items():
    group, name = field.split('.')
    c[group][name] = value
  return c


def run(workdir, **overrides):
  return pretrain.train_and_evaluate(small_config(**overrides), str(workdir),
                                  devices=jax.devices()[:1])


# 1. The workdir lock.

def test_a_second_trainer_on_the_same_workdir_stops_at_once_and_changes_nothing(tmp_path):
  first = subprocess.Popen(command(tmp_path, '--config.train.steps=100000'),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env=subprocess_env(), cwd=ROOT)
  for line in first.stdout:
    if line.startswith('step 3/'):
      break
  history = open(tmp_path / 'config_history.jsonl', encoding='utf-8').read()
  t0 = time.perf_counter()
  second = subprocess.run(command(tmp_path), capture_output=True, text=True, env=subprocess_env(),
                          cwd=ROOT, timeout=120)
  seconds = time.perf_counter() - t0
  first.send_signal(signal.SIGTERM)
  rest = first.communicate(timeout=120)[0]
  assert second.returncode == 1 and second.stdout == '', second.stdout
  [message] = second.stderr.strip().splitlines()
  assert message.startswith(f'error: {tmp_path} is in use by ')
  assert f'pid {first.pid}' in message and f'(lock file {tmp_path}/.lock)' in message
  assert seconds < 60
  assert first.returncode == 0 and 'received SIGTERM: saved step' in rest
  assert open(tmp_path / 'config_history.jsonl', encoding='utf-8').read() == history


def test_a_killed_holder_leaves_no_stale_lock(tmp_path):
  holder = subprocess.Popen([sys.executable, '-c', (
      'import sys, time; from jax_pretrain import workdir; lock = workdir.claim(sys.argv[1]); '
      'print("held", flush=True); time.sleep(600)'), str(tmp_path)],
                            stdout=subprocess.PIPE, text=True, env=subprocess_env())
  assert holder.stdout.readline() == 'held\n'
  with pytest.raises(workdir_lib.WorkdirError, match=f'pid {holder.pid}'):
    workdir_lib.claim(str(tmp_path))
  holder.kill()
  holder.wait()
  workdir_lib.claim(str(tmp_path)).close()  # the OS released it


# 2. The config on resume.

def test_changes_that_do_not_fit_the_checkpoint_are_refused_before_anything_is_written(tmp_path):
  run(tmp_path, **{'train.steps': 5})
  config_json = open(tmp_path / 'config.json', encoding='utf-8').read()
  for field, value, old in [('model.d_model', 128, 64), ('train.batch_size', 32, 16),
                            ('data.seq_len', 64, 32), ('train.seed', 1, 0),
                            ('data.train', 'synthetic', 'embedded'),
                            ('optim.mu_dtype', 'bfloat16', 'float32'),
                            ('optim.grad_clip', 0.0, 1.0), ('model.fp8', True, False)]:
    with pytest.raises(config_lib.ConfigError, match=f'{field} {old!r} -> {value!r}'):
      run(tmp_path, **{field: value, 'train.steps': 10})
  assert open(tmp_path / 'config.json', encoding='utf-8').read() == config_json
  assert workdir_lib.load(str(tmp_path), devices=jax.devices()[:1]).step == 5  # still usable


def test_safe_changes_are_accepted_printed_and_kept_in_the_history(tmp_path, capsys):
  run(tmp_path, **{'train.steps': 5})
  run(tmp_path, **{'train.steps': 10, 'optim.learning_rate': 1e-3, 'train.eval_every': 10})
  out = capsys.readouterr().out
  assert 'resuming from step 5' in out
  assert 'config change on resume: optim.learning_rate 0.003 -> 0.001' in out
  assert 'config change on resume: train.steps 5 -> 10' in out
  with open(tmp_path / 'config_history.jsonl', encoding='utf-8') as f:
    first, second = map(json.loads, f)
  assert first['start_step'] == 0 and first['changes'] == {}
  assert second['start_step'] == 5 and second['changes']['optim.learning_rate'] == [3e-3, 1e-3]
  saved = json.load(open(tmp_path / 'config.json', encoding='utf-8'))
  assert saved['optim']['learning_rate'] == 1e-3
  # Every field's resume policy (declared on the field in config.py): test_config.py.


@pytest.mark.parametrize('first,then', [('scan', 'unroll'), ('unroll', 'scan')])
def test_a_run_resumed_with_its_layers_run_the_other_way_continues_its_losses(tmp_path, first,
                                                                            then, capsys):
  """model.layers is how a step runs the layers, not what the checkpoint holds: a run saved with
  one way resumes with the other and continues the losses of an uninterrupted run."""
  workdir = lambda name: tmp_path / name
  run(workdir('whole'), **{'model.layers': first})
  run(workdir('split'), **{'model.layers': first, 'train.steps': 5})
  run(workdir('split'), **{'model.layers': then})
  assert f"config change on resume: model.layers '{first}' -> '{then}'" in capsys.readouterr().out
  whole, split = logged_losses(workdir('whole')), logged_losses(workdir('split'))
  assert sorted(split) == sorted(whole) == list(range(1, 11))
  for step in range(1, 11):  # (the other way compiles to other float32 roundings)
    assert split[step] == pytest.approx(whole[step], rel=1e-5, abs=0), step
  loaded = workdir_lib.load(str(workdir('split')), devices=jax.devices()[:1])
  assert loaded.step == 10
  assert loaded.config.model.layers == 'scan'  # (loaded for the CPU: its own choice)


def test_resume_with_grain_workers_draws_the_same_batches(tmp_path, uninterrupted):
  out, rc = run_and_signal(tmp_path, signal.SIGTERM, 10)
  assert rc == 0, out
  resumed = subprocess.run(command(tmp_path, '--config.data.num_workers=2'),
                           env=subprocess_env(), cwd=ROOT, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stdout + resumed.stderr
  assert 'config change on resume: data.num_workers 0 -> 2' in resumed.stdout
  assert logged_losses(tmp_path) == uninterrupted  # every step once, bitwise
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    tokens = {r['step']: r['train/tokens'] for r in map(json.loads, f)}
  assert all(tokens[s] == s * 16 * 32 for s in tokens)


def test_a_workdir_whose_checkpoints_are_gone_stops_and_writes_nothing_until_told(tmp_path):
  """Checkpoints moved away (a volume not mounted, a wrong path): the same command stops with one
  line naming what records the training and where the checkpoints should be, whichever of the
  history's records is left, and appends nothing; checkpoint.start_over=True trains from step 0,
  setting the old metrics aside."""
  run(tmp_path, **{'train.steps': 5})
  run(tmp_path)  # resumed from step 5, to step 10
  shutil.move(tmp_path / 'checkpoints', tmp_path / 'moved')
  history = (tmp_path / 'config_history.jsonl').read_text()
  advice = (f', but {tmp_path}/checkpoints holds no checkpoint (moved or deleted? a volume not '
            'mounted? killed before its first save?). Put the checkpoints back and run the same '
            'command to resume; or, to train from step 0 in this workdir on purpose, add '
            '--config.checkpoint.start_over=True (the metrics so far move to '
            'metrics.discarded.jsonl), or give a new --workdir.')
  for record, step in (('metrics.jsonl', 10), ('tensorboard', 10), ('config_history.jsonl', 5)):
    with pytest.raises(workdir_lib.WorkdirError) as e:
      run(tmp_path)
    assert str(e.value) == f'{tmp_path}/{record} records training to step {step}{advice}'
    assert (tmp_path / 'config_history.jsonl').read_text() == history  # nothing appended
    assert not (tmp_path / 'metrics.discarded.jsonl').exists()
    assert not (tmp_path / 'checkpoints').exists()  # (nothing to trip a `mv` putting them back)
    if record != 'config_history.jsonl':
      shutil.move(tmp_path / record, tmp_path / f'moved.{record}')  # the next record alone
  assert not (tmp_path / 'metrics.jsonl').exists() and not (tmp_path / 'tensorboard').exists()
  shutil.move(tmp_path / 'moved.metrics.jsonl', tmp_path / 'metrics.jsonl')
  run(tmp_path, **{'checkpoint.start_over': True})
  assert sorted(logged_losses(tmp_path)) == list(range(1, 11))
  with open(tmp_path / 'metrics.discarded.jsonl', encoding='utf-8') as f:
    assert [json.loads(line)['step'] for line in f] == list(range(1, 11))  # the old run's
  with open(tmp_path / 'config_history.jsonl', encoding='utf-8') as f:
    assert [json.loads(line)['start_step'] for line in f] == [0, 5, 0]


# 3. Save failures.

@pytest.fixture
def small_disk(tmp_path):
  """A 2 MiB tmpfs: room for one checkpoint of the test preset (1.2 MB), not two."""
  mount = tmp_path / 'disk'
  mount.mkdir()
  if subprocess.run(['mount', '-t', 'tmpfs', '-o', 'size=2m', 'tmpfs', str(mount)],
                    capture_output=True).returncode:
    pytest.skip('needs root and tmpfs to simulate a full disk')
  yield mount
  subprocess.run(['umount', '-l', str(mount)], check=False)


def test_a_full_disk_stops_the_run_at_the_save_naming_it_and_the_last_checkpoint(small_disk):
  with pytest.raises(checkpoint_lib.CheckpointError,
                     match=r'saving step 10: .* has .*B free, but the checkpoint needs about .*B\. '
                           r'The last complete checkpoint is step 5\.'):
    run(small_disk / 'run')
  assert sorted(os.listdir(small_disk / 'run' / 'checkpoints')) == ['5']
  assert max(logged_losses(small_disk / 'run')) == 10


def test_a_failed_background_save_is_reported_within_a_step(small_disk, monkeypatch):
  # The free-space check passes (as if another program filled the disk after it): orbax's write
  # itself fails in the background.
  monkeypatch.setattr(checkpoint_lib.shutil, 'disk_usage',
                      lambda path: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))  # noqa: SLF001
  with pytest.raises(checkpoint_lib.CheckpointError) as e:
    run(small_disk / 'run', **{'train.steps': 200, 'checkpoint.every_steps': 50})
  assert str(e.value).startswith('saving step 100 ')
  assert str(e.value).endswith('failed: No space left on device (errno 28). The last complete '
                               'checkpoint is step 50.')
  assert max(logged_losses(small_disk / 'run')) < 150  # not at the next save: when it failed
  assert os.listdir(small_disk / 'run' / 'checkpoints') == ['50']  # no temporary directory left


def test_check_reports_a_failed_background_save_the_first_time_it_is_called(small_disk,
                                                                           monkeypatch):
  monkeypatch.setattr(checkpoint_lib.shutil, 'disk_usage',
                      lambda path: shutil._ntuple_diskusage(1 << 40, 0, 1 << 40))  # noqa: SLF001
  checkpointer = checkpoint_lib.Checkpointer(str(small_disk / 'run'))
  state = {'w': jax.random.normal(jax.random.key(0), (300_000,))}  # 1.2 MB, incompressible
  checkpointer.save(1, state, {})
  checkpointer.wait()
  checkpointer.save(2, state, {})  # the disk fills up in the background
  while checkpointer._manager.is_saving_in_progress():  # noqa: SLF001
    time.sleep(0.01)
  with pytest.raises(checkpoint_lib.CheckpointError, match=r'saving step 2 .* No space left on '
                     r'device.* The last complete checkpoint is step 1\.'):
    checkpointer.check()
  assert sorted(os.listdir(small_disk / 'run' / 'checkpoints')) == ['1']


# 4. Verified checkpoints.

def test_a_checkpoint_altered_after_its_save_is_set_aside_and_the_previous_one_used(tmp_path):
  run(tmp_path)
  first = logged_losses(tmp_path)
  files = glob.glob(str(tmp_path / 'checkpoints' / '10' / 'state' / '**' / 'd' / '*'),
                    recursive=True)
  path = max(files, key=os.path.getsize)
  with open(path, 'r+b') as f:  # eight bytes in the middle of the arrays: a silent bit rot
    f.seek(os.path.getsize(path) // 2)
    f.write(b'\x12\x34\x56\x78\x9a\xbc\xde\xf0')
  shutil.move(tmp_path / 'metrics.jsonl', tmp_path / 'first.jsonl')
  run(tmp_path)
  assert os.path.isdir(tmp_path / 'checkpoints' / '10.damaged')
  assert logged_losses(tmp_path) == {s: first[s] for s in range(6, 11)}  # resumed from step 5


# 5. Metrics after a crash and resume.

def test_a_killed_and_resumed_run_logs_each_step_once_in_order(tmp_path, uninterrupted):
  out, rc = run_and_signal(tmp_path, signal.SIGKILL, 17, '--config.checkpoint.every_steps=5')
  assert rc == -signal.SIGKILL, out
  resumed = subprocess.run(command(tmp_path, '--config.checkpoint.every_steps=5'),
                           env=subprocess_env(), cwd=ROOT, capture_output=True, text=True)
  assert resumed.returncode == 0, resumed.stderr
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    steps = [json.loads(line)['step'] for line in f]
  assert steps == sorted(set(steps)) == list(range(1, 41))
  assert logged_losses(tmp_path) == uninterrupted
  resumed_from = int(resumed.stdout.split('resuming from step ')[1].split(' ')[0])
  with open(tmp_path / 'metrics.discarded.jsonl', encoding='utf-8') as f:
    discarded = [json.loads(line)['step'] for line in f]
  # Logged before the kill (at step 17, or the one after if the line was read late), then redone.
  assert discarded == list(range(resumed_from + 1, discarded[-1] + 1)) and discarded[-1] >= 17
  from tensorboard.backend.event_processing import plugin_event_accumulator  # noqa: PLC0415
  events = plugin_event_accumulator.EventAccumulator(  # TensorBoard's loader, every point kept
      str(tmp_path / 'tensorboard'), size_guidance={'tensors': 0})
  events.Reload()
  tb_steps = [e.step for e in events.Tensors('train/loss')]
  assert tb_steps == list(range(1, 41))


# 7. Ctrl-C.

def test_first_ctrl_c_is_acknowledged_at_once_and_saves_that_step(tmp_path):
  out, rc = run_and_signal(tmp_path, signal.SIGINT, 5, '--config.train.steps=100000')
  assert rc == 0, out
  lines = out.splitlines()
  ack = next(i for i, line in enumerate(lines) if line.startswith('received SIGINT: stopping'))
  n = int(lines[ack].split('stopping after step ')[1].split(' ')[0])
  assert lines[ack].endswith('(Ctrl-C again to abort without saving)')
  assert f'received SIGINT: saved step {n} to' in out
  # (steps take milliseconds: not 5 itself)
  assert os.path.isdir(tmp_path / 'checkpoints' / str(n)) and n >= 5


def test_second_ctrl_c_aborts_without_saving_in_one_line(tmp_path):
  slow = ('--config.train.steps=100000', '--config.model.num_layers=8',  # steps of about a second
          '--config.model.d_model=256', '--config.model.mlp_dim=512', '--config.data.seq_len=128')
  proc = subprocess.Popen(command(tmp_path, *slow), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=subprocess_env(), cwd=ROOT)
  out = []
  for line in proc.stdout:
    out.append(line)
    if line.startswith('step 2/'):
      proc.send_signal(signal.SIGINT)
    if line.startswith('received SIGINT: stopping after step'):
      proc.send_signal(signal.SIGINT)  # while that step still runs
  proc.wait(timeout=300)
  text = ''.join(out)
  assert proc.returncode == 130 and 'Traceback' not in text, text
  assert 'without saving. No checkpoint was completed yet.' in text
  assert text.rstrip().endswith('error: interrupted (Ctrl-C).')
  assert not [p for p in os.listdir(tmp_path / 'checkpoints') if p.isdigit()]  # none completed


def test_a_signal_before_training_stops_cleanly_in_one_line(tmp_path):
  proc = subprocess.Popen(command(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, env=subprocess_env(), cwd=ROOT)
  out = []
  for line in proc.stdout:
    out.append(line)
    if line.startswith('precision'):  # the plan is printed: restoring and compiling follow
      proc.send_signal(signal.SIGTERM)
  proc.wait(timeout=120)
  text = ''.join(out)
  assert proc.returncode == 0 and 'Traceback' not in text, text
  assert 'stopped before training; nothing new to save. No checkpoint was completed yet.' in text
  assert not any(line.startswith('step ') for line in out)


def test_a_resumed_fp8_run_equals_the_uninterrupted_one_bit_for_bit(tmp_path):
  """model.fp8's amax histories are train state: saved, restored, and the run goes on as if
  never stopped."""
  fp8_on = {'model.fp8': True, 'model.attention': 'xla'}
  run(tmp_path / 'whole', **fp8_on)
  run(tmp_path / 'split', **fp8_on, **{'train.steps': 5})
  run(tmp_path / 'split', **fp8_on)
  assert logged_losses(tmp_path / 'split') == logged_losses(tmp_path / 'whole')
  def state(name):
    s = workdir_lib.load(str(tmp_path / name), devices=jax.devices()[:1]).setup
    checkpointer = checkpoint_lib.Checkpointer(str(tmp_path / name), read_only=True)
    try:
      step, restored = checkpointer.restore_latest(s.abstract_state)
    finally:
      checkpointer.close()
    assert step == 10
    return restored
  whole, split = state('whole'), state('split')
  assert whole.fp8 is not None and jax.tree.leaves(whole.fp8)
  jax.tree.map(np.testing.assert_array_equal, split.fp8, whole.fp8)
  jax.tree.map(np.testing.assert_array_equal, split.params, whole.params)
