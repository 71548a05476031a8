"""Bad input never trains silently: each case is a DataError naming the file (and line)."""
import json
import logging

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain.data import prepare
from jax_pretrain.data import sources
from jax_pretrain.data.errors import DataError
from tests.conftest import build_data

GOOD = [json.dumps({'text': f'line {i} of a good document'}) + '\n' for i in range(40)]


def make_config(train, **data):
  c = config_lib.preset('test')
  c.data.train = train
  for k, v in data.items():
    c.data[k] = v
  return c


def write(path, content):
  with open(path, 'wb') as f:
    f.write(content.encode('utf-8') if isinstance(content, str) else content)
  return str(path)


def build_error(train, **data) -> str:
  with pytest.raises(DataError) as e:
    build_data(make_config(train, **data))
  return str(e.value)


def test_glob_that_matches_nothing(tmp_path):
  assert f'{tmp_path}/nothing*.jsonl: matches no files' in build_error(f'{tmp_path}/nothing*.jsonl')


@pytest.mark.parametrize('name', ['empty.jsonl', 'empty.txt', 'empty.parquet', 'empty.npy'])
def test_empty_file(tmp_path, name):
  path = write(tmp_path / name, '')
  assert f'{path}: empty file' in build_error(path)


def test_empty_npy_array_and_blank_jsonl(tmp_path):
  np.save(tmp_path / 'none.npy', np.zeros(0, np.int32))
  assert f'{tmp_path}/none.npy: empty file' in build_error(f'{tmp_path}/none.npy', tokenizer='byte')
  blank = write(tmp_path / 'blank.jsonl', '\n  \n\n')
  assert f'{blank}: no records' in build_error(blank)


def test_parquet_with_no_rows(tmp_path):
  pq.write_table(pa.table({'text': pa.array([], pa.string())}), tmp_path / 'rows.parquet')
  assert 'rows.parquet: empty file (no rows)' in build_error(f'{tmp_path}/rows.parquet')


def test_invalid_json_line(tmp_path):
  path = write(tmp_path / 'a.jsonl', ''.join(GOOD[:2]) + '{"text": "unterminated\n' + GOOD[3])
  assert f'{path}:3: invalid JSON' in build_error(path)


@pytest.mark.parametrize('line', ['{"body": "no text field"}', '["a list"]', '{"text": 42}'])
def test_line_without_text(tmp_path, line):
  path = write(tmp_path / 'a.jsonl', GOOD[0] + line + '\n')
  message = build_error(path)
  assert f'{path}:2: ' in message and '"text"' in message


def test_parquet_without_the_column(tmp_path):
  pq.write_table(pa.table({'body': ['some text ' * 10]}), tmp_path / 'a.parquet')
  message = build_error(f'{tmp_path}/a.parquet')
  assert f'{tmp_path}/a.parquet: no column "text" (columns: body)' in message
  build_data(make_config(f'{tmp_path}/a.parquet#body', val_ratio=0.0,
                             val=f'{tmp_path}/a.parquet#body'))  # the column can be named


def test_parquet_null_text_and_not_parquet(tmp_path):
  pq.write_table(pa.table({'text': ['fine', None]}), tmp_path / 'n.parquet')
  assert f'{tmp_path}/n.parquet: row 2: "text" is null' in build_error(f'{tmp_path}/n.parquet')
  path = write(tmp_path / 'fake.parquet', 'this is not parquet')
  assert f'{path}: not a readable Parquet file' in build_error(path)


def test_bytes_that_are_not_utf8(tmp_path):
  path = write(tmp_path / 'a.jsonl', GOOD[0].encode() + b'{"text": "caf\xe9"}\n')
  assert f'{path}:2: bytes that are not UTF-8' in build_error(path)
  txt = write(tmp_path / 'b.txt', b'first\nsecond\nthi\xffrd\n')
  assert f'{txt}:3: bytes that are not UTF-8' in build_error(txt)


def test_tokenizer_missing_or_not_sentencepiece(tmp_path):
  missing = str(tmp_path / 'missing.model')
  assert f'{missing}: tokenizer file not found' in build_error('embedded', tokenizer=missing)
  fake = write(tmp_path / 'fake.model', '{"not": "a model"}')
  assert f'{fake}: not a sentencepiece model' in build_error('embedded', tokenizer=fake)
  with pytest.raises(DataError, match='tokenizer file not found'):
    prepare.prepare('embedded', str(tmp_path / 'out'), tokenizer=missing, workers=1)


def test_token_ids_outside_the_vocabulary(tmp_path):
  ids = np.arange(1000) % 250
  ids[700] = 300
  np.save(tmp_path / 'ids.npy', ids.astype(np.uint16))
  message = build_error(f'{tmp_path}/ids.npy', tokenizer='byte')
  assert f'{tmp_path}/ids.npy: token id 300 at position 700 is outside the vocabulary [0, 259)' \
      in message
  with open(tmp_path / 'ids.json', 'w', encoding='utf-8') as f:  # a sidecar's vocabulary too
    json.dump({'vocab_size': 256, 'eos_id': 255}, f)
  assert 'token id 300 at position 700' in build_error(f'{tmp_path}/ids.npy')


def test_raw_bin_needs_a_sidecar_and_a_matching_size(tmp_path):
  np.arange(100, dtype=np.uint16).tofile(tmp_path / 't.bin')
  assert f'{tmp_path}/t.bin: a raw .bin token file needs a sidecar' in build_error(
      f'{tmp_path}/t.bin')
  with open(tmp_path / 't.json', 'w', encoding='utf-8') as f:
    json.dump({'dtype': 'uint16', 'vocab_size': 256, 'eos_id': 255, 'num_tokens': 150}, f)
  assert 'holds 100 tokens but its sidecar says 150' in build_error(f'{tmp_path}/t.bin')


def test_skip_counts_bad_records_per_file(tmp_path, caplog):
  bad = ['{"text": oops}\n', '{"body": "x"}\n', b'{"text": "\xff"}\n'.decode('latin-1') + '\n']
  a = write(tmp_path / 'a.jsonl', ''.join(GOOD[:20] + bad[:2]))
  b = write(tmp_path / 'b.jsonl', ''.join(GOOD[20:] + bad[:1]))
  with caplog.at_level(logging.WARNING):
    data = build_data(make_config(f'{tmp_path}/*.jsonl', on_bad_record='skip'))
  assert next(data.train)['tokens'].shape == (16, 33)
  assert f'{a}: skipped 2 bad records of 22' in caplog.text
  assert f'{b}: skipped 1 bad records of 21' in caplog.text

  lines = []
  meta = prepare.prepare(f'{tmp_path}/*.jsonl', str(tmp_path / 'out'), on_bad_record='skip',
                         workers=1, log=lines.append)
  assert meta['train'][0]['skipped'] == 3 and meta['train'][0]['documents'] == 40
  assert f'  {a}: skipped 2 bad records of 22' in lines


def test_skip_still_refuses_a_file_with_no_good_record(tmp_path):
  path = write(tmp_path / 'a.jsonl', '{"body": 1}\n{"body": 2}\n')
  assert f'{path}: no usable document (2 of 2 records were bad' in build_error(
      path, on_bad_record='skip')


def test_too_little_data_and_bad_settings(tmp_path):
  path = write(tmp_path / 'a.jsonl', json.dumps({'text': 'tiny'}) + '\n')
  assert 'make no window of seq_len + 1 = 33 tokens' in build_error(path, val_ratio=0.0, val=path)
  with pytest.raises(config_lib.ConfigError, match="data.on_bad_record='maybe'"):
    build_data(make_config('embedded', on_bad_record='maybe'))
  assert 'has weight -1.0' in build_error('embedded:-1')
  assert 'no eval data' in build_error('embedded', val_ratio=0.0)
  assert f'{tmp_path}: is a directory without meta.json' in build_error(f'{tmp_path}')


def test_source_list_parsing():
  specs = sources.parse('data/a/*.jsonl:0.45, tfds:usmle_qa@test#question:0.1,embedded,'
                        'tfds:mnist:3.0.1')
  assert [type(s) for s in specs] == [sources.Files, sources.Tfds, sources.Embedded, sources.Tfds]
  assert [s.weight for s in specs] == [0.45, 0.1, 1.0, 1.0]
  assert (specs[0].pattern, specs[1].dataset, specs[3].dataset) == (
      'data/a/*.jsonl', 'usmle_qa', 'mnist:3.0.1')
  assert (specs[1].split, specs[1].field) == ('test', 'question')
  assert specs[3].split == 'train'
