"""tokenizer.json (Hugging Face tokenizers) as a first-class tokenizer: train_tokenizer.py
--type bpe-bytelevel, special tokens from tokenizer_config.json / special_tokens_map.json,
prepare_data.py (worker processes), training, sample and evaluate, and the run's tokenizer/
record; ids checked against the tokenizers library itself."""
import json
import os
import shutil

import jax
import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import evaluate
from jax_pretrain import pretrain
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import corpus
from jax_pretrain.data import prepare
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError
from tests.conftest import run_cli

tokenizers = pytest.importorskip('tokenizers')

TEXT = 'The for statement:\n\tfor x in ünïcödé 日本 🙂 3.14159'


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  """A byte-level BPE trained by scripts/train_tokenizer.py on the embedded manual."""
  directory = tmp_path_factory.mktemp('tok') / 'bl'
  out = run_cli('scripts/train_tokenizer.py', '--input=embedded', '--type=bpe-bytelevel',
                '--vocab-size=700', f'--output={directory}')
  assert 'vocab_size 700 (bos 0, eos 0, pad 1)' in out
  assert sorted(os.listdir(directory)) == ['tokenizer.json', 'tokenizer_config.json']
  return str(directory)


def test_ids_are_the_tokenizers_librarys_and_text_round_trips(trained):
  ours = tokenizer_lib.load(trained)  # the directory, or the file itself
  assert ours.identity == tokenizer_lib.load(os.path.join(trained, 'tokenizer.json')).identity
  theirs = tokenizers.Tokenizer.from_file(os.path.join(trained, 'tokenizer.json'))
  docs = corpus.embedded_documents()[:5] + [TEXT]
  assert [x.tolist() for x in map(ours.encode, docs)] == [e.ids for e in theirs.encode_batch(docs)]
  assert [list(x) for x in ours.encode_batch(docs)] == [e.ids for e in theirs.encode_batch(docs)]
  assert max(ours.encode(docs[0])) >= 259 and ours.decode(ours.encode(TEXT)) == TEXT
  assert ours.decode([ours.eos_id, *ours.encode(TEXT), ours.pad_id, 10_000]) == TEXT


def write(directory, files: dict) -> str:
  os.makedirs(directory, exist_ok=True)
  for name, content in files.items():
    with open(os.path.join(directory, name), 'w', encoding='utf-8') as f:
      json.dump(content, f)
  return str(directory)


def test_special_tokens_come_from_the_files_beside_it(trained, tmp_path):
  def with_files(name, files):
    shutil.copytree(trained, tmp_path / name)
    os.remove(tmp_path / name / 'tokenizer_config.json')
    return tokenizer_lib.load(write(tmp_path / name, files))

  # AddedToken dicts as transformers writes them; no pad: one is appended after the vocabulary.
  tok = with_files('dicts', {'tokenizer_config.json': {
      'eos_token': {'content': '<|pad|>', '__type': 'AddedToken'}, 'bos_token': '<|endoftext|>'}})
  assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 700, 701)
  tok = with_files('map', {'special_tokens_map.json': {'eos_token': '<|endoftext|>'}})
  assert (tok.bos_id, tok.eos_id, tok.pad_id) == (0, 0, 700)
  with pytest.raises(DataError, match='no eos_token: put a tokenizer_config.json beside it'):
    with_files('none', {})
  with pytest.raises(DataError, match="the eos_token '</s>' of tokenizer_config.json is not in"):
    with_files('unknown', {'tokenizer_config.json': {'eos_token': '</s>'}})
  with pytest.raises(DataError, match='not a Hugging Face tokenizer.json'):
    tokenizer_lib.load(write(tmp_path / 'bad', {'tokenizer.json': {'model': 'none'}}))


def test_prepare_train_sample_and_evaluate_with_a_tokenizer_json(trained, tmp_path):
  # prepare_data.py: worker processes load the tokenizer from the same spec.
  prepared = str(tmp_path / 'prepared')
  meta = prepare.prepare('embedded', prepared, tokenizer=os.path.join(trained, 'tokenizer.json'),
                         val_ratio=0.05, workers=2, log=lambda _: None)
  single = prepare.prepare('embedded', str(tmp_path / 'single'), tokenizer=trained,
                           val_ratio=0.05, workers=1, log=lambda _: None)
  assert meta['tokenizer'] == single['tokenizer'] and meta['tokenizer']['tokenizer_file'] == (
      'tokenizer.json')
  for split in ('train', 'val'):
    name = meta[split][0]['name'] + '.bin'
    with open(os.path.join(prepared, split, name), 'rb') as a, open(
        os.path.join(tmp_path, 'single', split, name), 'rb') as b:
      assert a.read() == b.read()

  # Training from raw text with data.tokenizer, and from the prepared directory (its record).
  for data_train, tokenizer in (('embedded', trained), (prepared, '')):
    workdir = str(tmp_path / ('raw' if tokenizer else 'prep'))
    c = config_lib.preset('test')
    c.data.train, c.data.tokenizer, c.model.vocab_size = data_train, tokenizer, 768
    c.train.steps, c.optim.warmup_steps, c.train.eval_every = 2, 1, 2
    pretrain.train_and_evaluate(c, workdir, devices=jax.devices()[:1])
    run = workdir_lib.load(workdir, devices=jax.devices()[:1])
    assert run.tokenizer.identity == tokenizer_lib.load(trained).identity
    assert run.tokenizer.encode(TEXT).tolist() == tokenizer_lib.load(trained).encode(TEXT).tolist()
  # The run's tokenizer/ (its record) is a tokenizer spec too: prepare_data.py takes it.
  again = prepare.prepare('embedded', str(tmp_path / 'again'), val_ratio=0.05, workers=1,
                          tokenizer=os.path.join(workdir, 'tokenizer'), log=lambda _: None)
  assert again['tokenizer'] == meta['tokenizer']

  run_cli('-m', 'jax_pretrain.sample', f'--workdir={workdir}', '--prompt=The for ',
          '--max_new_tokens=8')
  results = evaluate.evaluate(workdir, max_tokens=512, devices=jax.devices()[:1])
  assert np.isfinite(results[0].bits_per_byte) and results[0].bytes > results[0].tokens
