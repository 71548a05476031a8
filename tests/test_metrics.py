"""Metric writers and MFU."""
import builtins
import glob
import importlib.util
import json
import os
import signal
import struct
import subprocess

import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import metrics
from tests.conftest import ROOT
from tests.conftest import STEPS
from tests.conftest import command
from tests.conftest import run_and_signal
from tests.conftest import subprocess_env


def test_mfu_uses_the_device_table_and_the_override():
  assert metrics.peak_flops_per_device('NVIDIA H100 80GB HBM3') == 989e12
  assert metrics.peak_flops_per_device('NVIDIA A100-SXM4-80GB') == 312e12
  assert metrics.peak_flops_per_device('cpu') is None
  assert metrics.peak_flops_per_device('cpu', override=1e12) == 1e12
  # 1e9 FLOPs/token at 100k tokens/s on 2 devices of 1e14 peak: 50%.
  assert metrics.mfu(1e9, 1e5, 2, 1e14) == pytest.approx(0.5)
  assert metrics.mfu(1e9, 1e5, 2, None) is None


def test_without_tensorflow_scalars_still_reach_metrics_jsonl(tmp_path, monkeypatch, caplog):
  real_import = builtins.__import__

  def no_clu(name, *args, **kwargs):
    if name.startswith('clu'):
      raise ImportError('No module named tensorflow')
    return real_import(name, *args, **kwargs)

  monkeypatch.setattr(builtins, '__import__', no_clu)
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(1, {'train/loss': 2.5, 'perf/mfu': None})
  writer.write(2, {'train/loss': 2.0})
  writer.close()
  warnings = [r for r in caplog.records if 'TensorBoard event files are not written' in r.message]
  assert len(warnings) == 1
  assert not os.path.exists(tmp_path / 'tensorboard')
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    assert [json.loads(line) for line in f] == [{'step': 1, 'train/loss': 2.5},
                                                {'step': 2, 'train/loss': 2.0}]


def test_with_tensorflow_event_files_are_written(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  writer.write(1, {'train/loss': 2.5})
  writer.close()
  assert any(f.startswith('events.out.tfevents') for f in os.listdir(tmp_path / 'tensorboard'))


def test_other_processes_write_nothing(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path / 'w'), enabled=False)
  writer.write(1, {'train/loss': 2.5})
  writer.close()
  assert not os.path.exists(tmp_path / 'w')


def test_resumed_writer_keeps_each_step_once_in_order(tmp_path):
  writer = metrics.MetricWriter(str(tmp_path))
  for step in range(1, 9):
    writer.write(step, {'train/loss': float(step)})
    if step % 4 == 0:
      writer.write(step, {'eval/loss': step + 0.5})  # the same step: merged into its line
  writer.close()
  writer = metrics.MetricWriter(str(tmp_path), start_step=5)  # resumed from step 5
  writer.write(6, {'train/loss': 60.0})
  writer.close()
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    rows = [json.loads(line) for line in f]
  assert [r['step'] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert rows[3] == {'step': 4, 'train/loss': 4.0, 'eval/loss': 4.5}
  assert rows[5]['train/loss'] == 60.0
  with open(tmp_path / 'metrics.discarded.jsonl', encoding='utf-8') as f:
    assert [json.loads(line)['step'] for line in f] == [6, 7, 8]


def test_a_failing_metrics_write_warns_once_and_training_goes_on(tmp_path, caplog):
  writer = metrics.MetricWriter(str(tmp_path))

  def full_disk(data):
    raise OSError(28, 'No space left on device')

  writer._jsonl.write = full_disk  # noqa: SLF001
  writer.write(1, {'train/loss': 1.0})
  writer.write(2, {'train/loss': 2.0})
  warnings = [r for r in caplog.records if 'No space left on device' in r.getMessage()]
  assert len(warnings) == 1 and 'training goes on' in warnings[0].getMessage()


def wandb_history(path: str) -> dict[int, dict]:
  """step -> the scalars logged at it, from an offline run file (run-ID.wandb).

  wandb (>= 0.20, whose core is in Go) ships no Python reader of its files: this reads the format
  (a LevelDB-style log of protobuf Records: 7-byte file header ':W&B' + magic + version, then in
  32 KiB blocks, records framed by checksum (4 bytes), length (2), type (1: whole, 2: first,
  3: middle, 4: last part)) and parses the records with wandb's own protobuf classes."""
  from wandb.proto import wandb_internal_pb2  # noqa: PLC0415
  with open(path, 'rb') as f:
    data = f.read()
  assert data[:4] == b':W&B', data[:7]
  rows, pos, parts = {}, 7, b''
  while pos + 7 <= len(data):
    if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
      pos += 32768 - pos % 32768
      continue
    _, length, kind = struct.unpack('<IHB', data[pos:pos + 7])
    parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
    if kind in (1, 4):
      record = wandb_internal_pb2.Record()
      record.ParseFromString(parts)
      parts = b''
      if record.WhichOneof('record_type') == 'history':
        row = {item.key or '/'.join(item.nested_key): json.loads(item.value_json)
               for item in record.history.item}
        rows[record.history.step.num] = {k: v for k, v in row.items() if not k.startswith('_')}
  return rows


def test_wandb_gets_the_same_scalars_and_a_resumed_run_continues_its_run(tmp_path, monkeypatch):
  pytest.importorskip('wandb')
  monkeypatch.setenv('WANDB_MODE', 'offline')
  monkeypatch.setenv('WANDB_SILENT', 'true')
  wandb_flags = ('--config.train.wandb_project=jax-pretrain-test', '--config.train.eval_every=4')
  out, status = run_and_signal(tmp_path, signal.SIGTERM, 5, *wandb_flags)
  assert status == 0 and 'received SIGTERM' in out, out
  resumed = subprocess.run(command(tmp_path, *wandb_flags), env=subprocess_env(), cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
  assert resumed.returncode == 0 and 'resuming from step' in resumed.stdout, resumed.stderr

  with open(tmp_path / metrics.WANDB_ID_FILE, encoding='utf-8') as f:
    run_id = f.read().strip()
  runs = sorted(glob.glob(str(tmp_path / 'wandb' / 'offline-run-*')))
  assert len(runs) == 2 and all(r.endswith(f'-{run_id}') for r in runs)  # one wandb run, resumed
  first, second = (wandb_history(os.path.join(r, f'run-{run_id}.wandb')) for r in runs)
  assert max(first) < min(second)  # the resumed run logged on from where the first stopped
  expected = {}  # metrics.jsonl, the lines of one step merged (train and eval scalars)
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    for record in map(json.loads, f):
      expected.setdefault(record.pop('step'), {}).update(record)
  assert len(expected) == STEPS and {**first, **second} == expected


def test_a_wandb_project_without_wandb_installed_is_refused_at_start(monkeypatch):
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, 'find_spec',
                      lambda name, *args: None if name == 'wandb' else real(name, *args))
  c = config_lib.preset('test')
  c.train.wandb_project = 'p'
  with pytest.raises(config_lib.ConfigError, match=r"train.wandb_project='p' needs wandb: `pip "
                     'install wandb`'):
    config_lib.resolve(c, num_devices=1, backend='cpu')


class _Recording:
  """A metric writer (the interface of clu's and _WandbWriter) that records, or always raises."""

  def __init__(self, error: Exception | None = None):
    self.steps, self.error, self.closed = [], error, False

  def write_scalars(self, step, scalars):
    if self.error:
      raise self.error
    self.steps.append(step)

  def close(self):
    self.closed = True
    if self.error:
      raise self.error


@pytest.mark.parametrize('failing', ['TensorBoard', 'wandb'])
def test_a_writer_that_raises_is_one_warning_and_the_others_and_jsonl_go_on(tmp_path, monkeypatch,
                                                                            caplog, failing):
  writers = {name: _Recording(RuntimeError(f'{name} broke') if name == failing else None)
             for name in ('TensorBoard', 'wandb')}
  monkeypatch.setattr(metrics, '_tensorboard_writer', lambda *args: writers['TensorBoard'])
  monkeypatch.setattr(metrics, '_WandbWriter', lambda *args: writers['wandb'])
  writer = metrics.MetricWriter(str(tmp_path), config={'train': {'wandb_project': 'p'}})
  for step in (1, 2, 3):
    writer.write(step, {'train/loss': float(step)})
  writer.close()
  [other] = set(writers) - {failing}
  assert writers[other].steps == [1, 2, 3] and writers[other].closed
  assert len(writers[failing].steps) == 0 and writers[failing].closed  # tried to the end
  with open(tmp_path / 'metrics.jsonl', encoding='utf-8') as f:
    assert [json.loads(line)['step'] for line in f] == [1, 2, 3]
  warnings = [r.getMessage() for r in caplog.records if 'broke' in r.getMessage()]
  assert warnings == [f'{failing}: writing the metrics of step 1 failed (RuntimeError: {failing} '
                      'broke); training goes on, with metrics.jsonl and the other writers, and '
                      'later writes are tried again.']
