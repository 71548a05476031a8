"""Tokenizers: UTF-8 bytes (the embedded default), sentencepiece, Hugging Face tokenizer.json, and
bare ids (pre-tokenized data).

All have encode(str) -> int32 [n], decode(ids) -> str, vocab_size, bos_id, eos_id, pad_id,
`identity`: equal for two tokenizers exactly when they map text to the same ids (prepared data
records the identity of the tokenizer that made it, so training can refuse a different one), and
`directory`: where its tokenizer_config.json belongs (the directory load() read, else that of its
file; None for bare bytes or ids), whose chat template (chat_template.jinja or the
"chat_template" of tokenizer_config.json: chat_template_source) SFT and the server render chats
with (data/chat.py), which a run keeps in its tokenizer/ (save) and which HF export writes
(data/tokenizer_json.py). A rendered chat is encoded with encode_rendered: as transformers'
apply_chat_template encodes it (the special tokens' text to their ids), with each token's
character span.
"""
import hashlib
import json
import os
import re
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
  directory: str | None = None

  def encode(self, text: str) -> np.ndarray:
    return np.frombuffer(text.encode('utf-8'), dtype=np.uint8).astype(np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    return [self.encode(t) for t in texts]

  def decode(self, ids) -> str:
    data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
    return data.decode('utf-8', errors='replace')

  def encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], character offsets int64 [n, 2]) of a rendered chat: '<s>', '</s>' and
    '<pad>' (the texts HF export gives BOS, EOS and pad) as their ids, each other character as
    its UTF-8 bytes."""
    pieces = []
    specials = {'<s>': self.bos_id, '</s>': self.eos_id, '<pad>': self.pad_id}
    for start, end, special in split_specials(text, specials):
      if special is not None:
        pieces.append((np.asarray([special]), np.asarray([[start, end]])))
        continue
      data, char_B1 = _char_of_byte(text[start:end])
      pieces.append((data, start + np.stack([char_B1[:-1], char_B1[:-1] + 1], axis=1)))
    return _rendered(pieces)


def _with_appended_specials(num_pieces: int, ids: list[int | None]) -> tuple[list[int], int]:
  """[bos, eos, pad] with the ids a model lacks (-1 or None) appended after its pieces; returns
  (ids, vocab_size). A pad equal to BOS or EOS (GPT-2-derived tokenizer_config.json files name EOS
  as pad) is treated as missing: the loss ignores pad targets and sampling never draws pad, so a
  shared id would make EOS untrainable and unreachable. BOS may equal EOS."""
  bos, eos, pad = ids
  if pad is not None and pad >= 0 and pad in (bos, eos):
    pad = None
  out, next_id = [], num_pieces
  for i in (bos, eos, pad):
    if i is None or i < 0:
      i, next_id = next_id, next_id + 1
    out.append(int(i))
  return out, max(next_id, max(out) + 1)


def split_specials(text: str, specials: dict[str, int]) -> list[tuple[int, int, int | None]]:
  """text as (start, end, id) pieces: a special token's text (the longest that starts where the
  text is matched first, as the tokenizers library matches added tokens) with its id, the text
  between with None."""
  if not specials:
    return [(0, len(text), None)] if text else []
  pattern = re.compile('|'.join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
  out: list[tuple[int, int, int | None]] = []
  pos = 0
  for m in pattern.finditer(text):
    if m.start() > pos:
      out.append((pos, m.start(), None))
    out.append((m.start(), m.end(), specials[m.group()]))
    pos = m.end()
  return out + ([(pos, len(text), None)] if pos < len(text) else [])


def _char_of_byte(text: str) -> tuple[np.ndarray, np.ndarray]:
  """(text's UTF-8 bytes uint8 [b], the index of the character each is part of int64 [b + 1],
  len(text) last)."""
  data = np.frombuffer(text.encode('utf-8'), np.uint8)
  starts = (data & 0xC0) != 0x80  # (a continuation byte is 10xxxxxx)
  return data, np.append(np.cumsum(starts) - 1, len(text))


def _rendered(pieces: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [n], offsets int64 [n, 2]) of pieces of (ids, offsets)."""
  if not pieces:
    return np.zeros(0, np.int32), np.zeros((0, 2), np.int64)
  return (np.concatenate([i for i, _ in pieces]).astype(np.int32),
          np.concatenate([o for _, o in pieces]).astype(np.int64).reshape(-1, 2))


class SentencePieceTokenizer:
  """A sentencepiece .model. A model without a pad (or BOS/EOS) piece gets one appended after its
  pieces, so pad never collides with a real token; vocab_size then counts it."""
  file_name = 'tokenizer.model'  # its name where a record keeps it (tokenizer.save)

  def __init__(self, path: str):
    import sentencepiece as spm  # noqa: PLC0415
    if not os.path.isfile(path):
      raise DataError(f'{path}: tokenizer file not found.')
    with open(path, 'rb') as f:
      proto = f.read()
    self._sp = spm.SentencePieceProcessor()
    try:
      self._sp.LoadFromSerializedProto(proto)
    except RuntimeError as e:
      raise DataError(f'{path}: not a sentencepiece model ({str(e).strip()[:120]}).') from None
    self.path, self.directory = path, os.path.dirname(os.path.abspath(path))
    self.num_pieces = self._sp.GetPieceSize()
    (self.bos_id, self.eos_id, self.pad_id), self.vocab_size = _with_appended_specials(
        self.num_pieces, [self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()])
    self.identity = 'sentencepiece:' + hashlib.sha256(proto).hexdigest()[:16]
    self._special_pieces: dict[str, int] | None = None  # (read when first asked: _specials)

  def encode(self, text: str) -> np.ndarray:
    return np.asarray(self._sp.EncodeAsIds(text), np.int32)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return self._sp.EncodeAsIds(texts) if texts else []

  def decode(self, ids) -> str:
    return self._sp.DecodeIds([int(i) for i in ids if 0 <= int(i) < self.num_pieces])

  def _specials(self) -> dict[str, int]:
    """The control pieces (<s>, </s>) and user-defined pieces by their text: the tokens HF export
    adds to its tokenizer.json (data/tokenizer_json.py)."""
    if self._special_pieces is None:
      from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415
      proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
      proto.ParseFromString(self._sp.serialized_model_proto())
      self._special_pieces = {p.piece: i for i, p in enumerate(proto.pieces)
                              if p.type in (p.CONTROL, p.USER_DEFINED)}
    return self._special_pieces

  def encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], character offsets int64 [n, 2]) of a rendered chat, as transformers encodes
    it with this model (HF export's tokenizer.json, or LlamaTokenizer with legacy=True): split at
    the control and user-defined pieces' text (their ids), each text between encoded alone (with
    the model's normalization: a dummy prefix '▁' each). A piece that covers no character (the
    dummy prefix, a character's leading byte pieces) gets the span of the piece after it."""
    pieces = []
    for start, end, special in split_specials(text, self._specials()):
      if special is not None:
        pieces.append((np.asarray([special]), np.asarray([[start, end]])))
        continue
      segment = text[start:end]
      _, char_B1 = _char_of_byte(segment)
      proto = self._sp.EncodeAsProto(segment)
      ids = [p.id for p in proto.pieces]
      spans = [[start + char_B1[p.begin], start + char_B1[p.end]] for p in proto.pieces]
      for k in range(len(spans) - 2, -1, -1):
        if spans[k][0] == spans[k][1]:
          spans[k] = [spans[k][0], spans[k + 1][1]]
      pieces.append((np.asarray(ids), np.asarray(spans).reshape(-1, 2)))
    return _rendered(pieces)


HF_CONFIG_FILE = 'tokenizer_config.json'  # beside a tokenizer.json: its special tokens
_HF_SPECIAL_FILES = ('special_tokens_map.json', HF_CONFIG_FILE)  # read in order; the last wins


def read_hf_file(directory: str, name: str) -> dict | None:
  """A tokenizer's JSON file beside it (tokenizer_config.json, ...): its object, None if absent."""
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    return None
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise DataError(f'{path}: invalid JSON ({e}).') from None


CHAT_TEMPLATE_FILE = 'chat_template.jinja'  # where transformers (since 4.47) saves a template


def chat_template_source(directory: str | None) -> tuple[str, str] | None:
  """(the chat template, the file it is in) of a tokenizer directory, as transformers finds it:
  chat_template.jinja, else the "chat_template" of tokenizer_config.json (a string, or a list of
  named ones: the one named "default"); None if it has neither."""
  if not directory:
    return None
  path = os.path.join(directory, CHAT_TEMPLATE_FILE)
  if os.path.isfile(path):
    return read_chat_template(path), path
  config = read_hf_file(directory, HF_CONFIG_FILE)
  template = config.get('chat_template') if isinstance(config, dict) else None
  if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
    named = {t.get('name'): t.get('template') for t in template if isinstance(t, dict)}
    template = named.get('default')
  if isinstance(template, str) and template:
    return template, os.path.join(directory, HF_CONFIG_FILE)
  return None


def read_chat_template(path: str) -> str:
  """A chat template file's text (chat_template.jinja, or serve --chat_template's)."""
  try:
    with open(path, encoding='utf-8') as f:
      return f.read()
  except FileNotFoundError:
    raise DataError(f'{path}: chat template file not found.') from None
  except (OSError, UnicodeDecodeError) as e:
    raise DataError(f'{path}: cannot read the chat template ({e}).') from None


def hf_special_tokens(directory: str) -> dict[str, str]:
  """{'bos_token': text, ...} that tokenizer_config.json / special_tokens_map.json in directory
  name (a value may be a string or an AddedToken dict with its 'content')."""
  found = {}
  for name in _HF_SPECIAL_FILES:
    config = read_hf_file(directory, name)
    if config is None:
      continue
    for key in ('bos_token', 'eos_token', 'pad_token'):
      value = config.get(key) if isinstance(config, dict) else None
      value = value.get('content') if isinstance(value, dict) else value
      if isinstance(value, str):
        found[key] = value
  return found


class HfTokenizer:
  """A Hugging Face `tokenizers` file, tokenizer.json (what SmolLM, Llama 3 and most current models
  ship), read with the tokenizers library.

  encode() applies the file's own post-processor, as AutoTokenizer does by default and as the
  model was trained: Llama 3's prepends <|begin_of_text|>, so a document is BOS text EOS. BOS,
  EOS and pad are the tokens that tokenizer_config.json (or special_tokens_map.json) beside the
  file names, or ids given by a record; a missing BOS is EOS, and a missing pad (or one that is
  EOS or BOS) is appended after the vocabulary (as for sentencepiece), so pad never collides with
  a real token.
  """
  file_name = 'tokenizer.json'  # its name where a record keeps it (tokenizer.save)

  def __init__(self, path: str, special_ids: tuple[int, int, int] | None = None):
    try:
      import tokenizers  # noqa: PLC0415
    except ImportError:
      raise DataError(f'{path}: reading a tokenizer.json needs the tokenizers package: '
                      '`pip install tokenizers`.') from None
    if not os.path.isfile(path):
      raise DataError(f'{path}: tokenizer file not found.')
    with open(path, 'rb') as f:
      data = f.read()
    try:
      self._tok = tokenizers.Tokenizer.from_str(data.decode('utf-8'))
    except Exception as e:  # noqa: BLE001  (tokenizers raises Exception itself)
      raise DataError(f'{path}: not a Hugging Face tokenizer.json ({str(e).strip()[:120]}).'
                      ) from None
    self.path, self.directory = path, os.path.dirname(os.path.abspath(path))
    self.num_pieces = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
    if special_ids is None:
      special_ids = self._special_ids_from_config()
    (self.bos_id, self.eos_id, self.pad_id), self.vocab_size = _with_appended_specials(
        self.num_pieces, list(special_ids))

    def identity(ids) -> str:
      return 'tokenizers:' + hashlib.sha256(data + json.dumps(list(ids)).encode()).hexdigest()[:16]
    self.identity = identity([self.bos_id, self.eos_id, self.pad_id])
    # Before pad got an id of its own where the files name EOS (or BOS) as pad, this tokenizer
    # had the shared id: data prepared and runs saved then recorded that identity; they still load.
    self.former_identity = (identity(special_ids) if special_ids[2] in special_ids[:2]
                            else self.identity)

  def _special_ids_from_config(self) -> tuple[int, int, int]:
    tokens = hf_special_tokens(os.path.dirname(os.path.abspath(self.path)))
    ids: dict[str, int] = {}
    for key, text in tokens.items():
      token_id = self._tok.token_to_id(text)
      if token_id is None:
        raise DataError(f'{self.path}: the {key} {text!r} of {HF_CONFIG_FILE} is not in its '
                        'vocabulary.')
      ids[key] = token_id
    if 'eos_token' not in ids:
      raise DataError(f'{self.path}: no eos_token: put a {HF_CONFIG_FILE} beside it that names '
                      'one, e.g. {"eos_token": "<|endoftext|>"} (documents are separated by it).')
    eos = ids['eos_token']
    return ids.get('bos_token', eos), eos, ids.get('pad_token', -1)

  def encode(self, text: str, add_special_tokens: bool = True) -> np.ndarray:
    return np.asarray(self._tok.encode(text, add_special_tokens=add_special_tokens).ids, np.int32)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in self._tok.encode_batch(texts)] if texts else []

  def encode_rendered(self, text: str) -> tuple[np.ndarray, np.ndarray]:
    """(ids int32 [n], character offsets int64 [n, 2]) of a rendered chat, as transformers'
    apply_chat_template encodes it: the whole text at once, its added tokens' text to their ids,
    no post-processor (add_special_tokens=False)."""
    encoding = self._tok.encode(text, add_special_tokens=False)
    return (np.asarray(encoding.ids, np.int32),
            np.asarray(encoding.offsets, np.int64).reshape(-1, 2))

  def decode(self, ids) -> str:
    return self._tok.decode([int(i) for i in ids if 0 <= int(i) < self.num_pieces],
                            skip_special_tokens=True)


def text_ids(tokenizer, text: str) -> np.ndarray:
  """The ids of text alone, without the special tokens a tokenizer.json's post-processor adds
  (Llama 3's BOS), for callers that frame text themselves (lm-evaluation-harness adds its own
  prefix token); our other tokenizers add none."""
  if isinstance(tokenizer, HfTokenizer):
    return tokenizer.encode(text, add_special_tokens=False)
  return tokenizer.encode(text)


def text_bytes(tokenizer, ids: np.ndarray) -> int | None:
  """UTF-8 bytes of the text that ids stand for, decoded a document (EOS-delimited) at a time: the
  text the ids stand for, since decode(encode(document)) is the document for the byte tokenizer
  and for sentencepiece models with byte fallback. None for a tokenizer without text."""
  if isinstance(tokenizer, IdTokenizer):
    return None
  total, start = 0, 0
  for end in [*np.flatnonzero(ids == tokenizer.eos_id).tolist(), len(ids)]:
    if end > start:
      total += len(tokenizer.decode(ids[start:end]).encode('utf-8'))
    start = end + 1
  return total


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
    self.directory: str | None = None

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
  """'byte', a sentencepiece .model, a tokenizer.json (any name ending in .json), or a directory:
  one written by save() (a run's tokenizer/), else one holding tokenizer.json or tokenizer.model
  (a Hugging Face model directory), whose tokenizer_config.json is the tokenizer's (`directory`)."""
  if spec == 'byte':
    return ByteTokenizer()
  if os.path.isdir(spec):
    path = os.path.join(spec, RECORD_FILE)
    if os.path.isfile(path):
      with open(path, encoding='utf-8') as f:
        tok = from_record(json.load(f), spec, path)
      tok.directory = os.path.abspath(spec)
      return tok
    for kind in (HfTokenizer, SentencePieceTokenizer):
      if os.path.isfile(os.path.join(spec, kind.file_name)):
        return kind(os.path.join(spec, kind.file_name))
    raise DataError(f'{spec}: a directory without {RECORD_FILE}, {HfTokenizer.file_name} or '
                    f'{SentencePieceTokenizer.file_name}; give a tokenizer file.')
  if spec.endswith('.json'):
    return HfTokenizer(spec)
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
  """Writes the tokenizer's file (if any), its tokenizer_config.json and chat_template.jinja (those
  it has: the chat template renders SFT's messages and the server's chats, data/chat.py; the
  special ids stay the record's) and RECORD_FILE into directory; returns the record.
  load(directory) gives the tokenizer back."""
  os.makedirs(directory, exist_ok=True)
  rec = record(tokenizer)
  if 'tokenizer_file' in rec:
    target = os.path.join(directory, rec['tokenizer_file'])
    if os.path.abspath(target) != os.path.abspath(tokenizer.path):
      shutil.copyfile(tokenizer.path, target)
  source = tokenizer.directory
  for name in (HF_CONFIG_FILE, CHAT_TEMPLATE_FILE):
    if source and os.path.isfile(os.path.join(source, name)) and not os.path.samefile(
        source, directory):
      shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
  with open(os.path.join(directory, RECORD_FILE), 'w', encoding='utf-8') as f:
    json.dump(rec, f, indent=2, sort_keys=True)
    f.write('\n')
  return rec


def from_record(rec: dict, directory: str, where: str):
  """The tokenizer a record describes (its file under directory), or bare ids when it names none."""
  identity = rec.get('tokenizer', '')
  if identity == 'byte':
    return ByteTokenizer()
  if identity.startswith(('sentencepiece:', 'tokenizers:')):
    kind = HfTokenizer if identity.startswith('tokenizers:') else SentencePieceTokenizer
    path = os.path.join(directory, rec.get('tokenizer_file', kind.file_name))
    # A tokenizer.json's special ids are the record's (not those of its tokenizer_config.json).
    tok = (HfTokenizer(path, (rec['bos_id'], rec['eos_id'], rec['pad_id'])) if kind is HfTokenizer
           else SentencePieceTokenizer(path))
    if identity not in (tok.identity, getattr(tok, 'former_identity', None)):
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
  import sentencepiece as spm  # noqa: PLC0415
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


def write_hf_tokenizer(tok, directory: str, specials: dict[str, str],
                       chat_template: str | list | None = None) -> None:
  """tok (a tokenizers.Tokenizer) as directory/tokenizer.json, and the tokenizer_config.json that
  names its special tokens (specials: {'bos_token': text, ...}) and holds the chat_template if
  given: the files that AutoTokenizer.from_pretrained(directory) and HfTokenizer read. Needs no
  transformers."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, HfTokenizer.file_name)
  tok.save(f'{path}.tmp-{os.getpid()}')
  os.replace(f'{path}.tmp-{os.getpid()}', path)  # complete or absent: never half-written
  config = dict(tokenizer_class='PreTrainedTokenizerFast', clean_up_tokenization_spaces=False,
                **specials)
  if chat_template is not None:
    config['chat_template'] = chat_template
  with open(os.path.join(directory, HF_CONFIG_FILE), 'w', encoding='utf-8') as f:
    json.dump(config, f, indent=2, ensure_ascii=False)
    f.write('\n')


BYTE_LEVEL_EOS, BYTE_LEVEL_PAD = '<|endoftext|>', '<|pad|>'  # ids 0 and 1 of train_bytelevel_bpe


def train_bytelevel_bpe(texts, output: str, vocab_size: int) -> HfTokenizer:
  """Trains a byte-level BPE (the GPT-2 and Llama 3 kind) with the tokenizers library and writes
  output (DIR/tokenizer.json) and DIR/tokenizer_config.json: a model directory's tokenizer.

  Every string is encodable (the 256 bytes are the base vocabulary) and decodes back exactly: no
  normalization; GPT-2's pre-tokenizer splits words (with their leading space) and digits are
  split one by one. Ids: <|endoftext|> 0 (EOS, also BOS), <|pad|> 1, then bytes and merges.
  """
  try:
    import tokenizers  # noqa: PLC0415
  except ImportError:
    raise DataError('training a byte-level BPE needs the tokenizers package: '
                    '`pip install tokenizers`.') from None
  if os.path.basename(output) != HfTokenizer.file_name:
    raise DataError(f'{output}: the file name must be {HfTokenizer.file_name} (its directory is '
                    'the tokenizer, with tokenizer_config.json beside it).')
  models, pre_tokenizers = tokenizers.models, tokenizers.pre_tokenizers
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  if vocab_size < len(alphabet) + 2:
    raise DataError(f'vocab size {vocab_size}: a byte-level BPE needs at least '
                    f'{len(alphabet) + 2} (256 bytes and 2 special tokens).')
  tok = tokenizers.Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Sequence([
      pre_tokenizers.Digits(individual_digits=True),
      pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = tokenizers.decoders.ByteLevel()
  tok.train_from_iterator(texts, tokenizers.trainers.BpeTrainer(
      vocab_size=vocab_size, special_tokens=[BYTE_LEVEL_EOS, BYTE_LEVEL_PAD],
      initial_alphabet=alphabet, show_progress=False))
  write_hf_tokenizer(tok, os.path.dirname(os.path.abspath(output)), {
      'bos_token': BYTE_LEVEL_EOS, 'eos_token': BYTE_LEVEL_EOS, 'pad_token': BYTE_LEVEL_PAD})
  return HfTokenizer(output)
