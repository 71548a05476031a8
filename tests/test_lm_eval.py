"""lm-evaluation-harness on a tiny trained run, with tasks defined here from local JSONL files (no
network): multiple choice, generation and rolling log-likelihood. Every log-likelihood equals the
training loss function's, every generation equals sample.generate's, a task compiles a handful of
shapes; the command line; lm_eval/* scalars during training. And agreement with lm_eval's own
Hugging Face backend on the exported model: needs torch and transformers, skipped without them
(docs/use.md says how to run it)."""
import dataclasses
import glob
import importlib.util
import json
import os
import random
import re
import subprocess
import sys

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # before lm_eval imports datasets
os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import lm_eval as lm_eval_lib
from jax_pretrain import model as model_lib
from jax_pretrain import pretrain
from jax_pretrain import sample
from jax_pretrain import state as state_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import corpus
from tests import tiny_run
from tests.conftest import ROOT
from tests.conftest import run_cli
from tests.conftest import subprocess_env

TASKS = ['local_mc', 'local_gen', 'local_rolling']
GEN_TOKENS = 8
YAMLS = {
    'local_mc': """
output_type: multiple_choice
doc_to_text: "{{context}}"
doc_to_choice: "{{choices}}"
doc_to_target: label
target_delimiter: ""
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]""",
    'local_gen': f"""
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
target_delimiter: ""
generation_kwargs: {{until: ["."], max_gen_toks: {GEN_TOKENS}, do_sample: false}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]""",
    'local_rolling': """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]""",
}


@pytest.fixture(scope='session')
def run(tmp_path_factory):
  return tiny_run.train_once(tmp_path_factory)


@pytest.fixture(scope='session')
def loaded(run):
  trained = workdir_lib.load(run, devices=jax.devices()[:1])
  return trained.config.model, trained.params, trained.tokenizer, trained.config


def _passages(n: int, context: int, continuation: int, start: int) -> list[tuple[str, str]]:
  text = '\n'.join(corpus.embedded_documents())[-20_000:]
  return [(text[s:s + context], text[s + context:s + context + continuation])
          for s in range(start, start + 97 * n, 97)]


@pytest.fixture(scope='session')
def tasks(loaded, tmp_path_factory):
  """The task folder, and what each task's documents should give: the multiple-choice documents
  (the true continuation among three of random symbols), the greedy continuations of the
  generation prompts (the target of every other document), the rolling texts (one spans three
  windows of the 64-token context)."""
  model_config, params, tokenizer, _ = loaded
  folder = tmp_path_factory.mktemp('tasks')
  rng = random.Random(0)
  mc = []
  for i, (context, true) in enumerate(_passages(24, 40, 16, 0)):
    fakes = [''.join(rng.choice('~^|{}@#$%&QXZJ0123456789') for _ in true) for _ in range(3)]
    mc.append({'context': context, 'choices': fakes[:i % 4] + [true] + fakes[i % 4:],
               'label': i % 4})
  prompts = [context for context, _ in _passages(12, 40, 0, 5000)]
  greedy = [sample.generate_text(model_config, params, tokenizer, p, GEN_TOKENS,
                                 temperature=0.0).split('.')[0] for p in prompts]
  gen = [{'context': p, 'target': g if i % 2 == 0 else g + 'zz'}
         for i, (p, g) in enumerate(zip(prompts, greedy))]
  rolling = [{'text': a + b} for a, b in _passages(5, 30, 20, 9000)]
  rolling.append({'text': ''.join(a + b for a, b in _passages(2, 50, 47, 12000))})  # 194 bytes
  for name, docs in zip(TASKS, (mc, gen, rolling)):
    with open(folder / f'{name}.jsonl', 'w', encoding='utf-8') as f:
      f.writelines(json.dumps(d) + '\n' for d in docs)
    (folder / f'{name}.yaml').write_text(
        f'task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
        f'    test: {folder / f"{name}.jsonl"}\ntest_split: test{YAMLS[name]}\n')
  return str(folder), mc, greedy, rolling


def _reference_loglikelihood(loaded):
  """(context ids, continuation ids) -> log-probability of the continuation, from the training
  loss function (state_lib.make_loss_fn): NLL(context + continuation) - NLL(context)."""
  model_config, params, tokenizer, _ = loaded
  loss_fn = jax.jit(state_lib.make_loss_fn(model_lib.Transformer(model_config), tokenizer.pad_id))

  def nll(ids):
    tokens = np.full((1, tiny_run.SEQ_LEN + 1), tokenizer.pad_id, np.int32)
    tokens[0, :len(ids)] = ids
    return float(loss_fn(params, tokens)[0])

  return lambda context, continuation: nll(context) - nll(context + continuation)


def _reference_rolling(loglikelihood, ids: list[int], eos: int, L: int) -> float:
  """A text's log-likelihood in windows of L: targets [a, b] of the stream EOS + text, each window
  conditioned on the L tokens before its last target (lm_eval's rolling windows)."""
  stream, total = [eos] + ids, 0.0
  for a in range(1, len(stream), L):
    b = min(a + L - 1, len(stream) - 1)
    total += loglikelihood(stream[max(0, b - L):a], stream[a:b + 1])
  return total


def test_requests_equal_training_loss_and_sample_generate(loaded, tasks):
  model_config, params, tokenizer, _ = loaded
  folder, mc, greedy, rolling = tasks
  lm = lm_eval_lib.JaxLM(model_config, params, tokenizer, max_length=tiny_run.SEQ_LEN,
                         batch_size=8)
  out = lm_eval_lib.run_tasks(lm, TASKS, include_path=folder, log_samples=True)
  reference = _reference_loglikelihood(loaded)
  encode = lambda text: [int(t) for t in tokenizer.encode(text)]

  # Multiple choice: each choice's log-likelihood, and so the accuracy.
  correct = []
  for s in sorted(out['samples']['local_mc'], key=lambda s: s['doc_id']):
    doc = mc[s['doc_id']]
    got = [r[0][0] for r in s['resps']]
    # lm_eval moves a context's trailing whitespace to the continuation.
    context = doc['context'].rstrip()
    want = [reference(encode(context), encode(doc['context'][len(context):] + c))
            for c in doc['choices']]
    np.testing.assert_allclose(got, want, atol=1e-4)
    correct.append(int(np.argmax(want)) == doc['label'])
  acc = out['results']['local_mc']['acc,none']
  assert acc == pytest.approx(np.mean(correct)) and acc >= 0.9  # symbols are easy to rule out
  assert lm.counts['loglikelihood'] == 4 * len(mc)

  # Generation: sample.generate's greedy continuations, cut before the first '.'; half the
  # targets are those continuations.
  for s in out['samples']['local_gen']:
    assert s['resps'][0][0] == greedy[s['doc_id']]
  assert out['results']['local_gen']['exact_match,none'] == 0.5

  # Rolling log-likelihood: one window, and (the last text) three windows of 64 tokens.
  for s in out['samples']['local_rolling']:
    ids = encode(rolling[s['doc_id']]['text'])
    want = _reference_rolling(reference, ids, tokenizer.eos_id, tiny_run.SEQ_LEN)
    assert s['resps'][0][0] == pytest.approx(want, abs=1e-4)
  assert len(encode(rolling[-1]['text'])) > 2 * tiny_run.SEQ_LEN

  # Few compiled shapes: scoring pads to 16, 32 or 64 tokens, 8 rows; prefills likewise.
  assert lm.score_shapes <= {(8, 16), (8, 32), (8, 64)}
  assert {s.length for s in lm.engine.shapes if s.kind == 'prefill'} <= {16, 32, 64}


def test_local_tasks_are_indexed_without_lm_evals_built_in_ones(tasks):
  """Tasks all from --include_path need not wait for lm_eval's built-in index (15-20 s to build);
  a built-in task named beside them is found in the index of both."""
  folder = tasks[0]
  own = lm_eval_lib.task_index(folder, TASKS)
  assert set(TASKS) <= set(own.all_tasks) and 'arc_easy' not in own.all_tasks
  both = lm_eval_lib.task_index(folder, [*TASKS, 'arc_easy'])
  assert set(TASKS) | {'arc_easy'} <= set(both.all_tasks)
  assert lm_eval_lib.task_index(folder, TASKS) is own  # built once


def test_command_line_table_results_json_and_unknown_task(run, tasks, tmp_path):
  folder = tasks[0]
  stdout = run_cli('-m', 'jax_pretrain.lm_eval', f'--workdir={run}', '--tasks=local_mc,local_gen',
                   f'--include_path={folder}', '--limit=4', f'--output={tmp_path / "r.json"}')
  assert '|local_mc' in stdout and '|acc' in stdout and 'exact_match' in stdout
  assert '20 requests (loglikelihood 16, generate_until 4)' in stdout and 'requests/s' in stdout
  results = json.load(open(tmp_path / 'r.json', encoding='utf-8'))
  assert results['n-samples']['local_mc'] == {'original': 24, 'effective': 4}
  assert 0 <= results['results']['local_mc']['acc,none'] <= 1

  out = subprocess.run([sys.executable, '-m', 'jax_pretrain.lm_eval', f'--workdir={run}',
                        '--tasks=local_mcq', f'--include_path={folder}'], cwd=ROOT,
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
  assert out.returncode == 1
  assert out.stderr.strip().splitlines()[-1].startswith('error: unknown lm_eval task(s) local_mcq')
  assert 'Traceback' not in out.stderr


def test_downstream_evals_during_training_are_logged(tasks, tmp_path):
  c = config_lib.preset('test')
  c.data.seq_len = tiny_run.SEQ_LEN
  c.train.steps, c.optim.warmup_steps, c.train.eval_every = 20, 2, 20
  c.train.lm_eval_tasks, c.train.lm_eval_include_path = 'local_mc', tasks[0]
  c.train.lm_eval_every, c.train.lm_eval_limit = 10, 8
  final = pretrain.train_and_evaluate(c, str(tmp_path / 'run'), devices=jax.devices()[:1])
  lines = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl', encoding='utf-8')]
  logged = {m['step']: m['lm_eval/local_mc/acc'] for m in lines if 'lm_eval/local_mc/acc' in m}
  assert sorted(logged) == [10, 20] and all(acc in np.arange(9) / 8 for acc in logged.values())
  assert {k for m in lines for k in m if k.startswith('lm_eval/')} == {'lm_eval/local_mc/acc'}
  assert final['lm_eval/local_mc/acc'] == logged[20]

  c.train.lm_eval_tasks = 'local_mc,no_such_task'
  with pytest.raises(config_lib.ConfigError, match='no_such_task'):
    pretrain.train_and_evaluate(c, str(tmp_path / 'other'), devices=jax.devices()[:1])


def _hf_python() -> str | None:
  """A Python with torch, transformers and lm_eval for lm_eval's Hugging Face backend:
  $JAX_PRETRAIN_HF_PYTHON, or this one when it has them."""
  if os.environ.get('JAX_PRETRAIN_HF_PYTHON'):
    return os.environ['JAX_PRETRAIN_HF_PYTHON']
  if all(importlib.util.find_spec(m) for m in ('torch', 'transformers')):
    return sys.executable
  return None


@pytest.mark.skipif(importlib.util.find_spec('transformers') is None or _hf_python() is None,
                    reason='needs transformers here (to export the tokenizer) and torch with '
                    'transformers here or in $JAX_PRETRAIN_HF_PYTHON (docs/use.md)')
def test_agrees_with_lm_eval_hugging_face_backend(run, loaded, tasks, tmp_path):
  model_config, params, tokenizer, _ = loaded
  folder = tasks[0]
  run_cli('scripts/export_hf.py', f'--workdir={run}', f'--out={tmp_path / "hf"}')
  hf = subprocess.run(
      [_hf_python(), '-m', 'lm_eval', '--model', 'hf', '--model_args',
       f'pretrained={tmp_path / "hf"},dtype=float32,prefix_token_id={tokenizer.eos_id}',
       '--tasks', ','.join(TASKS), '--include_path', folder, '--device', 'cpu',
       '--batch_size', '8', '--log_samples', '--output_path', str(tmp_path / 'out')],
      cwd=str(tmp_path), env=subprocess_env(), capture_output=True, text=True, timeout=900)
  assert hf.returncode == 0, hf.stderr[-3000:]
  [results_file] = glob.glob(str(tmp_path / 'out' / '*' / 'results_*.json'))
  theirs = json.load(open(results_file, encoding='utf-8'))['results']
  lm = lm_eval_lib.JaxLM(model_config, params, tokenizer, max_length=tiny_run.SEQ_LEN,
                         batch_size=8)
  ours = lm_eval_lib.run_tasks(lm, TASKS, include_path=folder, log_samples=True)

  assert ours['results']['local_mc']['acc,none'] == theirs['local_mc']['acc,none']
  assert ours['results']['local_gen']['exact_match,none'] == (
      theirs['local_gen']['exact_match,none'])
  worst = {}
  for task in TASKS:
    [samples_file] = glob.glob(str(tmp_path / 'out' / '*' / f'samples_{task}_*.jsonl'))
    hf_resps = {s['doc_id']: s['resps'] for s in map(json.loads, open(samples_file))}
    for s in ours['samples'][task]:
      mine, other = s['resps'], hf_resps[s['doc_id']]
      if task == 'local_gen':
        assert mine[0][0] == other[0][0]
        continue
      for a, b in zip(mine, other):  # [[loglikelihood, is greedy]] or [loglikelihood]
        a, b = (a[0], b[0]) if task == 'local_mc' else (a, b)
        if task == 'local_mc':
          assert str(a[1]) == str(b[1])  # is greedy
        worst[task] = max(worst.get(task, 0.0), abs(float(a[0]) - float(b[0])))
  print(f'\nagreement with lm_eval --model hf: local_mc acc {theirs["local_mc"]["acc,none"]} '
        f'(both), local_gen exact_match {theirs["local_gen"]["exact_match,none"]} (both, '
        f'identical generations), max |Δ loglikelihood| {worst}')
  assert max(worst.values()) < 1e-4


class _Logger:
  """What run_lm_eval writes its scalars to (step_logger.StepLogger's write)."""

  def __init__(self):
    self.written = []

  def write(self, step, scalars):
    self.written.append((step, scalars))


FAULT_TASKS = {
    'fine_mc': 'dataset_path: json\ndataset_kwargs: {data_files: {test: DOCS}}\n'
               'test_split: test' + YAMLS['local_mc'],
    # A download that fails (offline here: ConnectionError, then FileNotFoundError in datasets).
    'no_download': 'dataset_path: jax-pretrain-tests/no-such-dataset\ntest_split: test'
                   + YAMLS['local_mc'],
    'missing_file': 'dataset_path: json\ndataset_kwargs: {data_files: {test: MISSING}}\n'
                    'test_split: test' + YAMLS['local_mc'],
    # More new tokens than the model's context: our TaskError, raised in JaxLM.generate_until.
    'too_long': 'dataset_path: json\ndataset_kwargs: {data_files: {test: DOCS}}\n'
                'test_split: test' + YAMLS['local_gen'].replace(f'max_gen_toks: {GEN_TOKENS}',
                                                                'max_gen_toks: 100'),
}


def _raise(error):
  def raising(*args, **kwargs):
    raise error
  return raising


@pytest.mark.parametrize('task, patch, warned', [
    ('fine_mc', None, None),
    ('no_download', None, r'(ConnectionError|\w*NotFoundError): '),  # (offline | online)
    ('missing_file', None, "FileNotFoundError: Unable to find '.*/missing.jsonl'"),
    ('too_long', None, 'TaskError: a task asks for 100 new tokens'),  # (as a regex)
    # Ours: an error in our model's code, which the harness called, or before the harness.
    ('fine_mc', ('_score', jax.errors.JaxRuntimeError('RESOURCE_EXHAUSTED: Out of memory')), None),
    ('fine_mc', ('__init__', ValueError('a bug of ours')), None),
])
def test_lm_eval_during_training_warns_for_the_harness_and_raises_ours(loaded, tmp_path,
                                                                       monkeypatch, caplog, task,
                                                                       patch, warned):
  _, params, tokenizer, config = loaded
  docs = tmp_path / 'docs.jsonl'
  docs.write_text(''.join(json.dumps({'context': f'The {w}', 'choices': [' cat', ' dog'],
                                      'label': 0, 'target': 'x'}) + '\n'
                          for w in ('first', 'second', 'third', 'fourth')))
  (tmp_path / f'{task}.yaml').write_text(f'task: {task}\n' + FAULT_TASKS[task].replace(
      'DOCS', str(docs)).replace('MISSING', str(tmp_path / 'missing.jsonl')))
  config = dataclasses.replace(config, train=dataclasses.replace(
      config.train, lm_eval_tasks=task, lm_eval_include_path=str(tmp_path), lm_eval_limit=4))
  logger = _Logger()
  if patch is not None:
    name, error = patch
    monkeypatch.setattr(lm_eval_lib.JaxLM, name, _raise(error))
    with pytest.raises(type(error), match=str(error)):
      pretrain.run_lm_eval(params, tokenizer, config, logger, 7)
    assert not logger.written
    return
  pretrain.run_lm_eval(params, tokenizer, config, logger, 7)
  failed = [r.getMessage() for r in caplog.records if 'lm_eval at step 7 failed' in r.getMessage()]
  if warned is None:
    assert not failed and [step for step, _ in logger.written] == [7]
  else:
    assert not logger.written and len(failed) == 1, failed
    assert re.match(f'lm_eval at step 7 failed, training goes on: {warned}', failed[0]), failed
