"""scripts/prepare_data.py's library: output format, counts, no-op re-runs, atomic output, parallel
workers, sentencepiece tokenizers, and training from the prepared directory."""
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain.data import corpus
from jax_pretrain.data import prepare
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError
from tests.conftest import build_data


def make_config(train, vocab_size=384, **data):
  c = config_lib.preset('test')
  c.data.train = train
  c.model.vocab_size = vocab_size
  for k, v in data.items():
    c.data[k] = v
  return c


def write_jsonl(path, texts, extra_lines=()):
  with open(path, 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': t}) + '\n' for t in texts)
    f.writelines(extra_lines)
  return str(path)


@pytest.fixture(scope='module')
def sp_model(tmp_path_factory):
  path = str(tmp_path_factory.mktemp('tok') / 'bpe.model')
  return tokenizer_lib.train_sentencepiece(corpus.embedded_documents(), path, 1000, 'bpe')


def run_prepare(*args, **kwargs):
  lines = []
  meta = prepare.prepare(*args, log=lines.append, workers=kwargs.pop('workers', 1), **kwargs)
  return meta, '\n'.join(lines)


def test_prepare_writes_counts_and_is_a_no_op_when_unchanged(tmp_path):
  docs = [f'doc {i} ' * (i + 1) for i in range(50)]
  a = write_jsonl(tmp_path / 'a.jsonl', docs, ['\n', '{"text": 3}\n'])
  with open(tmp_path / 'b.txt', 'w', encoding='utf-8') as f:
    f.write('A plain text file\nwith two lines.\n')
  out = str(tmp_path / 'out')
  meta, log = run_prepare(f'{a}:0.8,{tmp_path}/*.txt:0.2', out, on_bad_record='skip')
  assert [e['documents'] for e in meta['train']] == [50, 1]
  assert [e['skipped'] for e in meta['train']] == [1, 0]
  assert meta['train'][0]['tokens'] == sum(len(d.encode()) + 1 for d in docs)
  assert f'{a}: skipped 1 bad records of 51' in log and 'MB/s per core' in log
  name = meta['train'][0]['name']
  with open(f'{out}/train/{name}.json', encoding='utf-8') as f:
    sidecar = json.load(f)
  assert (sidecar['tokenizer'], sidecar['eos_id'], sidecar['dtype']) == ('byte', 257, 'uint16')
  assert np.load(f'{out}/train/{name}.docs.npy')[-1] == sidecar['num_tokens']

  stamp = os.stat(f'{out}/meta.json').st_mtime_ns
  _, log = run_prepare(f'{a}:0.8,{tmp_path}/*.txt:0.2', out, on_bad_record='skip')
  assert 'up to date' in log and os.stat(f'{out}/meta.json').st_mtime_ns == stamp

  write_jsonl(tmp_path / 'a.jsonl', docs[:10])  # changed input: prepared again
  meta, log = run_prepare(f'{a}:0.8,{tmp_path}/*.txt:0.2', out, on_bad_record='skip')
  assert 'up to date' not in log and meta['train'][0]['documents'] == 10


def test_interrupted_or_failed_run_leaves_no_output_and_keeps_the_old_one(tmp_path):
  good = write_jsonl(tmp_path / 'good.jsonl', ['hello world'] * 20)
  bad = write_jsonl(tmp_path / 'bad.jsonl', ['fine'], ['{"text": broken\n'])
  out = str(tmp_path / 'out')
  with pytest.raises(DataError, match=r'bad\.jsonl:2: invalid JSON'):
    run_prepare(f'{good},{bad}', out)
  assert not [p for p in os.listdir(tmp_path) if p.startswith('out')]  # nothing half-written

  run_prepare(good, out)
  with open(f'{out}/meta.json', encoding='utf-8') as f:
    before = f.read()
  with pytest.raises(DataError):
    run_prepare(f'{good},{bad}', out)
  with open(f'{out}/meta.json', encoding='utf-8') as f:
    assert f.read() == before  # the previous complete output is untouched
  assert sorted(p for p in os.listdir(tmp_path) if p.startswith('out')) == ['out']


def test_parallel_workers_write_the_same_bytes_as_one(tmp_path, sp_model):
  rng = np.random.default_rng(0)
  docs = corpus.embedded_documents()
  for k in range(3):
    write_jsonl(tmp_path / f'part{k}.jsonl', [docs[i] for i in rng.integers(0, len(docs), 40)])
  source = f'{tmp_path}/part*.jsonl'
  one, _ = run_prepare(source, str(tmp_path / 'one'), tokenizer=sp_model.path, workers=1)
  two, log = run_prepare(source, str(tmp_path / 'two'), tokenizer=sp_model.path, workers=2)
  assert 'with 2 worker' in log
  name = one['train'][0]['name']
  for ext in ('.bin', '.docs.npy'):
    with open(tmp_path / 'one' / 'train' / (name + ext), 'rb') as f1, \
        open(tmp_path / 'two' / 'train' / (name + ext), 'rb') as f2:
      assert f1.read() == f2.read()
  assert one['train'][0]['files'] == sorted(str(tmp_path / f'part{k}.jsonl') for k in range(3))


@pytest.mark.parametrize('model_type', ['bpe', 'unigram'])
def test_trained_sentencepiece_tokenizer(tmp_path, model_type):
  tok = tokenizer_lib.train_sentencepiece(corpus.embedded_documents()[:20],
                                          str(tmp_path / 't.model'), 600, model_type)
  assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (600, 1, 2, 3)
  text = 'def f(x):\n    return x ** 2  # ünïcode ✓'
  assert tok.decode(tok.encode(text)) == text  # whitespace kept, byte fallback for the rest


def test_training_from_prepared_data_with_val_sources_and_a_sentencepiece_tokenizer(
    tmp_path, sp_model):
  docs = corpus.embedded_documents()
  train = write_jsonl(tmp_path / 'train.jsonl', docs[:60])
  pq.write_table(pa.table({'content': docs[60:]}), tmp_path / 'val.parquet')
  out = str(tmp_path / 'prepared')
  meta, _ = run_prepare(train, out, tokenizer=sp_model.path,
                        val=f'{tmp_path}/val.parquet#content')
  assert meta['val'][0]['documents'] == len(docs) - 60
  data = build_data(make_config(out, 1024))
  assert isinstance(data.tokenizer, tokenizer_lib.SentencePieceTokenizer)
  assert data.tokenizer.identity == sp_model.identity
  assert next(data.train)['tokens'].max() < 1000
  assert len(list(data.eval_batches())) == 4
  with pytest.raises(config_lib.ConfigError, match=r'model.vocab_size=384 .*\(1000\)'):
    build_data(make_config(out, 384))
  with pytest.raises(DataError, match='was tokenized with sentencepiece'):
    build_data(make_config(out, 1024, tokenizer='byte'))


def test_prepared_directory_without_val_is_carved_at_train_time(tmp_path):
  src = write_jsonl(tmp_path / 'a.jsonl', corpus.embedded_documents())
  out = str(tmp_path / 'p')
  meta, _ = run_prepare(src, out)
  assert meta['val'] == []
  data = build_data(make_config(out, val_ratio=0.1))
  assert len(list(data.eval_batches())) == 4


def test_prepare_refuses_to_replace_a_directory_it_did_not_write(tmp_path):
  src = write_jsonl(tmp_path / 'a.jsonl', ['x'])
  (tmp_path / 'mine').mkdir()
  (tmp_path / 'mine' / 'notes.txt').write_text('keep me')
  with pytest.raises(DataError, match='not prepared data'):
    run_prepare(src, str(tmp_path / 'mine'))


def test_compressed_corpora_and_a_byte_order_mark_read_like_plain_files(tmp_path):
  import gzip  # noqa: PLC0415

  import zstandard  # noqa: PLC0415
  docs = corpus.embedded_documents()[:40]
  plain = ''.join(json.dumps({'text': t}) + '\n' for t in docs).encode('utf-8')
  bom = b'\xef\xbb\xbf'
  (tmp_path / 'plain.jsonl').write_bytes(plain)
  (tmp_path / 'bom.jsonl').write_bytes(bom + plain)
  (tmp_path / 'a.jsonl.gz').write_bytes(gzip.compress(bom + plain))
  (tmp_path / 'a.jsonl.zst').write_bytes(zstandard.ZstdCompressor().compress(plain))
  (tmp_path / 'a.txt').write_text(docs[0], encoding='utf-8')
  (tmp_path / 'a.txt.gz').write_bytes(gzip.compress(bom + docs[0].encode('utf-8')))
  (tmp_path / 'a.txt.zst').write_bytes(zstandard.ZstdCompressor().compress(
      docs[0].encode('utf-8')))

  def tokens(name):
    out = str(tmp_path / f'prepared-{name}')
    meta, _ = run_prepare(str(tmp_path / name), out)
    return np.fromfile(os.path.join(out, 'train', meta['train'][0]['name'] + '.bin'), np.uint16)

  for name in ('bom.jsonl', 'a.jsonl.gz', 'a.jsonl.zst'):
    np.testing.assert_array_equal(tokens(name), tokens('plain.jsonl'))
  for name in ('a.txt.gz', 'a.txt.zst'):
    np.testing.assert_array_equal(tokens(name), tokens('a.txt'))
  data = build_data(make_config(f'{tmp_path}/a.jsonl.gz,{tmp_path}/a.jsonl.zst', val_ratio=0.1))
  assert next(data.train)['tokens'].shape == (16, 33)


def test_bad_compressed_input_names_the_file_and_line(tmp_path):
  import gzip  # noqa: PLC0415
  (tmp_path / 'bad.jsonl.gz').write_bytes(gzip.compress(b'{"text": "ok"}\n{"text": oops}\n'))
  with pytest.raises(DataError, match=rf'{tmp_path}/bad.jsonl.gz:2: invalid JSON'):
    run_prepare(str(tmp_path / 'bad.jsonl.gz'), str(tmp_path / 'p1'))
  (tmp_path / 'cut.jsonl.gz').write_bytes(gzip.compress(b'{"text": "ok"}\n' * 100)[:-12])
  with pytest.raises(DataError, match=rf'{tmp_path}/cut.jsonl.gz: cannot decompress it'):
    run_prepare(str(tmp_path / 'cut.jsonl.gz'), str(tmp_path / 'p2'))
