"""A request to the engine and what it decodes: Sequence, and its incremental detokenization."""
import dataclasses
from typing import Any, Callable

STOPPED = 'the engine stopped before this sequence finished'  # Sequence.error when it did


@dataclasses.dataclass(eq=False)
class Sequence:
  """One generation: what was asked, then what the engine fills in as it decodes."""
  prompt: list[int]
  max_new_tokens: int
  temperature: float = 0.0  # 0: greedy
  top_k: int = 0  # 0: no top-k cut
  top_p: float = 1.0  # 1.0: no nucleus cut
  seed: int = 0
  stream: int = 0  # index among the choices of one request: the same seed, other samples
  stop: tuple[str, ...] = ()  # the text ends before the first of these
  presence_penalty: float = 0.0  # subtracted from the logit of each token it has generated
  frequency_penalty: float = 0.0  # × the times it has generated the token, subtracted
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), MAX_LOGIT_BIAS
  alternatives: bool = False  # fill top_logprobs (the TOP_N most likely tokens at each step)
  # Its grammar's matcher (engine/grammar.py: a structured output or a tool call), or None: every
  # token it samples is one the matcher allows; it ends ('stop') when the grammar is complete.
  grammar: Any = None
  # Called on new text and at the end, from the engine's thread (from stop()'s for a sequence
  # still waiting then). One that raises fails its sequence (engine/output.py).
  on_update: Callable[['Sequence'], None] | None = None
  # Filled by the engine.
  cached_tokens: int = 0  # prompt tokens whose keys and values a cached prefix gave (not run)
  tokens: list[int] = dataclasses.field(default_factory=list)  # new tokens, EOS excluded
  logprobs: list[float] = dataclasses.field(default_factory=list)  # of each new token
  eos_logprob: float | None = None  # of the EOS that ended it, if one did (GRPO trains on it)
  top_logprobs: list[list[tuple[int, float]]] = dataclasses.field(default_factory=list)
  text: str = ''  # the decoded new tokens, cut before a stop string
  finish_reason: str | None = None  # 'stop' (EOS or stop string) | 'length' | 'cancelled' | 'error'
  error: str = ''
  cancelled: bool = False  # set by the caller (a client went away): dropped at the next chunk
  # Incremental detokenization: the text of tokens[:_read] is _decoded; _prefix <= _read starts
  # the few tokens decoded again to continue it (a tokenizer may print a token differently at the
  # start of a text), so that a chunk decodes a handful of tokens, not the whole sequence.
  _decoded: str = dataclasses.field(default='', repr=False)
  _prefix: int = dataclasses.field(default=0, repr=False)
  _read: int = dataclasses.field(default=0, repr=False)

  @property
  def done(self) -> bool:
    return self.finish_reason is not None

  @property
  def read(self) -> int:
    """Tokens whose text detokenize has settled (the text of tokens[:read] is final)."""
    return self._read

  def stable_text(self) -> str:
    """The text that later tokens will not change, for streaming: while decoding, holds back an
    unfinished UTF-8 character and an ending that may be the start of a stop string."""
    text = self.text
    if self.done:
      return text
    keep = len(text.rstrip('\ufffd'))
    for s in self.stop:
      for k in range(min(len(s) - 1, len(text)), 0, -1):
        if text.endswith(s[:k]):
          keep = min(keep, len(text) - k)
          break
    return text[:keep]

  def detokenize(self, tokenizer, final: bool = False) -> str:
    """The text of self.tokens, decoding only the tokens since the last call (and the few before
    them that the tokenizer needs to continue the text). An unfinished UTF-8 character at the end
    is left out of the text (the text before it is there, for stop strings and streaming) and its
    tokens are decoded again with the next ones. final: the whole sequence, decoded once."""
    if final:
      self._decoded = tokenizer.decode(self.tokens)
      self._prefix = self._read = len(self.tokens)
      return self._decoded
    window = tokenizer.decode(self.tokens[self._prefix:])
    new = window[len(tokenizer.decode(self.tokens[self._prefix:self._read])):]
    if new.endswith('\ufffd'):  # an unfinished character: its bytes come with the next tokens
      return self._decoded + new.rstrip('\ufffd')
    self._decoded += new
    self._prefix, self._read = self._read, len(self.tokens)
    return self._decoded
