"""Where text comes from: source lists, the files they name, and reading them into token ids.

A source list is what `data.train`, `data.val` and `prepare_data.py --train/--val` take:
comma-separated sources, each with an optional `:weight` and an optional `#field`:

  data/fineweb/*.jsonl:0.45,data/pdfs.parquet#content:0.2,tfds:usmle_qa@train:0.1,embedded

Reading is split so that it parallelizes: `plan(spec)` cuts a source into small `WorkItem`s (cheap,
one process: byte ranges of JSONL files, Parquet row groups, TFDS index ranges), and
`encode(item, ...)` reads, validates and tokenizes one item (any process). Bad records raise a
`DataError` naming the file and line, or are counted when on_bad_record='skip'.
"""
import dataclasses
import functools
import glob
import json
import os
from collections.abc import Iterator

import numpy as np

from jax_pretrain.data.errors import DataError

TEXT_EXTENSIONS = ('.jsonl', '.txt', '.parquet')
TOKEN_EXTENSIONS = ('.npy', '.bin')
_JSONL_ITEM_BYTES = 4 << 20  # work item size: small enough to spread over cores, big to amortize
_TFDS_ITEM_RECORDS = 2048


@dataclasses.dataclass(frozen=True)
class SourceSpec:
  """One entry of a source list."""
  text: str          # as written, without the weight (names the source in messages)
  kind: str          # 'embedded' | 'synthetic' | 'tfds' | 'files' | 'prepared'
  target: str = ''   # glob or directory ('files', 'prepared'), dataset name ('tfds')
  split: str = ''    # TFDS split
  field: str = ''    # text field/column overriding data.text_field
  weight: float = 1.0


def _as_weight(text: str) -> float | None:
  try:
    return float(text)
  except ValueError:
    return None


def parse(sources: str, what: str = 'data.train') -> list[SourceSpec]:
  """Parses a source list (see the module docstring); `what` names the setting in errors."""
  specs = []
  for item in (s.strip() for s in sources.split(',')):
    if not item:
      continue
    body, weight = item, 1.0
    head, sep, tail = item.rpartition(':')
    if sep and _as_weight(tail) is not None:
      body, weight = head, _as_weight(tail)
    if not weight > 0:
      raise DataError(f'{what}: source {item!r} has weight {weight}; weights must be positive.')
    body, _, field = body.partition('#')
    if body in ('embedded', 'synthetic'):
      spec = SourceSpec(body, body, weight=weight)
    elif body.startswith('tfds:'):
      name, _, split = body[len('tfds:'):].partition('@')
      spec = SourceSpec(body, 'tfds', name, split or 'train', field, weight)
    elif os.path.isfile(os.path.join(os.path.expanduser(body), 'meta.json')):
      spec = SourceSpec(body, 'prepared', os.path.expanduser(body), weight=weight)
    else:
      spec = SourceSpec(body, 'files', os.path.expanduser(body), field=field, weight=weight)
    specs.append(spec)
  if not specs:
    raise DataError(f'{what} is empty: give at least one source.')
  return specs


def expand(spec: SourceSpec) -> tuple[str, list[str]]:
  """A 'files' source's files, sorted, and their kind: 'text' or 'tokens'."""
  if os.path.isdir(spec.target):
    raise DataError(f'{spec.text}: is a directory without meta.json (not prepared data); give a '
                    f'glob such as {os.path.join(spec.text, "*.jsonl")}.')
  paths = sorted(glob.glob(spec.target, recursive=True))
  if not paths:
    raise DataError(f'{spec.text}: matches no files.')
  kinds = set()
  for path in paths:
    ext = os.path.splitext(path)[1].lower()
    if ext in TEXT_EXTENSIONS:
      kinds.add('text')
    elif ext in TOKEN_EXTENSIONS:
      kinds.add('tokens')
    else:
      raise DataError(f'{path}: unsupported file type {ext!r}; text sources are '
                      f'{", ".join(TEXT_EXTENSIONS)}, token files {", ".join(TOKEN_EXTENSIONS)}.')
  if len(kinds) > 1:
    raise DataError(f'{spec.text}: mixes text files and token files; give them as two sources.')
  return kinds.pop(), paths


@dataclasses.dataclass(frozen=True)
class WorkItem:
  """A piece of a text source that one process reads and tokenizes on its own."""
  kind: str          # 'jsonl' | 'txt' | 'parquet' | 'tfds' | 'embedded'
  path: str          # file path, or 'tfds:NAME@SPLIT'
  start: int = 0     # jsonl: byte offset; parquet: row group; tfds: first record
  stop: int = 0      # jsonl: end byte offset; tfds: end record
  first: int = 1     # number of the first line (jsonl) or row/record (parquet, tfds), from 1
  field: str = ''
  tfds_data_dir: str = ''

  @property
  def text_bytes(self) -> int:
    return self.stop - self.start if self.kind in ('jsonl', 'txt') else 0


@functools.lru_cache(maxsize=16)
def _tfds_source(name: str, split: str, data_dir: str):
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  (slow; only if used)
  try:
    return tfds.data_source(name, split=split, data_dir=data_dir or None, download=False)
  except Exception as e:  # pylint: disable=broad-except  (tfds raises many types)
    where = data_dir or '~/tensorflow_datasets'
    raise DataError(f'tfds:{name}@{split}: cannot open it from data_dir {where} ({e}). Build it '
                    f'there with array_record files first, e.g. `tfds build {name} --data_dir '
                    f'{where} --file_format=array_record`.') from None


def plan(spec: SourceSpec, text_field: str, tfds_data_dir: str = '') -> list[WorkItem]:
  """Cuts a text source (embedded, tfds or text files) into work items; checks what is cheap to
  check up front (missing or empty files, Parquet columns, TFDS features)."""
  field = spec.field or text_field
  if spec.kind == 'embedded':
    return [WorkItem('embedded', 'embedded')]
  if spec.kind == 'tfds':
    source = _tfds_source(spec.target, spec.split, tfds_data_dir)
    name = f'tfds:{spec.target}@{spec.split}'
    features = getattr(source, 'dataset_info', None)
    features = list(features.features.keys()) if features is not None else None
    if features is not None and field not in features:
      raise DataError(f'{name}: no feature "{field}" (features: {", ".join(features)}).')
    if len(source) == 0:
      raise DataError(f'{name}: the split is empty.')
    return [WorkItem('tfds', name, i, min(i + _TFDS_ITEM_RECORDS, len(source)), i + 1, field,
                     tfds_data_dir) for i in range(0, len(source), _TFDS_ITEM_RECORDS)]
  kind, paths = expand(spec)
  if kind != 'text':
    raise DataError(f'{spec.text}: token files are already tokenized; use them directly as a '
                    'training source.')
  items = []
  for path in paths:
    if os.path.getsize(path) == 0:
      raise DataError(f'{path}: empty file.')
    ext = os.path.splitext(path)[1].lower()
    if ext == '.txt':
      items.append(WorkItem('txt', path, 0, os.path.getsize(path), 1, field))
    elif ext == '.jsonl':
      items.extend(_plan_jsonl(path, field))
    else:
      items.extend(_plan_parquet(path, field))
  return items


def _plan_jsonl(path: str, field: str) -> Iterator[WorkItem]:
  """Byte ranges of whole lines, with the number of each range's first line."""
  with open(path, 'rb') as f:
    start, line = 0, 1
    while True:
      chunk = f.read(_JSONL_ITEM_BYTES)
      if not chunk:
        return
      cut = chunk.rfind(b'\n') + 1 if len(chunk) == _JSONL_ITEM_BYTES else len(chunk)
      if cut == 0:  # one line longer than the item size: take it whole
        rest = f.readline()
        chunk, cut = chunk + rest, len(chunk) + len(rest)
      f.seek(start + cut)
      yield WorkItem('jsonl', path, start, start + cut, line, field)
      line += chunk.count(b'\n', 0, cut)
      start += cut


def _plan_parquet(path: str, field: str) -> list[WorkItem]:
  import pyarrow  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  try:
    pf = pq.ParquetFile(path)
  except (pyarrow.ArrowException, OSError) as e:
    raise DataError(f'{path}: not a readable Parquet file ({e}).') from None
  schema = pf.schema_arrow
  if field not in schema.names:
    raise DataError(f'{path}: no column "{field}" (columns: {", ".join(schema.names)}); set '
                    f'data.text_field or write the source as {path}#COLUMN.')
  column_type = schema.field(field).type
  if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)
          or pyarrow.types.is_binary(column_type) or pyarrow.types.is_large_binary(column_type)):
    raise DataError(f'{path}: column "{field}" holds {column_type}, not text.')
  if pf.metadata.num_rows == 0:
    raise DataError(f'{path}: empty file (no rows).')
  items, first = [], 1
  for group in range(pf.metadata.num_row_groups):
    items.append(WorkItem('parquet', path, group, group + 1, first, field))
    first += pf.metadata.row_group(group).num_rows
  return items


# Reading: (record number, text, None) or (record number, None, what is wrong with it).
Record = tuple[int, str | None, str | None]


def _decode(raw: bytes) -> tuple[str | None, str | None]:
  try:
    return raw.decode('utf-8'), None
  except UnicodeDecodeError as e:
    return None, f'bytes that are not UTF-8 (byte {e.start + 1}: {raw[e.start:e.start + 4]!r})'


def read(item: WorkItem) -> Iterator[Record]:
  """The records of a work item, in order."""
  if item.kind == 'embedded':
    from jax_pretrain.data import corpus  # pylint: disable=g-import-not-at-top
    yield from ((i + 1, doc, None) for i, doc in enumerate(corpus.embedded_documents()))
  elif item.kind == 'txt':
    with open(item.path, 'rb') as f:
      raw = f.read()
    try:
      yield 1, raw.decode('utf-8'), None
    except UnicodeDecodeError as e:  # name the line of the first bad byte
      bad = raw[e.start:e.start + 4]
      yield raw.count(b'\n', 0, e.start) + 1, None, f'bytes that are not UTF-8 ({bad!r})'
  elif item.kind == 'jsonl':
    with open(item.path, 'rb') as f:
      f.seek(item.start)
      data = f.read(item.stop - item.start)
    for n, raw in enumerate(data.split(b'\n'), item.first):
      if raw.strip():
        yield (n, *_json_text(raw, item.field))
  elif item.kind == 'parquet':
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
    column = pq.ParquetFile(item.path).read_row_group(item.start, columns=[item.field]).column(0)
    for n, value in enumerate(column.to_pylist(), item.first):
      if value is None:
        yield n, None, f'"{item.field}" is null'
      elif isinstance(value, bytes):
        yield (n, *_decode(value))
      else:
        yield n, value, None
  elif item.kind == 'tfds':
    name, _, split = item.path[len('tfds:'):].partition('@')
    source = _tfds_source(name, split, item.tfds_data_dir)
    examples = source.__getitems__(list(range(item.start, item.stop)))
    for n, example in enumerate(examples, item.first):
      value = example[item.field]
      if isinstance(value, np.ndarray) and value.ndim == 0:
        value = value.item()
      if isinstance(value, bytes):
        yield (n, *_decode(value))
      elif isinstance(value, str):
        yield n, value, None
      else:
        yield n, None, f'"{item.field}" is {type(value).__name__}, not text'
  else:
    raise ValueError(f'unknown work item kind {item.kind!r}')


def _json_text(raw: bytes, field: str) -> tuple[str | None, str | None]:
  line, error = _decode(raw)
  if error:
    return None, error
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    return None, f'invalid JSON ({e.msg}, column {e.colno})'
  if not isinstance(obj, dict) or field not in obj:
    return None, f'no "{field}" field'
  if not isinstance(obj[field], str):
    return None, f'"{field}" is {type(obj[field]).__name__}, not a string'
  return obj[field], None


@dataclasses.dataclass
class Encoded:
  """One work item, tokenized: each document followed by EOS."""
  path: str
  tokens: np.ndarray       # int32 [num_tokens]
  doc_lengths: np.ndarray  # int64 [num_documents], EOS included
  skipped: int             # bad records skipped (on_bad_record='skip')
  records: int             # records seen, good or bad (0: the item held nothing)
  text_bytes: int          # UTF-8 bytes of the documents' text


def location(item: WorkItem, n: int) -> str:
  if item.kind == 'parquet':
    return f'{item.path}: row {n}'
  if item.kind in ('tfds', 'embedded'):
    return f'{item.path}: record {n}'
  return f'{item.path}:{n}'


def encode(item: WorkItem, tokenizer, on_bad_record: str = 'error') -> Encoded:
  """Reads and tokenizes one work item. Bad records raise DataError, or are counted ('skip')."""
  texts, skipped, records, text_bytes = [], 0, 0, 0
  for n, text, error in read(item):
    records += 1
    if error is not None:
      if on_bad_record != 'skip':
        raise DataError(f'{location(item, n)}: {error}. (Set data.on_bad_record=skip, or '
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


class FileStats:
  """Documents, tokens and skipped records per file, summed over work items."""

  def __init__(self):
    # path -> [documents, tokens, skipped, records, text bytes]
    self.by_path: dict[str, list[int]] = {}

  def add(self, e: Encoded) -> None:
    s = self.by_path.setdefault(e.path, [0, 0, 0, 0, 0])
    for k, v in enumerate((len(e.doc_lengths), len(e.tokens), e.skipped, e.records,
                           e.text_bytes)):
      s[k] += int(v)

  def check(self) -> None:
    """A file that gave no document at all is an error: never train on nothing."""
    for path, (docs, _, skipped, records, _) in self.by_path.items():
      if records == 0:
        raise DataError(f'{path}: no records (empty or only blank lines).')
      if docs == 0:
        raise DataError(f'{path}: no usable document ({skipped} of {records} records were bad, '
                        f'the rest empty).')

  def total(self) -> tuple[int, int, int]:
    return tuple(sum(s[k] for s in self.by_path.values()) for k in range(3))

  def skip_report(self) -> list[str]:
    return [f'{path}: skipped {s[2]} bad records of {s[3]}'
            for path, s in self.by_path.items() if s[2]]


def texts(source_list: str, text_field: str = 'text', tfds_data_dir: str = '',
          on_bad_record: str = 'error') -> Iterator[str]:
  """Every document's text of a source list, in order (one process; for training a tokenizer)."""
  for spec in parse(source_list, '--input'):
    if spec.kind not in ('embedded', 'tfds', 'files'):
      raise DataError(f'{spec.text}: not a text source.')
    for item in plan(spec, text_field, tfds_data_dir):
      for n, text, error in read(item):
        if error is not None and on_bad_record != 'skip':
          raise DataError(f'{location(item, n)}: {error}.')
        if text:
          yield text
