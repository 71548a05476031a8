"""Constrained decoding: a grammar (a JSON schema, any JSON object, a tool call) that each sampled
token of a sequence must keep, with llguidance (chosen by measurement: BENCHMARKS.md).

`Grammars(tokenizer)` builds the library's tokenizer once (from our tokenizer as a tokenizer.json:
data/tokenizer.py's byte, sentencepiece and tokenizer.json kinds; bare ids have no text, so no
grammar) and compiles a request's grammar (`json_schema`, `lark`): a schema the library cannot
compile is a GrammarError naming what it could not compile (serve: a 400). A `Matcher` is one
sequence's state: before each token the engine asks it for its mask (`fill`: a row of a bitmask,
bit i of word i // 32 set when id i is allowed; the device sets the logits of the others to -inf
before sampling: sampling.penalized), and after each token the output processor advances it
(`advance`); the sequence ends ('stop') when the grammar is complete (no token can follow, or it
accepted the EOS it allowed).
"""
import functools
import json

import llguidance
import llguidance.numpy
import numpy as np

from jax_pretrain.data import tokenizer_json
from jax_pretrain.data.errors import DataError
from jax_pretrain.errors import UserError


class GrammarError(UserError):
  """A grammar the library cannot compile, or a tokenizer it cannot constrain."""


def words(vocab_size: int) -> int:
  """int32 words of one row's bitmask."""
  return (vocab_size + 31) // 32


@functools.lru_cache(maxsize=8)
def lltokenizer(tokenizer):
  """llguidance's tokenizer of ours, read from our tokenizer as a tokenizer.json
  (data/tokenizer_json.convert: a byte tokenizer, a sentencepiece model or a tokenizer.json,
  with our special tokens at their ids), which gives it the bytes of every id; about a second for
  a large vocabulary: kept."""
  try:
    tok, _ = tokenizer_json.convert(tokenizer)
  except DataError as e:
    raise GrammarError(f'{e}: this model cannot be constrained to a grammar') from None
  return llguidance.LLTokenizer(tok.to_str(), n_vocab=tokenizer.vocab_size,
                                eos_token=tokenizer.eos_id)


_VALUES = frozenset({'const', 'enum', 'default', 'examples'})  # (JSON values, not schemas)


def closed(schema):
  """The schema with `additionalProperties: false` in each object schema that lists properties
  and says nothing of others, as vLLM decodes it (its default backend xgrammar's strict mode;
  its guidance backend's disable_additional_properties): the keys a client's schema names, not
  keys of the model's choosing, which a pydantic model or a tool's parameters written without
  `extra='forbid'` leave open (LangChain's with_structured_output by function calling,
  bind_tools)."""
  if isinstance(schema, list):
    return [closed(s) for s in schema]
  if not isinstance(schema, dict):
    return schema
  out = {k: v if k in _VALUES else closed(v) for k, v in schema.items()}
  if ('properties' in out or 'patternProperties' in out) and 'additionalProperties' not in out:
    out['additionalProperties'] = False
  return out


def token_bytes(tokenizer, ids: list[int]) -> bytes:
  """The bytes ids stand for, each token's own (an unfinished UTF-8 character's included, which
  decode shows as U+FFFD), special tokens and ids past the vocabulary left out as decode leaves
  them out: the logprobs' `bytes` (openai_api.py); b'' for a tokenizer the library cannot read."""
  lltok = _readable(tokenizer)
  if lltok is None:
    return b''
  return lltok.decode_bytes([int(i) for i in ids if 0 <= int(i) < lltok.vocab_size
                             and not lltok.is_special_token(int(i))])


@functools.lru_cache(maxsize=8)
def _readable(tokenizer):
  """lltokenizer(tokenizer), or None where it cannot be built (kept: not tried again)."""
  try:
    return lltokenizer(tokenizer)
  except GrammarError:
    return None


class Grammars:
  """Compiles grammars for one tokenizer (the module docstring)."""

  def __init__(self, tokenizer):
    self.tokenizer = tokenizer
    self.vocab_size = tokenizer.vocab_size

  def json_schema(self, schema: dict | bool, what: str = 'the schema') -> 'Grammar':
    """A grammar of the JSON values that `schema` validates (compact: no whitespace between
    tokens, as vLLM's default; objects closed, `closed`), or a GrammarError naming `what`."""
    try:
      grammar = llguidance.LLMatcher.grammar_from_json_schema(
          json.dumps(closed(schema)), defaults={'whitespace_flexible': False})
    except ValueError as e:
      raise GrammarError(f'{what} is not a JSON schema the grammar library can compile: '
                         f'{e}') from None
    return self._grammar(grammar, what)

  def lark(self, lark: str, what: str) -> 'Grammar':
    """A grammar in llguidance's Lark syntax (a tool call's framing around a schema, %json)."""
    return self._grammar(llguidance.LLMatcher.grammar_from_lark(lark), what)

  def _grammar(self, grammar: str, what: str) -> 'Grammar':
    lltok = lltokenizer(self.tokenizer)
    error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, lltok)
    if error:
      raise GrammarError(f'{what} is not a JSON schema the grammar library can compile: '
                         f'{messages[0] if messages else "invalid"}')
    return Grammar(lltok, grammar)


class Grammar:
  """A compiled grammar: each sequence that keeps it gets its own Matcher."""

  def __init__(self, lltok, grammar: str):
    self._lltok, self._grammar = lltok, grammar

  def matcher(self) -> 'Matcher':
    return Matcher(self._lltok, self._grammar)


class Matcher:
  """One sequence's place in its grammar (the module docstring)."""

  def __init__(self, lltok, grammar: str):
    self._m = llguidance.LLMatcher(lltok, grammar, log_level=0)
    self._row_1xW = np.zeros((1, words(lltok.vocab_size)), np.int32)
    self._check()

  def fill(self, bitmask_RxW: np.ndarray, row: int) -> None:
    """Writes the ids allowed next into row `row` of an int32 bitmask [rows, words] (the model's
    vocabulary, which may be wider than the tokenizer's: ids past it are not allowed)."""
    llguidance.numpy.fill_next_token_bitmask(self._m, self._row_1xW, 0)
    self._check()
    bitmask_RxW[row] = 0
    bitmask_RxW[row, :self._row_1xW.shape[1]] = self._row_1xW[0]

  def advance(self, token: int) -> bool:
    """Takes the sampled token; returns whether the grammar is complete (nothing may follow)."""
    self._m.consume_token(token)
    self._check()
    return self._m.is_stopped()

  def _check(self) -> None:
    if self._m.is_error():
      raise GrammarError(f'the grammar matcher failed: {self._m.get_error()}')
