"""From the config's data group to the trainer's batches.

`open_sources(config)` parses data.train and data.val once and settles the tokenizer (cheap: no
data is read); `open_batches(config, sources, ...)` resolves them into token streams, holds out
eval data and returns a `Data` with the grain iterators. See data/__init__.py for what Data holds.
`eval_sets(config, tokenizer, batch_size, ...)` is the eval data of a finished run, per source, in
order (evaluate.py).
"""
from collections.abc import Callable
from collections.abc import Iterator
import dataclasses
import os
from typing import TYPE_CHECKING, Any

from absl import logging
import numpy as np

from jax_pretrain.data import sources as sources_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokens as tokens_lib
from jax_pretrain.data.errors import DataError
from jax_pretrain.data.sources import Component

if TYPE_CHECKING:  # (not imported at run time: it imports jax, which data workers need not load)
  from jax_pretrain.config import Config
  from jax_pretrain.data.pipeline import LockedIterator

Batch = dict[str, np.ndarray]


@dataclasses.dataclass
class Data:
  tokenizer: object  # data.tokenizer's Byte-, SentencePiece-, Hf- or IdTokenizer
  train: 'LockedIterator'  # over grain's: next(), close()
  eval_batches: Callable[[], Iterator[Batch]]


@dataclasses.dataclass
class Sources:
  """data.train and data.val, parsed once, and the tokenizer that reads them."""
  train: list[sources_lib.Source]
  val: list[sources_lib.Source]  # []: eval data is held out of train
  tokenizer: Any  # data.tokenizer's Byte-, SentencePiece-, Hf- or IdTokenizer
  options: sources_lib.ReadOptions


def resolve_tokenizer(setting: str, sources: list[sources_lib.Source], model_vocab_size: int):
  """data.tokenizer if set; else the one the prepared data / sidecars record; else bytes for raw
  text; else (synthetic only) bare ids filling model.vocab_size. Checks that all sources agree."""
  declared = [r for source in sources for r in source.tokenizer_records()]
  if setting:
    tok = tokenizer_lib.load(setting)
  elif declared:
    first = declared[0]
    tok = tokenizer_lib.from_record(first.record, first.directory, first.where)
  elif any(not isinstance(source, sources_lib.Synthetic) for source in sources):
    tok = tokenizer_lib.ByteTokenizer()
  else:
    v = model_vocab_size
    tok = tokenizer_lib.IdTokenizer(v - 1, eos_id=v - 2, bos_id=v - 3)  # pad: v - 1
  for d in declared:
    identity = d.record.get('tokenizer')
    if identity and identity not in (tok.identity, getattr(tok, 'former_identity', None)):
      raise DataError(f'{d.where}: was tokenized with {identity}, but the tokenizer is '
                      f'{tok.identity} ({tok.path or "from the data"}). Use one tokenizer for '
                      'all sources (data.tokenizer, or re-run prepare_data.py).')
    if not identity and d.record.get('eos_id', tok.eos_id) != tok.eos_id:
      raise DataError(f'{d.where}: eos_id {d.record["eos_id"]} differs from the tokenizer\'s '
                      f'{tok.eos_id}.')
  return tok


def open_sources(config: 'Config') -> Sources:
  d = config.data
  if not d.train:
    raise DataError("data.train is empty: name the training data, e.g. --config.data.train="
                    "data/mix1 (a directory written by scripts/prepare_data.py), 'data/*.jsonl', "
                    "or 'embedded' (the Python manual that ships with Python); see docs/data.md.")
  train = sources_lib.parse(d.train, 'data.train')
  val = sources_lib.parse(d.val, 'data.val') if d.val else []
  setting = d.tokenizer
  run_tokenizer = os.path.join(config.checkpoint.restore_from, 'tokenizer')
  if (d.format == 'sft' and not setting and config.checkpoint.restore_from
      and os.path.isdir(run_tokenizer)):
    setting = run_tokenizer  # fine-tuning text is read with the tokenizer the model learned
  tokenizer = resolve_tokenizer(setting, train + val, config.model.vocab_size)
  return Sources(train, val, tokenizer, sources_lib.ReadOptions.from_config(d))


def eval_components(sources: list[sources_lib.Source], tokenizer,
                    options: sources_lib.ReadOptions, split: str = 'val') -> list[Component]:
  """The token streams of a source list read whole for evaluation (a prepared source: its split)."""
  return [c for source in sources for c in source.components(split, tokenizer, options)]


def split_components(sources: Sources, val_ratio: float) -> tuple[list[Component], list[Component]]:
  """(train, eval) components; the eval streams are never in train.

  Eval is data.val when given, else the split prepare_data.py made, else the last val_ratio of
  each training source.
  """
  train, val = [], []
  for source in sources.train:
    components = source.components('train', sources.tokenizer, sources.options)
    train.extend(components)
    if sources.val:
      continue
    if source.has_split('val'):
      # prepare_data.py's split
      val.extend(source.components('val', sources.tokenizer, sources.options))
      continue
    for c in components:
      if c.tokens is None:
        val.append(c)
      else:
        c.tokens, held_out = tokens_lib.carve(c.tokens, sources.tokenizer.eos_id, val_ratio)
        val.append(Component(c.name, c.weight, held_out))
  val.extend(eval_components(sources.val, sources.tokenizer, sources.options))
  return train, val


def open_batches(config: 'Config', sources: Sources, process_index: int = 0,
          process_count: int = 1, start_batch: int = 0) -> Data:
  """config: resolved (config.resolve); sources: open_sources(config); start_batch: the first
  global batch to draw (a run resumed after step N draws batch N next)."""
  from jax_pretrain.data import pipeline  # noqa: PLC0415
  # (grain, and the jax it imports, load here: prepare's worker processes start without them)
  d, t, tokenizer = config.data, config.train, sources.tokenizer
  if d.format == 'sft':
    from jax_pretrain.data import sft  # noqa: PLC0415
    train_rows, val_rows = sft.packed_sources(sources, d.seq_len, d.val_ratio, tokenizer.pad_id)
    return _data(config, tokenizer, train_rows, [r.examples.weight for r in train_rows],
                 val_rows, [r.examples.weight for r in val_rows], process_index, process_count,
                 start_batch)
  eval_budget = t.eval_steps * t.eval_batch_size
  train, val = split_components(sources, d.val_ratio)

  train_sources = []
  for k, c in enumerate(train):
    windows: pipeline.Windows | pipeline.SyntheticWindows
    if c.tokens is None:
      windows = pipeline.SyntheticWindows(tokenizer.vocab_size, tokenizer.pad_id, d.seq_len,
                                          seed=pipeline.source_seed(t.seed, k))
    else:
      windows = pipeline.Windows(c.tokens, d.seq_len)
      if not len(windows):
        raise DataError(f'{c.name}: {len(c.tokens)} training tokens make no window of seq_len + '
                        f'1 = {d.seq_len + 1} tokens. Add data or lower data.seq_len.')
    train_sources.append(windows)
    logging.info('train source %s: weight %.3f, %d windows', c.name, c.weight, len(windows))
  eval_sources: list[pipeline.Windows | pipeline.SyntheticWindows] = []
  eval_weights: list[float] = []
  for c in val:
    held = None if c.tokens is None else pipeline.Windows(c.tokens, d.seq_len, tokenizer.pad_id)
    if held is not None and len(held):  # a source too small to hold val tokens adds none
      eval_sources.append(held)
      eval_weights.append(c.weight)
  if not eval_sources and any(c.tokens is None for c in val):
    # Random tokens are eval data only for a synthetic-only run (a benchmark): they would blur
    # the eval loss of real data.
    eval_sources = [pipeline.SyntheticWindows(tokenizer.vocab_size, tokenizer.pad_id, d.seq_len,
                                              seed=pipeline.EVAL_SEED, length=max(eval_budget, 1))]
    eval_weights = [1.0]
  return _data(config, tokenizer, train_sources, [c.weight for c in train], eval_sources,
               eval_weights, process_index, process_count, start_batch)


def _data(config: 'Config', tokenizer, train_sources: list,
          train_weights: list[float], eval_sources: list, eval_weights: list[float],
          process_index: int, process_count: int, start_batch: int) -> Data:
  """The Data of grain random-access sources of rows (windows, or packed SFT rows)."""
  from jax_pretrain.data import pipeline  # noqa: PLC0415
  d, t = config.data, config.train
  ds = pipeline.train_dataset(train_sources, train_weights, t.batch_size, t.seed,
                              process_index, process_count, start_batch)
  train_it = pipeline.iterator(ds, d.read_threads, d.prefetch, d.num_workers)
  if not eval_sources:
    why = ('data.val holds no tokens' if d.val else
           f'data.val_ratio={d.val_ratio} holds out nothing from data.train')
    raise DataError(f'no eval data: {why}. Set data.val or a positive data.val_ratio.')
  eval_ds = pipeline.eval_dataset(eval_sources, eval_weights)

  def eval_batches() -> Iterator[Batch]:
    return pipeline.eval_batches(eval_ds, t.eval_steps, t.eval_batch_size, d.seq_len,
                                 tokenizer.pad_id, process_index, process_count)

  return Data(tokenizer=tokenizer, train=train_it, eval_batches=eval_batches)


@dataclasses.dataclass
class EvalSet:
  """One source's eval data, read in order."""
  name: str
  weight: float
  batches: Iterator[Batch]  # batch_size rows each; the last filled up with pad_id (loss ignores)
  bytes: int | None = None  # UTF-8 bytes of the targets' text; None: no text (or SFT)


class _First:
  """The first n rows of a random-access source of rows."""

  def __init__(self, rows, n: int):
    self.rows, self.n = rows, n

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, i: int):
    return self.rows[i]


def eval_sets(config: 'Config', tokenizer, batch_size: int, data: str = '',
              split: str = 'val', max_tokens: int = 0) -> list[EvalSet]:
  """A run's eval data, one EvalSet per source: `data` (a source list in data.train's syntax;
  prepared directories read at `split`), or with data '' the run's held-out data as
  `open_batches` holds it out. A source is read in order as windows of seq_len + 1 tokens
  starting every seq_len tokens, so each of its first max_tokens (0: all) is a target once; an
  SFT run's (data.format='sft') as its packed examples. tokenizer: the run's."""
  from jax_pretrain.data import pipeline  # noqa: PLC0415  (grain)
  T, pad_id = config.data.seq_len, tokenizer.pad_id

  def batches(rows, n: int) -> Iterator[Batch]:
    return pipeline.eval_batches(_First(rows, n), -(-n // batch_size), batch_size, T, pad_id)

  def count(rows) -> int:
    return len(rows) if not max_tokens else min(len(rows), -(-max_tokens // T))

  if config.data.format == 'sft':
    from jax_pretrain.data import sft  # noqa: PLC0415
    if data:
      sources = Sources([], sources_lib.parse(data, '--data'), tokenizer,
                        sources_lib.ReadOptions.from_config(config.data))
    else:
      sources = dataclasses.replace(open_sources(config), tokenizer=tokenizer)
    return [EvalSet(rows.examples.name, rows.examples.weight, batches(rows, count(rows)))
            for rows in sft.packed_sources(sources, T, config.data.val_ratio, pad_id)[1]]
  if data:
    components = eval_components(sources_lib.parse(data, '--data'), tokenizer,
                                 sources_lib.ReadOptions.from_config(config.data), split)
  else:
    components = split_components(open_sources(config), config.data.val_ratio)[1]
  sets = []
  for c in components:
    windows: pipeline.Windows | pipeline.SyntheticWindows
    if c.tokens is None:
      n = max(1, -(-max_tokens // T)) if max_tokens else 64
      windows = pipeline.SyntheticWindows(tokenizer.vocab_size, pad_id, T, pipeline.EVAL_SEED, n)
    else:
      windows = pipeline.Windows(c.tokens, T, pad_id=pad_id)
    n = count(windows)
    text_bytes = None
    if c.tokens is not None and n:  # the targets of windows [0, n): tokens [1, n·T + 1)
      text_bytes = tokenizer_lib.text_bytes(tokenizer,
                                            c.tokens.read(1, min(len(c.tokens), n * T + 1)))
    sets.append(EvalSet(c.name, c.weight, batches(windows, n), text_bytes))
  return sets
