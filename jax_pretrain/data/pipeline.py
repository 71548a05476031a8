"""The grain pipeline: token streams -> windows -> shard -> shuffle -> mix -> batches.

Each source's stream is cut into windows of seq_len + 1 tokens that start every seq_len tokens
(neighbours share one token), so in one pass over a source every token is a target exactly once.
Per source, windows are shuffled with a seed derived from the run's seed (reshuffled each epoch)
and repeated forever, so small sources repeat by epochs. Sources are interleaved by weight with
grain's deterministic mixture and cut into global batches; each process reads only its own rows
of each (sharding by process_index). Everything is a function of the batch index, so a run that
resumes after step N starts the dataset at global batch N (`start_batch`) and draws exactly the
batches an uninterrupted run would, on any number of processes and with any data.num_workers.
"""
from collections.abc import Iterator
import threading

from absl import flags
import grain
import numpy as np

from jax_pretrain.data.tokens import TokenStream

Batch = dict[str, np.ndarray]
EVAL_SEED = 20240917  # the eval sample is the same for every run, whatever train.seed


class Windows:
  """A grain random-access source: window i = tokens [i * seq_len, i * seq_len + seq_len + 1).

  With pad_id set, a last partial window is kept, filled up with pad_id (for eval).
  """

  def __init__(self, stream: TokenStream, seq_len: int, pad_id: int | None = None):
    self.stream, self.seq_len, self.pad_id = stream, seq_len, pad_id
    n = len(stream) - 1  # targets in the stream
    self._len = max(0, -(-n // seq_len) if pad_id is not None else n // seq_len)

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> np.ndarray:
    start = int(i) * self.seq_len
    window_T1 = self.stream.read(start, min(start + self.seq_len + 1, len(self.stream)))
    if len(window_T1) < self.seq_len + 1:
      assert self.pad_id is not None  # without a pad id the last window is whole (__init__)
      window_T1 = np.pad(window_T1, (0, self.seq_len + 1 - len(window_T1)),
                         constant_values=self.pad_id)
    return window_T1

  def __repr__(self):
    return f'Windows({self.stream.name}, {self._len} × {self.seq_len + 1})'


class SyntheticWindows:
  """Random tokens in [0, vocab_size) except pad_id, a pure function of (seed, index)."""

  def __init__(self, vocab_size: int, pad_id: int, seq_len: int, seed: int,
               length: int = 1 << 40):
    self.vocab_size, self.pad_id, self.seq_len, self.seed = vocab_size, pad_id, seq_len, seed
    self._len = length

  def __len__(self) -> int:
    return self._len

  def __getitem__(self, i: int) -> np.ndarray:
    rng = np.random.Generator(np.random.Philox(key=self.seed, counter=int(i)))
    window_T1 = rng.integers(0, self.vocab_size - 1, self.seq_len + 1, dtype=np.int32)
    return window_T1 + (window_T1 >= self.pad_id)  # skip pad: the loss would ignore it

  def __repr__(self):
    return f'SyntheticWindows(vocab {self.vocab_size}, seed {self.seed})'


def source_seed(seed: int, k: int) -> int:
  """An independent shuffle seed for source k (grain wants [0, 2**32))."""
  return int(np.random.SeedSequence([seed, k]).generate_state(1)[0])


def _as_batch(rows) -> Batch:
  """Windows batch to {'tokens': ...}; rows that are dicts (packed SFT rows) batch to themselves."""
  return rows if isinstance(rows, dict) else {'tokens': rows}


def train_dataset(sources: list, weights: list[float], batch_size: int, seed: int,
                  process_index: int = 0, process_count: int = 1,
                  start_batch: int = 0) -> grain.MapDataset:
  """Endless batches {'tokens': int32 [batch_size // process_count, seq_len + 1]}: this process's
  rows of the global batches start_batch, start_batch + 1, ...

  Global batch b is windows [b * batch_size, (b + 1) * batch_size) of the mixture, whatever the
  number of processes; process p reads only its rows p * local ... (p + 1) * local - 1 of it. So
  the step a checkpoint was saved at resumes the same batches on any number of hosts.
  """
  parts = [grain.MapDataset.source(source).shuffle(seed=source_seed(seed, k)).repeat()
           for k, source in enumerate(sources)]
  ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
  local = batch_size // process_count
  first = start_batch * process_count + process_index
  return ds.batch(local, drop_remainder=True)[first::process_count].map(_as_batch)


class LockedIterator:
  """A grain iterator whose next/get_state/set_state are serialized by one lock.

  The trainer draws batches in a background thread (data.Prefetcher) and closes the iterator from
  the main one; it never reads or sets the iterator's state (the data position is the step:
  start_batch). grain's multiprocess iterator is not thread-safe (concurrent calls reorder
  batches).
  """

  def __init__(self, it: grain.DatasetIterator):
    self._it, self._lock = it, threading.Lock()

  def __iter__(self):
    return self

  def __next__(self) -> Batch:
    with self._lock:
      return next(self._it)

  def get_state(self) -> dict:
    with self._lock:
      return self._it.get_state()

  def set_state(self, state: dict) -> None:
    with self._lock:
      self._it.set_state(state)

  def close(self) -> None:
    with self._lock:
      self._it.close()


def iterator(ds: grain.MapDataset, read_threads: int, prefetch: int,
             num_workers: int = 0) -> LockedIterator:
  """Batches assembled by `read_threads` threads (and `num_workers` processes when > 0)."""
  it_ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=read_threads,
                                               prefetch_buffer_size=prefetch))
  if num_workers > 0:
    if not flags.FLAGS.is_parsed():  # grain reads its absl flags; outside app.run: the defaults
      flags.FLAGS.mark_as_parsed()
    it_ds = it_ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=num_workers,
                                                           per_worker_buffer_size=prefetch))
  return LockedIterator(iter(it_ds))


def eval_dataset(sources: list, weights: list[float]) -> grain.MapDataset:
  """The held-out windows: each source shuffled with a fixed seed, mixed by weight, no repeats
  (the mixture ends when a source runs out at its weight)."""
  parts = [grain.MapDataset.source(source).shuffle(seed=source_seed(EVAL_SEED, k))
           for k, source in enumerate(sources)]
  return parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)


def eval_batches(ds: grain.MapDataset, num_batches: int, batch_size: int, seq_len: int,
                 pad_id: int, process_index: int = 0, process_count: int = 1) -> Iterator[Batch]:
  """The first num_batches × batch_size windows of ds; this process gets its rows of each batch,
  with rows past the end of the data filled with pad_id. Stops after the last non-empty batch."""
  local = batch_size // process_count
  for b in range(num_batches):
    start = b * batch_size
    if start >= len(ds):
      return
    if isinstance(ds[0], dict):  # packed SFT rows: padding rows have weights 0, segments 0
      batch = {k: np.zeros((local,) + v.shape, v.dtype) for k, v in ds[0].items()}
      batch['tokens'][:] = pad_id
    else:
      batch = {'tokens': np.full((local, seq_len + 1), pad_id, np.int32)}
    for r in range(local):
      i = start + process_index * local + r
      if i < len(ds):
        row = _as_batch(ds[i])
        for k in batch:
          batch[k][r] = row[k]
    yield batch
