"""The OpenAI-compatible server on a tiny trained run, started by the test on a free port and
queried with the official openai client: completions, batches of prompts with n choices,
streaming, stop sequences, seeds, echo and logprobs, temperature 0 equal to `jax_pretrain.sample
--temperature 0`, 16 concurrent clients, bucketed shapes, and bad requests answered with 400 while
the server goes on serving. Then a server built in this process (so that its engine can be broken
or held on purpose): the API key, the cap on sequences per request, failures that fail their own
requests only and never show their text, stopping; a server whose every step fails, which exits
1; and backpressure: a burst beyond the queue (429s, all answered), the openai client retrying a
429, a client that disconnects, /health on a stalled engine, no tokenizer call on the event loop,
and a shutdown that answers every request in flight by its deadline. Chat completions on a copy
of the run given a chat template: the completion of the rendered messages, streamed, n, stop,
logprobs, bad requests, a run without a template (400), and the template in the HF export; a
Qwen3-style multi-turn chat served with transformers' ids by a run whose tokenizer/ has only
chat_template.jinja, and serve --chat_template=FILE. The fields as OpenAI's spec has them: null
for a default, the no-op forms, an agent's history (tool calls, tool messages, content parts),
logit_bias and penalties, 20 top_logprobs, logprob tokens (strings and bytes) that join into
the content, [DONE] after an error event, no server path in an answer, and a run's
generation_config.json."""
import asyncio
import concurrent.futures
import contextlib
import email.message
import http.client
import importlib
import json
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from typing import Literal
import urllib.error
import urllib.request

from flax.core import meta
import jax
import jsonschema
import numpy as np
import openai
import pydantic
import pytest

from jax_pretrain import config as config_lib
from jax_pretrain import engine
from jax_pretrain import hf
from jax_pretrain import model as model_lib
from jax_pretrain import openai_api
from jax_pretrain import serve
from jax_pretrain import structured
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.data import chat as chat_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.engine import client as client_lib
from jax_pretrain.engine import grammar as grammar_lib
from jax_pretrain.errors import UserError
from tests import chat_templates
from tests import tiny_run
from tests.conftest import ROOT
from tests.conftest import run_cli
from tests.conftest import subprocess_env

NAME = 'tiny'
KEY = 'sk-test-key'


@pytest.fixture(scope='session')
def run(tmp_path_factory):
  return tiny_run.train_once(tmp_path_factory)


def _start(run, *args, env=None, code=('-m', 'jax_pretrain.serve')):
  """A server process on a free port, once its /health answers: (process, base URL)."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  proc = subprocess.Popen(
      [sys.executable, *code, f'--workdir={run}', f'--port={port}', f'--model_name={NAME}', *args],
      cwd=ROOT, env=env or subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  url = f'http://127.0.0.1:{port}'
  deadline = time.monotonic() + 180
  while True:
    try:
      urllib.request.urlopen(f'{url}/health', timeout=5)
      return proc, url
    except (urllib.error.URLError, ConnectionError):
      assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
      time.sleep(0.5)


@pytest.fixture(scope='session')
def server(run):
  """The server's base URL: one server per pytest-xdist worker (session scope: a worker may run
  other modules' tests between these), stopped at the end."""
  proc, url = _start(run, '--slots=8', '--chunk=4')
  yield url
  proc.terminate()
  _, stderr = proc.communicate(timeout=60)
  assert 'Traceback' not in stderr, stderr[-3000:]


@pytest.fixture
def client(server):
  return openai.OpenAI(base_url=f'{server}/v1', api_key='unused', max_retries=0, timeout=120)


def _get(url: str) -> dict:
  with urllib.request.urlopen(url, timeout=30) as r:
    return json.load(r)


def _status(url: str) -> tuple[int, dict]:
  """A GET's status and JSON, whatever the status."""
  try:
    with urllib.request.urlopen(url, timeout=30) as r:
      return r.status, json.load(r)
  except urllib.error.HTTPError as e:
    return e.code, json.load(e)


def _answer(url: str, body: bytes, path: str = '/v1/completions', key: str = ''
            ) -> tuple[int, dict, email.message.Message]:
  """A POST's status, JSON and headers (case-insensitive), whatever the status."""
  request = urllib.request.Request(url + path, data=body, headers={
      'Content-Type': 'application/json', **({'Authorization': f'Bearer {key}'} if key else {})})
  try:
    with urllib.request.urlopen(request, timeout=120) as r:
      return r.status, json.load(r), r.headers
  except urllib.error.HTTPError as e:
    return e.code, json.load(e), e.headers


def _post(url: str, body: bytes, path: str = '/v1/completions', key: str = ''
          ) -> tuple[int, dict]:
  status, answer, _ = _answer(url, body, path, key)
  return status, answer


def greedy(client, prompt, max_tokens=24, **kw):
  return client.completions.create(model=NAME, prompt=prompt, max_tokens=max_tokens,
                                   temperature=0, **kw)


def test_models_completion_and_a_batch_of_prompts(client, server):
  assert [m.id for m in client.models.list().data] == [NAME]
  assert _get(f'{server}/health')['status'] == 'ok'
  one = greedy(client, 'The for statement ')
  assert one.model == NAME and one.object == 'text_completion'
  [choice] = one.choices
  assert choice.finish_reason in ('length', 'stop') and choice.text
  assert one.usage.prompt_tokens == len('The for statement ')  # bytes
  assert one.usage.completion_tokens == len(choice.text.encode()) <= 24

  prompts = ['The for statement ', 'A class', 'x']
  batch = client.completions.create(model=NAME, prompt=prompts, max_tokens=24, temperature=0, n=2)
  assert [c.index for c in batch.choices] == list(range(6))  # prompt i, choice j: 2 i + j
  for i, prompt in enumerate(prompts):
    alone = greedy(client, prompt).choices[0].text
    assert batch.choices[2 * i].text == batch.choices[2 * i + 1].text == alone
  assert batch.usage.prompt_tokens == sum(len(p) for p in prompts)


def test_temperature_0_equals_the_sample_command(client, run):
  prompt = 'The for statement '
  out = run_cli('-m', 'jax_pretrain.sample', f'--workdir={run}', f'--prompt={prompt}',
                '--temperature=0', '--max_new_tokens=40', '--noecho')
  assert greedy(client, prompt, max_tokens=40).choices[0].text == out[:-1]  # print's newline


def test_streaming_gives_the_same_text_in_pieces(client):
  kw = dict(model=NAME, prompt='The ', max_tokens=40, temperature=1.0, seed=11)
  whole = client.completions.create(**kw).choices[0]
  events = list(client.completions.create(**kw, stream=True,
                                          stream_options={'include_usage': True}))
  pieces = [e.choices[0] for e in events if e.choices]
  # As many pieces as the reader kept up with: a reader slower than the decoding gets the updates
  # it missed merged into one (engine/client.py; the order and the merge:
  # tests/test_engine_client.py), so on a busy machine the text may come in one piece.
  assert pieces
  assert ''.join(p.text for p in pieces) == whole.text
  assert [p.finish_reason for p in pieces][-1] == whole.finish_reason
  assert all(p.finish_reason is None for p in pieces[:-1])
  assert events[-1].usage.completion_tokens == len(whole.text.encode())


def test_stop_sequences(client):
  text = greedy(client, 'The for statement ', max_tokens=40).choices[0].text
  stop = text[10:13]
  cut = greedy(client, 'The for statement ', max_tokens=40, stop=[stop, 'never there'])
  assert cut.choices[0].text == text[:text.index(stop)]
  assert cut.choices[0].finish_reason == 'stop'
  streamed = greedy(client, 'The for statement ', max_tokens=40, stop=stop, stream=True)
  assert ''.join(e.choices[0].text for e in streamed) == text[:text.index(stop)]


def test_a_seed_gives_the_same_text_whatever_is_decoded_beside_it(client):
  def sample(seed, prompt='The '):
    return client.completions.create(model=NAME, prompt=prompt, max_tokens=32, temperature=1.0,
                                     seed=seed).choices[0].text

  first = sample(5)
  assert sample(5) == first and sample(6) != first
  with concurrent.futures.ThreadPoolExecutor(4) as pool:
    crowd = list(pool.map(sample, [5, 7, 8, 9], ['The ', 'A', 'if x', 'The ']))
  assert crowd[0] == first and crowd[3] != first
  two = client.completions.create(model=NAME, prompt='The ', max_tokens=32, temperature=1.0,
                                  seed=5, n=2)
  assert two.choices[0].text == first and two.choices[1].text != first


def test_echo_and_logprobs(client):
  r = greedy(client, 'The for', max_tokens=6, echo=True, logprobs=3)
  [c] = r.choices
  lp = c.logprobs
  assert c.text.startswith('The for') and len(lp.tokens) == len('The for') + 6
  assert ''.join(lp.tokens) == c.text and lp.text_offset == list(range(len(c.text)))
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
  for logprob, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):
    assert len(top) == 3 and logprob <= 0 and max(top.values()) >= logprob
  for token, logprob, top in zip(lp.tokens[7:], lp.token_logprobs[7:], lp.top_logprobs[7:]):
    assert top[token] == pytest.approx(logprob, abs=1e-5) == max(top.values())  # greedy


def test_16_concurrent_clients_all_answered_with_few_compiled_shapes(client, server):
  prompts = [('The for statement ' * 3)[:n] for n in range(3, 51, 3)]  # 16 different lengths

  def ask(prompt):
    c = openai.OpenAI(base_url=f'{server}/v1', api_key='unused', max_retries=0, timeout=300)
    return c.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0.7,
                                seed=len(prompt))

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    answers = list(pool.map(ask, prompts))
  assert len(answers) == 16
  assert all(0 < a.usage.completion_tokens <= 12 and a.choices[0].finish_reason for a in answers)
  # Prompt lengths 3 .. 48 pad to 16, 32 or 64 tokens; rows to 1, 2, 4 or 8 (8 slots); decodes
  # cover 1, 2, 4 or 8 slots over 16, 24, 32, 48 or 64 positions (no top-k/top-p cut, no
  # logprobs: one compiled variant).
  health = _get(f'{server}/health')
  assert health['busy'] == health['waiting'] == 0 and health['compiled_shapes'] <= 4 * 3 + 4 * 5
  # A prompt, then one that reuses its cached prefix (16 tokens) in its slot: then new lengths in
  # the buckets of the one before (their rest pads to 16 tokens, decodes over 32 positions, in
  # that slot) compile nothing.
  assert greedy(client, 'y' * 24, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 0
  assert greedy(client, 'y' * 25, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 16
  before = _get(f'{server}/health')['compiled_shapes']
  for n in (26, 27, 28, 29, 30):
    assert greedy(client, 'y' * n, max_tokens=2).usage.prompt_tokens_details.cached_tokens == 16
  assert _get(f'{server}/health')['compiled_shapes'] == before


@pytest.mark.parametrize('body, param', [
    (b'{"model": "tiny", "max_tokens": 5}', 'prompt'),  # missing prompt
    (b'{"prompt": 5}', 'prompt'),  # wrong types
    (b'{"prompt": "a", "max_tokens": "10"}', 'max_tokens'),
    (b'{"prompt": "a", "temperature": "hot"}', 'temperature'),
    (b'{"prompt": "a", "stream": "yes"}', 'stream'),
    (b'{"prompt": "a", "max_tokens": 64}', 'max_tokens'),  # 1 + 64 tokens: past the context
    (b'{"prompt": "a", "n": 0}', 'n'),
    (b'{"prompt": "a", "logprobs": 21}', 'logprobs'),
    (b'{"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}', 'stop'),
    (b'{"prompt": [], "max_tokens": 5}', 'prompt'),
    (b'{"prompt": [1, 99999]}', 'prompt'),
    (b'{"prompt": "a", "frequency_penalty": 2.5}', 'frequency_penalty'),
    (b'{"prompt": "a", "logit_bias": {"1000": 5}}', 'logit_bias'),  # not a token id
    (b'{"prompt": "a", "temprature": 0}', 'temprature'),  # unknown field
    (b'{"prompt": "a", ', None),  # not JSON
    (b'[1, 2]', None),
])
def test_bad_requests_get_400_and_the_server_keeps_serving(server, client, body, param):
  status, answer = _post(server, body)
  assert status == 400, answer
  assert answer['error']['type'] == 'invalid_request_error' and answer['error']['message']
  assert answer['error']['param'] == param
  assert greedy(client, 'The ', max_tokens=3).choices[0].text


def test_client_errors_unknown_model_and_path(client, server):
  with pytest.raises(openai.BadRequestError, match='maximum context length is 64 tokens'):
    client.completions.create(model=NAME, prompt='The ', max_tokens=100)
  with pytest.raises(openai.NotFoundError, match='does not exist'):
    client.completions.create(model='gpt-4', prompt='The ', max_tokens=3)
  status, answer = _post(server, b'{}', '/v1/nowhere')
  assert status == 404 and answer['error']['code'] == 'not_found'
  assert greedy(client, 'The ', max_tokens=3).choices[0].text


def test_an_idle_connection_outlives_the_clients_keep_alive(server):
  """A client's pooled connection, idle for longer than httpx (the openai client) keeps one (5 s),
  still carries the next request: the server does not close it first (at uvicorn's default of
  5 s, a request sent as it closed was lost: "connection closed", 596 of 22,440 under load)."""
  connection = http.client.HTTPConnection(*_address(server), timeout=30)
  try:
    for pause in (0, 6):
      time.sleep(pause)
      connection.request('GET', '/health')
      response = connection.getresponse()
      assert response.status == 200 and json.load(response)['status'] == 'ok'
  finally:
    connection.close()


def test_engine_warmup_compiles_every_shape_that_traffic_uses(run):
  trained = workdir_lib.load(run, devices=jax.devices()[:1])
  make = lambda slots: engine.Engine(trained.config.model, trained.params, trained.tokenizer,
                                     slots=slots, context=32, chunk=4)
  eng = make(4)
  lines = []
  eng.warmup(report=lines.append)
  # Prompts pad to 16 or 32 tokens, 1, 2 or 4 of them per prefill, each with no copy or 4 (the
  # covers: 4 of them with 4 copies), each after a cached prefix or not; decodes cover 1, 2 or 4
  # slots over 16, 24 or 32 positions (the top-k/top-p cut and the top-5 alternatives: runtime
  # branches, not programs).
  assert len(eng.shapes) == 2 * 3 * 2 * 2 + 3 * 3
  assert len(lines) == len(eng.shapes) and lines[-1].startswith('warmup: 33/33 programs compiled')
  warm = set(eng.shapes)
  rng = random.Random(0)
  sequences = lambda: [engine.Sequence([rng.randrange(256) for _ in range(rng.randrange(1, 22))],
                                       10, temperature=1.0, seed=i, top_p=0.9 if i % 3 else 1.0,
                                       alternatives=i % 2 == 0) for i in range(12)]
  first = sequences()
  eng.generate(first)
  assert all(seq.done and seq.tokens for seq in first) and eng.shapes == warm
  assert eng.runner.programs.pending() == 0  # no call asked for a program of its own

  # Warmed in the background: the covering programs (4 prefills, 1 decode) before it returns;
  # until a call's own program is compiled it runs padded to one, with the same tokens.
  eng = make(2)
  lines = []
  eng.warmup(background=True, report=lines.append)
  assert lines[0].startswith('warmup: 1/') and 'ETA' in lines[0]
  assert any(line.startswith('warmup: 5 covering programs ready') for line in lines)
  eng.runner.programs.stop()  # (the covers alone from here)
  covering = set(eng.shapes)
  rng = random.Random(0)
  again = sequences()
  eng.generate(again)
  assert eng.shapes == covering
  assert [s.tokens for s in again] == [s.tokens for s in first]
  for a, b in zip(again, first):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
    assert [[i for i, _ in x] for x in a.top_logprobs] == [[i for i, _ in x]
                                                            for x in b.top_logprobs]


# A chat template short enough for the tiny run's 64 tokens of context.
CHAT_TEMPLATE = ("{% for m in messages %}{{ m['role'][0] + ': ' + m['content'] + '\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ 'a: ' }}{% endif %}")
MESSAGES = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'The for'}]
RENDERED = 's: Be brief.\nu: The for\na: '  # (the byte tokenizer: a token a byte)


@pytest.fixture(scope='module')
def chat_run(run, tmp_path_factory):
  """A copy of the tiny run whose tokenizer has a chat template (its tokenizer_config.json)."""
  copy = tmp_path_factory.mktemp('chat_run') / 'run'
  shutil.copytree(run, copy)
  with open(copy / workdir_lib.TOKENIZER_DIR / 'tokenizer_config.json', 'w',
            encoding='utf-8') as f:
    json.dump({'chat_template': CHAT_TEMPLATE}, f)
  return str(copy)


@pytest.fixture(scope='module')
def trained(chat_run):
  return workdir_lib.load(chat_run, devices=jax.devices()[:1])


@contextlib.contextmanager
def _serving(trained, context=tiny_run.SEQ_LEN, **kw):
  """A server in this process, on a free port (4 slots, chunks of 4): (base URL, its Server, to
  break on purpose, and shut_down(): uvicorn's shutdown, as on a signal; whether its thread ended
  within 60 s), serving the run's chat template as serve.main does. kw: Server's."""
  eng = engine.Engine(trained.config.model, trained.params, trained.tokenizer,
                      slots=4, context=context, chunk=4)
  srv = serve.Server(eng, NAME, chat_template=chat_lib.tokenizer_template(trained.tokenizer), **kw)
  uv = serve.listen(srv, '127.0.0.1', 0)
  sock = socket.socket()
  sock.bind(('127.0.0.1', 0))
  thread = threading.Thread(target=uv.run, kwargs={'sockets': [sock]}, daemon=True)
  thread.start()
  deadline = time.monotonic() + 60
  while not uv.started:
    assert thread.is_alive() and time.monotonic() < deadline
    time.sleep(0.05)

  def shut_down() -> bool:
    uv.should_exit = True
    thread.join(timeout=60)
    return not thread.is_alive()

  try:
    yield f'http://127.0.0.1:{sock.getsockname()[1]}', srv, shut_down
  finally:
    shut_down()
    sock.close()


@pytest.fixture(scope='module')
def local(trained):
  """The in-process server, with an API key and at most 4 sequences per request."""
  with _serving(trained, max_sequences=4, api_key=KEY) as (url, srv, _):
    yield url, srv


def _client(url: str, key: str = KEY) -> openai.OpenAI:
  return openai.OpenAI(base_url=f'{url}/v1', api_key=key, max_retries=0, timeout=120)


def _assert_internal(e: openai.APIError):
  """The generic answer to a failure of the server's own: nothing of the exception's text."""
  assert e.body == {'message': openai_api.INTERNAL, 'type': 'server_error', 'param': None,
                    'code': None}, e.body
  assert 'secret' not in str(e)


def test_the_api_key_is_asked_on_v1_and_not_on_health(local):
  url, _ = local
  for path in ('/v1/completions', '/v1/models', '/v1/nowhere'):
    status, answer = _post(url, b'{"prompt": "a"}', path)  # no Authorization header
    assert status == 401 and answer['error']['code'] == 'invalid_api_key', answer
    assert 'Bearer' in answer['error']['message'] and KEY not in answer['error']['message']
  wrong = _client(url, 'sk-wrong')
  with pytest.raises(openai.AuthenticationError, match='incorrect API key'):
    greedy(wrong, 'The ', max_tokens=3)
  with pytest.raises(openai.AuthenticationError):
    wrong.models.list()
  assert _get(f'{url}/health')['status'] == 'ok'  # open: for load balancers and supervisors
  assert greedy(_client(url), 'The ', max_tokens=3).choices[0].text


def test_a_request_asks_for_max_sequences_per_request_at_most(local):
  c = _client(local[0])
  with pytest.raises(openai.BadRequestError,
                     match=r'asks for 6 sequences \(3 prompts × n = 2\).* at most 4') as e:
    c.completions.create(model=NAME, prompt=['a', 'b', 'c'], n=2, max_tokens=2)
  assert (e.value.param, e.value.code, e.value.type) == (
      'n', 'too_many_sequences', 'invalid_request_error')
  with pytest.raises(openai.BadRequestError, match='asks for 5 sequences') as e:
    c.completions.create(model=NAME, prompt=list('abcde'), max_tokens=2)
  assert e.value.param == 'prompt'
  assert len(c.completions.create(model=NAME, prompt=['a', 'b'], n=2, max_tokens=2).choices) == 4


def test_an_unexpected_error_is_logged_and_answered_500_without_its_text(local, monkeypatch,
                                                                          caplog):
  url, srv = local

  def broken(*_):
    raise RuntimeError('secret detail')

  monkeypatch.setattr(srv, 'check', broken)
  with pytest.raises(openai.InternalServerError) as e:
    greedy(_client(url), 'The ', max_tokens=3)
  assert e.value.status_code == 500
  _assert_internal(e.value)
  assert 'POST /v1/completions failed' in caplog.text and 'RuntimeError: secret detail' in (
      caplog.text)  # with its traceback, server-side
  monkeypatch.undo()
  assert greedy(_client(url), 'The ', max_tokens=3).choices[0].text


def test_a_failing_callback_fails_its_own_request_only(local, monkeypatch, caplog):
  url, srv = local
  reported = client_lib.Request._reported  # noqa: SLF001

  def update(request, index, seq):  # the client's callback, in the engine's thread: raises for
    if srv.tokenizer.decode(seq.prompt) == 'boom':  # one prompt, every time
      raise RuntimeError('secret detail')
    return reported(request, index, seq)

  monkeypatch.setattr(client_lib.Request, '_reported', update)
  c = _client(url)
  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    fine = pool.submit(c.completions.create, model=NAME, prompt=['The ', 'A'], max_tokens=24,
                       temperature=0)
    whole = pool.submit(greedy, c, 'boom')
    streamed = pool.submit(lambda: list(greedy(c, 'boom', stream=True)))
    with pytest.raises(openai.InternalServerError) as e:
      whole.result()
    _assert_internal(e.value)
    with pytest.raises(openai.APIError) as e:
      streamed.result()
    _assert_internal(e.value)
    assert all(choice.text and choice.finish_reason in ('length', 'stop')  # the others go on
               for choice in fine.result().choices)
  assert 'on_update callback of a sequence raised' in caplog.text
  assert 'RuntimeError: secret detail' in caplog.text
  health = _get(f'{url}/health')
  assert health['status'] == 'ok' and health['busy'] == health['waiting'] == 0


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(local, monkeypatch, caplog):
  url, srv = local
  c = _client(url)
  before = greedy(c, 'The for ').choices[0].text
  decode, calls = srv.engine.runner.decode, []

  def fails_once(*args):
    calls.append(args)
    if len(calls) == 1:
      raise RuntimeError('secret detail')
    return decode(*args)

  monkeypatch.setattr(srv.engine.runner, 'decode', fails_once)
  with pytest.raises(openai.InternalServerError) as e:
    c.completions.create(model=NAME, prompt=['The for ', 'A'], max_tokens=12, temperature=0)
  assert e.value.status_code == 500
  _assert_internal(e.value)
  assert 'an engine step failed (1 in a row)' in caplog.text
  assert 'RuntimeError: secret detail' in caplog.text
  assert _get(f'{url}/health')['status'] == 'ok'
  assert greedy(c, 'The for ').choices[0].text == before  # a fresh cache, the same text


def test_stopping_fails_the_waiting_and_the_running_requests(trained, monkeypatch):
  with _serving(trained) as (url, srv, _):
    decode, gate = srv.engine.runner.decode, threading.Event()

    def held(*args):  # the first decode waits for the test
      gate.wait(60)
      return decode(*args)

    monkeypatch.setattr(srv.engine.runner, 'decode', held)
    c = _client(url)
    with concurrent.futures.ThreadPoolExecutor(6) as pool, contextlib.ExitStack() as opened:
      opened.callback(gate.set)  # (should an assertion fail first)
      asked = [pool.submit(greedy, c, f'The {i}', max_tokens=40) for i in range(6)]
      deadline = time.monotonic() + 60
      while True:  # one decoding (the first admitted), the others waiting behind it
        health = _get(f'{url}/health')
        if health['busy'] >= 1 and health['busy'] + health['waiting'] == 6:  # (admitted by now)
          break
        assert time.monotonic() < deadline
        time.sleep(0.05)
      assert health['busy'] >= 1 and health['waiting'] >= 1
      stopping = threading.Thread(target=srv.client.stop)
      stopping.start()
      while not srv.engine.stopped:
        time.sleep(0.01)
      gate.set()  # the waiting ones have failed; the decoding ones fail after this chunk
      stopping.join()
      for future in asked:
        with pytest.raises(openai.InternalServerError,
                           match='stopped before this request finished') as e:
          future.result(timeout=30)
        assert e.value.status_code == 503 and e.value.code == 'server_stopping'
    status, answer = _status(f'{url}/health')
    assert status == 503 and answer['error'] == {
        'message': 'the server is stopping', 'type': 'server_error', 'param': None,
        'code': 'engine_not_running'}
    with pytest.raises(openai.InternalServerError, match='stopped') as e:
      greedy(c, 'The ')
    assert e.value.status_code == 503


BROKEN = """from jax_pretrain import cli, serve
from jax_pretrain.engine import runner
def broken(*args):
  raise RuntimeError('secret detail')
runner.ModelRunner.decode = broken
cli.define_run_flags()
serve.define_flags()
cli.run(serve.main)
"""


def test_an_engine_whose_steps_keep_failing_stops_the_server_with_status_1(run):
  proc, url = _start(run, '--slots=2', env={**subprocess_env(), serve.API_KEY_ENV: KEY},
                     code=('-c', BROKEN))
  try:
    c = _client(url)
    for i in range(engine.MAX_FAILURES):
      with pytest.raises(openai.InternalServerError) as e:
        greedy(c, 'The ', max_tokens=4)
      _assert_internal(e.value)
      if i + 1 < engine.MAX_FAILURES:
        assert _get(f'{url}/health')['status'] == 'ok'  # the engine went on
    _, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == 1, stderr[-3000:]
  assert stderr.strip().splitlines()[-1] == (
      f'error: the engine stopped ({engine.MAX_FAILURES} engine steps failed in a row; the last '
      'error: RuntimeError: secret detail); the tracebacks are in the log above.')
  assert stderr.count('an engine step failed') == engine.MAX_FAILURES


class _Permits(threading.Semaphore):
  """Permits for the engine's steps (release(n): n more may run), and how many steps have ended
  (to wait for a step rather than for a time)."""

  def __init__(self):
    super().__init__(0)
    self.ended = 0


@contextlib.contextmanager
def _stepping(eng: engine.Engine):
  """The engine's steps (each decodes a chunk) wait for a permit of the yielded _Permits:
  release(n) lets n steps run (a step waits 60 s at most: nothing hangs for good). On exit they
  run freely again."""
  step, permits, free = eng.step, _Permits(), threading.Event()

  def held():
    if not free.is_set():
      permits.acquire(timeout=60)
    try:
      return step()
    finally:
      permits.ended += 1

  eng.step = held
  try:
    yield permits
  finally:
    free.set()
    permits.release(100)
    del eng.step


def _address(url: str) -> tuple[str, int]:
  return '127.0.0.1', int(url.rsplit(':', 1)[1])


def _refused(url: str) -> bool:
  """Whether the server at url refuses connections (it stopped listening)."""
  try:
    socket.create_connection(_address(url), timeout=5).close()
  except ConnectionRefusedError:
    return True
  return False


def _until(condition, what: str, timeout: float = 60):
  """Waits until condition() is true (a hang fails the test after timeout seconds)."""
  deadline = time.monotonic() + timeout
  while not condition():
    assert time.monotonic() < deadline, f'timed out waiting until {what}'
    time.sleep(0.02)


@pytest.fixture
def queued(local, monkeypatch):
  """The in-process server, its queue holding 4 sequences (as many as a request may ask for)."""
  url, srv = local
  monkeypatch.setattr(srv.client, 'max_queued', 4)
  return url, srv


def _completion(prompt='The ', **kw) -> bytes:
  return json.dumps({'model': NAME, 'prompt': prompt, 'max_tokens': 4, **kw}).encode()


def test_a_burst_beyond_the_queue_gets_429_and_every_request_an_answer(queued):
  url, srv = queued
  with concurrent.futures.ThreadPoolExecutor(12) as pool, _stepping(srv.engine) as permits:
    burst = [pool.submit(_answer, url, _completion(f'{i} '), key=KEY) for i in range(12)]
    # The engine decodes nothing meanwhile: 4 wait in the queue, the 8 others are refused.
    _until(lambda: sum(f.done() for f in burst) == 8, '8 requests are answered')
    assert srv.engine.stats()['waiting'] == 4
    permits.release(100)
    answers = [f.result(timeout=120) for f in burst]
  assert sorted(status for status, _, _ in answers) == [200] * 4 + [429] * 8
  for status, answer, headers in answers:
    if status == 200:
      assert answer['choices'][0]['text']
      continue
    assert headers['Retry-After'] == str(openai_api.RETRY_AFTER_S)
    assert answer == {'error': {
        'message': 'The server is busy: its queue of sequences waiting for a slot '
                   '(--max_queued_sequences=4) has no room for this request. Please try again in '
                   '1s.', 'type': 'requests', 'param': None, 'code': 'rate_limit_exceeded'}}
  health = _get(f'{url}/health')
  assert health['busy'] == health['waiting'] == 0 and health['max_queued_sequences'] == 4


def test_the_openai_client_retries_a_429_and_then_gets_its_answer(queued):
  url, srv = queued
  statuses = []

  def seen(response):  # the client's HTTP responses: the queue drains after the first 429
    statuses.append(response.status_code)
    if response.status_code == 429:
      permits.release(100)

  client = openai.OpenAI(base_url=f'{url}/v1', api_key=KEY, max_retries=4, timeout=120,
                         http_client=openai.DefaultHttpxClient(event_hooks={'response': [seen]}))
  with concurrent.futures.ThreadPoolExecutor(1) as pool, _stepping(srv.engine) as permits:
    first = pool.submit(_post, url, _completion(['a', 'b', 'c']), key=KEY)
    _until(lambda: srv.engine.stats()['waiting'] == 3, '3 of the 4 places are taken')
    answer = greedy(client, 'The ', max_tokens=4, n=2)  # a 429, retried after Retry-After
    assert first.result(timeout=120)[0] == 200
  assert statuses[0] == 429 and statuses[-1] == 200, statuses
  assert len(answer.choices) == 2 and all(c.finish_reason in ('length', 'stop') and c.text
                                          for c in answer.choices)


def test_a_client_that_disconnects_cancels_its_sequences(local, monkeypatch):
  url, srv = local
  submitted, submit = [], srv.engine.submit
  monkeypatch.setattr(srv.engine, 'submit', lambda seq: submit(submitted.append(seq) or seq))
  body = _completion(max_tokens=40)
  with _stepping(srv.engine) as permits, socket.create_connection(_address(url)) as sock:
    sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer %s\r\n'
                 b'Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' % (
                     KEY.encode(), len(body), body))
    _until(lambda: submitted, 'the request is queued')
    # Two steps: the first dispatches a chunk of 4 tokens, the second the next chunk and reads the
    # first (the device never waits for the host); then the engine waits again.
    permits.release(2)
    [seq] = submitted
    _until(lambda: seq.tokens, 'the first chunk is decoded')
    sock.close()
    _until(lambda: seq.cancelled, 'the server cancels the sequence of the client gone')
    generated = srv.engine.stats()['tokens_generated']
  _until(lambda: seq.done, 'the sequence ends')
  # The chunk in flight when it was cancelled is dropped: nothing more for it.
  assert seq.finish_reason == 'cancelled' and len(seq.tokens) == 4
  assert srv.engine.stats()['tokens_generated'] == generated


def _send(url: str, body: bytes) -> socket.socket:
  """A completion sent on a raw connection (closing it: the client goes away)."""
  sock = socket.create_connection(_address(url))
  sock.sendall(b'POST /v1/completions HTTP/1.1\r\nHost: test\r\nAuthorization: Bearer %s\r\n'
               b'Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s' % (
                   KEY.encode(), len(body), body))
  return sock


def test_clients_that_go_away_while_queued_give_their_places_back(queued):
  """Every slot busy, the queue full of requests whose clients have gone: a new request is
  queued and answered, not refused (the places of the gone were held until a slot freed)."""
  url, srv = queued
  with _stepping(srv.engine) as permits:
    gone = [_send(url, _completion(f'{i} ', max_tokens=8)) for i in range(4)]
    _until(lambda: srv.engine.stats()['waiting'] == 4, 'the queue is full')
    for sock in gone:
      sock.close()
    _until(lambda: srv.engine.stats()['waiting'] == 0, 'the places of the gone are free', 20)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
      asked = pool.submit(_answer, url, _completion('The '), key=KEY)
      _until(lambda: srv.engine.stats()['waiting'] == 1, 'the new request is queued')
      permits.release(100)
      status, answer, _ = asked.result(timeout=120)
  assert status == 200 and answer['choices'][0]['text'], answer


def test_a_step_that_outlives_the_shutdown_reports_to_no_closed_event_loop(trained, monkeypatch,
                                                                           caplog):
  """The shutdown gives up on two requests (503) and on the engine's thread, whose step hangs;
  the event loop closes; then the step returns and the engine fails the sequences it decodes:
  nothing is reported to the closed loop (before: 'Event loop is closed', logged twice a
  sequence)."""
  with _serving(trained, shutdown_timeout=0) as (url, srv, shut_down):
    decode, entered, gate = srv.engine.runner.decode, threading.Event(), threading.Event()

    def held(*args):
      entered.set()
      gate.wait(60)
      return decode(*args)

    monkeypatch.setattr(srv.engine.runner, 'decode', held)
    c = _client(url)
    with concurrent.futures.ThreadPoolExecutor(2) as pool, contextlib.ExitStack() as opened:
      opened.callback(gate.set)  # (should an assertion fail first)
      asked = [pool.submit(greedy, c, f'The {i}', max_tokens=40) for i in range(2)]
      _until(lambda: entered.is_set() and sum(srv.engine.stats()[k] for k in ('busy', 'waiting'))
             == 2, 'one decodes (held), the other decodes or waits', 300)
      assert shut_down()  # uvicorn's thread ended, its event loop closed; the step still hangs
      for future in asked:
        with pytest.raises(openai.InternalServerError, match='stopped before this request'):
          future.result(timeout=60)
      engine_thread = srv.client._thread  # noqa: SLF001
      assert engine_thread.is_alive()
      gate.set()
      engine_thread.join(60)
  assert not engine_thread.is_alive()
  assert 'Event loop is closed' not in caplog.text and 'raised' not in caplog.text, caplog.text


HUNG = """import signal, sys, threading, time
from jax_pretrain import cli, serve
from jax_pretrain.engine import runner
compile = runner.ModelRunner.compile
def hung(self, shape):
  if threading.current_thread().name == 'engine-compiler':
    time.sleep(3600)  # a compile in the background that does not end
  return compile(self, shape)
runner.ModelRunner.compile = hung
serve.CLOSE_TIMEOUT_S = 1
cli.define_run_flags()
serve.define_flags()
cli.run(serve.main)
"""


@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGINT])
def test_a_signal_closes_the_engine_without_waiting_for_a_compile_that_hangs(run, sig):
  """SIGTERM ran no cleanup (uvicorn re-raises it: the process ended before the engine's close);
  Ctrl-C waited for the compile in progress without end. Both now close the engine, waiting for
  that compile CLOSE_TIMEOUT_S at most, and end by the signal."""
  proc, url = _start(run, '--warmup', '--slots=2', code=('-c', HUNG))
  try:
    _until(lambda: _get(f'{url}/health')['compiling_shapes'] > 0, 'a compile in the background')
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
  finally:
    proc.kill()
  assert proc.returncode == -sig, stderr[-3000:]
  assert 'the background compiler is still compiling after 1 s: exiting without it' in stderr


def test_health_answers_503_while_the_engine_has_work_and_makes_no_progress(local, monkeypatch):
  url, srv = local
  monkeypatch.setattr(srv, 'stall_timeout', 1.0)
  time.sleep(1.5)  # idle for longer than that: not stalled
  assert _status(f'{url}/health')[0] == 200
  with concurrent.futures.ThreadPoolExecutor(1) as pool, _stepping(srv.engine):
    asked = pool.submit(greedy, _client(url), 'The ', max_tokens=4)
    _until(lambda: _status(f'{url}/health')[0] == 503, '/health says the engine is stalled')
    status, answer = _status(f'{url}/health')
    assert answer['error']['code'] == 'engine_stalled' and answer['error']['type'] == (
        'server_error') and 'generated no token' in answer['error']['message']
  assert asked.result(timeout=120).choices[0].text
  assert _status(f'{url}/health')[0] == 200


class _OffTheLoop:
  """A tokenizer that counts its encode/decode calls, and those made in a thread that runs an
  event loop (the server's: where nothing heavy belongs)."""

  def __init__(self, tokenizer):
    self.tokenizer, self.calls, self.on_the_loop = tokenizer, 0, []

  def __getattr__(self, name):
    attribute = getattr(self.tokenizer, name)
    if name not in ('encode', 'decode'):
      return attribute

    def counted(*args, **kw):
      self.calls += 1
      with contextlib.suppress(RuntimeError):  # (no loop in this thread)
        asyncio.get_running_loop()
        self.on_the_loop.append(name)
      return attribute(*args, **kw)

    return counted


def test_tokenizing_and_detokenizing_run_off_the_event_loop(local, monkeypatch):
  url, srv = local
  tokenizer = _OffTheLoop(srv.tokenizer)
  monkeypatch.setattr(srv, 'tokenizer', tokenizer)
  c = _client(url)  # (the same shapes twice: one compile)
  whole = greedy(c, [list(b'The'), list(b'A')], max_tokens=8, logprobs=1)  # ids: decoded
  assert all(choice.logprobs.tokens for choice in whole.choices)
  streamed = greedy(c, ['The', 'A'], max_tokens=8, stream=True, logprobs=1)  # text: encoded
  assert ''.join(e.choices[0].text for e in streamed)
  assert tokenizer.calls > 20 and tokenizer.on_the_loop == []


def test_a_shutdown_answers_every_request_in_flight_by_its_deadline(trained):
  """Three requests decode when the server is told to stop: the one that a single more step
  finishes is answered (200); the two that the held engine cannot finish wait for the shutdown's
  deadline, then get 503; the server exits while the engine's step still hangs. Ordered by events
  alone (the engine's steps, the deadline's arrival), not by the clock."""
  deadline = threading.Event()
  with concurrent.futures.ThreadPoolExecutor(4) as pool, \
      _serving(trained, shutdown_timeout=600) as (url, srv, shut_down), \
      _stepping(srv.engine) as permits:
    srv.shutdown_deadline = lambda: asyncio.to_thread(deadline.wait, 120)
    c = _client(url)

    def ask(prompt, **kw):
      return list(greedy(c, prompt, **kw)) if kw.get('stream') else greedy(c, prompt, **kw)

    # Queued one after the other, admitted into slots 0, 1, 2: once the short one's slot is free,
    # the decode of the two others has the first one's shape (no compile after the shutdown).
    short = pool.submit(ask, 'The ', max_tokens=4)
    _until(lambda: srv.engine.stats()['waiting'] == 1, 'the short request is queued')
    long = pool.submit(ask, 'A ', max_tokens=40)
    _until(lambda: srv.engine.stats()['waiting'] == 2, 'the long request is queued')
    streamed = pool.submit(ask, 'An ', max_tokens=40, stream=True)
    _until(lambda: srv.engine.stats()['waiting'] == 3, 'the streamed request is queued')
    # The first step admits and prefills the three and dispatches their first chunk: all of the
    # short one's 4 tokens (the compiles happen here); the second reads it.
    permits.release(1)
    _until(lambda: permits.ended == 1, 'the first step has run')
    assert srv.engine.stats()['busy'] == 3 and not short.done()  # decoding
    stopping = pool.submit(shut_down)
    _until(lambda: _refused(url), 'uvicorn closes its socket')
    permits.release(1)  # the second step; the next one hangs (for 60 s)
    assert short.result(timeout=60).choices[0].finish_reason == 'length'  # finished in time
    assert not long.done() and not streamed.done()  # waiting for the deadline
    deadline.set()
    with pytest.raises(openai.InternalServerError, match='stopped before this request') as e:
      long.result(timeout=60)
    assert e.value.status_code == 503 and e.value.code == 'server_stopping'
    with pytest.raises(openai.APIError, match='stopped before this request') as e:
      streamed.result(timeout=60)
    assert e.value.body['code'] == 'server_stopping'
    assert stopping.result(timeout=60)  # uvicorn's thread ended ...
    assert permits.ended == 2  # ... while the engine's third step still hangs


def test_limits_and_timeouts_out_of_range_are_one_error_line():
  flags = types.SimpleNamespace(max_sequences_per_request=8, max_queued_sequences=8,
                                stall_timeout=300.0, shutdown_timeout=0.0)
  serve.check_flags(flags)
  for name, value, message in [
      ('max_queued_sequences', 4, '--max_queued_sequences=4: it must be >= '
       '--max_sequences_per_request (8), else the largest request could never be queued'),
      ('stall_timeout', 0.0, '--stall_timeout=0.0: it must be > 0 seconds'),
      ('shutdown_timeout', -1.0, '--shutdown_timeout=-1.0: it must be >= 0 seconds')]:
    with pytest.raises(UserError) as e:
      serve.check_flags(types.SimpleNamespace(**{**vars(flags), name: value}))
    assert str(e.value) == message


def chat(c, messages=MESSAGES, **kw):
  return c.chat.completions.create(model=NAME, messages=messages, **kw)


def test_a_chat_completion_is_the_completion_of_its_rendered_messages(local):
  url, srv = local
  c = _client(url)
  assert chat_lib.prompt_ids(srv.chat_template, MESSAGES, srv.tokenizer).tolist() == list(
      RENDERED.encode())  # as SFT renders them
  answer = chat(c, temperature=0, max_tokens=20)
  plain = greedy(c, RENDERED, max_tokens=20)
  [choice] = answer.choices
  assert answer.object == 'chat.completion' and answer.model == NAME
  assert choice.message.role == 'assistant' and choice.message.content
  assert choice.message.content == plain.choices[0].text
  assert choice.finish_reason == plain.choices[0].finish_reason and choice.logprobs is None
  assert answer.usage.prompt_tokens == len(RENDERED)
  assert answer.usage.completion_tokens == len(choice.message.content.encode()) <= 20
  assert answer.usage.total_tokens == len(RENDERED) + answer.usage.completion_tokens
  assert chat(c, temperature=0, max_completion_tokens=20).choices[0].message.content == (
      choice.message.content)
  rest = tiny_run.SEQ_LEN - len(RENDERED)  # without a limit: the rest of the context
  assert chat(c, temperature=0).choices[0].message.content == greedy(
      c, RENDERED, max_tokens=rest).choices[0].text


def test_a_streamed_chat_sends_each_choices_role_then_its_content(local):
  c = _client(local[0])
  kw = dict(max_tokens=24, temperature=1.0, seed=3, n=2)
  whole = chat(c, **kw)
  chunks = list(chat(c, **kw, stream=True, stream_options={'include_usage': True}))
  assert {chunk.object for chunk in chunks} == {'chat.completion.chunk'}
  for i, choice in enumerate(whole.choices):
    mine = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].index == i]
    assert mine[0].delta.role == 'assistant' and mine[0].delta.content == ''
    # (its role, then its content in one piece or more: a reader slower than the decoding gets
    # the pending updates merged, test_engine_client; seen under a CPU hog)
    assert len(mine) >= 2 and all(d.delta.role is None for d in mine[1:])
    assert ''.join(d.delta.content or '' for d in mine) == choice.message.content
    assert [d.finish_reason for d in mine] == [None] * (len(mine) - 1) + [choice.finish_reason]
  assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
  assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
  # (the second of one prompt: its first 16 tokens (of 27) cached by the first)
  assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 16


def test_a_chats_next_turn_reports_the_prompt_tokens_its_earlier_turn_cached(trained):
  """usage.prompt_tokens_details.cached_tokens: the prompt's block-aligned prefix whose keys and
  values the engine's prefix cache held (the earlier turn's prompt and answer)."""
  with _serving(trained) as (url, _, _):
    c = _client(url)
    first = chat(c, temperature=0, max_tokens=16)
    content = first.choices[0].message.content
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert len(content.encode()) == first.usage.completion_tokens  # (a byte a token)
    held = (RENDERED + content).encode()[:-1]  # (its last token ended it: not run)
    messages = [*MESSAGES, {'role': 'assistant', 'content': content},
                {'role': 'user', 'content': 'Go on'}]
    prompt = (RENDERED + content + '\nu: Go on\na: ').encode()
    common = next(i for i, (x, y) in enumerate(zip([*held, -1], prompt)) if x != y)
    expected = min(common, len(prompt) - 1) // 16 * 16
    second = chat(c, messages, temperature=0, max_tokens=8)
    assert second.usage.prompt_tokens == len(prompt) and expected >= 32
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    # Asked again, streamed: all of its prompt but the last token, in whole blocks of 16.
    chunks = list(chat(c, messages, temperature=0, max_tokens=8, stream=True,
                       stream_options={'include_usage': True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // 16 * 16
    assert ''.join(x.choices[0].delta.content or '' for x in chunks if x.choices) == (
        second.choices[0].message.content)
    # A completion of the first turn's prompt: its first 16 tokens (of 27) held.
    assert greedy(c, RENDERED, max_tokens=4).usage.prompt_tokens_details.cached_tokens == 16


def test_n_chat_choices_are_the_completions_choices_of_the_same_seed(local):
  c = _client(local[0])
  answer = chat(c, max_tokens=16, temperature=1.0, seed=5, n=2)
  plain = c.completions.create(model=NAME, prompt=RENDERED, max_tokens=16, temperature=1.0,
                               seed=5, n=2)
  contents = [choice.message.content for choice in answer.choices]
  assert contents == [choice.text for choice in plain.choices] and contents[0] != contents[1]
  assert [choice.index for choice in answer.choices] == [0, 1]
  assert answer.usage.prompt_tokens == len(RENDERED)  # the prompt once, as completions count it
  assert answer.usage.completion_tokens == sum(len(text.encode()) for text in contents)


def test_a_chat_stops_at_a_stop_string(local):
  c = _client(local[0])
  text = chat(c, temperature=0, max_tokens=30).choices[0].message.content
  stop = text[5:8]
  cut = chat(c, temperature=0, max_tokens=30, stop=[stop, 'never there']).choices[0]
  assert cut.message.content == text[:text.index(stop)] and cut.finish_reason == 'stop'
  streamed = chat(c, temperature=0, max_tokens=30, stop=stop, stream=True)
  assert ''.join(e.choices[0].delta.content or '' for e in streamed) == text[:text.index(stop)]


def test_chat_logprobs_are_the_completions_logprobs_in_the_chat_form(local):
  c = _client(local[0])
  answer = chat(c, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
  plain = greedy(c, RENDERED, max_tokens=8, logprobs=3).choices[0].logprobs
  content = answer.choices[0].logprobs.content
  assert [t.token for t in content] == plain.tokens
  assert ''.join(t.token for t in content) == answer.choices[0].message.content
  assert b''.join(bytes(t.bytes) for t in content) == answer.choices[0].message.content.encode()
  for t, logprob in zip(content, plain.token_logprobs):
    assert t.logprob == pytest.approx(logprob, abs=1e-5) and len(t.bytes) == 1  # (a byte each)
    assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token  # greedy
    assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-5)
  streamed = chat(c, temperature=0, max_tokens=8, logprobs=True, stream=True)
  tokens = [t for e in streamed if e.choices and e.choices[0].logprobs
            for t in e.choices[0].logprobs.content]
  assert [t.token for t in tokens] == plain.tokens and all(t.top_logprobs == [] for t in tokens)


@pytest.mark.parametrize('body, param', [
    (b'{"messages": []}', 'messages'),
    (b'{"messages": [{"role": "user"}]}', 'messages'),  # no content
    (b'{"messages": [{"role": "user", "content": "hi"}], "tols": []}', 'tols'),  # unknown field
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f"}}]}', 'tool_choice'),  # ("auto": no parser of free text)
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
     b'"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": '
     b'"g"}}}', 'tool_choice'),  # (not among the tools)
    (b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "functio"}], '
     b'"tool_choice": "required"}', 'tools'),
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"json_schema", "json_schema": {"name": "x"}}}', 'response_format'),  # (no schema)
    (b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": '
     b'"xml"}}', 'response_format'),
    (b'{"messages": [{"role": "tool", "content": "4"}]}', 'messages'),  # no tool_call_id
    (b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 'top_logprobs'),
    (b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, "top_logprobs": 21}',
     'top_logprobs'),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 64}', 'max_tokens'),
    (b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, '
     b'"max_completion_tokens": 6}', 'max_completion_tokens'),
])
def test_bad_chat_requests_get_400(local, body, param):
  status, answer = _post(local[0], body, '/v1/chat/completions', key=KEY)
  assert status == 400, answer
  assert answer['error']['type'] == 'invalid_request_error' and answer['error']['param'] == param


def test_a_chat_without_a_chat_template_gets_400_naming_it(client):
  """The shared server's run has no chat template (the tiny run's byte tokenizer has none)."""
  with pytest.raises(openai.BadRequestError, match='tokenizer has no chat template') as e:
    chat(client)
  assert (e.value.status_code, e.value.param, e.value.code) == (
      400, 'messages', 'chat_template_missing')
  assert 'tokenizer_config.json' in e.value.message


def test_the_chat_template_travels_to_the_hf_export(local, chat_run, tmp_path):
  """Exported, then loaded with transformers: its apply_chat_template gives the served prompt."""
  transformers = pytest.importorskip('transformers')
  _, srv = local
  assert hf.export(chat_run, str(tmp_path / 'hf')) == []
  theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / 'hf'))
  assert list(theirs.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)) == (
      chat_lib.prompt_ids(srv.chat_template, MESSAGES, srv.tokenizer).tolist())


@pytest.fixture(scope='module')
def qwen_run(tmp_path_factory):
  """A run (random weights, the test preset) whose tokenizer is a byte-level BPE with Qwen3's
  special tokens and whose tokenizer/ has its chat template only as chat_template.jinja (as
  transformers 5's save_pretrained writes it)."""
  directory = tmp_path_factory.mktemp('qwen_tokenizer')
  chat_templates.bytelevel(directory)
  (directory / 'chat_template.jinja').write_text(chat_templates.QWEN3, encoding='utf-8')
  tok = tokenizer_lib.load(str(directory))
  c = config_lib.preset('test')
  c.data.seq_len = 128
  resolved, _ = config_lib.resolve(c, num_devices=1, backend='cpu',
                                   tokenizer_vocab_size=tok.vocab_size)
  params = jax.jit(model_lib.Transformer(resolved.model).init)(
      jax.random.key(0), np.zeros((1, 8), np.int32))['params']
  workdir = str(tmp_path_factory.mktemp('qwen_run') / 'run')
  workdir_lib.create(workdir, c, jax.tree.map(np.asarray, meta.unbox(params)), tok)
  config = tokenizer_lib.read_hf_file(f'{workdir}/tokenizer', tokenizer_lib.HF_CONFIG_FILE)
  assert config is not None and 'chat_template' not in config
  return workdir


def test_a_qwen3_style_multi_turn_chat_is_served_with_the_ids_transformers_gives(qwen_run):
  """Qwen3's template drops the <think> of the earlier turn: rendered once, the chat is served
  (200), its prompt the ids of transformers' apply_chat_template on the run's tokenizer/."""
  transformers = pytest.importorskip('transformers')
  messages = [chat_templates.SYSTEM, *chat_templates.CONVERSATIONS['multi']]
  theirs = transformers.AutoTokenizer.from_pretrained(f'{qwen_run}/tokenizer')
  expected = list(theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             return_dict=False))
  trained = workdir_lib.load(qwen_run, devices=jax.devices()[:1])
  with _serving(trained, context=128) as (url, srv, _):
    request = openai_api.ChatRequest.model_validate_json(json.dumps({'messages': messages}))
    assert srv.chat_prompt(request) == expected
    c = _client(url)
    answer = chat(c, messages=messages, temperature=0, max_tokens=8)
    plain = greedy(c, expected, max_tokens=8)  # the completion of transformers' ids
  assert answer.usage.prompt_tokens == len(expected)
  assert answer.choices[0].message.content == plain.choices[0].text
  assert answer.usage.completion_tokens == plain.usage.completion_tokens > 0


def test_serve_takes_a_chat_template_file(run, tmp_path):
  """--chat_template=FILE serves chats for a run without one; a missing or unparsable file is one
  error line before the run is loaded."""
  (tmp_path / 'chat.jinja').write_text(CHAT_TEMPLATE, encoding='utf-8')
  for name, text, message in [
      ('missing.jinja', None, 'missing.jinja: chat template file not found.'),
      ('bad.jinja', '{% for m in messages %}', 'bad.jinja: the chat template does not parse (')]:
    if text is not None:
      (tmp_path / name).write_text(text, encoding='utf-8')
    out = subprocess.run(
        [sys.executable, '-m', 'jax_pretrain.serve', f'--workdir={run}',
         f'--chat_template={tmp_path / name}'],
        cwd=ROOT, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stderr.strip().startswith(f'error: {tmp_path / name}'), (
        out.stderr[-3000:])
    assert message in out.stderr and 'Traceback' not in out.stderr
  proc, url = _start(run, '--slots=2', '--chunk=4', f'--chat_template={tmp_path / "chat.jinja"}')
  try:
    c = openai.OpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0, timeout=120)
    answer = chat(c, temperature=0, max_tokens=12)
    assert answer.choices[0].message.content == greedy(c, RENDERED, max_tokens=12).choices[0].text
    assert answer.usage.prompt_tokens == len(RENDERED)
  finally:
    proc.terminate()
    proc.communicate(timeout=60)


def _raw_stream(url: str, body: dict, path: str = '/v1/completions') -> list[str]:
  """A streamed request's data lines, raw (what a client that parses server-sent events reads)."""
  request = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={
      'Content-Type': 'application/json', 'Authorization': f'Bearer {KEY}'})
  with urllib.request.urlopen(request, timeout=120) as r:
    return [line[len('data: '):] for line in r.read().decode().splitlines()
            if line.startswith('data: ')]


def test_an_error_in_a_stream_is_an_error_event_then_done(local, monkeypatch):
  url, _ = local
  reported = client_lib.Request._reported  # noqa: SLF001

  def update(request, index, seq):
    raise RuntimeError('secret detail')

  monkeypatch.setattr(client_lib.Request, '_reported', update)
  lines = _raw_stream(url, {'prompt': 'The ', 'max_tokens': 8, 'stream': True})
  assert lines[-1] == '[DONE]' and json.loads(lines[-2]) == openai_api.internal().body()
  monkeypatch.setattr(client_lib.Request, '_reported', reported)
  lines = _raw_stream(url, {'prompt': 'The ', 'max_tokens': 8, 'stream': True})
  assert lines[-1] == '[DONE]' and all('error' not in json.loads(x) for x in lines[:-1])


NULLS = {'temperature': None, 'top_p': None, 'top_k': None, 'n': None, 'stream': None,
         'stream_options': None, 'stop': None, 'presence_penalty': None,
         'frequency_penalty': None, 'logit_bias': None, 'user': None, 'model': None}


def test_null_means_the_default(local):
  """Every nullable field sent as null (as the openai SDK sends a caller's None): the answer of the
  same request without them (seeded: temperature's default, 1, samples)."""
  url, _ = local
  plain = {'prompt': 'The ', 'seed': 3}
  nulls = {**plain, **NULLS, 'max_tokens': None, 'echo': None, 'logprobs': None,
           'best_of': None, 'suffix': None}
  status, with_nulls = _post(url, json.dumps(nulls).encode(), key=KEY)
  assert status == 200, with_nulls
  _, without = _post(url, json.dumps(plain).encode(), key=KEY)
  assert with_nulls['choices'] == without['choices']
  assert with_nulls['usage']['completion_tokens'] <= 16
  assert with_nulls['choices'][0]['logprobs'] is None
  chat_plain = {'messages': MESSAGES, 'seed': 3, 'max_completion_tokens': 12}
  chat_nulls = {**chat_plain, **NULLS, 'max_tokens': None, 'logprobs': None,
                'top_logprobs': None, 'tools': None, 'tool_choice': None,
                'response_format': None, 'parallel_tool_calls': None, 'metadata': None,
                'store': None}
  answers = [_post(url, json.dumps(b).encode(), '/v1/chat/completions', key=KEY)
             for b in (chat_nulls, chat_plain)]
  assert [status for status, _ in answers] == [200, 200], answers
  assert answers[0][1]['choices'] == answers[1][1]['choices']


def test_the_no_op_forms_are_accepted_and_change_nothing(local):
  c = _client(local[0])
  plain = chat(c, temperature=0, max_tokens=12).choices[0].message.content
  same = chat(c, temperature=0, max_tokens=12, tools=[], tool_choice='none',
              response_format={'type': 'text'}, store=False, metadata={'run': 'test'},
              parallel_tool_calls=True, user='someone', service_tier='auto')
  assert same.choices[0].message.content == plain


TOOL_CHAT = [
    {'role': 'user', 'content': [{'type': 'text', 'text': 'Add 2'}, {'type': 'text',
                                                                     'text': 'and 2'}]},
    {'role': 'assistant', 'content': None, 'tool_calls': [
        {'id': 'call_1', 'type': 'function',
         'function': {'name': 'add', 'arguments': '{"a": 2, "b": 2}'}}]},
    {'role': 'tool', 'tool_call_id': 'call_1', 'content': '4'}]


def test_an_agents_history_is_rendered(local):
  """A user's content parts (their texts joined with newlines for a template that prints a
  message's content, as vLLM joins them), an assistant's null content with its tool calls, a
  tool's answer: the completion of the rendered text."""
  c = _client(local[0])
  answer = chat(c, messages=TOOL_CHAT, temperature=0, max_tokens=10)
  rendered = 'u: Add 2\nand 2\na: \nt: 4\na: '
  assert answer.usage.prompt_tokens == len(rendered)
  assert answer.choices[0].message.content == greedy(c, rendered, max_tokens=10).choices[0].text


def test_a_template_that_loops_over_content_gets_the_parts_as_transformers_passes_them():
  looping = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
             "{% else %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endif %}"
             "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.a }})"
             "{% endfor %};{% endfor %}")
  assert openai_api.content_parts(looping) and not openai_api.content_parts(CHAT_TEMPLATE)
  template = chat_lib.ChatTemplate(looping, {}, '/srv/secret/tokenizer_config.json')
  r = openai_api.ChatRequest.model_validate({'messages': TOOL_CHAT})
  assert template.render([m.rendered(True) for m in r.messages], False) == (
      'user:[Add 2][and 2];assistant:add(2);tool:4;')


def test_a_template_error_names_no_server_path(local, monkeypatch):
  url, srv = local
  monkeypatch.setattr(srv, 'chat_template', chat_lib.ChatTemplate(
      "{{ raise_exception('no system messages') }}", {}, '/srv/secret/tokenizer_config.json'))
  status, answer = _post(url, json.dumps({'messages': MESSAGES}).encode(),
                         '/v1/chat/completions', key=KEY)
  assert status == 400 and 'no system messages' in answer['error']['message']
  assert '/srv' not in answer['error']['message'], answer


def test_logit_bias_and_penalties_are_applied(local):
  c = _client(local[0])
  plain = greedy(c, 'The ', max_tokens=16).choices[0].text
  forced = greedy(c, 'The ', max_tokens=16, logit_bias={str(ord('x')): 100}).choices[0].text
  assert forced == 'x' * 16
  banned = greedy(c, 'The ', max_tokens=16, logit_bias={str(ord(plain[0])): -100})
  assert banned.choices[0].text[0] != plain[0]
  repeats = lambda text: len(text) - len(set(text))
  penalized = greedy(c, 'The ', max_tokens=16, frequency_penalty=2.0).choices[0].text
  assert repeats(penalized) < repeats(plain), (plain, penalized)
  present = chat(c, temperature=0, max_tokens=16, presence_penalty=2.0).choices[0].message.content
  assert present != chat(c, temperature=0, max_tokens=16).choices[0].message.content


def test_twenty_top_logprobs(local):
  c = _client(local[0])
  answer = chat(c, temperature=0, max_tokens=4, logprobs=True, top_logprobs=20)
  content = answer.choices[0].logprobs.content
  assert [len(t.top_logprobs) for t in content] == [20] * len(content)
  for t in content:
    lps = [x.logprob for x in t.top_logprobs]
    assert lps == sorted(lps, reverse=True) and t.logprob == pytest.approx(lps[0], abs=1e-5)
  plain = greedy(c, RENDERED, max_tokens=4, logprobs=20).choices[0].logprobs
  assert [len(top) for top in plain.top_logprobs] == [20] * 4


def test_the_models_generation_config_gives_the_defaults_a_request_overrides(local, monkeypatch):
  url, srv = local
  c = _client(url)
  chat(c, temperature=0, max_tokens=1)  # (the chat's prompt cached: the next two reuse as much
  # of it, and so run the same programs; the earlier tests' requests leave other prefixes cached,
  # and a prefill of other lengths may differ in float rounding, enough to turn a close argmax)
  greedy_text = chat(c, temperature=0, max_tokens=6).choices[0].message.content
  monkeypatch.setattr(srv, 'defaults', openai_api.Defaults(temperature=0.0, max_tokens=6))
  answer = chat(c).choices[0]  # no temperature, no max_tokens: the model's
  assert answer.message.content == greedy_text and answer.finish_reason == 'length'
  sampled = chat(c, temperature=1.0, seed=1, max_tokens=8, n=2).choices
  assert sampled[0].message.content != sampled[1].message.content  # the request's own


def _text_tokenizers(tmp_path):
  from pydoc_data import topics  # noqa: PLC0415
  texts = [topics.topics[k] for k in sorted(topics.topics)[:60]]
  yield tokenizer_lib.ByteTokenizer()
  yield tokenizer_lib.train_sentencepiece(texts, str(tmp_path / 'sp.model'), 400)
  yield tokenizer_lib.train_bytelevel_bpe(texts, str(tmp_path / 'bpe' / 'tokenizer.json'), 400)


def _own_bytes(tok, token: int) -> bytes:
  """A token's bytes as its tokenizer's vocabulary has them (its file read with its own library:
  transformers' byte-level alphabet; sentencepiece's pieces, '▁' a space, <0xNN> a byte)."""
  if isinstance(tok, tokenizer_lib.ByteTokenizer):
    return bytes([token])
  if isinstance(tok, tokenizer_lib.SentencePieceTokenizer):
    import sentencepiece  # noqa: PLC0415
    piece = sentencepiece.SentencePieceProcessor(model_file=tok.path).IdToPiece(token)
    return (bytes([int(piece[3:5], 16)]) if re.fullmatch(r'<0x[0-9A-F]{2}>', piece)
            else piece.replace('\u2581', ' ').encode())
  import tokenizers  # noqa: PLC0415
  slow = importlib.import_module('transformers.convert_slow_tokenizer')
  byte_of = {c: b for b, c in slow.bytes_to_unicode().items()}
  return bytes(byte_of[c] for c in tokenizers.Tokenizer.from_file(tok.path).id_to_token(token))


def test_logprob_tokens_join_into_the_content(tmp_path):
  """With the byte tokenizer (a character in several tokens), a sentencepiece model (a space
  that a token decoded alone drops) and a byte-level BPE: each token's string is the text it
  adds, so that the strings join into the content, whole or streamed, cut at a stop string or
  not, and its bytes are its own (a token that ends inside a character: '' and the character's
  first bytes), which join into the content's UTF-8; an alternative's string and bytes are what
  it would have added there."""
  text = 'naïve café — 東京 🙂 x = 1\n\ty The for statement'
  for tok in _text_tokenizers(tmp_path):
    ids = [int(t) for t in tok.encode(text)]
    assert ''.join(tok.decode([t]) for t in ids) != tok.decode(ids)  # (each token alone)
    full = tok.decode(ids)
    # (7: the text cut before a stop string, the tokens not; then cut before a character that
    # tokens split: their first bytes are not the text's)
    for cut in (0, 7, len(full) - full.index('東')):
      seq = engine.Sequence(prompt=[1], max_new_tokens=len(ids), tokens=list(ids),
                            logprobs=[-0.5] * len(ids), finish_reason='stop',
                            top_logprobs=[[(t, -0.5), (ids[0], -1.0)] for t in ids])
      seq.text = tok.decode(ids)[:len(tok.decode(ids)) - cut]
      content = openai_api.ChatChoice(0, 2).final(seq, tok)['logprobs']['content']
      assert ''.join(t['token'] for t in content) == seq.text
      assert b''.join(bytes(t['bytes']) for t in content) == seq.text.encode()
      assert cut or all(t['top_logprobs'][0]['token'] == t['token'] and
                        t['top_logprobs'][0]['bytes'] == t['bytes'] for t in content)
      if not cut:  # (sentencepiece: the text drops the first token's leading space)
        assert [bytes(t['bytes']) for t in content[1:]] == [_own_bytes(tok, i) for i in ids[1:]]
        assert any(t['token'] == '' and t['bytes'] for t in content)  # (a character split)
      r = openai_api.CompletionRequest(prompt='x', logprobs=2)
      logprobs = openai_api.CompletionChoice(0, ('x', [1]), None, r).final(seq, tok)['logprobs']
      assert ''.join(logprobs['tokens']) == seq.text
      assert logprobs['text_offset'] == [len(''.join(logprobs['tokens'][:i]))
                                         for i in range(len(ids))]
    # Streamed, a few tokens an update: the same strings and bytes; and a stream that a stop
    # string ends before '東' (its last tokens start it: held back, then sent without bytes).
    cut = full.index('東')
    past = next(j for j in range(len(ids)) if len(tok.decode(ids[:j])) > cut)
    for n, content in [(len(ids), full), (past, full[:cut])]:
      streamed = _streamed(tok, ids[:n], content)
      assert ''.join(t for t, _ in streamed) == content and len(streamed) == n
      assert b''.join(b for _, b in streamed) == content.encode()


def _streamed(tok, ids: list[int], text: str) -> list[tuple[str, bytes]]:
  """The (token, bytes) of a chat choice's logprobs streamed a few tokens an update, the last
  update's text `text` (the whole text, or one a stop string cut)."""
  choice, streamed, seq = openai_api.ChatChoice(0, 0), [], engine.Sequence(
      prompt=[1], max_new_tokens=len(ids))
  for m in [*range(3, len(ids), 3), len(ids)]:
    seq.tokens, seq.logprobs = ids[:m], [-0.5] * m
    seq.top_logprobs = [[]] * m
    seq.text = text if m == len(ids) else seq.detokenize(tok)
    seq.finish_reason = 'stop' if m == len(ids) else None
    delta = choice.delta(client_lib.Update.of(0, seq), tok)
    streamed += [(t['token'], bytes(t['bytes'])) for t in delta['logprobs']['content']]
  return streamed


def test_the_server_reads_the_runs_generation_config(run, client, tmp_path):
  """A run with a generation_config.json (an imported instruct model's: temperature 0, an extra
  EOS id, a cap on new tokens): a request that sets none of them gets them, one that sets its own
  temperature gets that."""
  copy = tmp_path / 'run'
  shutil.copytree(run, copy)
  plain = greedy(client, 'The ', max_tokens=40).choices[0].text
  end = plain[3]
  with open(copy / workdir_lib.GENERATION_CONFIG_FILE, 'w', encoding='utf-8') as f:
    json.dump({'temperature': 0.0, 'eos_token_id': [257, ord(end)], 'max_new_tokens': 30}, f)
  assert serve.defaults(workdir_lib.generation_config(str(copy))) == openai_api.Defaults(
      temperature=0.0, max_tokens=30)
  proc, url = _start(str(copy), '--slots=2', '--chunk=4')
  try:
    c = openai.OpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0, timeout=120)
    [choice] = c.completions.create(model=NAME, prompt='The ', max_tokens=40).choices
    assert (choice.text, choice.finish_reason) == (plain[:plain.index(end)], 'stop')
    seeded = c.completions.create(model=NAME, prompt='The ', max_tokens=12, temperature=1.0,
                                  seed=4, n=2).choices
    assert seeded[0].text != seeded[1].text
  finally:
    proc.terminate()
    proc.communicate(timeout=60)


SHORT = [{'role': 'user', 'content': 'x'}]  # (a prompt of 8 tokens: 56 for the answer)
ANSWER_SCHEMA = {
    'type': 'object', 'additionalProperties': False, 'required': ['ok', 'kind', 'n'],
    'properties': {'ok': {'type': 'boolean'}, 'kind': {'enum': ['a', 'bc']},
                   'n': {'type': 'integer', 'minimum': 0, 'maximum': 9}}}
WEATHER = {'type': 'function', 'function': {  # (a call: 53 tokens)
    'name': 'wx', 'description': 'The weather in a city',
    'parameters': {'type': 'object', 'additionalProperties': False, 'required': ['city', 'days'],
                   'properties': {'city': {'enum': ['Oslo', 'Rome']},
                                  'days': {'type': 'integer', 'minimum': 1, 'maximum': 7}}}}}
CLOCK = {'type': 'function', 'function': {'name': 'clock', 'parameters': {
    'type': 'object', 'additionalProperties': False, 'required': ['utc'],
    'properties': {'utc': {'type': 'boolean'}}}}}


def test_structured_outputs_are_json_that_validates_against_the_schema(local):
  """A model with random weights answers, sampled or greedy, JSON that validates (jsonschema)
  against a json_schema response_format (strict), with the keys it names and no other where it
  leaves others open, and the openai SDK's parse of a pydantic model reads it; json_object
  gives a JSON object; a schema the grammar library cannot compile is a 400 naming it."""
  c = _client(local[0])
  fmt = {'type': 'json_schema', 'json_schema': {'name': 'answer', 'schema': ANSWER_SCHEMA,
                                                 'strict': True}}
  answer = chat(c, SHORT, response_format=fmt, max_tokens=56, temperature=1.0, seed=1, n=3)
  for choice in answer.choices:
    assert choice.finish_reason == 'stop', choice.message.content
    jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)
  assert len({choice.message.content for choice in answer.choices}) > 1  # (sampled)
  open_schema = {k: v for k, v in ANSWER_SCHEMA.items() if k != 'additionalProperties'}
  answer = chat(c, SHORT, response_format={'type': 'json_schema', 'json_schema': {
      'name': 'open', 'schema': open_schema}}, max_tokens=56, temperature=1.0, seed=1, n=3)
  for choice in answer.choices:  # (other keys allowed, none decoded: closed as vLLM closes it)
    assert choice.finish_reason == 'stop' and set(json.loads(choice.message.content)) == set(
        ANSWER_SCHEMA['properties'])
  free = chat(c, SHORT, max_tokens=20, temperature=0).choices[0].message.content
  with pytest.raises(json.JSONDecodeError):
    json.loads(free)  # (the same model, unconstrained)

  class Answer(pydantic.BaseModel):
    ok: bool
    kind: Literal['a', 'bc']
    n: int = pydantic.Field(ge=0, le=9)

  parsed = c.chat.completions.parse(model=NAME, messages=SHORT, response_format=Answer,
                                    max_tokens=56, temperature=0)
  assert isinstance(parsed.choices[0].message.parsed, Answer)
  obj = chat(c, SHORT, response_format={'type': 'json_object'}, max_tokens=56, temperature=0,
             logit_bias={str(ord('}')): 8.0}).choices[0]  # (an object that ends soon)
  assert obj.finish_reason == 'stop' and isinstance(json.loads(obj.message.content), dict)
  for schema, match in [({'type': 'strin'}, 'strin'), ({'type': 'string', 'pattern': '('},
                                                       'unclosed group')]:
    with pytest.raises(openai.BadRequestError, match=match) as e:
      chat(c, SHORT, response_format={'type': 'json_schema', 'json_schema': {
          'name': 'bad', 'schema': schema}})
    assert e.value.param == 'response_format' and "'bad'" in e.value.message


def test_an_object_schema_that_leaves_other_keys_open_is_closed_as_vllm_closes_it():
  """grammar.closed: additionalProperties false in each object schema that lists properties (or
  patternProperties) and says nothing of others, nested ones and definitions included; one that
  says (true, or a schema) is kept, and a JSON value (const, enum, default) is not a schema."""
  value = {'properties': {'x': 1}}
  schema = {'type': 'object', 'properties': {
      'a': {'type': 'object', 'properties': {'b': {'type': 'integer'}}},
      'c': {'const': value, 'default': value}, 'd': {'enum': [value]},
      'e': {'type': 'object', 'properties': {}, 'additionalProperties': True},
      'f': {'type': 'object', 'patternProperties': {'^x': {}}, 'additionalProperties': {}}},
            '$defs': {'g': {'anyOf': [{'properties': {'h': {}}}, {'type': 'string'}]}}}
  out = grammar_lib.closed(schema)
  assert out['additionalProperties'] is False
  assert out['properties']['a']['additionalProperties'] is False
  assert out['$defs']['g']['anyOf'][0]['additionalProperties'] is False
  assert out['properties']['c'] == schema['properties']['c'] and out['properties']['d'] == (
      schema['properties']['d'])
  assert out['properties']['e'] == schema['properties']['e'] and out['properties']['f'] == (
      schema['properties']['f'])
  assert 'additionalProperties' not in schema  # (the request's schema as it came)


def test_tool_calls_by_a_named_function_or_required_whole_and_streamed(local):
  """tool_choice naming a function: one call of it, its arguments JSON that its parameters
  validate, content null, finish_reason "stop" (OpenAI's); "required": calls among the tools
  (one with parallel_tool_calls false), finish_reason "tool_calls". Streamed, a call opens with
  its index, id and name, then its arguments in chunks that join into the whole answer's."""
  c = _client(local[0])
  schemas = {t['function']['name']: t['function']['parameters'] for t in (WEATHER, CLOCK)}
  named = {'type': 'function', 'function': {'name': 'wx'}}
  for kw, finish in [(dict(tool_choice=named), 'stop'),
                     (dict(tool_choice='required', parallel_tool_calls=False), 'tool_calls')]:
    answer = chat(c, SHORT, tools=[WEATHER, CLOCK], max_tokens=56, temperature=1.0, seed=2,
                  **kw).choices[0]
    assert answer.finish_reason == finish and answer.message.content is None
    [call] = answer.message.tool_calls
    assert call.type == 'function' and call.id.startswith('call_')
    assert kw['tool_choice'] != named or call.function.name == 'wx'
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(chat(c, SHORT, tools=[WEATHER, CLOCK], max_tokens=56, temperature=1.0,
                       seed=2, stream=True, **kw))
    deltas = [d for e in chunks for d in e.choices[0].delta.tool_calls or ()]
    assert deltas[0].index == 0 and deltas[0].id.startswith('call_')
    assert deltas[0].function.name == call.function.name and deltas[0].function.arguments == ''
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(deltas) > 2  # (the arguments in several chunks)
    assert ''.join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[0].choices[0].delta.role == 'assistant'
    assert chunks[-1].choices[0].finish_reason == finish
  many = chat(c, SHORT, tools=[WEATHER, CLOCK], tool_choice='required', max_tokens=56,
              temperature=0).choices[0]
  for call in many.message.tool_calls:  # (parallel calls allowed: those it completed)
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# Qwen2.5's tool prompt, shortened: the tools as JSON lines, Hermes' <tool_call> format asked.
HERMES = ("{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n"
          "{{ t | tojson }}{% endfor %}\n</tools>\nFor each function call, return a json object "
          "within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, "
          "\"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}"
          "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_tool_choice_auto_reads_hermes_tool_calls_where_the_template_asks_for_them():
  """tool_choice "auto" (the default with tools): a template that renders the tools and asks for
  Hermes' <tool_call> blocks gets free text whose blocks are the calls (whole: tool_calls, the
  text before them the content, finish_reason "tool_calls"; streamed: the content, then each
  call's index, id and name, then its arguments), an answer without one is content; another
  template is a 400 that says why."""
  tok = tokenizer_lib.ByteTokenizer()
  grammars = grammar_lib.Grammars(tok)
  template = chat_lib.ChatTemplate(HERMES, {}, 'hermes')
  rendered = template.render(SHORT, True, tools=[WEATHER])
  assert '"name": "wx"' in rendered and '<tool_call>' in rendered  # (the tools, the format)
  assert structured.plan(None, [WEATHER], None, None, grammars, HERMES) == structured.Plan(
      None, 'auto')
  with pytest.raises(structured.RequestError, match='Hermes') as e:
    structured.plan(None, [WEATHER], 'auto', None, grammars, CHAT_TEMPLATE)
  assert e.value.param == 'tool_choice'
  plan = structured.Plan(None, 'auto')
  text = ('Let me look. <tool_call>\n{"name": "wx", "arguments": {"city": "Oslo", "days": 2}}\n'
          '</tool_call>\n<tool_call>{"name": "clock", "arguments": {"utc": true}}</tool_call>')
  ids = [int(t) for t in tok.encode(text)]

  def sequence(n, finish=None):
    seq = engine.Sequence(prompt=[1], max_new_tokens=len(ids), tokens=ids[:n],
                          logprobs=[-0.5] * n, finish_reason=finish)
    seq.text = tok.decode(ids[:n])
    return seq

  whole = openai_api.ChatChoice(0, None, plan).final(sequence(len(ids), 'stop'), tok)
  assert whole['finish_reason'] == 'tool_calls'
  assert whole['message']['content'] == 'Let me look. '
  assert [(c['function']['name'], json.loads(c['function']['arguments']))
          for c in whole['message']['tool_calls']] == [('wx', {'city': 'Oslo', 'days': 2}),
                                                       ('clock', {'utc': True})]
  choice, deltas = openai_api.ChatChoice(0, None, plan), []
  for n in [*range(5, len(ids), 5), len(ids)]:
    seq = sequence(n, 'stop' if n == len(ids) else None)
    deltas.append(choice.delta(client_lib.Update.of(0, seq), tok))
  assert ''.join(d['delta'].get('content', '') for d in deltas) == 'Let me look. '
  calls = [c for d in deltas for c in d['delta'].get('tool_calls', ())]
  assert [(c['index'], c['function']['name']) for c in calls if 'id' in c] == [(0, 'wx'),
                                                                               (1, 'clock')]
  assert [''.join(c['function']['arguments'] for c in calls if c['index'] == i)
          for i in (0, 1)] == [c['function']['arguments'] for c in whole['message']['tool_calls']]
  assert deltas[-1]['finish_reason'] == 'tool_calls'
  plain = openai_api.ChatChoice(0, None, plan).final(sequence(12, 'length'), tok)
  assert plain['message'] == {'role': 'assistant', 'content': text[:12]}
  assert plain['finish_reason'] == 'length'
