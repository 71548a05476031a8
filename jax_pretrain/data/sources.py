"""Where data comes from: source lists, and the kinds of source they name.

A source list is what `data.train`, `data.val` and `prepare_data.py --train/--val` take:
comma-separated sources, each with an optional `:weight` and an optional `#field`:

  data/fineweb/*.jsonl:0.45,data/pdfs.parquet#content:0.2,tfds:usmle_qa@train:0.1,embedded,
  hf:data/my_dataset:0.1,hf://datasets/OWNER/NAME/data/*.parquet#content:0.1

Each kind of source is a class registered in KINDS, tried in order: the first whose `claims(body)`
is true parses the entry. A kind turns itself into token streams (`components`); text kinds also
cut themselves into work items (`work_items`) that `encode` reads and tokenizes in any process. A
new kind is one class plus `@register`.
"""
from collections.abc import Iterator
import dataclasses
import functools
import glob
import json
import os
from typing import TYPE_CHECKING

from absl import logging
import numpy as np

from jax_pretrain.data import formats
from jax_pretrain.data import hub
from jax_pretrain.data import tokens as tokens_lib
from jax_pretrain.data.errors import DataError

if TYPE_CHECKING:  # (not imported at run time: it imports jax, which data workers need not load)
  from jax_pretrain.config import DataConfig

_TFDS_ITEM_RECORDS = 2048
_ON_THE_FLY_WARNING_TOKENS = 200_000_000


@dataclasses.dataclass(frozen=True)
class ReadOptions:
  """How text is read: config.data's text_field, tfds_data_dir and on_bad_record."""
  text_field: str = 'text'
  tfds_data_dir: str = ''
  on_bad_record: str = 'error'

  @classmethod
  def from_config(cls, d: 'DataConfig') -> 'ReadOptions':
    return cls(d.text_field, d.tfds_data_dir, d.on_bad_record)


@dataclasses.dataclass
class Component:
  """One stream of a source, resolved to tokens (None: synthetic)."""
  name: str
  weight: float
  tokens: tokens_lib.TokenStream | None


@dataclasses.dataclass(frozen=True)
class TokenizerRecord:
  """A tokenizer that data declares it was made with (prepared data, token-file sidecars)."""
  where: str       # the data that says so, for messages
  record: dict     # tokenizer.record() fields (identity, vocab_size, special ids, file)
  directory: str   # where the record's tokenizer file is


class Source:
  """One entry of a source list. Subclasses are the kinds; see the module docstring."""

  def __init__(self, text: str, weight: float = 1.0, field: str = ''):
    self.text, self.weight, self.field = text, weight, field  # text: as written, sans weight

  @property
  def is_text(self) -> bool:
    """Whether it can be planned into work items and read as text."""
    return False

  @staticmethod
  def claims(body: str) -> bool:
    raise NotImplementedError

  def tokenizer_records(self) -> list[TokenizerRecord]:
    return []

  def has_split(self, split: str) -> bool:
    """Whether the source holds its own `split` (else eval data is carved from train)."""
    return False

  def components(self, split: str, tokenizer, options: ReadOptions) -> list[Component]:
    """The source's token streams for split ('train' or 'val')."""
    raise NotImplementedError

  def work_items(self, options: ReadOptions) -> list[formats.WorkItem]:
    raise DataError(f'{self.text}: not a text source (it holds token ids already).')

  def __repr__(self):
    return f'{type(self).__name__}({self.text!r}, weight={self.weight})'


class TextSource(Source):
  """A source of documents' text, tokenized on the fly for training (or by prepare_data.py)."""

  @property
  def is_text(self) -> bool:
    return True

  def components(self, split: str, tokenizer, options: ReadOptions) -> list[Component]:
    return _text_components(self, tokenizer, options)


def _text_components(source: Source, tokenizer, options: ReadOptions) -> list[Component]:
  """A text source's one component: its work items' text, tokenized here."""
  stats, parts = FileStats(), []
  for item in source.work_items(options):
    encoded = encode(item, tokenizer, options.on_bad_record)
    stats.add(encoded)
    parts.append(encoded.tokens.astype(tokens_lib.token_dtype(tokenizer.vocab_size)))
  stats.check()
  for line in stats.skip_report():
    logging.warning('%s', line)
  total = stats.total()
  if total.tokens > _ON_THE_FLY_WARNING_TOKENS:
    logging.warning('%s: tokenized %d tokens on the fly; prepare large data once with '
                    'scripts/prepare_data.py instead.', source.text, total.tokens)
  logging.info('%s: %d documents, %d tokens', source.text, total.documents, total.tokens)
  return [Component(source.text, source.weight, tokens_lib.TokenStream([np.concatenate(parts)],
                                                                       source.text))]


KINDS: list[type[Source]] = []  # tried in order; Files takes whatever none of them claims


def register(cls):
  """Adds a kind of source (and, for a text kind that reads its own work items, its reader)."""
  KINDS.append(cls)
  if issubclass(cls, formats.Reader):
    formats.register(cls)
  return cls


@register
class Embedded(TextSource, formats.Reader):
  """The Python reference manual, shipped with every Python (see corpus.py)."""
  name = 'embedded'

  @staticmethod
  def claims(body: str) -> bool:
    return body == 'embedded'

  def work_items(self, options: ReadOptions) -> list[formats.WorkItem]:
    return [formats.WorkItem(self.name, 'embedded')]

  @classmethod
  def read(cls, item: formats.WorkItem) -> Iterator[formats.Record]:
    from jax_pretrain.data import corpus  # noqa: PLC0415
    yield from ((i + 1, doc, None) for i, doc in enumerate(corpus.embedded_documents()))

  @classmethod
  def location(cls, item: formats.WorkItem, n: int) -> str:
    return f'{item.path}: record {n}'


@register
class Synthetic(Source):
  """Random tokens (benchmarks, tests): no text, no tokenizer of its own."""

  @staticmethod
  def claims(body: str) -> bool:
    return body == 'synthetic'

  def components(self, split: str, tokenizer, options: ReadOptions) -> list[Component]:
    return [Component('synthetic', self.weight, None)]


@functools.lru_cache(maxsize=16)
def _tfds_source(name: str, split: str, data_dir: str):
  import tensorflow_datasets as tfds  # noqa: PLC0415  (slow; only if used)
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except Exception as e:  # noqa: BLE001  (tfds raises many types)
    where = data_dir or '~/tensorflow_datasets'
    raise DataError(f'tfds:{name}@{split}: cannot open it from data_dir {where} ({e}). Build it '
                    f'there with array_record files first, e.g. `tfds build {name} --data_dir '
                    f'{where} --file_format=array_record`.') from None


@register
class Tfds(TextSource, formats.Reader):
  """tfds:NAME[@SPLIT]: a TensorFlow Datasets data source (array_record files, random access)."""
  name = 'tfds'

  def __init__(self, text: str, weight: float = 1.0, field: str = ''):
    super().__init__(text, weight, field)
    self.dataset, _, split = text[len('tfds:'):].partition('@')
    self.split = split or 'train'

  @staticmethod
  def claims(body: str) -> bool:
    return body.startswith('tfds:')

  def work_items(self, options: ReadOptions) -> list[formats.WorkItem]:
    field = self.field or options.text_field
    source = _tfds_source(self.dataset, self.split, options.tfds_data_dir)
    name = f'tfds:{self.dataset}@{self.split}'
    features = getattr(source, 'dataset_info', None)
    features = list(features.features.keys()) if features is not None else None
    if features is not None and field not in features:
      raise DataError(f'{name}: no feature "{field}" (features: {", ".join(features)}).')
    if len(source) == 0:
      raise DataError(f'{name}: the split is empty.')
    return [formats.WorkItem(self.name, name, i, min(i + _TFDS_ITEM_RECORDS, len(source)), i + 1,
                             field, options.tfds_data_dir)
            for i in range(0, len(source), _TFDS_ITEM_RECORDS)]

  @classmethod
  def read(cls, item: formats.WorkItem) -> Iterator[formats.Record]:
    dataset, _, split = item.path[len('tfds:'):].partition('@')
    examples = _tfds_source(dataset, split, item.tfds_data_dir).__getitems__(
        list(range(item.start, item.stop)))
    for n, example in enumerate(examples, item.first):
      yield (n, *formats.text_value(example[item.field], item.field))

  @classmethod
  def location(cls, item: formats.WorkItem, n: int) -> str:
    return f'{item.path}: record {n}'


# Hugging Face datasets, and Parquet files on URLs (data/hub.py) ------------------------------

@register
class HfDataset(TextSource, formats.Reader):
  """hf:NAME_OR_PATH[@SPLIT]: a Hugging Face dataset, saved (save_to_disk), local or on the Hub."""
  name = 'hf'

  def __init__(self, text: str, weight: float = 1.0, field: str = ''):
    super().__init__(text, weight, field)
    self.dataset, _, self.split = text[len('hf:'):].partition('@')

  @staticmethod
  def claims(body: str) -> bool:
    return body.startswith('hf:') and not body.startswith('hf://')

  def work_items(self, options: ReadOptions) -> list[formats.WorkItem]:
    return hub.work_items(self.name, self.dataset, self.split, self.field or options.text_field)

  @classmethod
  def read(cls, item: formats.WorkItem) -> Iterator[formats.Record]:
    return hub.read(item)

  @classmethod
  def location(cls, item: formats.WorkItem, n: int) -> str:
    return hub.location(item, n)


@register
class RemoteFiles(TextSource):
  """Parquet files on a URL: hf://datasets/OWNER/NAME[@REVISION]/GLOB.parquet (huggingface_hub's
  filesystem), or any URL fsspec opens (s3://, gs://, file://)."""

  @staticmethod
  def claims(body: str) -> bool:
    return '://' in body

  def work_items(self, options: ReadOptions) -> list[formats.WorkItem]:
    field = self.field or options.text_field
    return [item for url in hub.glob(self.text) for item in formats.Parquet.work_items(url, field)]

# ---------------------------------------------------------------------------------------------


def read_meta(directory: str) -> dict:
  with open(os.path.join(directory, 'meta.json'), encoding='utf-8') as f:
    return json.load(f)


@register
class Prepared(Source):
  """A directory written by scripts/prepare_data.py: memory-mapped token files per split."""

  def __init__(self, text: str, weight: float = 1.0, field: str = ''):
    super().__init__(text, weight, field)
    self.directory = os.path.expanduser(text)
    self.meta = read_meta(self.directory)

  @staticmethod
  def claims(body: str) -> bool:
    return os.path.isfile(os.path.join(os.path.expanduser(body), 'meta.json'))

  def tokenizer_records(self) -> list[TokenizerRecord]:
    return [TokenizerRecord(self.text, self.meta['tokenizer'], self.directory)]

  def has_split(self, split: str) -> bool:
    return bool(self.meta.get(split))

  def components(self, split: str, tokenizer, options: ReadOptions) -> list[Component]:
    entries = self.meta.get(split, [])
    if not entries:
      raise DataError(f'{self.text}: prepared without a {split} split.')
    total = sum(e['weight'] for e in entries)
    out = []
    for e in entries:
      path = os.path.join(self.directory, split, e['name'] + '.bin')
      stream, files = tokens_lib.open_stream([path], f'{self.text}/{split}/{e["name"]}')
      tokens_lib.check_ids(files[0], tokenizer.vocab_size)
      out.append(Component(stream.name, self.weight * e['weight'] / total, stream))
    return out


class Files(Source):
  """A path or glob of files of one category: text (tokenized on the fly) or token ids; the kind of
  whatever no registered kind claims."""

  def __init__(self, text: str, weight: float = 1.0, field: str = ''):
    super().__init__(text, weight, field)
    self.pattern = os.path.expanduser(text)

  @functools.cached_property
  def files(self) -> list[tuple[str, type[formats.TextFormat] | type[formats.TokenFormat]]]:
    """(path, format) of each file, sorted; all text or all token files."""
    if os.path.isdir(self.pattern):
      raise DataError(f'{self.text}: is a directory without meta.json (not prepared data); give a '
                      f'glob such as {os.path.join(self.text, "*.jsonl")}.')
    paths = sorted(glob.glob(self.pattern, recursive=True))
    if not paths:
      raise DataError(f'{self.text}: matches no files.')
    found = [(path, formats.find(path)) for path in paths]
    if len({issubclass(f, formats.TextFormat) for _, f in found}) > 1:
      raise DataError(f'{self.text}: mixes text files and token files; give them as two sources.')
    return found

  @property
  def is_text(self) -> bool:
    return issubclass(self.files[0][1], formats.TextFormat)

  @property
  def text_files(self) -> list[tuple[str, type[formats.TextFormat]]]:
    """files, when they are text (is_text); else []."""
    return [(path, fmt) for path, fmt in self.files if issubclass(fmt, formats.TextFormat)]

  def tokenizer_records(self) -> list[TokenizerRecord]:
    if self.is_text:
      return []
    return [TokenizerRecord(path, info, os.path.dirname(path))
            for path, _ in self.files if (info := tokens_lib.read_sidecar(path))]

  def components(self, split: str, tokenizer, options: ReadOptions) -> list[Component]:
    if self.is_text:
      return _text_components(self, tokenizer, options)
    stream, files = tokens_lib.open_stream([path for path, _ in self.files], self.text)
    for f in files:
      tokens_lib.check_ids(f, tokenizer.vocab_size)
    return [Component(self.text, self.weight, stream)]

  def work_items(self, options: ReadOptions) -> list[formats.WorkItem]:
    if not self.is_text:
      return super().work_items(options)
    field = self.field or options.text_field
    items: list[formats.WorkItem] = []
    for path, fmt in self.text_files:
      if os.path.getsize(path) == 0:
        raise DataError(f'{path}: empty file.')
      items.extend(fmt.work_items(path, field))
    return items


def _as_weight(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None


def parse(sources: str, what: str = 'data.train') -> list[Source]:
  """Parses a source list (see the module docstring); `what` names the setting in errors."""
  parsed = []
  for item in (part.strip() for part in sources.split(',')):
    if not item:
      continue
    body, weight = item, 1.0
    head, sep, tail = item.rpartition(':')
    if sep and (tail_weight := _as_weight(tail)) is not None:
      body, weight = head, tail_weight
    if not weight > 0:
      raise DataError(f'{what}: source {item!r} has weight {weight}; weights must be positive.')
    body, _, field = body.partition('#')
    kind = next((k for k in KINDS if k.claims(body)), Files)
    parsed.append(kind(body, weight, field))
  if not parsed:
    raise DataError(f'{what} is empty: give at least one source.')
  return parsed


@dataclasses.dataclass
class Encoded:
  """One work item, tokenized: each document followed by EOS."""
  path: str
  tokens: np.ndarray       # int32 [num_tokens]
  doc_lengths: np.ndarray  # int64 [num_documents], EOS included
  skipped: int             # bad records skipped (on_bad_record='skip')
  records: int             # records seen, good or bad (0: the item held nothing)
  text_bytes: int          # UTF-8 bytes of the documents' text


def encode(item: formats.WorkItem, tokenizer, on_bad_record: str = 'error') -> Encoded:
  """Reads and tokenizes one work item. Bad records raise DataError, or are counted ('skip')."""
  texts, skipped, records, text_bytes = [], 0, 0, 0
  for n, text, error in formats.read(item):
    records += 1
    if error is not None:
      if on_bad_record != 'skip':
        raise DataError(f'{formats.location(item, n)}: {error}. (Set data.on_bad_record=skip, or '
                        '--on-bad-record=skip, to skip such records and count them.)')
      skipped += 1
    elif text:
      texts.append(text)
      text_bytes += len(text.encode('utf-8'))
  ids = tokenizer.encode_batch(texts)
  doc_lengths = np.fromiter((len(x) + 1 for x in ids), np.int64, len(ids))
  tokens = np.empty(int(doc_lengths.sum()), np.int32)
  end = np.cumsum(doc_lengths)
  for doc, stop, length in zip(ids, end, doc_lengths):
    tokens[stop - length:stop - 1] = doc
  tokens[end - 1] = tokenizer.eos_id
  return Encoded(item.path, tokens, doc_lengths, skipped, records, text_bytes)


@dataclasses.dataclass
class Counts:
  """What a file (or, summed, a source) held: documents kept, their tokens (EOS included), bad
  records skipped, records read, and the UTF-8 bytes of the documents' text."""
  documents: int = 0
  tokens: int = 0
  skipped: int = 0
  records: int = 0
  text_bytes: int = 0


class FileStats:
  """Counts per file, summed over work items."""

  def __init__(self):
    self.by_path: dict[str, Counts] = {}

  def add(self, e: Encoded) -> None:
    counts = self.by_path.setdefault(e.path, Counts())
    counts.documents += len(e.doc_lengths)
    counts.tokens += len(e.tokens)
    counts.skipped += e.skipped
    counts.records += e.records
    counts.text_bytes += e.text_bytes

  def check(self) -> None:
    """A file that gave no document at all is an error: never train on nothing."""
    for path, counts in self.by_path.items():
      if counts.records == 0:
        raise DataError(f'{path}: no records (empty or only blank lines).')
      if counts.documents == 0:
        raise DataError(f'{path}: no usable document ({counts.skipped} of {counts.records} '
                        'records were bad, the rest empty).')

  def total(self) -> Counts:
    return Counts(*(sum(getattr(counts, f.name) for counts in self.by_path.values())
                    for f in dataclasses.fields(Counts)))

  def skip_report(self) -> list[str]:
    return [f'{path}: skipped {counts.skipped} bad records of {counts.records}'
            for path, counts in self.by_path.items() if counts.skipped]


def texts(source_list: str, options: ReadOptions = ReadOptions()) -> Iterator[str]:
  """Every document's text of a source list, in order (one process; for training a tokenizer)."""
  for source in parse(source_list, '--input'):
    if not source.is_text:
      raise DataError(f'{source.text}: not a text source.')
    for item in source.work_items(options):
      for n, text, error in formats.read(item):
        if error is not None and options.on_bad_record != 'skip':
          raise DataError(f'{formats.location(item, n)}: {error}.')
        if text:
          yield text
