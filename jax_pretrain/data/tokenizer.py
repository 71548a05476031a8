"""Tokenizers: UTF-8 bytes (the embedded default), sentencepiece, and bare ids (pre-tokenized data).

All have encode(str) -> int32 [n], decode(ids) -> str, vocab_size, bos_id, eos_id, pad_id, and
`identity`: equal for two tokenizers exactly when they map text to the same ids. Prepared data
records the identity of the tokenizer that made it, so training can refuse a different one.
"""
import hashlib
import json
import os
import shutil

import numpy as np

from jax_pretrain.data.errors import DataError


class ByteTokenizer:
  """Ids 0..255 are the UTF-8 bytes; then BOS, EOS and PAD."""
  bos_id = 256
  eos_id = 257
  pad_id = 258
  vocab_size = 259
  identity = 'byte'
  path = 'byte'

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode('utf-8', errors='replace')


def _with_appended_specials(num_pieces: int, ids: list[int]) -> tuple[list[int], int]:
  """Special ids a model lacks (-1) get fresh ids after its pieces; returns (ids, vocab_size)."""
  out, next_id = [], num_pieces
  for i in ids:
    if i is None or i < 0:
      i, next_id = next_id, next_id + 1
    out.append(int(i))
  return out, max(next_id, max(out) + 1)


class SentencePieceTokenizer:
  """A sentencepiece .model. A model without a pad (or BOS/EOS) piece gets one appended after its
  pieces, so pad never collides with a real token; vocab_size then counts it."""
  file_name = 'tokenizer.model'  # its name where a record keeps it (tokenizer.save)

  def __init__(self, path: str):
    import sentencepiece as spm  # pylint: disable=g-import-not-at-top
    if not os.path.isfile(path):
      raise DataError(f'{path}: tokenizer file not found.')
    with open(path, 'rb') as f:
      proto = f.read()
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(proto)
    except RuntimeError as e:
      raise DataError(f'{path}: not a sentencepiece model ({str(e).strip()[:120]}).') from None
    self.path = path
    self.num_pieces = self._sp.GetPieceSize()
    (self.bos_id, self.eos_id, self.pad_id), self.vocab_size = _with_appended_specials(
        self.num_pieces, [self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()])
    self.identity = 'sentencepiece:' + hashlib.sha256(proto).hexdigest()[:16]

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.EncodeAsIds(text), np.int32)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return self._sp.EncodeAsIds(texts) if texts else []

  def decode(self, ids) -> str:
    return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self.num_pieces])


class IdTokenizer:
  """Pre-tokenized data with no tokenizer at hand: knows the ids, not the text.

  encode() reads a prompt of whitespace-separated ids; any other text becomes [eos_id] (the start of
  a new document), so that sampling at the end of a run still works. decode() prints the ids.
  """

  def __init__(self, vocab_size: int, eos_id: int, bos_id: int | None = None,
               pad_id: int | None = None):
    (self.bos_id, self.eos_id, self.pad_id), self.vocab_size = _with_appended_specials(
        vocab_size, [eos_id if bos_id is None else bos_id, eos_id, pad_id])
    self.identity = f'ids:{vocab_size}:eos={eos_id}'
    self.path = ''

  def encode(self, text: str) -> np.ndarray:
    try:
      return np.asarray([int(t) for t in text.split()] or [self.eos_id], np.int32)
    except ValueError:
      return np.asarray([self.eos_id], np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    raise DataError('this data has no tokenizer (token ids only): raw text sources need '
                    'data.tokenizer to be set.')

  def decode(self, ids) -> str:
    return ' '.join(str(int(i)) for i in ids)


RECORD_FILE = 'tokenizer_record.json'  # in a tokenizer directory written by save()


def load(spec: str):
  """'byte', a sentencepiece .model path, or a directory written by save() (a run's tokenizer/)."""
  if spec == 'byte':
    return ByteTokenizer()
  if os.path.isdir(spec):
    path = os.path.join(spec, RECORD_FILE)
    if not os.path.isfile(path):
      raise DataError(f'{spec}: a directory without {RECORD_FILE}; give a tokenizer file.')
    with open(path, encoding='utf-8') as f:
      return from_record(json.load(f), spec, path)
  return SentencePieceTokenizer(spec)


def record(tokenizer) -> dict:
  """What identifies a tokenizer and its special ids (prepared data, token sidecars and runs keep
  it); 'tokenizer_file' names its file, when it has one, relative to where the record is."""
  out = dict(tokenizer=tokenizer.identity, vocab_size=tokenizer.vocab_size,
             bos_id=tokenizer.bos_id, eos_id=tokenizer.eos_id, pad_id=tokenizer.pad_id)
  if getattr(tokenizer, 'file_name', None):
    out['tokenizer_file'] = tokenizer.file_name
  return out


def save(tokenizer, directory: str) -> dict:
  """Writes the tokenizer's file (if any) and RECORD_FILE into directory; returns the record.
  load(directory) gives the tokenizer back."""
  os.makedirs(directory, exist_ok=True)
  rec = record(tokenizer)
  if 'tokenizer_file' in rec:
    target = os.path.join(directory, rec['tokenizer_file'])
    if os.path.abspath(target) != os.path.abspath(tokenizer.path):
      shutil.copyfile(tokenizer.path, target)
  with open(os.path.join(directory, RECORD_FILE), 'w', encoding='utf-8') as f:
    json.dump(rec, f, indent=2, sort_keys=True)
    f.write('\n')
  return rec


def from_record(rec: dict, directory: str, where: str):
  """The tokenizer a record describes (its file under directory), or bare ids when it names none."""
  identity = rec.get('tokenizer', '')
  if identity == 'byte':
    return ByteTokenizer()
  if identity.startswith('sentencepiece:'):
    path = os.path.join(directory, rec.get('tokenizer_file', 'tokenizer.model'))
    tok = SentencePieceTokenizer(path)
    if tok.identity != identity:
      raise DataError(f'{where}: records tokenizer {identity}, but {path} is {tok.identity}.')
    return tok
  if identity.startswith('ids:'):  # ids:N:eos=E (N excludes appended specials)
    return IdTokenizer(int(identity.split(':')[1]), rec['eos_id'], rec.get('bos_id'),
                       rec.get('pad_id'))
  if 'vocab_size' not in rec or 'eos_id' not in rec:
    raise DataError(f'{where}: the sidecar must give "vocab_size" and "eos_id" (or set '
                    'data.tokenizer).')
  return IdTokenizer(rec['vocab_size'], rec['eos_id'], rec.get('bos_id'), rec.get('pad_id'))


def train_sentencepiece(texts, output: str, vocab_size: int, model_type: str = 'bpe',
                        max_sentences: int = 2_000_000,
                        num_threads: int = 0) -> SentencePieceTokenizer:
  """Trains a sentencepiece model on texts (an iterable of documents) and writes output (.model).

  Text is kept as is (identity normalization, whitespace and newlines preserved), digits are
  split, and byte fallback makes every string encodable. Ids: unk 0, BOS 1, EOS 2, pad 3.
  Sentencepiece trains on lines: documents are split at newlines (which byte fallback encodes).
  """
  import sentencepiece as spm  # pylint: disable=g-import-not-at-top
  if model_type not in ('bpe', 'unigram'):
    raise DataError(f'model type {model_type!r}: choose bpe or unigram.')
  if not output.endswith('.model'):
    raise DataError(f'{output}: the tokenizer file name must end in .model.')

  def lines():
    for text in texts:
      yield from (line for line in text.split('\n') if line.strip())

  prefix = f'{output[:-len(".model")]}.tmp-{os.getpid()}'
  try:
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines(), model_prefix=prefix, vocab_size=vocab_size,
        model_type=model_type, byte_fallback=True, split_digits=True, character_coverage=0.9995,
        normalization_rule_name='identity', remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True, max_sentence_length=1 << 16,
        input_sentence_size=max_sentences, shuffle_input_sentence=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=3, num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2)
  except RuntimeError as e:  # e.g. a vocabulary larger than the text supports
    raise DataError(f'sentencepiece training for {output} failed: {str(e).strip()[:300]}') from None
  os.replace(prefix + '.model', output)  # complete or absent: never half-written
  os.replace(prefix + '.vocab', output[:-len('.model')] + '.vocab')
  return SentencePieceTokenizer(output)
