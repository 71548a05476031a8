"""scripts/make_task.py: the same files for the same seed, train and heldout disjoint, answers
correct (recomputed from the prompts), sft.jsonl the train items with a newline-ended completion,
prefs.jsonl the same answers chosen over wrong ones, and heldout.jsonl scored as a task file under
the exact reward."""
import json
import subprocess
import sys

import pytest

from jax_pretrain import tasks
from tests.conftest import ROOT
from tests.conftest import run_cli
from tests.conftest import subprocess_env

FILES = ('train.jsonl', 'sft.jsonl', 'heldout.jsonl', 'prefs.jsonl', 'heldout_prefs.jsonl')


def _make(out, task, seed, train=300, heldout=50) -> dict[str, bytes]:
  run_cli('scripts/make_task.py', f'--output-dir={out}', f'--task={task}', f'--seed={seed}',
          f'--train={train}', f'--heldout={heldout}')
  return {name: (out / name).read_bytes() for name in FILES}


def _read(data: bytes) -> list[dict]:
  return [json.loads(line) for line in data.decode().splitlines()]


def _answer(task: str, prompt: str) -> str:
  """The answer, recomputed from the prompt alone."""
  assert prompt.endswith('=')
  if task == 'add':
    a, b = prompt[:-1].split('+')
    assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
    return str(int(a) + int(b))
  word, text = prompt[:-1].split(' ')
  assert word == {'reverse': 'rev', 'copy': 'copy'}[task] and 3 <= len(text) <= 6
  return text[::-1] if task == 'reverse' else text


@pytest.mark.parametrize('task', ['add', 'reverse', 'copy'])
def test_make_task_files(tmp_path, task):
  files = _make(tmp_path / 'a', task, seed=1)
  assert _make(tmp_path / 'b', task, seed=1) == files  # deterministic
  assert _make(tmp_path / 'c', task, seed=2) != files  # the seed matters
  train, sft, heldout, prefs, heldout_prefs = (_read(files[name]) for name in FILES)
  assert len(train) == len(sft) == 300 and len(heldout) == 50
  train_prompts = [r['prompt'] for r in train]
  assert len(set(train_prompts)) == len(train_prompts)
  assert not set(train_prompts) & {r['prompt'] for r in heldout}
  for r in train + heldout:
    assert set(r) == {'prompt', 'answer'} and r['answer'] == _answer(task, r['prompt'])
  assert sft == [{'prompt': r['prompt'], 'completion': r['answer'] + '\n'} for r in train]
  for split, pairs in (('train', prefs), ('heldout', heldout_prefs)):
    items = tasks.load(str(tmp_path / 'a' / f'{split}.jsonl'))
    assert [(p['prompt'], p['chosen']) for p in pairs] == [(i.prompt, i.answer + '\n')
                                                           for i in items]
    for p, item in zip(pairs, items):
      assert p['rejected'].endswith('\n') and tasks.exact(p['rejected'], item) == 0.0
  items = tasks.load(str(tmp_path / 'a' / 'heldout.jsonl'))
  assert all(tasks.exact(r['answer'] + '\n', item) == 1.0 for r, item in zip(heldout, items))


def test_make_task_too_many_items(tmp_path):
  out = subprocess.run([sys.executable, 'scripts/make_task.py', f'--output-dir={tmp_path}',
                        '--task=add', '--train=8000', '--heldout=200'], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert out.stderr.startswith('error: task ') and 'lower --train or --heldout' in out.stderr
