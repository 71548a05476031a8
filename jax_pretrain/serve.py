"""An OpenAI-compatible server for a trained run: completions and chat completions.

  python -m jax_pretrain.serve --workdir=runs/x [--step=N] [--port=8000] [--host=127.0.0.1]
      [--slots=16] [--context=0] [--chunk=8] [--model_name=NAME] [--warmup]
      [--max_sequences_per_request=256] [--max_queued_sequences=256] [--api_key=KEY]
      [--stall_timeout=300] [--shutdown_timeout=20] [--kv_cache_dtype=auto|int8|fp8]
      [--chat_template=FILE] [--noprefix_cache]

Endpoints (FastAPI, served by uvicorn):
- POST /v1/completions: OpenAI's completions API. `prompt` (a string, a list of strings, a list
  of token ids or a list of such lists), `max_tokens` (default 16), `temperature` (default 1; 0 is
  greedy), `top_p`, `top_k` (an extension; 0: off), `n` choices per prompt, `stop` (up to 4
  strings), `seed`, `stream` (server-sent events, `stream_options.include_usage`), `echo`,
  `logprobs` (0..20 alternatives per token), `presence_penalty`, `frequency_penalty` and
  `logit_bias` (applied on the device, engine/sampling.py), `user`. suffix and best_of != n are
  refused with 400 rather than ignored. A field sent as null takes its default.
- POST /v1/chat/completions: OpenAI's chat completions API. `messages` are rendered once with the
  chat template (--chat_template=FILE, else the run's tokenizer/ chat_template.jinja or
  tokenizer_config.json's, which the run keeps from its tokenizer, HF import and HF export) with
  the generation prompt, and encoded once, as SFT and transformers' apply_chat_template do
  (data/chat.py's prompt_ids; openai_api.ChatMessage.rendered: tool calls, tool messages, content
  parts); a run without one answers 400. `max_completion_tokens` (or `max_tokens`; default: the
  rest of the context), `logprobs` (true) with `top_logprobs` (0..20), and the sampling fields of
  completions; `stream` sends each choice's role, then its content. The no-op forms of tools,
  tool_choice and response_format and the fields vLLM ignores are accepted
  (openai_api.ChatRequest). Structured outputs (response_format json_schema, json_object) and
  tool calls (tool_choice "required" or a named function; "auto": 400) by constrained decoding
  (structured.py, engine/grammar.py): message.content the JSON, or message.tool_calls, streamed
  as OpenAI streams them.
- Defaults: the run's generation_config.json (workdir.generation_config) gives temperature,
  top_p, top_k and a chat's max_tokens where a request gives none, and its eos_token_ids end a
  sequence as EOS does.
- GET /v1/models, GET /health (with the engine's slots, queue and compiled shapes; 503 with
  OpenAI's error JSON saying why when the engine is not running, or when it is stalled: below).

Two layers, as vLLM's AsyncLLM and OpenAIServing: the engine client (engine/client.py: the
engine's thread, submit, a request's updates, cancel, backpressure, health) and the OpenAI layer
here (Server: the requests' checks, prompts and answers, openai_api.py's bodies and rendering; the
app). Requests are decoded by one engine.Engine in a thread of its own: whatever arrives while
others decode joins them at the next chunk of tokens (continuous batching over a KV cache of
--slots rows of --context tokens, allocated once). Prefix caching (--prefix_cache, on by default,
as vLLM's): a finished sequence's slot keeps its keys and values until a new sequence needs the
slot (least recently used first), and a prompt that starts with 16 or more of those tokens (a
chat's earlier turns, a shared system prompt, a request's other choices) reuses them, whole blocks
of 16, prefilling only the rest; usage.prompt_tokens_details.cached_tokens says how many
(engine/scheduler.py). An empty prompt starts a new document (EOS). A
request with a seed gets the same text whatever else is being decoded; choice i of n uses the
seed's stream i.

The event loop only routes: every tokenizer call (a prompt's encoding, a chat's rendering, the
text of the logprobs' tokens, a stream's deltas) and the rendering of a whole response run in
worker threads (asyncio.to_thread), so that /health and new requests are answered at once while
others are prepared.

Backpressure: the sequences waiting for a slot, over all requests, are --max_queued_sequences at
most (default 256). A request whose sequences would pass it is refused whole with 429 and OpenAI's
rate-limit error (type `requests`, code `rate_limit_exceeded`) and `Retry-After: 1`, which the
official clients retry after that second; nothing is queued without bound, so memory and the wait
of an accepted request stay bounded whatever the traffic. While the queue is full a completion or
chat completion is refused at the door (_Guard), before its body is read: under a flood most
requests are refused, and each costs the event loop next to nothing.

Bad requests get OpenAI's error JSON ({"error": {"message", "type", "param", "code"}}) with status
400 (404 for an unknown model or path), and the server goes on serving. A request may ask for
--max_sequences_per_request sequences (prompts × n) at most (default 256: one request cannot hold
the engine for everyone else; --max_queued_sequences must hold one such request). With --api_key
(or the environment variable JAX_PRETRAIN_API_KEY, which keeps the key out of `ps`), every /v1
request needs `Authorization: Bearer KEY` (401 without it, as vLLM's --api-key; the OpenAI client
sends its api_key so); /health stays open.

A client that goes away cancels its sequences (a stream's when Starlette sees the disconnect, a
whole response's when the ASGI receive channel says http.disconnect, watched while the request
waits): those still waiting leave the queue at once (their places go to the next requests), those
decoding leave the engine at its next chunk.

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
a supervisor's liveness probe.

Stopping (Ctrl-C, SIGTERM): no new connections; the requests in flight have --shutdown_timeout
seconds (default 20) to finish, then the engine client gives up: every one still waiting fails
with 503 ("the server stopped before this request finished"; the openai client retries it),
whether or not the engine's step ever returns, and uvicorn cancels what is left a moment later
(timeout_graceful_shutdown); the engine's thread gets a few seconds to end. A second Ctrl-C quits
at once. Once stopped, the engine fails whatever is still waiting or decoding with 503 and new
requests are refused with 503, so that no request is left hanging. Then, on every way out, the
engine is closed (its background compiler waited for CLOSE_TIMEOUT_S at most) and the process ends
by the signal that stopped it (uvicorn would re-raise it before that close).
"""
import asyncio
from collections.abc import AsyncIterator
from collections.abc import Awaitable
from collections.abc import Callable
import contextlib
import dataclasses
import gc
import json
import math
import os
import secrets
import signal
import sys
import time
from typing import TypeVar

from absl import logging
import fastapi
from fastapi import exceptions as fastapi_exceptions
from fastapi import responses
import jax
import numpy as np
from starlette import exceptions as starlette_exceptions
import uvicorn

from jax_pretrain import cli
from jax_pretrain import engine as engine_lib
from jax_pretrain import openai_api as api
from jax_pretrain import sample as sample_lib
from jax_pretrain import structured
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import chat as chat_lib
from jax_pretrain.engine import client as client_lib
from jax_pretrain.engine import core as engine_core
from jax_pretrain.engine import grammar as grammar_lib
from jax_pretrain.errors import UserError

MAX_SEQUENCES = 256  # prompts × n per request (--max_sequences_per_request)
MAX_QUEUED = 256  # sequences waiting for a slot, over all requests (--max_queued_sequences)
STALL_TIMEOUT_S = 300.0  # work and no new token this long: /health 503 (--stall_timeout)
SHUTDOWN_TIMEOUT_S = 20.0  # a shutdown's time for the requests in flight (--shutdown_timeout)
FORCE_AFTER_S = client_lib.JOIN_S  # then uvicorn cancels what is left (answered 503 by then, but
# for a client that does not read its answer), and the engine's thread gets this long again to end
# An idle keep-alive connection is closed after this long: longer than clients keep theirs (httpx,
# the openai client's: 5 s, uvicorn's own default), so that the server never closes one as a
# client sends on it (a POST lost to "connection closed": 596 of 22,440 at 10 x load with 5 s).
KEEP_ALIVE_S = 75
CLOSE_TIMEOUT_S = 10.0  # the way out waits this long at most for a compile in the background
API_KEY_ENV = 'JAX_PRETRAIN_API_KEY'  # the key when --api_key is not given
T = TypeVar('T')


class Server:
  """The OpenAI layer over the engine client: a request's checks, its prompts (encoded, or
  messages rendered with chat_template: an chat_lib.ChatTemplate, or None) and its answer, whole or
  streamed; the model's sampling defaults (api.Defaults: its generation_config.json's; None: the
  API's), its name, the limits (see the flags), the timeouts and the API key ('' or None: none
  asked). shutdown_deadline: what a shutdown waits for before giving up on the requests in flight
  (shutdown_timeout seconds)."""

  def __init__(self, engine: engine_lib.Engine, name: str, *,
               chat_template: chat_lib.ChatTemplate | None = None,
               defaults: api.Defaults | None = None,
               max_sequences: int = MAX_SEQUENCES, max_queued: int = MAX_QUEUED,
               api_key: str | None = None, stall_timeout: float = STALL_TIMEOUT_S,
               shutdown_timeout: float = SHUTDOWN_TIMEOUT_S):
    self.client = client_lib.EngineClient(engine, max_queued=max_queued)
    self.engine, self.name, self.tokenizer = engine, name, engine.tokenizer
    self.chat_template, self.defaults = chat_template, defaults or api.Defaults()
    self.grammars = grammar_lib.Grammars(self.tokenizer)  # (structured outputs, tool calls)
    self.max_sequences, self.api_key = max_sequences, api_key or None
    self.stall_timeout, self.shutdown_timeout = stall_timeout, shutdown_timeout
    self.shutdown_deadline: Callable[[], Awaitable] = lambda: asyncio.sleep(self.shutdown_timeout)
    self.created = int(time.time())

  def prompts(self, r: api.CompletionRequest) -> list[tuple[str, list[int]]]:
    """(text, token ids) of each prompt of a completion."""
    p: list[str] | list[list[int]]
    if isinstance(r.prompt, str):
      p = [r.prompt]
    elif api.is_ids(r.prompt):
      p = [r.prompt]
    else:
      p = r.prompt
    if not p:
      raise api.APIError('prompt must not be empty', 'prompt')
    self._check_sequences(len(p), r.n)  # before encoding any of them
    out = []
    for item in p:
      if isinstance(item, str):
        out.append((item, [int(t) for t in sample_lib.encode_prompt(self.tokenizer, item)]))
      elif not item or not all(0 <= t < self.tokenizer.vocab_size for t in item):
        raise api.APIError(f'token prompts need ids in [0, {self.tokenizer.vocab_size})',
                           'prompt')
      else:
        out.append((self.tokenizer.decode(item), list(item)))
    return out

  def _check_sequences(self, prompts: int, n: int) -> None:
    if prompts * n > self.max_sequences:
      raise api.APIError(
          f'This request asks for {prompts * n} sequences ({prompts} prompts × n = {n}); this '
          f'server decodes at most {self.max_sequences} per request '
          '(--max_sequences_per_request). Please split it.', 'n' if n > 1 else 'prompt',
          code='too_many_sequences')

  def check(self, r: api.CompletionRequest, prompts: list[tuple[str, list[int]]]) -> int:
    """Refuses a completion that cannot be served; returns max_tokens."""
    api.check_sampling(r, self.name)
    max_tokens = r.max_tokens
    for ok, param, message in [
        (max_tokens >= 0, 'max_tokens', 'max_tokens must be >= 0'),
        (r.logprobs is None or 0 <= r.logprobs <= engine_lib.TOP_N, 'logprobs',
         f'logprobs must be between 0 and {engine_lib.TOP_N}'),
        (r.suffix is None, 'suffix', 'suffix is not supported'),
        (r.best_of is None or r.best_of == r.n, 'best_of', 'best_of other than n is not supported'),
    ]:
      if not ok:
        raise api.APIError(message, param)
    api.check_context([ids for _, ids in prompts], max_tokens, self.engine.context)
    return max_tokens

  async def complete(self, r: api.CompletionRequest, http: fastapi.Request):
    prompts = await asyncio.to_thread(self.prompts, r)
    max_tokens = self.check(r, prompts)
    request = self._submit(r, [ids for _, ids in prompts], max_tokens, r.logprobs is not None)
    try:
      prompt_logprobs: list[api.PromptLogprobs | None] = [None] * len(prompts)
      if r.echo and r.logprobs is not None:  # (while the engine decodes)
        prompt_logprobs = [await asyncio.to_thread(self._prompt_logprobs, ids)
                           for _, ids in prompts]
    except BaseException:
      request.cancel()
      raise
    answer = api.CompletionAnswer(r, self.name, prompts, prompt_logprobs, self.tokenizer)
    return await self._answer(request, answer, http)

  def chat_prompt(self, r: api.ChatRequest, with_tools: bool = False) -> list[int]:
    """The ids of a chat's messages (and with_tools, its tools: tool calls asked), rendered with
    the chat template (chat.prompt_ids)."""
    if self.chat_template is None:
      raise api.APIError(
          "This model's tokenizer has no chat template (no chat_template.jinja or "
          "\"chat_template\" in the tokenizer_config.json of the run's tokenizer/, and no "
          '--chat_template), so /v1/chat/completions cannot render messages; send a prompt to '
          '/v1/completions.',
          'messages', code='chat_template_missing')
    if not r.messages:
      raise api.APIError('messages must not be empty', 'messages')
    try:
      parts = api.content_parts(self.chat_template.source)
      ids = chat_lib.prompt_ids(self.chat_template, [m.rendered(parts) for m in r.messages],
                                self.tokenizer, r.tools if with_tools else None)
    except ValueError as e:  # (the template's words: no path of the server's)
      raise api.APIError(str(e), 'messages') from None
    return [int(t) for t in ids] or [self.tokenizer.eos_id]

  def check_chat(self, r: api.ChatRequest, ids: list[int]) -> int:
    """Refuses a chat completion that cannot be served (its sampling checked before: chat);
    returns its max_tokens."""
    self._check_sequences(1, r.n)
    given = [x for x in (r.max_completion_tokens, r.max_tokens) if x is not None]
    rest = max(0, self.engine.context - len(ids))
    max_tokens = given[0] if given else min(rest, self.defaults.max_tokens or rest)
    for ok, param, message in [
        (len(set(given)) <= 1, 'max_completion_tokens',
         'max_tokens and max_completion_tokens differ: give one'),
        (max_tokens >= 0, 'max_completion_tokens', 'max_completion_tokens must be >= 0'),
        (r.top_logprobs is None or r.logprobs, 'top_logprobs',
         'top_logprobs needs logprobs: true'),
        (r.top_logprobs is None or 0 <= r.top_logprobs <= engine_lib.TOP_N, 'top_logprobs',
         f'top_logprobs must be between 0 and {engine_lib.TOP_N}')]:
      if not ok:
        raise api.APIError(message, param)
    api.check_context([ids], max_tokens, self.engine.context)
    return max_tokens

  async def chat(self, r: api.ChatRequest, http: fastapi.Request):
    api.check_sampling(r, self.name)  # (an unknown model first: 404, template or not)
    plan = await asyncio.to_thread(self.plan, r)
    ids = await asyncio.to_thread(self.chat_prompt, r, plan.kind != 'content')
    max_tokens = self.check_chat(r, ids)
    request = self._submit(r, [ids], max_tokens, r.logprobs, plan.grammar)
    return await self._answer(request, api.ChatAnswer(r, self.name, ids, self.tokenizer, plan),
                              http)

  def plan(self, r: api.ChatRequest) -> structured.Plan:
    """What the chat's response_format, tools and tool_choice ask (structured.plan: its grammar
    compiled); a 400 naming the field that cannot be served."""
    try:
      return structured.plan(r.response_format, r.tools, r.tool_choice, r.parallel_tool_calls,
                             self.grammars, self.chat_template.source if self.chat_template else '')
    except structured.RequestError as e:
      raise api.APIError(str(e), e.param) from None

  def _submit(self, r: api.Sampling, prompts: list[list[int]], max_tokens: int,
              alternatives: bool, grammar: grammar_lib.Grammar | None = None
              ) -> client_lib.Request:
    """The n sequences of each prompt, submitted (the client's QueueFull, Stopped); with a
    grammar, each keeps it with a matcher of its own."""
    seed = secrets.randbits(32) if r.seed is None else r.seed
    temperature, top_p, top_k = r.settings(self.defaults)
    bias = r.bias(self.tokenizer.vocab_size)
    return self.client.submit([engine_lib.Sequence(
        ids, max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
        stream=j, stop=r.stops(), presence_penalty=r.presence_penalty,
        frequency_penalty=r.frequency_penalty, logit_bias=bias, alternatives=alternatives,
        grammar=None if grammar is None else grammar.matcher())
        for ids in prompts for j in range(r.n)], stream=r.stream)

  async def _answer(self, request: client_lib.Request, answer: api.Answer,
                    http: fastapi.Request) -> responses.Response:
    """The answer once every sequence has ended, or a stream of it; a client that goes away
    first cancels the request (499, nginx's "client closed request": nobody reads it)."""
    if request.stream:
      return responses.StreamingResponse(self._events(request, answer),
                                         media_type='text/event-stream')
    try:
      sequences = await _unless_gone(http, request.result())
    finally:
      request.cancel()
    if sequences is None:
      return responses.Response(status_code=499)
    return responses.JSONResponse(await asyncio.to_thread(answer.whole, sequences))

  async def _events(self, request: client_lib.Request, answer: api.Answer) -> AsyncIterator[str]:
    """Server-sent events: the answer's chunks as its choices' text grows, then the usage if
    asked, then [DONE]; a failure, one error event (as OpenAI's error JSON) instead of the rest,
    then [DONE] (as vLLM ends it: a client reads to [DONE]). A client that goes away cancels the
    request."""
    try:
      for chunk in answer.opening():
        yield _event(chunk)
      async for update in request.updates():
        delta = await asyncio.to_thread(answer.delta, update)
        if delta is not None:
          yield _event(delta)
      closing = answer.usage(request.sequences)
      if closing is not None:
        yield _event(closing)
    except client_lib.Stopped:
      yield _event(api.stopping().body())
    except client_lib.Failed:  # (the engine logged why)
      yield _event(api.internal().body())
    except Exception:  # noqa: BLE001  (the response has started: told in the stream)
      logging.exception('a streamed completion failed')
      yield _event(api.internal().body())
    finally:
      request.cancel()
    yield 'data: [DONE]\n\n'

  def _prompt_logprobs(self, ids: list[int]) -> api.PromptLogprobs:
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


async def _unless_gone(http: fastapi.Request, work: Awaitable[T]) -> T | None:
  """work's result, or None (work cancelled) when the client goes away first: the ASGI receive
  channel's http.disconnect (the body has been read: nothing else comes on it)."""

  async def gone():
    while (await http.receive())['type'] != 'http.disconnect':
      pass

  task, watch = asyncio.ensure_future(work), asyncio.ensure_future(gone())
  try:
    await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
  finally:
    watch.cancel()
    if not task.done():
      task.cancel()
  return task.result() if task.done() and not task.cancelled() else None


def _event(data: dict) -> str:
  return f'data: {json.dumps(data)}\n\n'


class _Guard:
  """The app's outer layer (plain ASGI, so that streams pass through untouched): a /v1 request
  without the API key gets 401 (OpenAI's invalid_api_key); a completion or chat completion that
  comes when the queue is full gets 429 at once, before its body is read or parsed (under a flood
  most requests are refused: they must cost the event loop next to nothing); an exception that
  no handler answered is logged with its traceback and answered with a generic 500 (its text is
  never sent)."""

  def __init__(self, app, server: Server):
    self.app, self.server = app, server
    self.expected = f'Bearer {server.api_key}'.encode() if server.api_key else None

  async def __call__(self, scope, receive, send):
    if scope['type'] != 'http':
      return await self.app(scope, receive, send)
    if self.expected and scope['path'].startswith('/v1') and not secrets.compare_digest(
        dict(scope['headers']).get(b'authorization', b''), self.expected):
      return await api.APIError(
          'Missing or incorrect API key: send the header "Authorization: Bearer KEY" with the '
          f'key this server was started with (--api_key or {API_KEY_ENV}).', status=401,
          code='invalid_api_key').response()(scope, receive, send)
    if scope['path'] in ('/v1/completions', '/v1/chat/completions') and (
        self.server.client.queue_room() < 1):
      return await api.busy(self.server.client.max_queued).response()(scope, receive, send)
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
        await api.internal().response()(scope, receive, send)


def create_app(server: Server) -> fastapi.FastAPI:
  client = server.client

  @contextlib.asynccontextmanager
  async def lifespan(_):
    client.start()
    yield
    await asyncio.to_thread(client.stop)  # (it waits for the engine's thread: not on the loop)

  app = fastapi.FastAPI(title='jax_pretrain', lifespan=lifespan)
  app.add_middleware(_Guard, server=server)
  for error, answer in [(api.APIError, lambda e: e),
                        (client_lib.QueueFull, lambda _: api.busy(client.max_queued)),
                        (client_lib.Stopped, lambda _: api.stopping()),
                        (client_lib.Failed, lambda _: api.internal())]:
    app.add_exception_handler(error, lambda _, e, answer=answer: answer(e).response())

  @app.exception_handler(fastapi_exceptions.RequestValidationError)
  async def invalid(_, e: fastapi_exceptions.RequestValidationError):
    first = e.errors()[0]
    if first.get('type') == 'json_invalid':
      return api.APIError('the body is not valid JSON').response()
    loc = [str(x) for x in first.get('loc', ()) if x != 'body']
    return api.APIError(f'{".".join(loc) or "body"}: {first.get("msg", "invalid")}',
                        loc[0] if loc else None).response()

  @app.exception_handler(starlette_exceptions.HTTPException)
  async def http_error(_, e: starlette_exceptions.HTTPException):
    return api.APIError(str(e.detail), status=e.status_code,
                        code='not_found' if e.status_code == 404 else None).response()

  @app.get('/health')
  async def health():
    why = client.not_running()
    if why:
      return api.APIError(why, status=503, kind='server_error',
                          code='engine_not_running').response()
    stalled = client.stalled_for()
    if stalled > server.stall_timeout:
      return api.APIError(
          f'the engine has had work and generated no token for {stalled:.0f} s (--stall_timeout='
          f'{server.stall_timeout:g}): its step may hang', status=503, kind='server_error',
          code='engine_stalled').response()
    return {'status': 'ok', 'model': server.name, **server.engine.stats(),
            'max_queued_sequences': client.max_queued}

  @app.get('/v1/models')
  async def models():
    return {'object': 'list', 'data': [{'id': server.name, 'object': 'model',
                                        'created': server.created, 'owned_by': 'jax_pretrain',
                                        'max_model_len': server.engine.context}]}

  @app.post('/v1/completions')
  async def completions(body: api.CompletionRequest, request: fastapi.Request):
    return await server.complete(body, request)

  @app.post('/v1/chat/completions')
  async def chat_completions(body: api.ChatRequest, request: fastapi.Request):
    return await server.chat(body, request)

  return app


class _Uvicorn(uvicorn.Server):
  """uvicorn's server, whose shutdown gives the requests in flight until the server's
  shutdown_deadline (shutdown_timeout seconds), then gives up on them (they fail with 503);
  uvicorn's own timeout_graceful_shutdown, FORCE_AFTER_S later, cancels whatever is left."""

  def __init__(self, config: uvicorn.Config, server: Server):
    super().__init__(config)
    self.server = server
    self.signals: list[int] = []  # the signals that stopped it, for main to re-raise

  @contextlib.contextmanager
  def capture_signals(self):
    """uvicorn's, but the signals that stopped the server are kept for main to re-raise after the
    engine's close (uvicorn re-raises them on its way out: a SIGTERM would end the process before
    main's cleanup)."""
    with super().capture_signals():
      try:
        yield
      finally:
        self.signals += self._captured_signals
        self._captured_signals.clear()

  async def shutdown(self, sockets=None) -> None:
    async def give_up():
      await self.server.shutdown_deadline()
      self.server.client.give_up()

    deadline = asyncio.ensure_future(give_up())
    try:
      await super().shutdown(sockets)
    finally:
      deadline.cancel()


def listen(server: Server, host: str, port: int) -> _Uvicorn:
  """A uvicorn server of the app on host:port (its run() serves until a signal), told to exit
  should the engine's thread end on its own (server.client.failure says why)."""
  uv = _Uvicorn(uvicorn.Config(
      create_app(server), host=host, port=port, log_level='warning',
      timeout_keep_alive=KEEP_ALIVE_S,
      timeout_graceful_shutdown=math.ceil(server.shutdown_timeout + FORCE_AFTER_S)), server)
  server.client.on_failure = lambda: setattr(uv, 'should_exit', True)
  return uv


def main():
  from absl import flags  # noqa: PLC0415
  f = flags.FLAGS
  check_flags(f)
  if f.chat_template:  # a missing or unparsable file: one error line before the run is loaded
    chat_lib.template_file(f.chat_template)
  run = workdir_lib.load(f.workdir, f.step, devices=jax.devices()[:1])
  context = f.context or run.config.data.seq_len
  generation = workdir_lib.generation_config(f.workdir)
  engine = engine_lib.Engine(run.config.model, run.engine_params, run.tokenizer,
                             slots=f.slots, context=context, chunk=f.chunk,
                             kv_cache_dtype=f.kv_cache_dtype, eos_ids=generation.eos_ids,
                             prefix_cache=f.prefix_cache)
  # the engine holds its own copy: free the float32 one
  run = dataclasses.replace(run, params=None, fp8=None)
  signals: list[int] = []
  try:
    _serve(f, engine, run, context, defaults(generation), signals)
  except BaseException as e:
    _close(engine, signals, e)
    raise
  _close(engine, signals)


def defaults(generation: workdir_lib.GenerationConfig) -> api.Defaults:
  """A run's generation_config.json as the server's defaults (the API's where it sets none)."""
  api_defaults = api.Defaults()
  given = lambda x, default: default if x is None else x
  return api.Defaults(temperature=given(generation.temperature, api_defaults.temperature),
                      top_p=given(generation.top_p, api_defaults.top_p),
                      top_k=given(generation.top_k, api_defaults.top_k),
                      max_tokens=generation.max_new_tokens)


def _close(engine: engine_lib.Engine, signals: list[int], error: BaseException | None = None):
  """The engine's close (its background compiler), on every way out, CLOSE_TIMEOUT_S at most;
  then the signals that stopped the server are raised again, as uvicorn would: the process ends
  by the first (SIGTERM: exit status 143, Ctrl-C: 130). A compile still running then is not
  waited for: the process ends at once (os._exit), as the interpreter's own exit would abort it
  while a thread is inside XLA."""
  closed = engine.close(timeout=CLOSE_TIMEOUT_S)
  if not closed:
    print(f'the background compiler is still compiling after {CLOSE_TIMEOUT_S:g} s: exiting '
          'without it', file=sys.stderr, flush=True)
  if signals:
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signals[0], signal.SIG_DFL)
    signal.raise_signal(signals[0])
  if not closed:
    if isinstance(error, UserError):
      print(f'error: {error}', file=sys.stderr)
    code = error.code if isinstance(error, SystemExit) else 0 if error is None else 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 1)


def _compiled(line: str) -> None:
  """The warmup's progress line, after each program (the background compiler's thread too): what
  its compile kept (jaxprs, caches) lives as long as the server, so it is frozen out of the
  garbage collector's full collections (one walked it for 0.6 s under load, /health waiting)."""
  print(line, flush=True)
  gc.freeze()


def _serve(f, engine: engine_lib.Engine, run, context: int, defaults: api.Defaults,
           signals: list[int]) -> None:
  """Warms up (--warmup), serves until a shutdown (the signals that stopped it: into signals),
  and exits 1 if the engine gave up."""
  name = f.model_name or os.path.basename(os.path.normpath(f.workdir))
  if f.warmup:
    t0 = time.perf_counter()
    engine.warmup(background=True, report=_compiled)
    print(f'compiled {len(engine.shapes)} programs in {time.perf_counter() - t0:.1f}s '
          f'({engine.stats()["compiling_shapes"]} more in the background)', flush=True)
  server = Server(engine, name,
                  chat_template=chat_lib.tokenizer_template(run.tokenizer, f.chat_template),
                  defaults=defaults,
                  max_sequences=f.max_sequences_per_request,
                  max_queued=f.max_queued_sequences, stall_timeout=f.stall_timeout,
                  shutdown_timeout=f.shutdown_timeout,
                  api_key=f.api_key or os.environ.get(API_KEY_ENV))
  print(f'serving {name} on http://{f.host}:{f.port}/v1 ({f.slots} slots of {context} tokens, '
        f'KV cache {f.kv_cache_dtype}{", API key required" if server.api_key else ""})',
        flush=True)
  uv = listen(server, f.host, f.port)
  # What the load and the warmup made lives as long as the server (the params, the programs,
  # the tokenizer, the libraries): kept out of the garbage collector's full collections, which
  # would walk all of it under traffic (half a second each, the event loop stalled meanwhile).
  gc.collect()
  gc.freeze()
  try:
    uv.run()
  except SystemExit:  # uvicorn's own exit when it cannot start (a port in use, say)
    if uv.started:
      raise
    raise UserError(f'could not serve on {f.host}:{f.port} (the line above says why)') from None
  finally:
    signals += uv.signals
  failure = server.client.failure
  if failure is not None:
    cause = failure.__cause__ or failure
    print(f'error: the engine stopped ({failure}; the last error: {type(cause).__name__}: '
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
  flags.DEFINE_integer('slots', engine_core.SLOTS, 'Sequences decoded together at most (KV cache '
                       'rows).')
  flags.DEFINE_integer('context', 0, "Tokens per sequence, prompt included; 0: the run's seq_len.")
  flags.DEFINE_integer('chunk', engine_core.CHUNK, 'Tokens decoded per compiled call (requests '
                       'join between).')
  flags.DEFINE_bool('warmup', False, 'Compile the programs that cover every call before '
                    'serving, the others in the background: no request waits for a compile (one '
                    'runs padded until its own program is ready).')
  flags.DEFINE_bool('prefix_cache', True, "Keep finished sequences' keys and values in their "
                    'slots (least recently used evicted first): a prompt that starts with one '
                    "reuses it, whole blocks of 16 tokens (usage's prompt_tokens_details."
                    'cached_tokens), and prefills only the rest.')
  flags.DEFINE_integer('max_sequences_per_request', MAX_SEQUENCES, 'Sequences (prompts × n) one '
                       'request may ask for; more get 400.')
  flags.DEFINE_integer('max_queued_sequences', MAX_QUEUED, 'Sequences waiting for a slot, over '
                       'all requests, at most: a request that would pass it gets 429 (OpenAI\'s '
                       f'rate-limit error, Retry-After: {api.RETRY_AFTER_S}). At least '
                       '--max_sequences_per_request.')
  flags.DEFINE_float('stall_timeout', STALL_TIMEOUT_S, '/health answers 503 (engine_stalled) once '
                     'the engine has had work and generated no token for this many seconds.')
  flags.DEFINE_float('shutdown_timeout', SHUTDOWN_TIMEOUT_S, 'On Ctrl-C or SIGTERM, seconds the '
                     'requests in flight have to finish; those still waiting then get 503.')
  flags.DEFINE_string('api_key', '', 'Requests to /v1 need "Authorization: Bearer KEY" (401 '
                      f'without); default: ${API_KEY_ENV} if set, else none needed. /health '
                      'stays open.')
  flags.DEFINE_string('chat_template', '', 'A chat template file (Jinja, as chat_template.jinja) '
                      "to render /v1/chat/completions' messages with, instead of the run's "
                      "tokenizer's.")
  cli.define_kv_cache_flag()


if __name__ == '__main__':
  cli.define_run_flags()
  define_flags()
  cli.run(main)
