"""Token ids on disk and in memory.

On disk (what prepare_data.py writes, and what a user may bring):
  NAME.bin        flat little-endian token ids (uint16 when the vocabulary fits, else uint32);
                  each document is followed by the EOS id
  NAME.json       sidecar: dtype, num_tokens, num_documents, vocab_size, bos/eos/pad ids, the
                  tokenizer identity (and file) and the largest id
  NAME.docs.npy   document index: int64 [num_documents + 1] offsets of each document's first token
                  (and the end); for tools: training only needs the token stream
A user's NAME.npy (any 1-D integer array) works too, with an optional NAME.json sidecar; a raw
.bin needs the sidecar for its dtype. Files are memory-mapped: training reads only what it uses.
"""
import dataclasses
import json
import os

import numpy as np

from jax_pretrain.data import formats
from jax_pretrain.data.errors import DataError

FORMAT = 'jax_pretrain.tokens/1'
_SCAN_CHUNK = 1 << 24  # tokens checked per step when validating ids


def sidecar_path(path: str) -> str:
  return os.path.splitext(path)[0] + '.json'


def token_dtype(vocab_size: int) -> np.dtype:
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


@dataclasses.dataclass
class TokenFile:
  path: str
  tokens: np.ndarray  # memory-mapped [num_tokens]
  info: dict          # the sidecar ({} when there is none)


def read_sidecar(path: str) -> dict:
  """A token file's sidecar NAME.json ({} when there is none)."""
  if not os.path.isfile(sidecar_path(path)):
    return {}
  try:
    with open(sidecar_path(path), encoding='utf-8') as f:
      info = json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f'{sidecar_path(path)}: invalid JSON ({e}).') from None
  if not isinstance(info, dict):
    raise DataError(f'{sidecar_path(path)}: must hold a JSON object.')
  return info


def open_file(path: str) -> TokenFile:
  """Memory-maps a token file (formats.TOKEN_FORMATS) and reads its sidecar; checks the size."""
  info = read_sidecar(path)
  if os.path.getsize(path) == 0:
    raise DataError(f'{path}: empty file.')
  fmt = formats.find(path)
  if not issubclass(fmt, formats.TokenFormat):
    raise DataError(f'{path}: a text file, not token ids.')
  tokens = fmt.open(path, info)
  if len(tokens) == 0:
    raise DataError(f'{path}: empty file (no tokens).')
  if 'num_tokens' in info and info['num_tokens'] != len(tokens):
    raise DataError(f'{path}: holds {len(tokens)} tokens but its sidecar says '
                    f'{info["num_tokens"]}: the file is truncated or from another run.')
  return TokenFile(path, tokens, info)


def check_ids(tf: TokenFile, vocab_size: int) -> None:
  """Every id must lie in [0, vocab_size); names the first one that does not."""
  if 'max_id' in tf.info and tf.info.get('min_id', 0) >= 0 and tf.info['max_id'] < vocab_size:
    return  # written by prepare_data.py, which recorded the range
  for start in range(0, len(tf.tokens), _SCAN_CHUNK):
    chunk = np.asarray(tf.tokens[start:start + _SCAN_CHUNK])
    bad = np.flatnonzero((chunk < 0) | (chunk >= vocab_size))
    if len(bad):
      pos = start + int(bad[0])
      raise DataError(f'{tf.path}: token id {int(chunk[bad[0]])} at position {pos} is outside '
                      f'the vocabulary [0, {vocab_size}).')


class TokenStream:
  """One source's tokens: a concatenation of arrays (memory-mapped files or in memory).

  Pickles memory-mapped parts by file name and offset (not by content), so grain worker processes
  reopen the files instead of receiving copies.
  """

  def __init__(self, parts: list[np.ndarray], name: str):
    self.name = name
    self._parts = [p for p in parts if len(p)]
    self._ends = np.cumsum([len(p) for p in self._parts], dtype=np.int64)

  def __len__(self) -> int:
    return int(self._ends[-1]) if len(self._ends) else 0

  def read(self, start: int, stop: int) -> np.ndarray:
    """Tokens [start, stop) as int32."""
    k = int(np.searchsorted(self._ends, start, side='right'))
    begin = int(self._ends[k - 1]) if k else 0
    if stop <= self._ends[k]:  # the common case: inside one part
      return self._parts[k][start - begin:stop - begin].astype(np.int32)
    pieces = []
    while start < stop:
      end = int(self._ends[k])
      pieces.append(self._parts[k][start - begin:min(stop, end) - begin])
      start, begin, k = min(stop, end), end, k + 1
    return np.concatenate(pieces).astype(np.int32)

  def slice(self, start: int, stop: int) -> 'TokenStream':
    parts, begin = [], 0
    for part, end in zip(self._parts, self._ends):
      lo, hi = max(start, begin), min(stop, int(end))
      if lo < hi:
        parts.append(part[lo - begin:hi - begin])
      begin = int(end)
    return TokenStream(parts, self.name)

  def __getstate__(self):
    # ('file', name, dtype, offset, length) or ('array', the tokens)
    parts: list[tuple[str, str, str, int, int] | tuple[str, np.ndarray]] = []
    for p in self._parts:
      if isinstance(p, np.memmap) and p.filename:
        root = p  # the mapping itself; views of it share its file
        while isinstance(root.base, np.memmap):
          root = root.base
        view_offset = p.__array_interface__['data'][0] - root.__array_interface__['data'][0]
        parts.append(('file', p.filename, p.dtype.str, root.offset + view_offset, len(p)))
      else:
        parts.append(('array', np.asarray(p)))
    return {'name': self.name, 'parts': parts}

  def __setstate__(self, state):
    parts: list[np.ndarray] = []
    for kind, *rest in state['parts']:
      if kind == 'file':
        filename, dtype, offset, length = rest
        parts.append(np.memmap(filename, dtype=np.dtype(dtype), mode='r', offset=offset,
                               shape=(length,)))
      else:
        parts.append(rest[0])
    TokenStream.__init__(self, parts, state['name'])


def open_stream(paths: list[str], name: str) -> tuple[TokenStream, list[TokenFile]]:
  files = [open_file(p) for p in paths]
  return TokenStream([f.tokens for f in files], name), files


def carve(stream: TokenStream, eos_id: int, val_ratio: float) -> tuple[TokenStream, TokenStream]:
  """(train, val): the last val_ratio of the tokens, starting at a document boundary when there is
  one in that tail. Depends only on the data, never on the seed: the split is fixed."""
  n = len(stream)
  target = n - int(round(n * val_ratio))
  if val_ratio <= 0 or target >= n:
    return stream, stream.slice(n, n)
  cut = target
  for start in range(target, n - 1, _SCAN_CHUNK):  # first EOS at or after the target
    eos = np.flatnonzero(stream.read(start, min(start + _SCAN_CHUNK, n - 1)) == eos_id)
    if len(eos):
      cut = start + int(eos[0]) + 1
      break
  return stream.slice(0, cut), stream.slice(cut, n)


class Writer:
  """Appends documents' token ids to NAME.bin; close() writes NAME.docs.npy and NAME.json.

  Meant to write into a temporary directory that is renamed into place once complete.
  """

  def __init__(self, stem: str, dtype: np.dtype):
    self.stem, self.dtype = stem, np.dtype(dtype)
    self._file = open(stem + '.bin', 'wb')  # noqa: SIM115
    self._doc_lengths: list[np.ndarray] = []
    self.num_tokens, self.max_id = 0, -1

  def append(self, tokens: np.ndarray, doc_lengths: np.ndarray) -> None:
    if len(tokens):
      self.max_id = max(self.max_id, int(tokens.max()))
      self._file.write(tokens.astype(self.dtype).tobytes())
      self.num_tokens += len(tokens)
      self._doc_lengths.append(doc_lengths)

  def close(self, info: dict) -> dict:
    self._file.close()
    lengths = np.concatenate(self._doc_lengths) if self._doc_lengths else np.zeros(0, np.int64)
    np.save(self.stem + '.docs.npy', np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
    info = dict(format=FORMAT, dtype=self.dtype.name, num_tokens=self.num_tokens,
                num_documents=len(lengths), min_id=0, max_id=self.max_id, **info)
    write_json(self.stem + '.json', info)
    return info


def split_file(stem: str, cut: int, val_stem: str, info: dict) -> tuple[dict, dict]:
  """Moves tokens [cut:] of a written NAME.bin into val_stem.bin (the val split of that source)."""
  dtype = np.dtype(info['dtype'])
  docs = np.load(stem + '.docs.npy')
  with open(stem + '.bin', 'rb') as f:
    f.seek(cut * dtype.itemsize)
    tail = np.frombuffer(f.read(), dtype)
  os.truncate(stem + '.bin', cut * dtype.itemsize)
  tail.tofile(val_stem + '.bin')
  k = int(np.searchsorted(docs, cut, side='right'))  # docs starting after the cut go to val
  train_docs = np.concatenate([docs[:k], [cut]]) if docs[k - 1] != cut else docs[:k]
  val_docs = np.concatenate([[cut], docs[k:]]) - cut
  np.save(stem + '.docs.npy', train_docs)
  np.save(val_stem + '.docs.npy', val_docs)
  out = []
  for s, d, n in ((stem, train_docs, cut), (val_stem, val_docs, len(tail))):
    part = dict(info, num_tokens=int(n), num_documents=len(d) - 1)
    write_json(s + '.json', part)
    out.append(part)
  return out[0], out[1]


def write_json(path: str, obj) -> None:
  with open(path, 'w', encoding='utf-8') as f:
    json.dump(obj, f, indent=2, sort_keys=True)
    f.write('\n')
