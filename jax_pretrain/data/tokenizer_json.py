"""Our tokenizers as a Hugging Face tokenizer.json (+ tokenizer_config.json): the files that
AutoTokenizer loads, encoding text to the same ids as ours. hf.export writes them beside the model.

`write(out_dir, tokenizer)` converts the byte tokenizer (ids 0..255 as ByteLevel's printable bytes),
a sentencepiece model (BPE or unigram: pieces, scores, merges, byte fallback, its normalization) or
copies a tokenizer.json, gives our special tokens their ids, keeps our chat template, and checks
the written file on a sample text with the tokenizers library. Needs tokenizers (and sentencepiece
for its models).
"""
import os

import tokenizers

from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError

_PROBE = ' Two  spaces,\ttabs\nand ünïcödé 日本 🙂 3.14159 '


def write(out_dir: str, tokenizer) -> list[str]:
  """tokenizer.json and tokenizer_config.json that AutoTokenizer loads, encoding text to the same
  ids as ours (checked on a sample text with the tokenizers library), with our chat template if
  there is one (from chat_template.jinja or tokenizer_config.json, written into
  tokenizer_config.json, where every transformers version reads it); returns notes. Our special
  tokens are special tokens there too, so a text that spells one out ('</s>') encodes to its
  id."""
  try:
    tok, specials = convert(tokenizer)
  except DataError as e:
    return [f'{e}: exported the model without a tokenizer.']
  template = tokenizer_lib.chat_template_source(tokenizer.directory)
  tokenizer_lib.write_hf_tokenizer(tok, out_dir, specials, template and template[0])
  written = tokenizers.Tokenizer.from_file(os.path.join(out_dir,
                                                       tokenizer_lib.HfTokenizer.file_name))
  if written.encode(_PROBE).ids != [int(i) for i in tokenizer.encode(_PROBE)]:
    return [f'the exported tokenizer encodes {_PROBE!r} differently from ours: check it.']
  return []


def convert(tokenizer) -> tuple[tokenizers.Tokenizer, dict[str, str]]:
  """Our tokenizer as a tokenizers.Tokenizer with our BOS, EOS and pad as its special tokens (at
  our ids), and their texts ({'bos_token': ..., ...}); a DataError for one without text (bare
  ids) or whose special tokens cannot have our ids. What write exports, and what the grammar
  library reads a token's bytes from (engine/grammar.py)."""
  converter = {tokenizer_lib.ByteTokenizer: _byte_tokenizer,
               tokenizer_lib.SentencePieceTokenizer: _sentencepiece_tokenizer,
               tokenizer_lib.HfTokenizer: lambda t: tokenizers.Tokenizer.from_file(t.path)
               }.get(type(tokenizer))
  if converter is None:
    raise DataError(f'the run has no text tokenizer ({type(tokenizer).__name__})')
  tok = converter(tokenizer)
  specials = {}
  for key, i in (('bos_token', tokenizer.bos_id), ('eos_token', tokenizer.eos_id),
                 ('pad_token', tokenizer.pad_id)):
    text = tok.id_to_token(i)
    if text is None:  # an id we appended after the tokenizer's own (a pad it lacks)
      text = next(t for t in (f'<{key[:-6]}>', f'<|{key[:-6]}|>', f'<|{key}_{i}|>')
                  if tok.token_to_id(t) is None)
    tok.add_special_tokens([tokenizers.AddedToken(text, special=True, normalized=False)])
    if tok.token_to_id(text) != i:
      raise DataError(f'could not give the {key} {text!r} its id {i}')
    specials[key] = text
  return tok, specials


def _sentencepiece_tokenizer(tokenizer):
  """A sentencepiece model (BPE or unigram) as a tokenizers.Tokenizer: its pieces and scores (BPE
  merges ranked by the merged piece's id, as transformers' own conversion ranks them), byte
  fallback, and sentencepiece's normalization rebuilt from the model's spec: a '▁' prepended
  (dummy prefix) and, where the model says so, whitespace stripped and collapsed."""
  from sentencepiece import sentencepiece_model_pb2  # noqa: PLC0415
  decoders, models, normalizers = tokenizers.decoders, tokenizers.models, tokenizers.normalizers
  # (protobuf builds ModelProto at import; sentencepiece's py.typed package does not declare it)
  proto = sentencepiece_model_pb2.ModelProto()  # type: ignore[attr-defined]
  with open(tokenizer.path, 'rb') as f:
    proto.ParseFromString(f.read())
  trainer, spec = proto.trainer_spec, proto.normalizer_spec
  model: tokenizers.models.Model
  if trainer.model_type == trainer.UNIGRAM:
    model = models.Unigram([(p.piece, p.score) for p in proto.pieces], trainer.unk_id,
                           byte_fallback=trainer.byte_fallback)
  elif trainer.model_type == trainer.BPE:
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = sorted((rank, i, piece[:i], piece[i:]) for piece, rank in vocab.items()
                    for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab)
    model = models.BPE(vocab, [(left, right) for _, _, left, right in merges],
                       unk_token=trainer.unk_piece, fuse_unk=True,
                       byte_fallback=trainer.byte_fallback)
  else:
    raise DataError(f'{tokenizer.path}: a sentencepiece model of type {trainer.model_type} '
                    '(only BPE and unigram are exported).')
  tok = tokenizers.Tokenizer(model)
  # Control pieces (<s>, </s>) are special tokens; user-defined pieces are plain added tokens.
  tok.add_special_tokens([tokenizers.AddedToken(p.piece, special=True, normalized=False)
                          for p in proto.pieces if p.type == p.CONTROL])
  tok.add_tokens([tokenizers.AddedToken(p.piece, normalized=False)
                  for p in proto.pieces if p.type == p.USER_DEFINED])
  steps: list[tokenizers.normalizers.Normalizer] = (
      [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else [])
  if spec.remove_extra_whitespaces:
    steps += [normalizers.Strip(), normalizers.Replace(tokenizers.Regex(' {2,}'), ' ')]
  steps.append(normalizers.Replace(' ', '▁'))
  if spec.add_dummy_prefix:
    steps.append(normalizers.Prepend('▁'))
  tok.normalizer = normalizers.Sequence(steps)
  tok.decoder = decoders.Sequence(
      [decoders.Replace('▁', ' '), decoders.ByteFallback(), decoders.Fuse()]
      + ([decoders.Strip(' ', 1, 0)] if spec.add_dummy_prefix else []))
  return tok


def _byte_tokenizer(tokenizer):
  """Our UTF-8 byte tokenizer as a tokenizers.Tokenizer: ids 0..255 are bytes (as the printable
  stand-ins of the ByteLevel pre-tokenizer), then <s>, </s>, <pad>; no merges."""
  pre_tokenizers = tokenizers.pre_tokenizers
  to_char = _bytes_to_unicode()  # the printable stand-in of each byte that ByteLevel emits
  assert set(to_char.values()) == set(pre_tokenizers.ByteLevel.alphabet())
  vocab = {to_char[b]: b for b in range(256)}
  vocab.update({'<s>': tokenizer.bos_id, '</s>': tokenizer.eos_id, '<pad>': tokenizer.pad_id})
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  return tok


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character table (what the ByteLevel pre-tokenizer emits)."""
  bs = (list(range(ord('!'), ord('~') + 1)) + list(range(ord('¡'), ord('¬') + 1))
        + list(range(ord('®'), ord('ÿ') + 1)))
  cs, n = bs[:], 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return {b: chr(c) for b, c in zip(bs, cs)}
