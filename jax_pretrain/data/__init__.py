"""Input pipeline: what the trainer calls to get batches.

`build(config, process_index, process_count)` returns a `Data` with
  tokenizer      encode/decode, vocab_size, bos_id, eos_id, pad_id
  train          an endless iterator of {'tokens': int32 [local_batch, seq_len + 1]} with
                 get_state()/set_state() so a checkpoint can resume it exactly
  eval_batches() a fresh pass over the fixed held-out set, the same batches every call; rows past
                 the end of the data are filled with pad_id (the loss ignores them)
Each process gets only its own rows: local_batch = batch_size // process_count.

Sources (config.data.train / .val, see docs/data.md): prepared directories (scripts/prepare_data.py,
recommended for real runs), token files (.npy/.bin), raw text (.jsonl/.txt/.parquet, tfds:NAME,
embedded) tokenized here on the fly, and synthetic random tokens. Modules: sources (source lists,
reading text), tokenizer, tokens (token files and streams), prepare (text -> token files),
pipeline (grain), corpus (the embedded text).
"""
import dataclasses
import json
import os
from collections.abc import Callable, Iterator

from absl import logging
import ml_collections
import numpy as np

from jax_pretrain.data import sources
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data import tokens as tokens_lib
from jax_pretrain.data.errors import DataError

Batch = dict[str, np.ndarray]
__all__ = ['Data', 'DataError', 'build']


@dataclasses.dataclass
class Data:
  tokenizer: object  # ByteTokenizer | SentencePieceTokenizer | IdTokenizer
  train: Iterator[Batch]  # pipeline.LockedIterator over grain's: get_state() / set_state()
  eval_batches: Callable[[], Iterator[Batch]]


@dataclasses.dataclass
class Component:
  """One source of the mixture, resolved to tokens (None: synthetic)."""
  name: str
  weight: float
  tokens: tokens_lib.TokenStream | None


def read_meta(directory: str) -> dict:
  with open(os.path.join(directory, 'meta.json'), encoding='utf-8') as f:
    return json.load(f)


def _declared_tokenizers(specs: list[sources.SourceSpec]) -> list[tuple[str, dict, str]]:
  """(where, tokenizer record, directory of its files) of prepared data and token-file sidecars."""
  found = []
  for spec in specs:
    if spec.kind == 'prepared':
      found.append((spec.text, read_meta(spec.target)['tokenizer'], spec.target))
    elif spec.kind == 'files':
      kind, paths = sources.expand(spec)
      for path in paths if kind == 'tokens' else []:
        info = tokens_lib.read_sidecar(path)
        if info:
          found.append((path, info, os.path.dirname(path)))
  return found


def tokenizer_from_record(record: dict, directory: str, where: str):
  """The tokenizer that prepared data or a sidecar records: its identity, or bare ids."""
  identity = record.get('tokenizer', '')
  if identity == 'byte':
    return tokenizer_lib.ByteTokenizer()
  if identity.startswith('sentencepiece:'):
    path = os.path.join(directory, record.get('tokenizer_file', 'tokenizer.model'))
    tok = tokenizer_lib.SentencePieceTokenizer(path)
    if tok.identity != identity:
      raise DataError(f'{where}: records tokenizer {identity}, but {path} is {tok.identity}.')
    return tok
  if 'vocab_size' not in record or 'eos_id' not in record:
    raise DataError(f'{where}: the sidecar must give "vocab_size" and "eos_id" (or set '
                    'data.tokenizer).')
  return tokenizer_lib.IdTokenizer(record['vocab_size'], record['eos_id'], record.get('bos_id'),
                                   record.get('pad_id'))


def resolve_tokenizer(setting: str, specs: list[sources.SourceSpec], model_vocab_size: int):
  """data.tokenizer if set; else the one the prepared data / sidecars record; else bytes for raw
  text; else (synthetic only) bare ids filling model.vocab_size. Checks that all sources agree."""
  declared = _declared_tokenizers(specs)
  if setting:
    tok = tokenizer_lib.load(setting)
  elif declared:
    where, record, directory = declared[0]
    tok = tokenizer_from_record(record, directory, where)
  elif any(s.kind != 'synthetic' for s in specs):
    tok = tokenizer_lib.ByteTokenizer()
  else:
    v = model_vocab_size
    tok = tokenizer_lib.IdTokenizer(v - 1, eos_id=v - 2, bos_id=v - 3)  # pad: v - 1
  for where, record, _ in declared:
    identity = record.get('tokenizer')
    if identity and identity != tok.identity:
      raise DataError(f'{where}: was tokenized with {identity}, but the tokenizer is '
                      f'{tok.identity} ({tok.path or "from the data"}). Use one tokenizer for '
                      'all sources (data.tokenizer, or re-run prepare_data.py).')
    if not identity and record.get('eos_id', tok.eos_id) != tok.eos_id:
      raise DataError(f'{where}: eos_id {record["eos_id"]} differs from the tokenizer\'s '
                      f'{tok.eos_id}.')
  return tok


class _Resolver:
  """Turns source specs into token streams: memory-maps prepared and token files, tokenizes raw
  text on the fly."""

  def __init__(self, tokenizer, d: ml_collections.ConfigDict):
    self.tokenizer, self.d = tokenizer, d

  def components(self, spec: sources.SourceSpec, split: str) -> list[Component]:
    if spec.kind == 'synthetic':
      return [Component('synthetic', spec.weight, None)]
    if spec.kind == 'prepared':
      return self._prepared(spec, split)
    if spec.kind == 'files':
      kind, paths = sources.expand(spec)
      if kind == 'tokens':
        stream, files = tokens_lib.open_stream(paths, spec.text)
        for f in files:
          tokens_lib.check_ids(f, self.tokenizer.vocab_size)
        return [Component(spec.text, spec.weight, stream)]
    return [Component(spec.text, spec.weight, self._tokenize(spec))]

  def _prepared(self, spec: sources.SourceSpec, split: str) -> list[Component]:
    entries = read_meta(spec.target).get(split, [])
    if not entries:
      raise DataError(f'{spec.text}: prepared without a {split} split.')
    total = sum(e['weight'] for e in entries)
    out = []
    for e in entries:
      path = os.path.join(spec.target, split, e['name'] + '.bin')
      stream, files = tokens_lib.open_stream([path], f'{spec.text}/{split}/{e["name"]}')
      tokens_lib.check_ids(files[0], self.tokenizer.vocab_size)
      out.append(Component(stream.name, spec.weight * e['weight'] / total, stream))
    return out

  def _tokenize(self, spec: sources.SourceSpec) -> tokens_lib.TokenStream:
    items = sources.plan(spec, self.d.text_field, self.d.tfds_data_dir)
    stats, parts = sources.FileStats(), []
    for item in items:
      encoded = sources.encode(item, self.tokenizer, self.d.on_bad_record)
      stats.add(encoded)
      parts.append(encoded.tokens.astype(tokens_lib.token_dtype(self.tokenizer.vocab_size)))
    stats.check()
    for line in stats.skip_report():
      logging.warning('%s', line)
    docs, num_tokens, _ = stats.total()
    if num_tokens > 200_000_000:
      logging.warning('%s: tokenized %d tokens on the fly; prepare large data once with '
                      'scripts/prepare_data.py instead.', spec.text, num_tokens)
    logging.info('%s: %d documents, %d tokens', spec.text, docs, num_tokens)
    return tokens_lib.TokenStream([np.concatenate(parts)], spec.text)


def _check_windows(component: Component, windows, seq_len: int) -> None:
  if not len(windows):
    raise DataError(f'{component.name}: {len(component.tokens)} training tokens make no window of '
                    f'seq_len + 1 = {seq_len + 1} tokens. Add data or lower data.seq_len.')


def split_components(d: ml_collections.ConfigDict, tokenizer,
                     data: str = '', split: str = 'val') -> tuple[list[Component], list[Component]]:
  """(train, eval) components of the config's data group d; the eval streams are never in train.

  Eval is data.val when given, else the split prepare_data.py made, else the last val_ratio of
  each training source. `data` (e.g. evaluate's --data) replaces both with its own split.
  """
  resolver = _Resolver(tokenizer, d)
  if data:
    return [], [c for spec in sources.parse(data, '--data') for c in resolver.components(spec, split)]
  val_specs = sources.parse(d.val, 'data.val') if d.val else []
  train, val = [], []
  for spec in sources.parse(d.train, 'data.train'):
    components = resolver.components(spec, 'train')
    train.extend(components)
    if val_specs:
      continue
    if spec.kind == 'prepared' and read_meta(spec.target).get('val'):
      val.extend(resolver.components(spec, 'val'))  # the split prepare_data.py made
      continue
    for c in components:
      if c.tokens is None:
        val.append(c)
      else:
        c.tokens, held_out = tokens_lib.carve(c.tokens, tokenizer.eos_id, d.val_ratio)
        val.append(Component(c.name, c.weight, held_out))
  for spec in val_specs:
    val.extend(resolver.components(spec, 'val'))
  return train, val


def build(config: ml_collections.ConfigDict, process_index: int = 0,
          process_count: int = 1) -> Data:
  from jax_pretrain.data import pipeline  # pylint: disable=g-import-not-at-top
  # (grain, and the jax it imports, load here: prepare's worker processes start without them)
  d, t = config.data, config.train
  if d.on_bad_record not in ('error', 'skip'):
    raise DataError(f"data.on_bad_record={d.on_bad_record!r}: choose 'error' or 'skip'.")
  if not d.train:
    raise DataError("data.train is empty: name the training data, e.g. --config.data.train="
                    "data/mix1 (a directory written by scripts/prepare_data.py), 'data/*.jsonl', or "
                    "'embedded' (the Python manual that ships with Python); see docs/data.md.")
  train_specs = sources.parse(d.train, 'data.train')
  val_specs = sources.parse(d.val, 'data.val') if d.val else []
  tokenizer = resolve_tokenizer(d.tokenizer, train_specs + val_specs, config.model.vocab_size)
  if config.model.vocab_size < tokenizer.vocab_size:
    raise ValueError(f'model.vocab_size={config.model.vocab_size} is smaller than the '
                     f"tokenizer's vocabulary ({tokenizer.vocab_size}).")
  eval_batch_size = t.eval_batch_size or t.batch_size  # 0 (unresolved config): batch_size
  eval_budget = t.eval_steps * eval_batch_size
  train, val = split_components(d, tokenizer)

  train_sources = []
  for k, c in enumerate(train):
    if c.tokens is None:
      windows = pipeline.SyntheticWindows(tokenizer.vocab_size, tokenizer.pad_id, d.seq_len,
                                          seed=pipeline.source_seed(t.seed, k))
    else:
      windows = pipeline.Windows(c.tokens, d.seq_len)
    _check_windows(c, windows, d.seq_len)
    train_sources.append(windows)
    logging.info('train source %s: weight %.3f, %d windows', c.name, c.weight, len(windows))
  ds = pipeline.train_dataset(train_sources, [c.weight for c in train], t.batch_size, t.seed,
                              process_index, process_count)
  train_it = pipeline.iterator(ds, d.read_threads, d.prefetch, d.num_workers)

  eval_sources, eval_weights = [], []
  for c in val:
    windows = None if c.tokens is None else pipeline.Windows(c.tokens, d.seq_len, tokenizer.pad_id)
    if windows is not None and len(windows):  # a source too small to hold val tokens adds none
      eval_sources.append(windows)
      eval_weights.append(c.weight)
  if not eval_sources and any(c.tokens is None for c in val):
    # Random tokens are eval data only for a synthetic-only run (a benchmark): they would blur
    # the eval loss of real data.
    eval_sources = [pipeline.SyntheticWindows(tokenizer.vocab_size, tokenizer.pad_id, d.seq_len,
                                              seed=pipeline.EVAL_SEED, length=max(eval_budget, 1))]
    eval_weights = [1.0]
  if not eval_sources:
    why = ('data.val holds no tokens' if d.val else
           f'data.val_ratio={d.val_ratio} holds out nothing from data.train')
    raise DataError(f'no eval data: {why}. Set data.val or a positive data.val_ratio.')
  eval_ds = pipeline.eval_dataset(eval_sources, eval_weights)

  def eval_batches() -> Iterator[Batch]:
    return pipeline.eval_batches(eval_ds, t.eval_steps, eval_batch_size, d.seq_len,
                                 tokenizer.pad_id, process_index, process_count)

  return Data(tokenizer=tokenizer, train=train_it, eval_batches=eval_batches)
