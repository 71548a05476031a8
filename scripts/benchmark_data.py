"""Input pipeline throughput: tokens/s delivered for a batch shape, and preparation MB/s per core.

  python scripts/benchmark_data.py                        # xlarge shape, 256 × 2049, temp mixture
  python scripts/benchmark_data.py --data data/prepared   # your prepared data
  python scripts/benchmark_data.py --data synthetic --num-workers 2 --read-threads 1
  python scripts/benchmark_data.py --prepare-mb 50        # also time prepare_data on 50 MB of text

Without --data it writes a 3-source mixture of random token files (--tokens in all) to a temporary
directory, so the numbers measure the pipeline (memory-mapped reads, shuffling, mixing, batching),
not the disk. Batches are drawn with next(it), as the trainer draws them, each followed by
it.get_state() (which the trainer no longer calls: the data position is the step), so the figure
errs on the slow side.
"""
import argparse
import json
import os
import random
import tempfile
import time

import numpy as np

from jax_pretrain import cli
from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
from jax_pretrain.data import prepare
from jax_pretrain.data import tokenizer as tokenizer_lib


def write_mixture(directory: str, num_tokens: int, vocab_size: int) -> str:
  """Three random-token .npy sources (documents of ~1k tokens) with a sidecar each."""
  rng = np.random.default_rng(0)
  specs = []
  for k, share in enumerate((0.5, 0.3, 0.2)):
    tokens = rng.integers(0, vocab_size - 1, int(num_tokens * share), dtype=np.uint16)
    tokens[rng.random(len(tokens)) < 1e-3] = vocab_size - 1  # EOS: ~1000-token documents
    path = os.path.join(directory, f'source{k}.npy')
    np.save(path, tokens)
    with open(os.path.join(directory, f'source{k}.json'), 'w', encoding='utf-8') as f:
      json.dump({'vocab_size': vocab_size, 'eos_id': vocab_size - 1}, f)
    specs.append(f'{path}:{share}')
  return ','.join(specs)


def benchmark_pipeline(a, source_list: str) -> float:
  c = config_lib.defaults()
  c.data.train, c.data.seq_len = source_list, a.seq_len
  c.data.num_workers, c.data.read_threads = a.num_workers, a.read_threads
  c.data.prefetch = a.prefetch
  c.train.batch_size, c.train.eval_batch_size, c.train.eval_steps = a.batch_size, a.batch_size, 1
  c.train.steps = a.warmup + a.steps
  c.model.vocab_size = a.vocab_size + 1  # room for an appended pad id
  t0 = time.perf_counter()
  sources = data_lib.open_sources(c)
  c, _ = config_lib.resolve(c, num_devices=1, backend='cpu',
                            tokenizer_vocab_size=sources.tokenizer.vocab_size)
  data = data_lib.open_batches(c, sources)
  print(f'built the pipeline in {time.perf_counter() - t0:.2f} s ({source_list[:80]})')
  it = data.train
  for _ in range(a.warmup):
    next(it)
  t0 = time.perf_counter()
  for _ in range(a.steps):
    batch = next(it)
    it.get_state()
  seconds = time.perf_counter() - t0
  assert batch['tokens'].shape == (a.batch_size, a.seq_len + 1), batch['tokens'].shape
  tokens_per_s = a.steps * a.batch_size * (a.seq_len + 1) / seconds
  print(f'{a.steps} batches of {a.batch_size} × {a.seq_len + 1} in {seconds:.2f} s: '
        f'{tokens_per_s:,.0f} tokens/s ({a.steps / seconds:.1f} batches/s; '
        f'num_workers={a.num_workers}, read_threads={a.read_threads})')
  if hasattr(it, 'close'):
    it.close()
  return tokens_per_s


def benchmark_prepare(a, directory: str) -> None:
  """Tokenizes ~prepare_mb MB of JSONL (reshuffled Python manual pages) with a BPE tokenizer."""
  from jax_pretrain.data import corpus
  docs = corpus.embedded_documents()
  rnd = random.Random(0)
  path = os.path.join(directory, 'text.jsonl')
  written = 0
  with open(path, 'w', encoding='utf-8') as f:
    while written < a.prepare_mb * 1e6:
      line = json.dumps({'text': rnd.choice(docs)}) + '\n'
      f.write(line)
      written += len(line)
  model = os.path.join(directory, 'bpe.model')
  tokenizer_lib.train_sentencepiece(docs, model, a.prepare_vocab, 'bpe')
  print(f'\npreparing {written / 1e6:.0f} MB of JSONL with a {a.prepare_vocab}-piece BPE '
        'tokenizer:')
  for workers in sorted({1, a.prepare_workers or os.cpu_count() or 1}):
    prepare.prepare(path, os.path.join(directory, f'prepared{workers}'), tokenizer=model,
                    workers=workers)


def main() -> None:
  cli.output_policy()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--data', default='', help='source list (default: a temporary random mixture)')
  p.add_argument('--tokens', type=int, default=300_000_000, help='tokens in the temp mixture')
  p.add_argument('--vocab-size', type=int, default=32767)
  p.add_argument('--batch-size', type=int, default=256)
  p.add_argument('--seq-len', type=int, default=2048)
  p.add_argument('--steps', type=int, default=50)
  p.add_argument('--warmup', type=int, default=5)
  p.add_argument('--num-workers', type=int, default=0)
  p.add_argument('--read-threads', type=int, default=2)
  p.add_argument('--prefetch', type=int, default=4)
  p.add_argument('--prepare-mb', type=float, default=0, help='also time preparation (MB of text)')
  p.add_argument('--prepare-vocab', type=int, default=8192)
  p.add_argument('--prepare-workers', type=int, default=0)
  a = p.parse_args()
  with cli.user_errors(), tempfile.TemporaryDirectory() as directory:
    source_list = a.data or write_mixture(directory, a.tokens, a.vocab_size)
    benchmark_pipeline(a, source_list)
    if a.prepare_mb:
      benchmark_prepare(a, directory)


if __name__ == '__main__':
  main()
