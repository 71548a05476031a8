"""A user's mistake, in any program, is one `error:` line (exit status 1, no traceback) naming the
file, field or value, and it comes before any data is loaded."""
import json
import subprocess
import sys

import pytest

from jax_pretrain import cli
from jax_pretrain.errors import UserError
from tests.conftest import ROOT
from tests.conftest import subprocess_env


def run(*args):
  return subprocess.run([sys.executable, *args], cwd=ROOT, env=subprocess_env(),
                        capture_output=True, text=True, timeout=300)


def one_error_line(out) -> str:
  assert out.returncode == 1, out.stdout + out.stderr
  lines = [line for line in out.stderr.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith('error: '), out.stderr
  return lines[0]


def train(tmp_path, *overrides, workdir=None):
  return run('-m', 'jax_pretrain.main', '--config=configs/test.py',
             f'--workdir={workdir or tmp_path / "run"}', *overrides)


@pytest.mark.parametrize('overrides, expected', [
    (('--config.model.vocab_size=128',),
     "model.vocab_size=128 is smaller than the tokenizer's vocabulary (259)"),
    (('--config.model.attention=cudnn',), "model.attention='cudnn' needs an NVIDIA GPU"),
    (('--config.optim.learning_rate=-0.001',), 'optim.learning_rate=-0.001 must be positive'),
    (('--config=configs/nope.py',), "--config: cannot load the config file (configs/nope.py; "
                                    "[Errno 2] No such file or directory"),
    (('--config.train.stepz=3',), '--config.train.stepz: no such config field (Did you mean '
                                  '"steps" instead of "stepz"?)'),
    (('--config.train.learning_rate=0.1',), '--config.train.learning_rate: no such config field '
                                            '(it moved to optim.learning_rate)'),
    (('--config.model.scan_layers=False',), "--config.model.scan_layers: no such config field "
                                            "(model.layers='scan'|'unroll'|'auto' replaced it"),
    (('--config.model.layers=sideways',), "model.layers='sideways': choose one of ('scan', "
                                          "'unroll', 'auto')"),
    # (train.batch_size is a field: only the grpo override is named)
    (('--config.train.batch_size=128', '--config.grpo.num_samples=16'),
     'error: --config.grpo.num_samples: no such config field (the grpo group comes with '
     '--config=configs/grpo.py:PRESET, the config of python -m jax_pretrain.grpo)'),
    (('--config.data.train=/nonexistent/*.jsonl',), '/nonexistent/*.jsonl: matches no files'),
])
def test_config_and_data_mistakes(tmp_path, overrides, expected):
  assert expected in one_error_line(train(tmp_path, *overrides))


def test_plan_grpo_on_a_pretraining_preset_names_the_grpo_override_alone():
  line = one_error_line(run('-m', 'jax_pretrain.plan', '--grpo', '--config=configs/xlarge.py',
                            '--config.train.batch_size=128', '--config.grpo.num_samples=16'))
  assert line.startswith('error: --config.grpo.num_samples: no such config field (the grpo group '
                         'comes with --config=configs/grpo.py:PRESET, the config of python -m '
                         'jax_pretrain.grpo); ')


def test_a_bad_record_names_the_file_and_line(tmp_path):
  path = tmp_path / 'bad.jsonl'
  path.write_text(json.dumps({'text': 'fine'}) + '\n{"text": oops}\n')
  line = one_error_line(train(tmp_path, f'--config.data.train={path}'))
  assert line.startswith(f'error: {path}:2: invalid JSON')


def test_workdir_mistakes_come_before_the_data_is_read(tmp_path):
  a_file = tmp_path / 'file'
  a_file.write_text('x')
  # Data that fails when it is read: had the workdir been checked after, this error would show.
  (tmp_path / 'bad.jsonl').write_text('{"text": oops}\n')
  bad_data = f'--config.data.train={tmp_path}/bad.jsonl'
  assert one_error_line(train(tmp_path, bad_data, workdir=a_file)) == (
      f'error: --workdir={a_file}: is a file, not a directory.')
  line = one_error_line(train(tmp_path, bad_data, workdir='/proc/jax_pretrain_test'))
  assert line.startswith('error: --workdir=/proc/jax_pretrain_test: cannot write there (')


def test_sample_evaluate_and_export_on_a_directory_that_is_not_a_run(tmp_path):
  for args in (('-m', 'jax_pretrain.sample', f'--workdir={tmp_path}'),
               ('-m', 'jax_pretrain.evaluate', f'--workdir={tmp_path}'),
               ('scripts/export_hf.py', f'--workdir={tmp_path}', f'--out={tmp_path / "hf"}')):
    assert one_error_line(run(*args)) == (f'error: {tmp_path}/config.json not found: is '
                                          f"'{tmp_path}' the workdir of a training run?")


def test_a_fine_tuning_programs_init_must_be_the_run_its_config_restores():
  """python -m jax_pretrain.grpo / .dpo: --init=RUN and the config's checkpoint.restore_from name
  one run (paths compared normalized), else one error naming both."""
  cli.check_init('runs/sft', 'runs/sft/')
  cli.check_init('', 'runs/other')  # no --init: the config's restore_from stands
  with pytest.raises(UserError, match=r"^--init=runs/sft but the config restores from "
                     r"'runs/other': give one of them\.$"):
    cli.check_init('runs/sft', 'runs/other')
