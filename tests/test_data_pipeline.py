"""The grain pipeline through data.open_batches: determinism, sharding, resume, mixture, one-pass
coverage, eval batches, token files, synthetic data and the embedded default."""
import collections
import json
import os
import threading

import numpy as np
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
from jax_pretrain.data import corpus
from jax_pretrain.data import prepare
from jax_pretrain.data.tokenizer import ByteTokenizer
from tests.conftest import build_data


def make_config(train='embedded', vocab_size=384, **data):
  c = config_lib.preset('test')  # seq_len 32, batch 16, eval 4 × 16
  c.data.train = train
  c.model.vocab_size = vocab_size
  for k, v in data.items():
    c.data[k] = v
  return c


def write_tokens(path, tokens, **sidecar):
  np.save(path, np.asarray(tokens))
  if sidecar:
    with open(os.path.splitext(path)[0] + '.json', 'w', encoding='utf-8') as f:
      json.dump(sidecar, f)
  return str(path)


def positional_source(tmp_path, n=20_000):
  """Token i == i, so a window's first token says where it came from."""
  return write_tokens(tmp_path / 'pos.npy', np.arange(n, dtype=np.int32), vocab_size=n,
                      eos_id=n - 1)


def take(it, k):
  return [next(it)['tokens'] for _ in range(k)]


def test_embedded_default_runs_through_the_pipeline():
  c = make_config()
  data = build_data(c)
  assert isinstance(data.tokenizer, ByteTokenizer)
  batch = next(data.train)
  assert batch['tokens'].shape == (16, 33) and batch['tokens'].dtype == np.int32
  assert batch['tokens'].max() < 259
  corpus_bytes = '\n'.join(corpus.embedded_documents()).encode('utf-8')
  for row in batch['tokens']:  # each window is a piece of the manual (up to a document's end)
    end = np.flatnonzero(row == data.tokenizer.eos_id)
    assert bytes(row[:end[0] if len(end) else None].tolist()) in corpus_bytes
  eval_batches = list(data.eval_batches())
  assert len(eval_batches) == c.train.eval_steps
  assert all(b['tokens'].shape == (16, 33) for b in eval_batches)
  state = data.train.get_state()
  assert json.loads(json.dumps(state)) == state  # goes into the checkpoint as JSON


def test_same_seed_same_batches_other_seed_other_batches(tmp_path):
  src = positional_source(tmp_path)
  a = take(build_data(make_config(src, 30_000)).train, 3)
  b = take(build_data(make_config(src, 30_000)).train, 3)
  c_ = make_config(src, 30_000)
  c_.train.seed = 1
  other = take(build_data(c_).train, 3)
  np.testing.assert_array_equal(np.stack(a), np.stack(b))
  assert not np.array_equal(np.stack(a), np.stack(other))


def test_windows_are_consecutive_tokens_overlapping_by_one(tmp_path):
  src = positional_source(tmp_path)
  rows = np.concatenate(take(build_data(make_config(src, 30_000)).train, 2))
  np.testing.assert_array_equal(rows, rows[:, :1] + np.arange(33))
  assert (rows[:, 0] % 32 == 0).all()  # windows start every seq_len tokens


def test_processes_read_disjoint_rows_of_the_same_global_batches(tmp_path):
  src = positional_source(tmp_path)
  c = make_config(f'{src}:0.7,synthetic:0.3', 30_000)
  p0 = take(build_data(c, 0, 2).train, 10)
  p1 = take(build_data(c, 1, 2).train, 10)
  assert p0[0].shape == (8, 33)  # batch_size // process_count rows each
  assert not {tuple(r) for r in np.concatenate(p0)} & {tuple(r) for r in np.concatenate(p1)}
  # Together they are the batches one process draws: a checkpoint resumes on any number of hosts.
  one = take(build_data(c).train, 10)
  np.testing.assert_array_equal(np.stack(one), np.concatenate([p0, p1], axis=1))
  it = build_data(c, 1, 2).train
  it.set_state(build_data(c).train.get_state() | {'next_index': 7})
  np.testing.assert_array_equal(next(it)['tokens'], one[7][8:])


@pytest.mark.parametrize('train', ['positional', 'embedded:0.7,synthetic:0.3'])
def test_restored_state_gives_the_next_batch(tmp_path, train):
  train = positional_source(tmp_path) if train == 'positional' else train
  c = make_config(train, 30_000 if 'pos' in train else 384)
  it = build_data(c).train
  take(it, 5)
  state = json.loads(json.dumps(it.get_state()))
  expected = take(it, 3)
  fresh = build_data(c).train
  fresh.set_state(state)
  np.testing.assert_array_equal(np.stack(take(fresh, 3)), np.stack(expected))


def test_state_read_from_another_thread_does_not_disturb_the_order():
  # The trainer's prefetch thread calls next() while the main thread may call get_state().
  c = make_config('embedded:0.6,synthetic:0.4')
  expected = take(build_data(c).train, 20)
  it = build_data(c).train
  got = []
  reader = threading.Thread(target=lambda: got.extend(take(it, 20)))
  reader.start()
  while reader.is_alive():
    it.get_state()
  reader.join()
  np.testing.assert_array_equal(np.stack(got), np.stack(expected))


def test_mixture_shares_within_one_point_over_10k_sequences(tmp_path):
  # Source k holds ids in [10k, 10k + 9) plus EOS 39: a window's first token names its source.
  rng = np.random.default_rng(0)
  weights = (0.5, 0.3, 0.2)
  specs = []
  for k, n_tokens in enumerate((9_000, 2_000, 500)):  # small sources repeat by epochs
    tokens = rng.integers(10 * k, 10 * k + 9, n_tokens)
    path = write_tokens(tmp_path / f's{k}.npy', tokens, vocab_size=40, eos_id=39)
    specs.append(f'{path}:{weights[k]}')
  c = make_config(','.join(specs), 64, seq_len=8)
  c.train.batch_size = 100
  rows = np.concatenate(take(build_data(c).train, 100))
  shares = np.bincount(rows[:, 0] // 10, minlength=3) / len(rows)
  assert len(rows) == 10_000
  np.testing.assert_allclose(shares, weights, atol=0.01)


@pytest.mark.parametrize('process_count', [1, 2])
def test_one_pass_over_a_prepared_corpus_loses_and_duplicates_nothing(tmp_path, process_count):
  docs = [f'document {i}: ' + 'lorem ipsum ' * (i % 7 + 1) for i in range(60)]
  with open(tmp_path / 'docs.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps({'text': d}) + '\n' for d in docs)
  out = str(tmp_path / 'prepared')
  meta = prepare.prepare(str(tmp_path / 'docs.jsonl'), out, val_ratio=0.1, workers=1,
                         log=lambda _: None)
  name = meta['train'][0]['name']

  # Preparation: train + val together are exactly the documents, each followed by EOS.
  tok = ByteTokenizer()
  expected = np.concatenate([np.append(tok.encode(d), tok.eos_id) for d in docs])
  stream = np.concatenate([np.fromfile(f'{out}/{s}/{name}.bin', np.uint16)
                           for s in ('train', 'val')])
  np.testing.assert_array_equal(stream, expected)

  # Training: one pass (the first n_windows rows of the global batches, over all processes) is
  # every window of the train split exactly once.
  train = np.fromfile(f'{out}/train/{name}.bin', np.uint16).astype(np.int32)
  n_windows = (len(train) - 1) // 32
  all_windows = collections.Counter(tuple(train[i * 32:i * 32 + 33]) for i in range(n_windows))
  c = make_config(out)
  num_batches = -(-n_windows // 16)
  per_process = [take(build_data(c, p, process_count).train, num_batches)
                 for p in range(process_count)]
  global_rows = np.concatenate([np.concatenate(rows) for rows in zip(*per_process)])
  assert collections.Counter(tuple(r) for r in global_rows[:n_windows]) == all_windows


def test_eval_batches_are_fixed_and_padded(tmp_path):
  src = positional_source(tmp_path)
  val = write_tokens(tmp_path / 'val.npy', np.arange(100, dtype=np.int32), vocab_size=20_000,
                     eos_id=19_999)
  c = make_config(src, 30_000, val=val)
  data = build_data(c)
  pad = data.tokenizer.pad_id
  first, second = list(data.eval_batches()), list(data.eval_batches())
  assert len(first) == 1  # 100 tokens: 4 windows (the last one partial), then nothing
  np.testing.assert_array_equal(first[0]['tokens'], second[0]['tokens'])
  rows = first[0]['tokens']
  real = rows[(rows != pad).any(axis=1)]
  assert len(real) == 4 and (rows[4:] == pad).all()
  assert sorted(real[:, 0]) == [0, 32, 64, 96] and (real[real[:, 0] == 96][0, 4:] == pad).all()
  # Two processes split each eval batch's rows.
  halves = [list(build_data(c, p, 2).eval_batches())[0]['tokens'] for p in (0, 1)]
  np.testing.assert_array_equal(np.concatenate(halves), rows)


def test_val_ratio_holds_out_the_end_of_the_data_from_a_document_start(tmp_path):
  tokens = np.arange(10_000, dtype=np.int32) % 100
  src = write_tokens(tmp_path / 't.npy', tokens, vocab_size=100, eos_id=99)
  data = build_data(make_config(src, 128, val_ratio=0.1))
  rows = np.concatenate([b['tokens'] for b in data.eval_batches()])
  assert (rows[:, 0] == 0).any()  # val starts right after an EOS (99): at a document start
  train_rows = np.concatenate(take(data.train, 20))
  assert train_rows.shape == (320, 33)


def test_pretokenized_npy_with_and_without_sidecar(tmp_path):
  tok = ByteTokenizer()
  ids = np.concatenate([np.append(tok.encode(d), tok.eos_id)
                        for d in corpus.embedded_documents()[:200]]).astype(np.uint16)
  bare = write_tokens(tmp_path / 'bare.npy', ids)
  data = build_data(make_config(bare, tokenizer='byte'))
  assert isinstance(data.tokenizer, ByteTokenizer)
  assert next(data.train)['tokens'].shape == (16, 33)
  with_sidecar = write_tokens(tmp_path / 'ids.npy', ids, vocab_size=258, eos_id=257)
  data = build_data(make_config(with_sidecar))  # no tokenizer: ids only
  assert data.tokenizer.vocab_size == 259 and data.tokenizer.pad_id == 258
  assert data.tokenizer.decode([1, 2]) == '1 2'
  with pytest.raises(data_lib.DataError, match='no tokenizer'):
    build_data(make_config(f'{with_sidecar},embedded'))


def test_raw_bin_with_sidecar(tmp_path):
  ids = (np.arange(5000) % 250).astype(np.uint16)
  ids.tofile(tmp_path / 'tokens.bin')
  with open(tmp_path / 'tokens.json', 'w', encoding='utf-8') as f:
    json.dump({'dtype': 'uint16', 'vocab_size': 256, 'eos_id': 255}, f)
  data = build_data(make_config(str(tmp_path / 'tokens.bin')))
  row = next(data.train)['tokens'][0]
  np.testing.assert_array_equal(row, (row[0] + np.arange(33)) % 250)


def test_synthetic_tokens_at_any_vocab_size():
  data = build_data(make_config('synthetic', 50_000))
  tokens = next(data.train)['tokens']
  assert tokens.shape == (16, 33) and tokens.max() < 50_000 and tokens.min() >= 0
  assert not (tokens == data.tokenizer.pad_id).any()
  assert len(list(data.eval_batches())) == 4


def test_synthetic_tokens_stay_out_of_real_eval_data(tmp_path):
  src = positional_source(tmp_path)
  data = build_data(make_config(f'{src}:0.5,synthetic:0.5', 30_000))
  rows = np.concatenate([b['tokens'] for b in data.eval_batches()])
  real = rows[rows[:, 0] != data.tokenizer.pad_id]
  np.testing.assert_array_equal(real[:, 1:4], real[:, :1] + np.arange(1, 4))  # consecutive ids


def test_model_vocab_smaller_than_tokenizer_is_refused():
  with pytest.raises(config_lib.ConfigError, match=r'model.vocab_size=200 .*\(259\)'):
    build_data(make_config(vocab_size=200))
