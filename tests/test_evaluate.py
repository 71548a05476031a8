"""evaluate: the run's held-out loss equals training's eval, per-source rows for a mixture, bits
per byte from the detokenized text; the sample and evaluate command lines on a trained run."""
import json
import math
import os

import jax
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import evaluate
from jax_pretrain import pretrain
from jax_pretrain.data import corpus
from jax_pretrain.data import tokenizer as tokenizer_lib
from tests.conftest import run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RUNS = {}


def _train_once(tmp_path_factory) -> tuple[str, dict]:
  """A short run of the test preset whose final eval covers the whole held-out split (24 batches
  of 16 windows), shared by every test of the session that asks for it."""
  if 'run' not in _RUNS:
    workdir = str(tmp_path_factory.mktemp('run'))
    c = config_lib.preset('test')
    c.train.steps, c.optim.warmup_steps, c.train.eval_every, c.train.eval_steps = 30, 3, 30, 24
    final = pretrain.train_and_evaluate(c, workdir, devices=jax.devices()[:1])
    _RUNS['run'] = workdir, final
  return _RUNS['run']


@pytest.fixture(scope='session')
def trained_run(tmp_path_factory):
  return _train_once(tmp_path_factory)


def test_held_out_loss_equals_training_eval_and_mixture_rows(trained_run):
  workdir, final = trained_run
  [held_out] = evaluate.evaluate(workdir, devices=jax.devices()[:1])
  assert held_out.tokens > 10_000
  np.testing.assert_allclose(held_out.loss, final['eval/loss'], rtol=1e-5)
  assert held_out.perplexity == pytest.approx(math.exp(held_out.loss))
  # Byte tokenizer: one byte per target except the EOS of each document.
  assert 0 < held_out.tokens - held_out.bytes < 50
  assert held_out.bits_per_byte == pytest.approx(
      held_out.nll / math.log(2) / held_out.bytes)

  rows = evaluate.evaluate(workdir, 'embedded:0.3,synthetic', max_tokens=3000, batch_size=16,
                           devices=jax.devices()[:1])
  assert [r.source for r in rows] == ['embedded', 'synthetic', 'all']
  assert rows[0].weight == pytest.approx(0.3) and rows[0].tokens == 3008  # 94 windows of 32
  assert rows[1].bytes is None and rows[1].loss > rows[0].loss + 2  # random tokens
  assert rows[2].tokens == rows[0].tokens + rows[1].tokens
  assert rows[2].nll == pytest.approx(rows[0].nll + rows[1].nll)
  table = evaluate.format_table(rows)
  assert 'bits/byte' in table and 'synthetic' in table


def test_text_bytes_are_the_documents_bytes(tmp_path):
  docs = corpus.embedded_documents()[:20] + ['ünïcödé 日本 🙂\n']
  n_bytes = sum(len(d.encode('utf-8')) for d in docs)
  byte_tok = tokenizer_lib.ByteTokenizer()
  assert tokenizer_lib.text_bytes(byte_tok, corpus.concatenate(docs, byte_tok)) == n_bytes
  sp = tokenizer_lib.train_sentencepiece(docs, str(tmp_path / 'sp.model'), vocab_size=400)
  assert tokenizer_lib.text_bytes(sp, corpus.concatenate(docs, sp)) == n_bytes
  assert tokenizer_lib.text_bytes(tokenizer_lib.IdTokenizer(100, eos_id=0), np.arange(10)) is None


def test_sample_and_evaluate_command_lines(trained_run, tmp_path):
  workdir, _ = trained_run
  out = run_cli('-m', 'jax_pretrain.sample', f'--workdir={workdir}', '--prompt=The ',
                '--prompt=for x in', '--max_new_tokens=16', '--temperature=0')
  first, second = out.split('-' * 40 + '\n')
  assert first.startswith('The ') and second.startswith('for x in')
  out = run_cli('-m', 'jax_pretrain.evaluate', f'--workdir={workdir}', '--data=embedded',
                '--max_tokens=2000', f'--json={tmp_path / "r.json"}')
  assert 'bits/byte' in out and 'embedded' in out
  [row] = json.load(open(tmp_path / 'r.json', encoding='utf-8'))
  assert row['source'] == 'embedded' and row['tokens'] == 2016 and row['bits_per_byte'] > 0
