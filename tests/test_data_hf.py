"""Hugging Face data: hf:NAME_OR_PATH[@SPLIT][#field] sources (save_to_disk directories, local
datasets through load_dataset, a streamed dataset) and Parquet on URLs (hf://, read here through
fsspec's file://), in training, mixtures and prepare_data.py, on datasets made here."""
import json
import logging
import os
import shutil
import sys

import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain.data import hub
from jax_pretrain.data import prepare
from jax_pretrain.data.errors import DataError
from tests.conftest import build_data

datasets = pytest.importorskip('datasets')

TRAIN = [f'train document {i}: ' + 'the quick brown fox ' * (i + 3) for i in range(30)]
TEST = [f'test document {i}: ' + 'jumps over the lazy dog ' * (i + 3) for i in range(10)]


@pytest.fixture(scope='module')
def data(tmp_path_factory):
  """A saved Dataset, a saved DatasetDict, a directory of JSONL files and Parquet files."""
  d = tmp_path_factory.mktemp('hf')
  datasets.Dataset.from_dict({'text': TRAIN, 'title': [f'title {i}' for i in range(30)]}
                             ).save_to_disk(str(d / 'saved'))
  datasets.DatasetDict({'train': datasets.Dataset.from_dict({'text': TRAIN}),
                        'test': datasets.Dataset.from_dict({'text': TEST})}
                       ).save_to_disk(str(d / 'dict'))
  os.makedirs(d / 'jsonl')
  for split, docs in (('train', TRAIN), ('test', TEST)):
    with open(d / 'jsonl' / f'{split}.jsonl', 'w', encoding='utf-8') as f:
      f.writelines(json.dumps({'body': t}) + '\n' for t in docs)
  import pyarrow as pa  # noqa: PLC0415
  import pyarrow.parquet as pq  # noqa: PLC0415
  os.makedirs(d / 'parquet')
  pq.write_table(pa.table({'text': TRAIN[:15]}), str(d / 'parquet' / 'a.parquet'), row_group_size=4)
  pq.write_table(pa.table({'text': TRAIN[15:]}), str(d / 'parquet' / 'b.parquet'), row_group_size=4)
  return d


@pytest.fixture(autouse=True)
def datasets_cache(tmp_path, monkeypatch):
  """load_dataset's Arrow cache under the test's directory, not ~/.cache."""
  monkeypatch.setattr(datasets.config, 'HF_DATASETS_CACHE', str(tmp_path / 'cache'))


def make_config(train, val=''):
  c = config_lib.preset('test')
  c.data.train, c.data.val = train, val
  return c


def texts(data, batches=None) -> str:
  rows = [r for b in (batches or [next(data.train) for _ in range(4)]) for r in b['tokens']]
  return ''.join(data.tokenizer.decode(r) for r in rows)


def all_tokens(data) -> np.ndarray:
  return np.concatenate([b['tokens'] for b in data.eval_batches()])


def test_each_kind_of_dataset_trains_and_evaluates(data):
  for train, val in ((f'hf:{data}/saved', ''), (f'hf:{data}/dict', f'hf:{data}/dict@test'),
                     (f'hf:{data}/jsonl@train#body', f'hf:{data}/jsonl@test#body'),
                     (f'file://{data}/parquet/*.parquet', '')):
    loaded = build_data(make_config(train, val))
    assert next(loaded.train)['tokens'].shape == (16, 33)
    assert 'quick brown fox' in texts(loaded), train
    held_out = ''.join(loaded.tokenizer.decode(r) for b in loaded.eval_batches()
                       for r in b['tokens'])
    assert ('lazy dog' in held_out) == bool(val) and ('quick brown' in held_out) != bool(val)


def test_the_same_tokens_as_the_same_text_in_a_jsonl_file(data, tmp_path):
  """A dataset is a text source like any other: its batches equal those of its text as JSONL."""
  with open(tmp_path / 'same.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': t}) + '\n' for t in TRAIN)
  a = build_data(make_config(f'hf:{data}/saved:0.5,embedded:0.5'))
  b = build_data(make_config(f'{tmp_path}/same.jsonl:0.5,embedded:0.5'))
  for _ in range(3):
    np.testing.assert_array_equal(next(a.train)['tokens'], next(b.train)['tokens'])
  np.testing.assert_array_equal(all_tokens(a), all_tokens(b))


def test_prepare_data_reads_datasets_and_parquet_urls_in_worker_processes(data, tmp_path):
  meta = prepare.prepare(f'hf:{data}/saved#title,file://{data}/parquet/*.parquet',
                         str(tmp_path / 'out'), val=f'hf:{data}/dict@test', workers=2,
                         log=lambda _: None)
  assert [e['documents'] for e in meta['train']] == [30, 30]
  assert meta['val'][0]['documents'] == 10
  loaded = build_data(make_config(str(tmp_path / 'out')))
  assert 'title 1' in texts(loaded)
  assert 'lazy dog' in loaded.tokenizer.decode(all_tokens(loaded)[0])


def test_a_streamed_dataset_is_read_by_shard_and_says_it_is_not_pinned(data, monkeypatch, caplog):
  """A Hub name streams (here a local JSON dataset in streaming mode stands in for the Hub)."""
  real = datasets.load_dataset
  calls = []

  def from_the_hub(name, split, streaming):
    calls.append((name, split, streaming))
    return real('json', data_files=[str(data / 'jsonl' / 'train.jsonl'),
                                    str(data / 'jsonl' / 'test.jsonl')], split=split,
                streaming=streaming)

  monkeypatch.setattr(datasets, 'load_dataset', from_the_hub)
  hub.open_dataset.cache_clear()
  try:
    with caplog.at_level(logging.WARNING):
      items = hub.work_items('hf', 'someone/fineweb-tiny', 'train', 'body')
    assert calls == [('someone/fineweb-tiny', 'train', True)]
    assert [(i.start, i.stop) for i in items] == [(0, 1), (1, 2)]  # one item per data file
    assert any('streamed from the Hub' in r.getMessage() for r in caplog.records)
    read = [text for item in items for _, text, _ in hub.read(item)]
    assert read == TRAIN + TEST
  finally:
    hub.open_dataset.cache_clear()


def test_errors_name_the_dataset_and_what_to_do(data, monkeypatch):
  for source, message in (
      (f'hf:{data}/saved#body', 'no column "body" (columns: text, title)'),
      (f'hf:{data}/dict@validation', "no split 'validation' (splits: train, test)"),
      (f'hf:{data}/saved@test', 'a saved Dataset has no splits'),
      (f'file://{data}/parquet/*.jsonl', 'matches no files'),
      (f'file://{data}/jsonl/*.jsonl', 'only Parquet files are read from URLs')):
    with pytest.raises(DataError, match=message.replace('(', r'\(').replace(')', r'\)')):
      build_data(make_config(source))
  monkeypatch.setitem(sys.modules, 'datasets', None)  # as if it were not installed
  with pytest.raises(DataError, match='hf: sources need the datasets package: `pip install'):
    build_data(make_config(f'hf:{data}/other'))


def test_prepare_data_sees_a_changed_local_dataset(tmp_path):
  saved = str(tmp_path / 'ds')
  datasets.Dataset.from_dict({'text': TRAIN}).save_to_disk(saved)
  lines = []
  prepare.prepare(f'hf:{saved}', str(tmp_path / 'out'), workers=1, log=lines.append)
  datasets.Dataset.from_dict({'text': [t.upper() for t in TRAIN]}).save_to_disk(
      str(tmp_path / 'ds2'))  # the same number of rows, other text
  shutil.rmtree(saved)
  shutil.move(str(tmp_path / 'ds2'), saved)
  lines.clear()
  meta = prepare.prepare(f'hf:{saved}', str(tmp_path / 'out'), workers=1, log=lines.append)
  assert not any('up to date' in line for line in lines)
  assert meta['train'][0]['documents'] == len(TRAIN)
  lines.clear()
  prepare.prepare(f'hf:{saved}', str(tmp_path / 'out'), workers=1, log=lines.append)
  assert any('up to date' in line for line in lines)  # unchanged now: nothing to do
