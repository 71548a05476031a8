"""File formats, registered by file-name ending: text to read (JSONL, plain text, Parquet) and token
ids to memory-map (.npy, .bin).

A text format cuts a file into `WorkItem`s (`work_items`: cheap, one process; byte ranges, row
groups) and reads an item's records (`read`: any process), so reading parallelizes over cores. Each
record is (number, text, None), or (number, None, what is wrong with it) for a bad one; numbers
are lines (or rows) from 1, so errors name them. Sources that are not files (the embedded manual,
TFDS, see sources.py) register their readers here too: a work item names its reader by `reader`.

A new format is one class with a `register` decorator (CompressedJsonl below is one; so is the
walk-through in docs/architecture.md). Compressed text (gzip, zstd) is read as a stream, one work
item per file; a leading UTF-8 byte order mark is dropped.
"""
from collections.abc import Iterator
import contextlib
import dataclasses
import gzip
import io
import json
import os

import numpy as np

from jax_pretrain.data.errors import DataError

_JSONL_ITEM_BYTES = 4 << 20  # work item size: small enough to spread over cores, big to amortize

# (record number, text, None) or (record number, None, what is wrong with it).
Record = tuple[int, str | None, str | None]
# A JSONL field that reads each line whole: the text is the line itself, once it has been checked
# to be a JSON object (SFT examples, data/sft.py, read several fields of it).
WHOLE_LINE = '*'


@dataclasses.dataclass(frozen=True)
class WorkItem:
  """A piece of a text source that one process reads and tokenizes on its own."""
  reader: str        # the name it is registered under in READERS
  path: str          # file path, or the source's name ('tfds:NAME@SPLIT', 'embedded')
  start: int = 0     # jsonl: byte offset; parquet: row group; tfds: first record
  stop: int = 0      # jsonl: end byte offset; tfds: end record
  first: int = 1     # number of the first line (jsonl) or row/record (parquet, tfds), from 1
  field: str = ''
  tfds_data_dir: str = ''


class Reader:
  """Reads the records of the work items it made (see the module docstring)."""
  name: str = ''

  @classmethod
  def read(cls, item: WorkItem) -> Iterator[Record]:
    raise NotImplementedError

  @classmethod
  def location(cls, item: WorkItem, n: int) -> str:
    """Where record n of the item is, for messages."""
    return f'{item.path}:{n}'


class TextFormat(Reader):
  endings: tuple[str, ...] = ()

  @classmethod
  def work_items(cls, path: str, field: str) -> list[WorkItem]:
    raise NotImplementedError


class TokenFormat:
  endings: tuple[str, ...] = ()

  @classmethod
  def open(cls, path: str, info: dict) -> np.ndarray:
    """The file's ids, memory-mapped, 1-D; info is its sidecar ({} when there is none)."""
    raise NotImplementedError


READERS: dict[str, type[Reader]] = {}
TEXT_FORMATS: dict[str, type[TextFormat]] = {}  # by file-name ending
TOKEN_FORMATS: dict[str, type[TokenFormat]] = {}


def register(cls):
  """Registers a Reader (by name), TextFormat or TokenFormat (by endings) class."""
  if issubclass(cls, Reader):
    READERS[cls.name] = cls
  table = TEXT_FORMATS if issubclass(cls, TextFormat) else TOKEN_FORMATS
  for ending in getattr(cls, 'endings', ()):
    table[ending] = cls
  return cls


def find(path: str) -> type[TextFormat] | type[TokenFormat]:
  """The format of a file, by its longest registered ending (case-insensitive)."""
  lower = path.lower()
  for table in (TEXT_FORMATS, TOKEN_FORMATS):
    for ending in sorted(table, key=len, reverse=True):
      if lower.endswith(ending):
        return table[ending]
  raise DataError(f'{path}: unsupported file type {os.path.splitext(path)[1]!r}; text files are '
                  f'{", ".join(TEXT_FORMATS)}, token files {", ".join(TOKEN_FORMATS)}.')


def read(item: WorkItem) -> Iterator[Record]:
  return READERS[item.reader].read(item)


def location(item: WorkItem, n: int) -> str:
  return READERS[item.reader].location(item, n)


def decode_utf8(raw: bytes) -> tuple[str | None, str | None]:
  """(text, None), or (None, what is wrong) for bytes that are not UTF-8."""
  try:
    return raw.decode('utf-8'), None
  except UnicodeDecodeError as e:
    return None, f'bytes that are not UTF-8 (byte {e.start + 1}: {raw[e.start:e.start + 4]!r})'


def text_value(value, field: str) -> tuple[str | None, str | None]:
  """A record's field (str, UTF-8 bytes, or a 0-d array of them) as text, or what is wrong."""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if isinstance(value, bytes):
    return decode_utf8(value)
  if isinstance(value, str):
    return value, None
  if value is None:
    return None, f'"{field}" is null'
  return None, f'"{field}" is {type(value).__name__}, not text'


# Text files.

@register
class Jsonl(TextFormat):
  """One JSON object per line, its text under the field; split into byte ranges of whole lines."""
  name, endings = 'jsonl', ('.jsonl',)

  @classmethod
  def work_items(cls, path: str, field: str) -> list[WorkItem]:
    items: list[WorkItem] = []
    with open(path, 'rb') as f:
      start, line = 0, 1
      while True:
        chunk = f.read(_JSONL_ITEM_BYTES)
        if not chunk:
          return items
        cut = chunk.rfind(b'\n') + 1 if len(chunk) == _JSONL_ITEM_BYTES else len(chunk)
        if cut == 0:  # one line longer than the item size: take it whole
          rest = f.readline()
          chunk, cut = chunk + rest, len(chunk) + len(rest)
        f.seek(start + cut)
        items.append(WorkItem(cls.name, path, start, start + cut, line, field))
        line += chunk.count(b'\n', 0, cut)
        start += cut

  @classmethod
  def read(cls, item: WorkItem) -> Iterator[Record]:
    with open(item.path, 'rb') as f:
      f.seek(item.start)
      data = f.read(item.stop - item.start)
    if item.start == 0:
      data = data.removeprefix(_BOM)
    yield from _jsonl_records(data.split(b'\n'), item)


_BOM = b'\xef\xbb\xbf'  # a UTF-8 byte order mark, which some editors put first


def _jsonl_records(lines, item: WorkItem) -> Iterator[Record]:
  for n, raw in enumerate(lines, item.first):
    if raw.strip():
      yield (n, *_json_text(raw, item.field))


def _json_text(raw: bytes, field: str) -> tuple[str | None, str | None]:
  line, error = decode_utf8(raw)
  if line is None:
    return None, error
  try:
    obj = json.loads(line)
  except json.JSONDecodeError as e:
    return None, f'invalid JSON ({e.msg}, column {e.colno})'
  if field == WHOLE_LINE:
    return (line, None) if isinstance(obj, dict) else (None, 'not a JSON object')
  if not isinstance(obj, dict) or field not in obj:
    return None, f'no "{field}" field'
  if not isinstance(obj[field], str):
    return None, f'"{field}" is {type(obj[field]).__name__}, not a string'
  return obj[field], None


@register
class Txt(TextFormat):
  """A whole file is one document."""
  name, endings = 'txt', ('.txt',)

  @classmethod
  def work_items(cls, path: str, field: str) -> list[WorkItem]:
    return [WorkItem(cls.name, path, 0, os.path.getsize(path), 1, field)]

  @classmethod
  def read(cls, item: WorkItem) -> Iterator[Record]:
    with open(item.path, 'rb') as f:
      yield _text_record(f.read())


def _text_record(raw: bytes) -> Record:
  """A whole text file as one record (its first bad line named if it is not UTF-8)."""
  raw = raw.removeprefix(_BOM)
  try:
    return 1, raw.decode('utf-8'), None
  except UnicodeDecodeError as e:  # name the line of the first bad byte
    bad = raw[e.start:e.start + 4]
    return raw.count(b'\n', 0, e.start) + 1, None, f'bytes that are not UTF-8 ({bad!r})'


def _decompressed(path: str):
  """A binary file object streaming the decompressed content (gzip or zstd, by the file name)."""
  if path.lower().endswith('.gz'):
    return gzip.open(path, 'rb')
  import zstandard  # noqa: PLC0415
  return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, 'rb'),
                                                                      closefd=True))


class _Compressed(TextFormat):
  """A gzip or zstd compressed text file, streamed: one work item per file (a compressed stream
  cannot be cut into byte ranges); prepare_data.py spreads files over cores. Corrupt or truncated
  data is a DataError naming the file."""

  @classmethod
  def work_items(cls, path: str, field: str) -> list[WorkItem]:
    return [WorkItem(cls.name, path, 0, 0, 1, field)]

  @classmethod
  def read(cls, item: WorkItem) -> Iterator[Record]:
    import zstandard  # noqa: PLC0415
    try:
      with _decompressed(item.path) as f:
        yield from cls.records(f, item)
    except (OSError, EOFError, zstandard.ZstdError) as e:  # corrupt or truncated
      raise DataError(f'{item.path}: cannot decompress it ({type(e).__name__}: {e}).') from None

  @classmethod
  def records(cls, f, item: WorkItem) -> Iterator[Record]:
    raise NotImplementedError


@register
class CompressedJsonl(_Compressed):
  name, endings = 'jsonl-compressed', ('.jsonl.gz', '.jsonl.zst', '.jsonl.zstd')

  @classmethod
  def records(cls, f, item: WorkItem) -> Iterator[Record]:
    if f.peek(len(_BOM)).startswith(_BOM):
      f.read(len(_BOM))
    yield from _jsonl_records((line.rstrip(b'\n') for line in f), item)


@register
class CompressedTxt(_Compressed):
  name, endings = 'txt-compressed', ('.txt.gz', '.txt.zst', '.txt.zstd')

  @classmethod
  def records(cls, f, item: WorkItem) -> Iterator[Record]:
    yield _text_record(f.read())


@register
class Parquet(TextFormat):
  """A text (or UTF-8 binary) column; one work item per row group."""
  name, endings = 'parquet', ('.parquet',)

  @staticmethod
  @contextlib.contextmanager
  def _open(path: str):
    """A pyarrow ParquetFile of a path, or of a URL that fsspec opens (hf://, s3://, ...), closed
    on leaving."""
    import pyarrow.parquet as pq  # noqa: PLC0415
    if '://' in path:
      import fsspec  # noqa: PLC0415
      opened = fsspec.open(path, 'rb')
    else:
      opened = open(path, 'rb')  # noqa: SIM115
    with opened as f:
      yield pq.ParquetFile(f)

  @classmethod
  def work_items(cls, path: str, field: str) -> list[WorkItem]:
    import pyarrow  # noqa: PLC0415
    try:
      with cls._open(path) as pf:
        schema, metadata = pf.schema_arrow, pf.metadata
    except (pyarrow.ArrowException, OSError) as e:
      raise DataError(f'{path}: not a readable Parquet file ({e}).') from None
    if field not in schema.names:
      raise DataError(f'{path}: no column "{field}" (columns: {", ".join(schema.names)}); set '
                      f'data.text_field or write the source as {path}#COLUMN.')
    column_type = schema.field(field).type
    if not (pyarrow.types.is_string(column_type) or pyarrow.types.is_large_string(column_type)
            or pyarrow.types.is_binary(column_type) or pyarrow.types.is_large_binary(column_type)):
      raise DataError(f'{path}: column "{field}" holds {column_type}, not text.')
    if metadata.num_rows == 0:
      raise DataError(f'{path}: empty file (no rows).')
    items, first = [], 1
    for group in range(metadata.num_row_groups):
      items.append(WorkItem(cls.name, path, group, group + 1, first, field))
      first += metadata.row_group(group).num_rows
    return items

  @classmethod
  def read(cls, item: WorkItem) -> Iterator[Record]:
    with cls._open(item.path) as pf:
      column = pf.read_row_group(item.start, columns=[item.field]).column(0)
    for n, value in enumerate(column.to_pylist(), item.first):
      yield (n, *text_value(value, item.field))

  @classmethod
  def location(cls, item: WorkItem, n: int) -> str:
    return f'{item.path}: row {n}'


# Token files (see tokens.py for the sidecar).

@register
class Npy(TokenFormat):
  """Any 1-D integer NumPy array."""
  endings = ('.npy',)

  @classmethod
  def open(cls, path: str, info: dict) -> np.ndarray:
    try:
      tokens = np.load(path, mmap_mode='r')
    except ValueError as e:
      raise DataError(f'{path}: not a readable .npy file ({e}).') from None
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise DataError(f'{path}: holds {tokens.dtype} {tokens.shape}; token files are flat integer '
                      'arrays.')
    return tokens


@register
class Bin(TokenFormat):
  """Flat little-endian ids whose dtype the sidecar gives."""
  endings = ('.bin',)

  @classmethod
  def open(cls, path: str, info: dict) -> np.ndarray:
    if 'dtype' not in info:
      raise DataError(f'{path}: a raw .bin token file needs a sidecar '
                      f'{os.path.splitext(path)[0]}.json with at least '
                      '{"dtype": "uint16", "vocab_size": V, "eos_id": E}.')
    dtype = np.dtype(info['dtype'])
    if os.path.getsize(path) % dtype.itemsize:
      raise DataError(f'{path}: size {os.path.getsize(path)} is not a multiple of {dtype} '
                      f'({dtype.itemsize} bytes): truncated or the wrong dtype.')
    return np.memmap(path, dtype=dtype, mode='r')
