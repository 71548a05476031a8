"""An OpenAI-compatible completions server for a trained run.

  python -m jax_pretrain.serve --workdir=runs/x [--step=N] [--port=8000] [--host=127.0.0.1]
      [--slots=16] [--context=0] [--chunk=8] [--model_name=NAME] [--warmup]
      [--max_sequences_per_request=256] [--max_queued_sequences=256] [--api_key=KEY]
      [--stall_timeout=300] [--shutdown_timeout=20]

Endpoints (FastAPI, served by uvicorn):
- POST /v1/completions: OpenAI's completions API. `prompt` (a string, a list of strings, a list
  of token ids or a list of such lists), `max_tokens` (default 16), `temperature` (default 1; 0 is
  greedy), `top_p`, `top_k` (an extension; 0: off), `n` choices per prompt, `stop` (up to 4
  strings), `seed`, `stream` (server-sent events, `stream_options.include_usage`), `echo`,
  `logprobs` (0..5 alternatives per token). Penalties, logit_bias, suffix and best_of != n are
  refused with 400 rather than ignored.
- GET /v1/models, GET /health (with the engine's slots, queue and compiled shapes; 503 with
  OpenAI's error JSON saying why when the engine is not running, or when it is stalled: below).

Requests are decoded by one engine.Engine in a thread of its own: whatever arrives while others
decode joins them at the next chunk of tokens (continuous batching over a KV cache of --slots rows
of --context tokens, allocated once). An empty prompt starts a new document (EOS). A request with
a seed gets the same text whatever else is being decoded; choice i of n uses the seed's stream i.

The event loop only routes: every tokenizer call (a prompt's encoding, the text of the logprobs'
tokens, a stream's deltas) and the rendering of a whole response run in worker threads
(asyncio.to_thread), and the engine's callback only hands the loop a snapshot of its sequence
(_Update), so that /health and new requests are answered at once while others are prepared.

Backpressure: the sequences waiting for a slot, over all requests, are --max_queued_sequences at
most (default 256). A request whose sequences would pass it is refused whole with 429 and OpenAI's
rate-limit error (type `requests`, code `rate_limit_exceeded`) and `Retry-After: 1`, which the
official clients retry after that second; nothing is queued without bound, so memory and the wait
of an accepted request stay bounded whatever the traffic. While the queue is full a completion is
refused at the door (_Guard), before its body is read: under a flood most requests are refused,
and each costs the event loop next to nothing. Otherwise the check and the submits run on the
event loop with no await between them: two requests cannot both take the last places.

Bad requests get OpenAI's error JSON ({"error": {"message", "type", "param", "code"}}) with status
400 (404 for an unknown model or path), and the server goes on serving. A request may ask for
--max_sequences_per_request sequences (prompts × n) at most (default 256: one request cannot hold
the engine for everyone else; --max_queued_sequences must hold one such request). With --api_key
(or the environment variable JAX_PRETRAIN_API_KEY, which keeps the key out of `ps`), every /v1
request needs `Authorization: Bearer KEY` (401 without it, as vLLM's --api-key; the OpenAI client
sends its api_key so); /health stays open.

A client that goes away cancels its sequences, which leave the engine at its next chunk (or when
they would have been admitted): a stream's when Starlette sees the disconnect, a whole response's
when the ASGI receive channel says http.disconnect (watched while the request waits).

Failures: nothing that goes wrong reaches a client as exception text; it gets OpenAI's error JSON
with a generic message (500, server_error) and the traceback goes to the server's log (absl). The
engine's thread is supervised (engine/core.py's docstring): a request whose callback raises
fails alone; a decoding step that raises fails the requests decoding in it (500) and the engine
goes on; after engine.MAX_FAILURES (3) steps failed in a row, none succeeding between them, the
engine is broken, not a request: every request still waiting fails (503), /health answers 503,
and the server exits with status 1 and one `error:` line (for a supervisor to restart it) rather
than serving errors. An engine whose step hangs raises nothing: /health answers 503 (code
`engine_stalled`) once the engine has had work and generated no token for --stall_timeout seconds
(default 300, longer than a compile of a new shape; after `--warmup` no call waits for one), for
a supervisor's liveness probe; the engine's progress is looked at by /health and by each submit
(which starts the clock of an engine that was idle).

Stopping (Ctrl-C, SIGTERM): no new connections; the requests in flight have --shutdown_timeout
seconds (default 20) to finish, then Server.give_up fails every one still waiting with 503 ("the
server stopped before this request finished"; the openai client retries it), whether or not the
engine's step ever returns, and uvicorn cancels what is left a moment later
(timeout_graceful_shutdown); the engine's thread gets a few seconds to end. A second Ctrl-C quits
at once. Server.stop fails whatever is still waiting or decoding with 503 and refuses new requests
with 503, so that no request is left hanging.
"""
import asyncio
import contextlib
import dataclasses
import json
import math
import secrets
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable
import uuid
import weakref

from absl import logging
import fastapi
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses
import jax
import numpy as np
import pydantic
from starlette import exceptions as starlette_exceptions
import uvicorn

from jax_pretrain import cli
from jax_pretrain import engine as engine_lib
from jax_pretrain import sample as sample_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.errors import UserError

if TYPE_CHECKING:
  from typing_extensions import TypeIs  # typing's from Python 3.13

MAX_STOP = 4  # stop strings per request, as OpenAI
MAX_N = 128  # choices per request
MAX_SEQUENCES = 256  # prompts × n per request (--max_sequences_per_request)
MAX_QUEUED = 256  # sequences waiting for a slot, over all requests (--max_queued_sequences)
RETRY_AFTER_S = 1  # a 429's Retry-After
STALL_TIMEOUT_S = 300.0  # work and no new token this long: /health 503 (--stall_timeout)
SHUTDOWN_TIMEOUT_S = 20.0  # a shutdown's time for the requests in flight (--shutdown_timeout)
FORCE_AFTER_S = 2.0  # then uvicorn cancels what is left (answered 503 by then, but for a client
# that does not read its answer), and the engine's thread gets this long again to end
# An idle keep-alive connection is closed after this long: longer than clients keep theirs (httpx,
# the openai client's: 5 s, uvicorn's own default), so that the server never closes one as a
# client sends on it (a POST lost to "connection closed": 596 of 22,440 at 10 x load with 5 s).
KEEP_ALIVE_S = 75
API_KEY_ENV = 'JAX_PRETRAIN_API_KEY'  # the key when --api_key is not given
POLL_S = 1.0  # a request waiting on the engine looks at its sequences this often, update or not
# What a waiting request hears besides its sequences' _Updates: its client went away (the
# non-streamed response is not sent), or the shutdown's deadline passed (Server.give_up).
DISCONNECTED, GIVE_UP = 'disconnected', 'give up'
# A prompt's logprob of each token after the first, and [(id, logprob) of its top alternatives].
PromptLogprobs = tuple[list[float], list[list[tuple[int, float]]]]
INTERNAL = 'The server had an error while processing your request (it is in the server\'s log).'


class CompletionRequest(pydantic.BaseModel):
  """The body of POST /v1/completions: strict types, no unknown fields."""
  model_config = pydantic.ConfigDict(extra='forbid', strict=True)
  model: str | None = None
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = 16
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  n: int = 1
  stream: bool = False
  stream_options: dict | None = None
  stop: str | list[str] | None = None
  seed: int | None = None
  echo: bool = False
  logprobs: int | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict | None = None
  best_of: int | None = None
  suffix: str | None = None
  user: str | None = None


def _is_ids(prompt: list[str] | list[int] | list[list[int]]) -> 'TypeIs[list[int]]':
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


def _internal() -> APIError:
  """What a client is told of an error of the server's own (its text and traceback: the log)."""
  return APIError(INTERNAL, status=500, kind='server_error')


def _stopping() -> APIError:
  return APIError('The server stopped before this request finished; please retry.', status=503,
                  kind='server_error', code='server_stopping')


def _failed(seq: engine_lib.Sequence) -> APIError:
  """What a client is told of a sequence that ended with 'error' (the engine logged why)."""
  return _stopping() if seq.error == engine_lib.STOPPED else _internal()


class Server:
  """The engine, its supervised thread, and what a request needs: the tokenizer, the model's
  name, the limits (see the flags), the timeouts and the API key ('' or None: none asked)."""

  def __init__(self, engine: engine_lib.Engine, name: str, *,
               max_sequences: int = MAX_SEQUENCES, max_queued: int = MAX_QUEUED,
               api_key: str | None = None, stall_timeout: float = STALL_TIMEOUT_S,
               shutdown_timeout: float = SHUTDOWN_TIMEOUT_S):
    self.engine, self.name = engine, name
    self.tokenizer = engine.tokenizer
    self.max_sequences, self.max_queued, self.api_key = max_sequences, max_queued, api_key or None
    self.stall_timeout, self.shutdown_timeout = stall_timeout, shutdown_timeout
    self.created = int(time.time())
    self.failure: BaseException | None = None  # why the engine's thread ended on its own
    self.on_failure: Callable[[], None] = lambda: None  # then called (serve: the server exits)
    self._thread = threading.Thread(target=self._run_engine, name='engine', daemon=True)
    # The update queues of the requests waiting on the engine (for give_up).
    self._waiting: weakref.WeakSet[asyncio.Queue] = weakref.WeakSet()
    # The engine's tokens_generated when last looked at, and since when it has not moved while
    # the engine had work (the time it was last seen to move, or idle).
    self._tokens, self._progress_at = -1, time.monotonic()

  def start(self) -> None:
    self._thread.start()

  def stop(self) -> None:
    """Stops the engine: requests still waiting fail at once, those decoding after the current
    chunk (503, engine.STOPPED), and new ones are refused (503). Waits FORCE_AFTER_S at most for
    the engine's thread (a daemon: a step that hangs does not keep the process)."""
    self.engine.stop()
    if self._thread.is_alive():
      self._thread.join(timeout=FORCE_AFTER_S)

  def give_up(self) -> None:
    """The shutdown's deadline: stops the engine, and every request still waiting on it fails
    now (503), whether or not the engine's current step ever ends."""
    self.engine.stop()
    for updates in list(self._waiting):
      updates.put_nowait(GIVE_UP)

  def stalled_for(self) -> float:
    """Seconds the engine has had work without generating a token (0 while idle or moving)."""
    stats, now = self.engine.stats(), time.monotonic()
    if not (stats['busy'] or stats['waiting']) or stats['tokens_generated'] != self._tokens:
      self._tokens, self._progress_at = stats['tokens_generated'], now
    return now - self._progress_at

  def not_running(self) -> str | None:
    """Why the engine serves no request (for /health's 503), or None while it does."""
    if self.failure is not None:
      return "the engine failed and stopped (the server's log says why)"
    if self.engine.stopped:
      return 'the server is stopping'
    if not self._thread.is_alive():
      return 'the engine is not running'
    return None

  def _run_engine(self) -> None:
    """The engine's thread: run_forever until stop(). Should it end otherwise (it gave up after
    failing steps, or its loop has a bug), the error is logged and kept, and on_failure called."""
    try:
      self.engine.run_forever()
    except BaseException as e:  # noqa: BLE001  (logged, then the server exits)
      self.failure = e
      logging.exception('the engine stopped: %s', e)
      self.on_failure()

  def prompts(self, r: CompletionRequest) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt of the request."""
    p: list[str] | list[list[int]]
    if isinstance(r.prompt, str):
      p = [r.prompt]
    elif _is_ids(r.prompt):
      p = [r.prompt]
    else:
      p = r.prompt
    if not p:
      raise APIError('prompt must not be empty', 'prompt')
    if len(p) * r.n > self.max_sequences:  # before encoding any of them
      raise APIError(
          f'This request asks for {len(p) * r.n} sequences ({len(p)} prompts × n = {r.n}); this '
          f'server decodes at most {self.max_sequences} per request '
          '(--max_sequences_per_request). Please split it.', 'n' if r.n > 1 else 'prompt',
          code='too_many_sequences')
    out = []
    for item in p:
      if isinstance(item, str):
        out.append((item, [int(t) for t in sample_lib.encode_prompt(self.tokenizer, item)]))
      elif not item or not all(0 <= t < self.tokenizer.vocab_size for t in item):
        raise APIError(f'token prompts need ids in [0, {self.tokenizer.vocab_size})', 'prompt')
      else:
        out.append((self.tokenizer.decode(item), list(item)))
    return out

  def check(self, r: CompletionRequest, prompts) -> int:
    """Refuses what cannot be served; returns max_tokens."""
    if r.model is not None and r.model != self.name:
      raise APIError(f'The model `{r.model}` does not exist: this server serves `{self.name}`.',
                     'model', status=404, code='model_not_found')
    max_tokens = 16 if r.max_tokens is None else r.max_tokens
    stops = _stops(r)
    for ok, param, message in [
        (max_tokens >= 0, 'max_tokens', 'max_tokens must be >= 0'),
        (1 <= r.n <= MAX_N, 'n', f'n must be between 1 and {MAX_N}'),
        (0 <= r.temperature <= 2, 'temperature', 'temperature must be between 0 and 2'),
        (0 < r.top_p <= 1, 'top_p', 'top_p must be in (0, 1]'),
        (r.top_k >= 0, 'top_k', 'top_k must be >= 0 (0: off)'),
        (r.logprobs is None or 0 <= r.logprobs <= engine_lib.TOP_N, 'logprobs',
         f'logprobs must be between 0 and {engine_lib.TOP_N}'),
        (len(stops) <= MAX_STOP and all(stops), 'stop',
         f'stop takes at most {MAX_STOP} non-empty strings'),
        (r.presence_penalty == r.frequency_penalty == 0, 'presence_penalty',
         'presence and frequency penalties are not supported'),
        (not r.logit_bias, 'logit_bias', 'logit_bias is not supported'),
        (r.suffix is None, 'suffix', 'suffix is not supported'),
        (r.best_of is None or r.best_of == r.n, 'best_of', 'best_of other than n is not supported'),
    ]:
      if not ok:
        raise APIError(message, param)
    context = self.engine.context
    for _, ids in prompts:
      if len(ids) + max_tokens > context:
        raise APIError(
            f"This model's maximum context length is {context} tokens, however you requested "
            f'{len(ids) + max_tokens} tokens ({len(ids)} in your prompt; {max_tokens} for the '
            'completion). Please reduce your prompt; or completion length.', 'max_tokens',
            code='context_length_exceeded')
    return max_tokens

  async def complete(self, r: CompletionRequest, request: fastapi.Request):
    prompts = await asyncio.to_thread(self.prompts, r)
    max_tokens = self.check(r, prompts)
    loop = asyncio.get_running_loop()
    updates: asyncio.Queue = asyncio.Queue()
    seed = secrets.randbits(32) if r.seed is None else r.seed

    def on_update(seq):  # in the engine thread; without a stream only the end matters
      if r.stream or seq.done:
        loop.call_soon_threadsafe(updates.put_nowait, _Update(seq))

    sequences = [engine_lib.Sequence(
        ids, max_tokens, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, seed=seed,
        stream=j, stop=_stops(r), alternatives=r.logprobs is not None, on_update=on_update)
        for _, ids in prompts for j in range(r.n)]
    self._submit(sequences)
    self._waiting.add(updates)
    try:
      prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)
      if r.echo and r.logprobs is not None:  # (while the engine decodes)
        prompt_logprobs = [await asyncio.to_thread(self._prompt_logprobs, ids)
                           for _, ids in prompts]
    except BaseException:
      _cancel(sequences)
      raise
    choices = [_Choice(i, prompts[i // r.n], prompt_logprobs[i // r.n], r)
               for i in range(len(sequences))]
    header = {'id': f'cmpl-{uuid.uuid4().hex}', 'object': 'text_completion',
              'created': int(time.time()), 'model': self.name}
    if r.stream:
      return responses.StreamingResponse(
          self._events(r, header, sequences, choices, updates, prompts),
          media_type='text/event-stream')
    watcher = asyncio.create_task(_watch_disconnect(request, updates))
    try:
      while not all(seq.done for seq in sequences):
        if any(seq.finish_reason == 'error' for seq in sequences):
          break
        update = await _next(updates)
        if update == DISCONNECTED:  # nobody to answer: the finally cancels its sequences
          return responses.Response(status_code=499)  # (nginx's "client closed request")
        if update == GIVE_UP:
          raise _stopping()
    finally:
      watcher.cancel()
      _cancel(sequences)
    for seq in sequences:
      if seq.finish_reason == 'error':
        raise _failed(seq)
    return await asyncio.to_thread(self._response, header, choices, sequences, prompts)

  def _submit(self, sequences: list[engine_lib.Sequence]) -> None:
    """Queues a request's sequences, or refuses them all: 429 when they would take the queue past
    max_queued, 503 once the engine is stopped. (On the event loop with no await from the check
    to the submits: no other request queues in between.)"""
    self.stalled_for()  # an engine that was idle starts its stall clock now
    if len(sequences) > self.queue_room():
      raise self.busy()
    try:
      for seq in sequences:
        self.engine.submit(seq)
    except engine_lib.EngineStopped:
      _cancel(sequences)
      raise _stopping() from None

  def queue_room(self) -> int:
    """Sequences the queue takes before a request gets 429."""
    return self.max_queued - len(self.engine.scheduler.waiting)  # (each request, 429s included)

  def busy(self) -> APIError:
    """The answer to a request that the queue has no room for: OpenAI's rate-limit error."""
    return APIError(
        f'The server is busy: its queue of sequences waiting for a slot (--max_queued_sequences='
        f'{self.max_queued}) has no room for this request. Please try again in {RETRY_AFTER_S}s.',
        status=429, kind='requests', code='rate_limit_exceeded',
        headers={'Retry-After': str(RETRY_AFTER_S)})

  def _response(self, header, choices, sequences, prompts) -> responses.JSONResponse:
    """The whole answer, rendered: its text, logprobs (detokenized) and JSON, in a worker thread."""
    return responses.JSONResponse({
        **header, 'choices': [c.final(seq, self.tokenizer) for c, seq in zip(choices, sequences)],
        'usage': _usage(prompts, sequences)})

  async def _events(self, r, header, sequences, choices, updates, prompts):
    """Server-sent events: a chunk per choice as its text grows, then the usage if asked, then
    [DONE]; a failure, one error event (as OpenAI's error JSON) instead. A client that goes away
    cancels its sequences."""
    try:
      pending = {id(seq): i for i, seq in enumerate(sequences)}
      while pending:
        update = await _next(updates)
        if update == GIVE_UP:
          yield _event(_stopping().body())
          return
        if not isinstance(update, _Update):  # no news: a sequence may have ended without an update
          ended = [seq for seq in sequences if id(seq) in pending and seq.done]
          if not ended:
            continue
          update = _Update(ended[0])
        if id(update.seq) not in pending:
          continue
        if update.finish == 'error':
          yield _event(_failed(update.seq).body())
          return
        chunk = await asyncio.to_thread(choices[pending[id(update.seq)]].delta, update,
                                        self.tokenizer)
        if chunk['text'] or chunk['finish_reason']:
          yield _event({**header, 'choices': [chunk]})
        if chunk['finish_reason']:
          del pending[id(update.seq)]
      if (r.stream_options or {}).get('include_usage'):
        yield _event({**header, 'choices': [], 'usage': _usage(prompts, sequences)})
      yield 'data: [DONE]\n\n'
    except Exception:  # noqa: BLE001  (the response has started: told in the stream)
      logging.exception('a streamed completion failed')
      yield _event(_internal().body())
    finally:
      _cancel(sequences)

  def _prompt_logprobs(self, ids: list[int]) -> PromptLogprobs:
    """(logprob, top alternatives) of each prompt token after the first, by one scoring pass."""
    T = engine_lib.bucket(len(ids), self.engine.context, engine_lib.MIN_BUCKET)
    tokens_1xT1 = np.full((1, T + 1), self.tokenizer.pad_id, np.int32)
    tokens_1xT1[0, :len(ids)] = ids
    logprob_1xT, _, (top_lp_1xTxN, top_ids_1xTxN) = jax.device_get(
        self.engine.score(tokens_1xT1, top_n=engine_lib.TOP_N))
    n = len(ids) - 1
    return (logprob_1xT[0, :n].tolist(),
            [list(zip(i, lp)) for i, lp in zip(top_ids_1xTxN[0, :n].tolist(),
                                                top_lp_1xTxN[0, :n].tolist())])


class _Choice:
  """One choice of a response: its text (after the prompt when echoed) and logprobs, whole or as
  the deltas of a stream. Token offsets are followed incrementally (_text_ends): a stream decodes
  a few tokens a chunk, not the whole completion."""

  def __init__(self, index: int, prompt: tuple[str, list[int]], prompt_logprobs, r):
    self.index, (self.prompt_text, self.prompt_ids) = index, prompt
    self.prompt_logprobs, self.echo, self.logprobs = prompt_logprobs, r.echo, r.logprobs
    self.started, self.sent_text = False, 0
    # With logprobs: the tokens sent, seq.tokens[:sent_tokens], and the length of their text.
    self.sent_tokens, self.sent_chars = 0, 0

  def final(self, seq: engine_lib.Sequence, tokenizer) -> dict:
    ends = list(_text_ends(tokenizer, seq.tokens, 0, 0)) if self.logprobs is not None else []
    return {'index': self.index, 'text': (self.prompt_text if self.echo else '') + seq.text,
            'logprobs': self._logprobs(tokenizer, seq, 0, ends, self.echo),
            'finish_reason': seq.finish_reason}

  def delta(self, update: '_Update', tokenizer) -> dict:
    """What was not sent yet: the echoed prompt first, then the text that is final so far and
    (with logprobs) the tokens it covers; finish_reason at the end."""
    seq, text = update.seq, update.text
    ends: list[tuple[int, int]] = []  # (n, the text length of tokens[:n]) of the tokens covered
    if self.logprobs is not None:
      for n, length in _text_ends(tokenizer, seq.tokens[:update.n_tokens], self.sent_tokens,
                                  self.sent_chars):
        if not update.finish and length > len(text):
          break
        ends.append((n, length))
    echo = self.echo and not self.started
    out = {'index': self.index,
           'text': (self.prompt_text if echo else '') + text[self.sent_text:],
           'logprobs': self._logprobs(tokenizer, seq, self.sent_chars, ends, echo),
           'finish_reason': update.finish}
    self.started, self.sent_text = True, len(text)
    if ends:
      self.sent_tokens, self.sent_chars = ends[-1]
    return out

  def _logprobs(self, tokenizer, seq, start_chars: int, ends: list[tuple[int, int]],
                with_prompt: bool) -> dict | None:
    """OpenAI's logprobs object for the new tokens that ends covers ((n, the text length of
    tokens[:n]) for each, _text_ends'; the text before the first is start_chars long), after the
    prompt's when asked."""
    if self.logprobs is None:
      return None
    ids, logprobs, tops = seq.tokens, seq.logprobs, seq.top_logprobs
    out: dict[str, list] = {'tokens': [], 'token_logprobs': [], 'top_logprobs': [],
                            'text_offset': []}

    def add(token, logprob, top, offset):
      out['tokens'].append(tokenizer.decode([token]))
      out['token_logprobs'].append(logprob)
      out['top_logprobs'].append(
          None if top is None else {tokenizer.decode([t]): lp for t, lp in top[:self.logprobs]})
      out['text_offset'].append(offset)

    if with_prompt:
      lps, prompt_tops = self.prompt_logprobs
      offset = 0
      for (k, token), (_, after) in zip(enumerate(self.prompt_ids),
                                        _text_ends(tokenizer, self.prompt_ids, 0, 0)):
        add(token, lps[k - 1] if k else None, prompt_tops[k - 1] if k else None, offset)
        offset = after
    base = len(self.prompt_text) if self.echo else 0
    offset = start_chars
    for n, after in ends:
      add(ids[n - 1], logprobs[n - 1], tops[n - 1], base + offset)
      offset = after
    return out


class _Update:
  """A sequence's state when the engine reported it (in the engine thread, which goes on
  appending): its final-so-far text, its finish reason, its token count. A stream sends one
  chunk per update, so the text arrives as it is decoded."""

  def __init__(self, seq: engine_lib.Sequence):
    self.seq, self.finish = seq, seq.finish_reason
    self.text, self.n_tokens = seq.stable_text(), len(seq.tokens)


TEXT_WINDOW = 4  # tokens decoded before a new one to place it in the text


def _text_ends(tokenizer, ids: list[int], start: int, start_chars: int):
  """(n, the length of the text of ids[:n]) for n = start + 1 .. len(ids), given that of
  ids[:start]: each from a decode of the token and the TEXT_WINDOW before it (a tokenizer may
  print a token differently after others: a leading space, the bytes of one character), not of
  all of ids[:n]."""
  chars = start_chars
  for n in range(start + 1, len(ids) + 1):
    p = max(0, n - 1 - TEXT_WINDOW)
    chars += len(tokenizer.decode(ids[p:n])) - len(tokenizer.decode(ids[p:n - 1]))
    yield n, chars


def _stops(r: CompletionRequest) -> tuple[str, ...]:
  return (r.stop,) if isinstance(r.stop, str) else tuple(r.stop or ())


def _usage(prompts, sequences) -> dict:
  prompt_tokens = sum(len(ids) for _, ids in prompts)
  completion_tokens = sum(len(seq.tokens) for seq in sequences)
  return {'prompt_tokens': prompt_tokens, 'completion_tokens': completion_tokens,
          'total_tokens': prompt_tokens + completion_tokens}


async def _next(updates: asyncio.Queue) -> '_Update | str | None':
  """The next update (or DISCONNECTED, GIVE_UP), or None after POLL_S without one."""
  try:
    return await asyncio.wait_for(updates.get(), POLL_S)
  except TimeoutError:
    return None


async def _watch_disconnect(request: fastapi.Request, updates: asyncio.Queue) -> None:
  """Tells updates DISCONNECTED when the client goes away: the ASGI receive channel's
  http.disconnect (the body has been read: nothing else comes on it)."""
  while (await request.receive())['type'] != 'http.disconnect':
    pass
  updates.put_nowait(DISCONNECTED)


def _cancel(sequences) -> None:
  for seq in sequences:
    if not seq.done:
      seq.cancelled = True


def _event(data: dict) -> str:
  return f'data: {json.dumps(data)}\n\n'


class _Guard:
  """The app's outer layer (plain ASGI, so that streams pass through untouched): a /v1 request
  without the API key gets 401 (OpenAI's invalid_api_key); a completion that comes when the queue
  is full gets 429 at once, before its body is read or parsed (under a flood most requests are
  refused: they must cost the event loop next to nothing); an exception that no handler answered
  is logged with its traceback and answered with a generic 500 (its text is never sent)."""

  def __init__(self, app, server: Server):
    self.app, self.server = app, server
    self.expected = f'Bearer {server.api_key}'.encode() if server.api_key else None

  async def __call__(self, scope, receive, send):
    if scope['type'] != 'http':
      return await self.app(scope, receive, send)
    if self.expected and scope['path'].startswith('/v1') and not secrets.compare_digest(
        dict(scope['headers']).get(b'authorization', b''), self.expected):
      return await APIError(
          'Missing or incorrect API key: send the header "Authorization: Bearer KEY" with the '
          f'key this server was started with (--api_key or {API_KEY_ENV}).', status=401,
          code='invalid_api_key').response()(scope, receive, send)
    if scope['path'] == '/v1/completions' and self.server.queue_room() < 1:
      return await self.server.busy().response()(scope, receive, send)
    started = False

    async def sending(message):
      nonlocal started
      started = started or message['type'] == 'http.response.start'
      await send(message)

    try:
      await self.app(scope, receive, sending)
    except Exception:  # noqa: BLE001  (logged here, a generic answer there)
      logging.exception('%s %s failed', scope['method'], scope['path'])
      if not started:
        await _internal().response()(scope, receive, send)


def create_app(server: Server) -> fastapi.FastAPI:
  @contextlib.asynccontextmanager
  async def lifespan(_):
    server.start()
    yield
    server.stop()

  app = fastapi.FastAPI(title='jax_pretrain', lifespan=lifespan)
  app.add_middleware(_Guard, server=server)

  @app.exception_handler(APIError)
  async def api_error(_, e: APIError):
    return e.response()

  @app.exception_handler(fastapi_exceptions.RequestValidationError)
  async def invalid(_, e: fastapi_exceptions.RequestValidationError):
    first = e.errors()[0]
    if first.get('type') == 'json_invalid':
      return APIError('the body is not valid JSON').response()
    loc = [str(x) for x in first.get('loc', ()) if x != 'body']
    return APIError(f'{".".join(loc) or "body"}: {first.get("msg", "invalid")}',
                    loc[0] if loc else None).response()

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def http_error(_, e: starlette_exceptions.HTTPException):
    return APIError(str(e.detail), status=e.status_code,
                    code='not_found' if e.status_code == 404 else None).response()

  @app.get('/health')
  async def health():
    why = server.not_running()
    if why:
      return APIError(why, status=503, kind='server_error', code='engine_not_running').response()
    stalled = server.stalled_for()
    if stalled > server.stall_timeout:
      return APIError(
          f'the engine has had work and generated no token for {stalled:.0f} s (--stall_timeout='
          f'{server.stall_timeout:g}): its step may hang', status=503, kind='server_error',
          code='engine_stalled').response()
    return {'status': 'ok', 'model': server.name, **server.engine.stats(),
            'max_queued_sequences': server.max_queued}

  @app.get('/v1/models')
  async def models():
    return {'object': 'list', 'data': [{'id': server.name, 'object': 'model',
                                        'created': server.created, 'owned_by': 'jax_pretrain',
                                        'max_model_len': server.engine.context}]}

  @app.post('/v1/completions')
  async def completions(body: CompletionRequest, request: fastapi.Request):
    return await server.complete(body, request)

  return app


class _Uvicorn(uvicorn.Server):
  """uvicorn's server, whose shutdown gives the requests in flight server.shutdown_timeout
  seconds, then calls server.give_up (they fail with 503); uvicorn's own
  timeout_graceful_shutdown, FORCE_AFTER_S later, cancels whatever is left."""

  def __init__(self, config: uvicorn.Config, server: Server):
    super().__init__(config)
    self.server = server

  async def shutdown(self, sockets=None) -> None:
    deadline = asyncio.get_running_loop().call_later(self.server.shutdown_timeout,
                                                     self.server.give_up)
    try:
      await super().shutdown(sockets)
    finally:
      deadline.cancel()


def listen(server: Server, host: str, port: int) -> uvicorn.Server:
  """A uvicorn server of the app on host:port (its run() serves until a signal), told to exit
  should the engine's thread end on its own (server.failure says why)."""
  uv = _Uvicorn(uvicorn.Config(
      create_app(server), host=host, port=port, log_level='warning',
      timeout_keep_alive=KEEP_ALIVE_S,
      timeout_graceful_shutdown=math.ceil(server.shutdown_timeout + FORCE_AFTER_S)), server)
  server.on_failure = lambda: setattr(uv, 'should_exit', True)
  return uv


def main():
  import os  # noqa: PLC0415

  from absl import flags  # noqa: PLC0415
  f = flags.FLAGS
  check_flags(f)
  run = workdir_lib.load(f.workdir, f.step, devices=jax.devices()[:1])
  context = f.context or run.config.data.seq_len
  engine = engine_lib.Engine(run.config.model, run.params, run.tokenizer,
                             slots=f.slots, context=context, chunk=f.chunk)
  run = dataclasses.replace(run, params=None)  # the engine holds its own copy: free the float32 one
  name = f.model_name or os.path.basename(os.path.normpath(f.workdir))
  if f.warmup:
    t0 = time.perf_counter()
    engine.warmup(background=True, report=lambda line: print(line, flush=True))
    print(f'compiled {len(engine.shapes)} programs in {time.perf_counter() - t0:.1f}s '
          f'({engine.runner.programs.pending()} more in the background)', flush=True)
  server = Server(engine, name, max_sequences=f.max_sequences_per_request,
                  max_queued=f.max_queued_sequences, stall_timeout=f.stall_timeout,
                  shutdown_timeout=f.shutdown_timeout,
                  api_key=f.api_key or os.environ.get(API_KEY_ENV))
  print(f'serving {name} on http://{f.host}:{f.port}/v1 ({f.slots} slots of {context} tokens'
        f'{", API key required" if server.api_key else ""})', flush=True)
  uv = listen(server, f.host, f.port)
  try:
    uv.run()
  except SystemExit:  # uvicorn's own exit when it cannot start (a port in use, say)
    if uv.started:
      raise
    raise UserError(f'could not serve on {f.host}:{f.port} (the line above says why)') from None
  if server.failure is not None:
    cause = server.failure.__cause__ or server.failure
    print(f'error: the engine stopped ({server.failure}; the last error: {type(cause).__name__}: '
          f'{cause}); the tracebacks are in the log above.', file=sys.stderr, flush=True)
    sys.exit(1)


def check_flags(f) -> None:
  """One error line for a limit or a timeout out of range (f: the flags), before loading the run."""
  for name, ok, must in [
      ('max_sequences_per_request', f.max_sequences_per_request >= 1, 'be >= 1'),
      ('max_queued_sequences', f.max_queued_sequences >= f.max_sequences_per_request,
       f'be >= --max_sequences_per_request ({f.max_sequences_per_request}), else the largest '
       'request could never be queued'),
      ('stall_timeout', f.stall_timeout > 0, 'be > 0 seconds'),
      ('shutdown_timeout', f.shutdown_timeout >= 0, 'be >= 0 seconds')]:
    if not ok:
      raise UserError(f'--{name}={getattr(f, name)}: it must {must}')


def define_flags() -> None:
  """The server's flags, after cli.define_run_flags (--workdir, --step)."""
  from absl import flags  # noqa: PLC0415
  flags.DEFINE_string('host', '127.0.0.1', 'Address to listen on (0.0.0.0: every interface).')
  flags.DEFINE_integer('port', 8000, 'Port to listen on.')
  flags.DEFINE_string('model_name', '', 'Name in /v1/models and responses (default: the '
                      "workdir's last component).")
  flags.DEFINE_integer('slots', 16, 'Sequences decoded together at most (KV cache rows).')
  flags.DEFINE_integer('context', 0, "Tokens per sequence, prompt included; 0: the run's seq_len.")
  flags.DEFINE_integer('chunk', 8, 'Tokens decoded per compiled call (requests join between).')
  flags.DEFINE_bool('warmup', False, 'Compile the programs that cover every call before '
                    'serving, the others in the background: no request waits for a compile (one '
                    'runs padded until its own program is ready).')
  flags.DEFINE_integer('max_sequences_per_request', MAX_SEQUENCES, 'Sequences (prompts × n) one '
                       'request may ask for; more get 400.')
  flags.DEFINE_integer('max_queued_sequences', MAX_QUEUED, 'Sequences waiting for a slot, over '
                       'all requests, at most: a request that would pass it gets 429 (OpenAI\'s '
                       f'rate-limit error, Retry-After: {RETRY_AFTER_S}). At least '
                       '--max_sequences_per_request.')
  flags.DEFINE_float('stall_timeout', STALL_TIMEOUT_S, '/health answers 503 (engine_stalled) once '
                     'the engine has had work and generated no token for this many seconds.')
  flags.DEFINE_float('shutdown_timeout', SHUTDOWN_TIMEOUT_S, 'On Ctrl-C or SIGTERM, seconds the '
                     'requests in flight have to finish; those still waiting then get 503.')
  flags.DEFINE_string('api_key', '', 'Requests to /v1 need "Authorization: Bearer KEY" (401 '
                      f'without); default: ${API_KEY_ENV} if set, else none needed. /health '
                      'stays open.')


if __name__ == '__main__':
  cli.define_run_flags()
  define_flags()
  cli.run(main)
