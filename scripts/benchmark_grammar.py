"""The grammar libraries for constrained decoding compared on this machine's CPU (BENCHMARKS.md):
llguidance and xgrammar, with each kind of tokenizer we load (bytes, sentencepiece, byte-level
BPE tokenizer.json; trained here on Python's own docs), the time to build the library's tokenizer,
to compile a JSON schema, and to fill one row's mask per token (the median over a generated JSON
document, sampled at random among the allowed tokens).

  python scripts/benchmark_grammar.py [--vocab=32000]
"""
import argparse
import json
import os
import random
import statistics
import tempfile
import time

import numpy as np

from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.engine import grammar as grammar_lib

SCHEMA = {
    'type': 'object', 'additionalProperties': False,
    'required': ['name', 'age', 'tags', 'address', 'kind'],
    'properties': {
        'name': {'type': 'string', 'maxLength': 20},
        'age': {'type': 'integer', 'minimum': 0, 'maximum': 150},
        'tags': {'type': 'array', 'items': {'type': 'string', 'maxLength': 8}, 'maxItems': 4},
        'address': {'type': 'object', 'required': ['city', 'zip'], 'additionalProperties': False,
                    'properties': {'city': {'type': 'string', 'maxLength': 12},
                                   'zip': {'type': 'string', 'pattern': '^[0-9]{5}$'}}},
        'kind': {'enum': ['a', 'b', 'c']}}}


def tokenizers(vocab: int, directory: str):
  from pydoc_data import topics
  texts = [topics.topics[k] for k in sorted(topics.topics)]
  for name in sorted(os.listdir(os.path.dirname(os.__file__)))[:400]:  # (Python's own code)
    if name.endswith('.py'):
      with open(os.path.join(os.path.dirname(os.__file__), name), encoding='utf-8') as f:
        texts.append(f.read())
  yield 'bytes', tokenizer_lib.ByteTokenizer()
  yield f'sentencepiece {vocab}', tokenizer_lib.train_sentencepiece(
      texts, os.path.join(directory, 'sp.model'), min(vocab, 8000))
  yield f'byte-level BPE {vocab}', tokenizer_lib.train_bytelevel_bpe(
      texts, os.path.join(directory, 'bpe', 'tokenizer.json'), vocab)


def allowed(mask_W: np.ndarray, vocab: int) -> np.ndarray:
  bits = np.unpackbits(mask_W.view(np.uint8), bitorder='little')[:vocab]
  return np.flatnonzero(bits)


def walk(fill, advance, vocab, eos, steps=200):
  """Per-token fill times (s) along a random walk through the grammar."""
  rng, times = random.Random(0), []
  mask = np.zeros((1, grammar_lib.words(vocab)), np.int32)
  for _ in range(steps):
    t = time.perf_counter()
    fill(mask)
    times.append(time.perf_counter() - t)
    ids = [i for i in allowed(mask[0], vocab) if i != eos] or [eos]
    if advance(rng.choice(ids)):
      break
  return times


def bench_llguidance(tok):
  t = time.perf_counter()
  grammar_lib.lltokenizer(tok)
  build = time.perf_counter() - t
  t = time.perf_counter()
  m = grammar_lib.Grammars(tok).json_schema(SCHEMA).matcher()
  compile_s = time.perf_counter() - t
  times = walk(lambda mask: m.fill(mask, 0), m.advance, tok.vocab_size, tok.eos_id)
  return build, compile_s, times


def bench_xgrammar(tok):
  import xgrammar as xgr
  lltok = grammar_lib.lltokenizer(tok)  # (the bytes of each id, as llguidance reads them)
  tokens = [b'' if lltok.is_special_token(i) else lltok.decode_bytes([i])
            for i in range(tok.vocab_size)]
  t = time.perf_counter()
  info = xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=tok.vocab_size,
                           stop_token_ids=[tok.eos_id])
  compiler = xgr.GrammarCompiler(info, cache_enabled=False)
  build = time.perf_counter() - t
  t = time.perf_counter()
  compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
  m = xgr.GrammarMatcher(compiled)
  compile_s = time.perf_counter() - t
  bitmask = xgr.allocate_token_bitmask(1, tok.vocab_size)

  def fill(mask):
    m.fill_next_token_bitmask(bitmask, 0)
    mask[:] = bitmask.numpy()

  def advance(token):
    assert m.accept_token(token)
    return m.is_terminated()

  return build, compile_s, walk(fill, advance, tok.vocab_size, tok.eos_id)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument('--vocab', type=int, default=32000)
  args = parser.parse_args()
  with tempfile.TemporaryDirectory() as d:
    for name, tok in tokenizers(args.vocab, d):
      for lib, bench in (('llguidance', bench_llguidance), ('xgrammar', bench_xgrammar)):
        try:
          build, compile_s, times = bench(tok)
        except Exception as e:  # noqa: BLE001  (a library that does not take this tokenizer)
          print(f'{lib:10s} {name:22s} failed: {type(e).__name__}: {e}')
          continue
        print(f'{lib:10s} {name:22s} (vocab {tok.vocab_size}) tokenizer {build * 1e3:8.1f} ms, '
              f'schema compile {compile_s * 1e3:7.2f} ms, mask per token median '
              f'{statistics.median(times) * 1e6:7.1f} us, max {max(times) * 1e6:8.1f} us '
              f'({len(times)} tokens)')


if __name__ == '__main__':
  main()
