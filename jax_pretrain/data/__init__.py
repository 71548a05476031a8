"""Input pipeline: what the trainer calls to get batches.

`build(config, process_index, process_count)` returns a `Data` with
  tokenizer      encode/decode, vocab_size, bos_id, eos_id, pad_id
  train          an endless iterator of {'tokens': int32 [local_batch, seq_len + 1]} with
                 get_state()/set_state() so a checkpoint can resume it exactly
  eval_batches() a fresh pass over the fixed held-out set, the same batches every call; rows past
                 the end of the data are filled with pad_id (the loss ignores them)
Each process gets only its own rows: local_batch = batch_size // process_count.
"""
import dataclasses
from collections.abc import Callable, Iterator

import ml_collections
import numpy as np

from jax_pretrain.data import corpus
from jax_pretrain.data.tokenizer import ByteTokenizer

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class Data:
  tokenizer: ByteTokenizer
  train: 'RandomWindows'
  eval_batches: Callable[[], Iterator[Batch]]


class RandomWindows:
  """Windows of seq_len + 1 tokens at random offsets; batch i depends only on (seed, i)."""

  def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
               process_index: int, process_count: int):
    if len(tokens) < seq_len + 2:
      raise ValueError(f'training data has {len(tokens)} tokens, fewer than one sequence of '
                       f'seq_len + 1 = {seq_len + 1}.')
    self._tokens, self._seq_len, self._seed = tokens, seq_len, seed
    local = global_batch // process_count
    self._rows = slice(process_index * local, (process_index + 1) * local)
    self._global_batch = global_batch
    self._step = 0

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    rng = np.random.default_rng([self._seed, self._step])
    starts = rng.integers(0, len(self._tokens) - self._seq_len - 1, size=self._global_batch)
    idx = starts[self._rows, None] + np.arange(self._seq_len + 1)[None, :]
    self._step += 1
    return {'tokens': self._tokens[idx].astype(np.int32)}

  def get_state(self) -> dict:
    return {'step': self._step}

  def set_state(self, state: dict) -> None:
    self._step = int(state['step'])


def _eval_batches(tokens: np.ndarray, seq_len: int, global_batch: int, num_batches: int,
                  pad_id: int, process_index: int, process_count: int) -> Iterator[Batch]:
  n_windows = max(1, (len(tokens) - 1) // seq_len)
  local = global_batch // process_count
  for b in range(num_batches):
    rows = np.full((global_batch, seq_len + 1), pad_id, np.int32)
    for r in range(global_batch):
      w = b * global_batch + r
      if w >= n_windows:
        break
      window = tokens[w * seq_len: w * seq_len + seq_len + 1]
      rows[r, :len(window)] = window
    if (rows == pad_id).all():
      return
    yield {'tokens': rows[process_index * local:(process_index + 1) * local]}


def build(config: ml_collections.ConfigDict, process_index: int = 0,
          process_count: int = 1) -> Data:
  d, t = config.data, config.train
  if d.train != 'embedded':
    raise NotImplementedError(f'data.train={d.train!r}: only the embedded corpus is supported yet.')
  tokenizer = ByteTokenizer()
  if config.model.vocab_size < tokenizer.vocab_size:
    raise ValueError(f'model.vocab_size={config.model.vocab_size} is smaller than the '
                     f"tokenizer's vocabulary ({tokenizer.vocab_size}).")
  tokens = corpus.concatenate(corpus.embedded_documents(), tokenizer)
  train_tokens, val_tokens = corpus.split_tokens(tokens, d.val_ratio)
  train = RandomWindows(train_tokens, d.seq_len, t.batch_size, t.seed, process_index,
                        process_count)
  return Data(
      tokenizer=tokenizer, train=train,
      eval_batches=lambda: _eval_batches(val_tokens, d.seq_len, t.eval_batch_size, t.eval_steps,
                                         tokenizer.pad_id, process_index, process_count))
