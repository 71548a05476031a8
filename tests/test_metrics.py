"""Metric writers and MFU."""
import builtins
import json
import os

import pytest

from jax_pretrain import metrics


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

  writer._jsonl.write = full_disk  # pylint: disable=protected-access
  writer.write(1, {'train/loss': 1.0})
  writer.write(2, {'train/loss': 2.0})
  warnings = [r for r in caplog.records if 'No space left on device' in r.getMessage()]
  assert len(warnings) == 1 and 'training goes on' in warnings[0].getMessage()
