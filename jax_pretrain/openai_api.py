"""OpenAI's API as the server speaks it (serve.py): the bodies it takes (strict types, no unknown
field), its error JSON, and the answers (a completion's or a chat completion's choices, whole or
as a stream's chunks), rendered from the engine client's sequences and updates.

A stream sends each choice's text as it becomes final (engine/client.py's Update) and, with
logprobs, the tokens that text covers: token offsets are followed incrementally (_tokens), so
that a chunk decodes a few tokens, not the whole completion. A chat stream opens each choice with
its role, as OpenAI's does.
"""
from collections.abc import Iterator
import dataclasses
import functools
import json
import time
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol
import uuid

from fastapi import responses
import pydantic

from jax_pretrain import engine as engine_lib
from jax_pretrain import structured
from jax_pretrain.engine import client as client_lib
from jax_pretrain.engine import grammar as grammar_lib

if TYPE_CHECKING:
  from typing_extensions import TypeIs  # typing's from Python 3.13

MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_N = 128  # choices per request
RETRY_AFTER_S = 1  # a 429's Retry-After
INTERNAL = 'The server had an error while processing your request (it is in the server\'s log).'
# A prompt's logprob of each token after the first, and [(id, logprob) of its top alternatives].
PromptLogprobs = tuple[list[float], list[list[tuple[int, float]]]]


class _Body(pydantic.BaseModel):
  """A request body: strict types, no unknown field, and null for a field its default (OpenAI's
  spec marks the optional fields nullable; the openai SDK sends null for a caller's None)."""
  model_config = pydantic.ConfigDict(extra='forbid', strict=True)

  @pydantic.model_validator(mode='before')
  @classmethod
  def _null_is_the_default(cls, data):
    if isinstance(data, dict):
      return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
    return data


@dataclasses.dataclass(frozen=True)
class Defaults:
  """The model's own sampling defaults (its generation_config.json; workdir.generation_config),
  which a request's explicit values override, as vLLM applies them. max_tokens: a chat's cap when
  the request gives none (None: the rest of the context)."""
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_tokens: int | None = None


class Sampling(_Body):
  """What completions and chat completions share: the model, the choices and their sampling.
  temperature, top_p and top_k: None (absent or null) for the model's default (Defaults)."""
  model: str | None = None
  temperature: float | None = None
  top_p: float | None = None
  top_k: int | None = None  # an extension (0: off)
  n: int = 1
  stream: bool = False
  stream_options: dict | None = None
  stop: str | list[str] | None = None
  seed: int | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  user: str | None = None  # (accepted, as OpenAI's and vLLM's: no effect here)

  def stops(self) -> tuple[str, ...]:
    return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

  def settings(self, defaults: Defaults) -> tuple[float, float, int]:
    """(temperature, top_p, top_k): the request's, else the model's defaults."""
    return (defaults.temperature if self.temperature is None else self.temperature,
            defaults.top_p if self.top_p is None else self.top_p,
            defaults.top_k if self.top_k is None else self.top_k)

  def bias(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """logit_bias as (token id, bias) pairs, each bias clamped to [-100, 100] as vLLM clamps it;
    a key that is not a token id of this model is refused ("1" and "01": one token, the last)."""
    out: dict[int, float] = {}
    for key, value in (self.logit_bias or {}).items():
      try:
        token = int(key)
      except ValueError:
        token = -1
      if not 0 <= token < vocab_size:
        raise APIError(f'logit_bias: {key!r} is not a token id of this model (0 .. '
                       f'{vocab_size - 1})', 'logit_bias')
      out[token] = min(100.0, max(-100.0, float(value)))
    return tuple(out.items())


class CompletionRequest(Sampling):
  """The body of POST /v1/completions."""
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int = 16
  echo: bool = False
  logprobs: int | None = None
  best_of: int | None = None
  suffix: str | None = None


class TextPart(_Body):
  type: Literal['text']
  text: str


class Function(_Body):
  name: str
  arguments: str  # JSON, as the model wrote it


class ToolCall(_Body):
  id: str
  type: Literal['function'] = 'function'
  function: Function


class ChatMessage(_Body):
  """A message of a chat: its content is required but for an assistant's, which may be null (its
  tool_calls said it); a tool's answers the call tool_call_id."""
  role: str  # (any, as vLLM takes it: the template decides what it renders)
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCall] | None = None  # (an assistant's)
  tool_call_id: str | None = None  # (a tool's)
  refusal: str | None = None  # (an assistant's; not rendered)

  @pydantic.model_validator(mode='after')
  def _complete(self) -> 'ChatMessage':
    if self.content is None and self.role != 'assistant':
      raise ValueError(f'a {self.role} message needs its content')
    if self.tool_calls is not None and self.role != 'assistant':
      raise ValueError('only an assistant message has tool_calls')
    if (self.tool_call_id is None) != (self.role != 'tool'):
      raise ValueError('a tool message (and only a tool message) has a tool_call_id')
    return self

  def rendered(self, parts: bool) -> dict:
    """The message as the chat template reads it, as vLLM gives it: content parts as they came
    (a list of {"type": "text", "text": ...}, as transformers passes them) to a template that
    loops over a message's content (parts: content_parts), else their texts joined with
    newlines; a string as it came, null content as ''; a tool call's arguments parsed from JSON
    (templates read them as a mapping)."""
    if isinstance(self.content, list):
      texts = [p.text for p in self.content]
      content: str | list[dict] = ([{'type': 'text', 'text': t} for t in texts] if parts
                                   else '\n'.join(texts))
    else:
      content = self.content or ''
    out: dict = {'role': self.role, 'content': content}
    if self.name is not None:
      out['name'] = self.name
    if self.tool_call_id is not None:
      out['tool_call_id'] = self.tool_call_id
    if self.tool_calls is not None:
      out['tool_calls'] = [{'id': c.id, 'type': c.type, 'function': {
          'name': c.function.name, 'arguments': _arguments(c.function.arguments)}}
                           for c in self.tool_calls]
    return out


def _arguments(text: str):
  """A tool call's arguments as a mapping (vLLM's: templates read them so), or as they came when
  they are not a JSON object."""
  try:
    value = json.loads(text)
  except ValueError:
    return text
  return value if isinstance(value, dict) else text


@functools.lru_cache(maxsize=16)
def content_parts(template_source: str) -> bool:
  """Whether a chat template loops over a message's content (it takes content parts, a list of
  {"type", "text"}) rather than printing it (a string): vLLM's --chat-template-content-format
  auto, by the template's syntax tree."""
  import jinja2  # noqa: PLC0415
  from jinja2 import nodes  # noqa: PLC0415
  try:
    tree = jinja2.Environment(extensions=['jinja2.ext.loopcontrols']).parse(template_source)
  except jinja2.TemplateError:
    return False

  def is_content(node) -> bool:
    return (isinstance(node, nodes.Getattr) and node.attr == 'content') or (
        isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const)
        and node.arg.value == 'content')

  return any(is_content(loop.iter) or (isinstance(loop.iter, nodes.Filter)
                                       and is_content(loop.iter.node))
             for loop in tree.find_all(nodes.For))


class ChatRequest(Sampling):
  """The body of POST /v1/chat/completions. Accepted as vLLM accepts them, with no effect:
  store, metadata, service_tier, prompt_cache_key, safety_identifier, modalities ["text"].
  response_format, tools, tool_choice and parallel_tool_calls: structured.py (structured outputs
  and tool calls, by constrained decoding)."""
  messages: list[ChatMessage]
  max_tokens: int | None = None  # (deprecated by OpenAI for max_completion_tokens)
  max_completion_tokens: int | None = None
  logprobs: bool = False
  top_logprobs: int | None = None
  tools: list[dict] | None = None
  tool_choice: str | dict | None = None
  response_format: dict | None = None
  parallel_tool_calls: bool | None = None
  store: bool | None = None
  metadata: dict[str, str] | None = None
  service_tier: str | None = None
  prompt_cache_key: str | None = None
  safety_identifier: str | None = None
  modalities: list[Literal['text']] | None = None


def is_ids(prompt: list[str] | list[int] | list[list[int]]) -> 'TypeIs[list[int]]':
  """Whether a list prompt is one prompt of token ids (strict validation made its items all of one
  type: the first says which)."""
  return bool(prompt) and isinstance(prompt[0], int)


class APIError(Exception):
  """A request the server refuses: answered as OpenAI's error JSON."""

  def __init__(self, message: str, param: str | None = None, status: int = 400,
               code: str | None = None, kind: str = 'invalid_request_error',
               headers: dict[str, str] | None = None):
    super().__init__(message)
    self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind
    self.headers = headers

  def body(self) -> dict:
    return {'error': {'message': self.message, 'type': self.kind, 'param': self.param,
                      'code': self.code}}

  def response(self) -> responses.JSONResponse:
    return responses.JSONResponse(status_code=self.status, content=self.body(),
                                  headers=self.headers)


def internal() -> APIError:
  """What a client is told of an error of the server's own (its text and traceback: the log)."""
  return APIError(INTERNAL, status=500, kind='server_error')


def stopping() -> APIError:
  return APIError('The server stopped before this request finished; please retry.', status=503,
                  kind='server_error', code='server_stopping')


def busy(max_queued: int) -> APIError:
  """The answer to a request that the queue has no room for: OpenAI's rate-limit error."""
  return APIError(
      f'The server is busy: its queue of sequences waiting for a slot (--max_queued_sequences='
      f'{max_queued}) has no room for this request. Please try again in {RETRY_AFTER_S}s.',
      status=429, kind='requests', code='rate_limit_exceeded',
      headers={'Retry-After': str(RETRY_AFTER_S)})


def check_sampling(r: Sampling, name: str) -> None:
  """Refuses a request for another model, or with choices or sampling the server cannot give."""
  if r.model is not None and r.model != name:
    raise APIError(f'The model `{r.model}` does not exist: this server serves `{name}`.',
                   'model', status=404, code='model_not_found')
  stops = r.stops()
  for ok, param, message in [
      (1 <= r.n <= MAX_N, 'n', f'n must be between 1 and {MAX_N}'),
      (r.temperature is None or 0 <= r.temperature <= 2, 'temperature',
       'temperature must be between 0 and 2'),
      (r.top_p is None or 0 < r.top_p <= 1, 'top_p', 'top_p must be in (0, 1]'),
      (r.top_k is None or r.top_k >= 0, 'top_k', 'top_k must be >= 0 (0: off)'),
      (len(stops) <= MAX_STOP and all(stops), 'stop',
       f'stop takes at most {MAX_STOP} non-empty strings'),
      (-2 <= r.presence_penalty <= 2, 'presence_penalty',
       'presence_penalty must be between -2 and 2'),
      (-2 <= r.frequency_penalty <= 2, 'frequency_penalty',
       'frequency_penalty must be between -2 and 2'),
      (len(r.logit_bias or ()) <= engine_lib.MAX_LOGIT_BIAS, 'logit_bias',
       f'logit_bias takes at most {engine_lib.MAX_LOGIT_BIAS} tokens')]:
    if not ok:
      raise APIError(message, param)


def check_context(prompts: list[list[int]], max_tokens: int, context: int) -> None:
  for ids in prompts:
    if len(ids) + max_tokens > context:
      raise APIError(
          f"This model's maximum context length is {context} tokens, however you requested "
          f'{len(ids) + max_tokens} tokens ({len(ids)} in your prompt; {max_tokens} for the '
          'completion). Please reduce your prompt; or completion length.', 'max_tokens',
          code='context_length_exceeded')


def usage(prompts: list[list[int]], sequences: list[engine_lib.Sequence]) -> dict:
  """A response's usage: each prompt counted once (its n choices share it), and of its tokens
  those whose keys and values the engine's prefix cache gave (its first choice's cached_tokens:
  OpenAI's and vLLM's prompt_tokens_details.cached_tokens)."""
  prompt_tokens = sum(len(ids) for ids in prompts)
  completion_tokens = sum(len(seq.tokens) for seq in sequences)
  n = max(1, len(sequences) // max(1, len(prompts)))
  return {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
          'total_tokens': prompt_tokens + completion_tokens,
          'prompt_tokens_details': {'cached_tokens': sum(seq.cached_tokens
                                                         for seq in sequences[::n])}}


class _Added(NamedTuple):
  """What a token adds to the text: its string ('' while it leaves a character unfinished), its
  bytes (OpenAI's `bytes`: the token's own, an unfinished character's first bytes included) and
  the raw bytes of the unfinished character's tokens after it (b'': none)."""
  text: str
  data: bytes
  pending: bytes


@dataclasses.dataclass(frozen=True)
class _Offsets:
  """Where incremental detokenization stands (vLLM's, as engine/sequence.py's): the text of
  ids[:read] is complete (no unfinished character at its end) and `chars` long; the next tokens
  are decoded after ids[prefix:read] (prefix <= read: the tokens a tokenizer needs before one to
  print it as it prints it in the text, a leading space say), not after all of them. pending:
  the raw bytes of ids[read:] where their text ends in an unfinished character."""
  prefix: int = 0
  read: int = 0
  chars: int = 0
  pending: bytes = b''

  def added(self, tokenizer, ids: list[int], n: int, token: int) -> _Added:
    """What `token` adds after ids[:n - 1] (whose text up to `read` is complete), in place of
    ids[n - 1]: while it leaves a character unfinished, no text and its own bytes (the
    character's first), then with the token that completes it, the whole character and the
    character's other bytes; so that the tokens' strings join into the text and their bytes
    into its UTF-8."""
    new = tokenizer.decode([*ids[self.prefix:n - 1], token])[
        len(tokenizer.decode(ids[self.prefix:self.read])):]
    if not new.endswith('\ufffd'):
      return _Added(new, new.encode()[len(self.pending):], b'')
    pending = grammar_lib.token_bytes(tokenizer, [*ids[self.read:n - 1], token])
    return _Added('', pending[len(self.pending):], pending)

  def then(self, n: int, added: _Added) -> '_Offsets':
    """The offsets once token n - 1 added `added`."""
    if added.text:
      return _Offsets(self.read, n, self.chars + len(added.text))
    return dataclasses.replace(self, pending=added.pending)


class _Token(NamedTuple):
  n: int  # the token is ids[n - 1]
  before: _Offsets  # the offsets before it
  after: _Offsets  # and after it
  end: int  # the length of the text through it (the last one's: to the end of the text)
  data: bytes  # its bytes (_Added.data)


def _tokens(tokenizer, ids: list[int], start: int, offsets: _Offsets) -> Iterator[_Token]:
  """Each token of ids[start:] with the text length through it, given the offsets after
  ids[:start]; a few tokens decoded for each, not all of ids[:n]."""
  for n in range(start + 1, len(ids) + 1):
    added = offsets.added(tokenizer, ids, n, ids[n - 1])
    after = offsets.then(n, added)
    yield _Token(n, offsets, after, after.chars, added.data)
    offsets = after


def _past(token: _Token, text: str) -> bool:
  """Whether a token leaves a character unfinished where the text ends: a character that is not
  the text's (a stop string cut the text before it), or not yet (decoding goes on)."""
  return bool(token.after.pending) and token.end >= len(text)


def _to_the_end(tokens: list[_Token], text: str) -> list[_Token]:
  """tokens, the last one's end at least the text's end (an unfinished character that ended the
  sequence is in its text, as a replacement character)."""
  return [*tokens[:-1], tokens[-1]._replace(end=max(tokens[-1].end, len(text)))] if tokens else []


def _entry(text: str, data: bytes, logprob: float | None) -> dict:
  return {'token': text, 'logprob': logprob, 'bytes': list(data)}


class _Choice:
  """One choice of a response, and what a stream has sent of it: its text, and (with logprobs:
  top, the alternatives per token) its tokens seq.tokens[:sent_tokens], the offsets after them.

  A token's string in the logprobs is the text it adds to the choice's (vLLM's and OpenAI's
  incremental detokenization), so that the strings join into the text: a token that ends inside a
  character adds '' (and its own bytes, the character's first), the one that completes it the
  whole character (and the character's other bytes): the bytes join into the text's UTF-8. A
  token past a stop string adds nothing either, and the last token the rest of the text. An
  alternative's string (and bytes) are what it would have added in the token's place."""

  def __init__(self, index: int, top: int | None):
    self.index, self.top = index, top
    self.sent_text, self.sent_tokens, self.offsets = 0, 0, _Offsets()

  def ends(self, seq: engine_lib.Sequence, tokenizer) -> list[_Token]:
    """All of a sequence's tokens, with logprobs."""
    return [] if self.top is None else _to_the_end(
        list(_tokens(tokenizer, seq.tokens, 0, _Offsets())), seq.text)

  def advance(self, update: client_lib.Update, tokenizer) -> tuple[str, list[_Token], int]:
    """The update's text not sent yet, the tokens that text covers (with logprobs) and the text
    length before the first; now sent."""
    text, start_chars, ends = update.text, self.offsets.chars, []
    if self.top is not None:
      ids = update.seq.tokens[:update.n_tokens]
      for token in _tokens(tokenizer, ids, self.sent_tokens, self.offsets):
        if not update.finish and (token.end > len(text) or _past(token, text)):
          break  # (its text, or its character's, not final yet)
        ends.append(token)
      if ends:
        self.sent_tokens, self.offsets = ends[-1].n, ends[-1].after
      if update.finish:
        ends = _to_the_end(ends, text)
    new, self.sent_text = text[self.sent_text:], len(text)
    return new, ends, start_chars

  def tokens(self, tokenizer, ids: list[int], logprobs: list[float] | list[float | None],
             tops: list | None,
             text: str, start_chars: int, ends: list[_Token]
             ) -> Iterator[tuple[int, str, bytes, float | None,
                                 list[tuple[str, bytes, float]] | None]]:
    """(where its text starts, the text it adds to `text`, its bytes, its logprob, the top
    alternatives' texts, bytes and logprobs, or None) of each token that ends covers;
    tops[n - 1]: token n - 1's alternatives (None: none). A token whose text `text` cuts (a stop
    string) or extends (the last): the bytes of what it adds there."""
    offset = start_chars
    for token in ends:
      n, before, after, end, data = token
      top = None if not tops or tops[n - 1] is None else tops[n - 1][:self.top]
      offset = min(offset, len(text))
      piece = text[offset:min(end, len(text))]
      if end != after.chars or end > len(text):
        data = piece.encode()[len(before.pending):]
      elif _past(token, text):
        data = b''  # (the character it starts is not the text's: a stop string's)
      yield (offset, piece, data, logprobs[n - 1],
             None if top is None else [(*before.added(tokenizer, ids, n, t)[:2], lp)
                                       for t, lp in top])
      offset = end


class CompletionChoice(_Choice):
  """A completion's choice: its text (after the prompt when echoed) and OpenAI's logprobs object
  (tokens, token_logprobs, top_logprobs, text_offset), the prompt's first when echoed."""

  def __init__(self, index: int, prompt: tuple[str, list[int]],
               prompt_logprobs: PromptLogprobs | None, r: CompletionRequest):
    super().__init__(index, r.logprobs)
    (self.prompt_text, self.prompt_ids), self.prompt_logprobs = prompt, prompt_logprobs
    self.echo, self.started = r.echo, False

  def final(self, seq: engine_lib.Sequence, tokenizer) -> dict:
    return {'index': self.index, 'text': (self.prompt_text if self.echo else '') + seq.text,
            'logprobs': self._logprobs(tokenizer, seq, seq.text, 0, self.ends(seq, tokenizer),
                                       self.echo),
            'finish_reason': seq.finish_reason}

  def delta(self, update: client_lib.Update, tokenizer) -> dict:
    """What was not sent yet: the echoed prompt first, then the text that is final so far and
    (with logprobs) the tokens it covers; finish_reason at the end."""
    echo = self.echo and not self.started
    new, ends, start_chars = self.advance(update, tokenizer)
    self.started = True
    return {'index': self.index, 'text': (self.prompt_text if echo else '') + new,
            'logprobs': self._logprobs(tokenizer, update.seq, update.text, start_chars, ends,
                                       echo),
            'finish_reason': update.finish}

  def _logprobs(self, tokenizer, seq, text: str, start_chars: int, ends: list[_Token],
                with_prompt: bool) -> dict | None:
    """The logprobs object of the tokens that ends covers (the text before the first is
    start_chars long), after the prompt's when asked."""
    if self.top is None:
      return None
    out: dict[str, list] = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [],
                            'text_offset': []}

    def add(tokens, base: int = 0):
      for offset, token, _, logprob, top in tokens:
        out['tokens'].append(token)
        out['token_logprobs'].append(logprob)
        out['top_logprobs'].append(None if top is None else {t: lp for t, _, lp in top})
        out['text_offset'].append(base + offset)

    if with_prompt:
      assert self.prompt_logprobs is not None  # (echo with logprobs scores the prompt)
      lps, tops = self.prompt_logprobs
      ids, prompt = self.prompt_ids, self.prompt_text
      add(self.tokens(tokenizer, ids, [None, *lps], [None, *tops], prompt, 0,
                      _to_the_end(list(_tokens(tokenizer, ids, 0, _Offsets())), prompt)))
    add(self.tokens(tokenizer, seq.tokens, seq.logprobs, seq.top_logprobs, text, start_chars,
                    ends), len(self.prompt_text) if self.echo else 0)
    return out


class ChatChoice(_Choice):
  """A chat completion's choice: the assistant's message, and with logprobs OpenAI's chat form
  ({'content': [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}). With a tool
  plan (structured.Plan 'named', 'required' or 'auto') the message's tool_calls, read from the
  text (structured.Calls), and its content ('auto': the text before the calls; else null);
  finish_reason "tool_calls" where calls were asked ('required') or found ('auto')."""

  def __init__(self, index: int, top: int | None,
               plan: structured.Plan = structured.CONTENT):
    super().__init__(index, top)
    self.calls = None if plan.kind == 'content' else structured.Calls(plan)
    self.sent_content = 0  # ('auto': the content's characters sent)

  def _finish(self, reason: str | None, called: bool) -> str | None:
    kind = self.calls.plan.kind if self.calls is not None else 'content'
    tools = kind == 'required' or (kind == 'auto' and called)
    return 'tool_calls' if tools and reason == 'stop' else reason

  def final(self, seq: engine_lib.Sequence, tokenizer) -> dict:
    message: dict = {'role': 'assistant', 'content': seq.text}
    calls = self.calls.whole(seq.text) if self.calls is not None else []
    if self.calls is not None and (calls or self.calls.plan.kind != 'auto'):
      message = {'role': 'assistant', 'content': self.calls.content(seq.text, True) or None,
                 'tool_calls': calls}
    return {'index': self.index, 'message': message,
            'logprobs': self._logprobs(tokenizer, seq, seq.text, 0, self.ends(seq, tokenizer)),
            'finish_reason': self._finish(seq.finish_reason, bool(calls))}

  def delta(self, update: client_lib.Update, tokenizer) -> dict:
    new, ends, start_chars = self.advance(update, tokenizer)
    delta: dict = {'content': new} if new else {}
    if self.calls is not None:
      calls = self.calls.delta(update.text)
      content = self.calls.content(update.text, update.finish is not None)
      if update.finish is not None and not self.calls.ids:
        content = update.text  # ('auto' without a call: all of it is content)
      delta = {'tool_calls': calls} if calls else {}
      if content and len(content) > self.sent_content:
        delta['content'], self.sent_content = content[self.sent_content:], len(content)
    return {'index': self.index, 'delta': delta,
            'logprobs': self._logprobs(tokenizer, update.seq, update.text, start_chars, ends),
            'finish_reason': self._finish(update.finish, bool(self.calls and self.calls.ids))}

  def _logprobs(self, tokenizer, seq, text: str, start_chars: int,
                ends: list[_Token]) -> dict | None:
    if self.top is None:
      return None
    return {'content': [
        {**_entry(token, data, logprob),
         'top_logprobs': [_entry(t, t_data, lp) for t, t_data, lp in top or ()]}
        for _, token, data, logprob, top in self.tokens(tokenizer, seq.tokens, seq.logprobs,
                                                  seq.top_logprobs, text, start_chars, ends)]}


class Answer(Protocol):
  """A request's response: whole, or as a stream's chunks (opening, a delta per update, usage)."""

  def whole(self, sequences: list[engine_lib.Sequence]) -> dict: ...

  def opening(self) -> list[dict]: ...

  def delta(self, update: client_lib.Update) -> dict | None: ...

  def usage(self, sequences: list[engine_lib.Sequence]) -> dict | None: ...


def _header(prefix: str, kind: str, name: str) -> dict:
  return {'id': f'{prefix}-{uuid.uuid4().hex}', 'object': kind, 'created': int(time.time()),
          'model': name}


class CompletionAnswer:
  """A completion's response (Answer): choice i is choice i % n of prompt i // n."""

  def __init__(self, r: CompletionRequest, name: str, prompts: list[tuple[str, list[int]]],
               prompt_logprobs: list[PromptLogprobs | None], tokenizer):
    self.header, self.tokenizer = _header('cmpl', 'text_completion', name), tokenizer
    self.prompts, self.include_usage = [ids for _, ids in prompts], _include_usage(r)
    self.choices = [CompletionChoice(i, prompts[i // r.n], prompt_logprobs[i // r.n], r)
                    for i in range(len(prompts) * r.n)]

  def whole(self, sequences):
    return {**self.header, 'choices': [c.final(seq, self.tokenizer)
                                       for c, seq in zip(self.choices, sequences)],
            'usage': usage(self.prompts, sequences)}

  def opening(self):
    return []

  def delta(self, update):
    chunk = self.choices[update.index].delta(update, self.tokenizer)
    # (a token whose text adds no character still goes out with its logprobs)
    keep = chunk['text'] or chunk['finish_reason'] or (chunk['logprobs'] or {}).get('tokens')
    return {**self.header, 'choices': [chunk]} if keep else None

  def usage(self, sequences):
    return ({**self.header, 'choices': [], 'usage': usage(self.prompts, sequences)}
            if self.include_usage else None)


class ChatAnswer:
  """A chat completion's response (Answer): n choices of one prompt (the rendered messages)."""

  def __init__(self, r: ChatRequest, name: str, prompt: list[int], tokenizer,
               plan: structured.Plan = structured.CONTENT):
    self.header, self.tokenizer = _header('chatcmpl', 'chat.completion', name), tokenizer
    self.chunk_header = {**self.header, 'object': 'chat.completion.chunk'}
    self.prompt, self.include_usage = prompt, _include_usage(r)
    top = (r.top_logprobs or 0) if r.logprobs else None
    self.choices = [ChatChoice(i, top, plan) for i in range(r.n)]
    self.content = None if plan.kind in ('named', 'required') else ''  # (calls: null, OpenAI's)

  def whole(self, sequences):
    return {**self.header, 'choices': [c.final(seq, self.tokenizer)
                                       for c, seq in zip(self.choices, sequences)],
            'usage': usage([self.prompt], sequences)}

  def opening(self):
    return [{**self.chunk_header, 'choices': [{
        'index': c.index, 'delta': {'role': 'assistant', 'content': self.content},
        'logprobs': None,
        'finish_reason': None}]} for c in self.choices]

  def delta(self, update):
    chunk = self.choices[update.index].delta(update, self.tokenizer)
    keep = chunk['delta'] or chunk['finish_reason'] or (chunk['logprobs'] or {}).get('content')
    return {**self.chunk_header, 'choices': [chunk]} if keep else None

  def usage(self, sequences):
    return ({**self.chunk_header, 'choices': [], 'usage': usage([self.prompt], sequences)}
            if self.include_usage else None)


def _include_usage(r: Sampling) -> bool:
  return bool((r.stream_options or {}).get('include_usage'))
