"""The server driven by the clients people point at it, installed from the registry: LangChain's
ChatOpenAI (invoke, stream, with_structured_output by each of its methods, bind_tools), the openai
SDK's parse helpers (its stream with a pydantic response_format, parse with a pydantic function
tool; create, stream and parse of a response_format: test_serve.py) and lm-evaluation-harness's
`local-chat-completions` model running a generate_until task end to end. One in-process server
(tests/test_serve.py's) on a copy of the tiny run given a chat template; its weights are barely
trained, so structured outputs and tool calls are schema-valid only by constrained decoding."""
import json
import os
from typing import Literal

os.environ.setdefault('HF_DATASETS_OFFLINE', '1')  # before lm_eval imports datasets
os.environ.setdefault('HF_HUB_OFFLINE', '1')

import jax
import jsonschema
import openai
import pydantic
import pytest

from jax_pretrain import sample
from jax_pretrain import workdir as workdir_lib
from tests import tiny_run
from tests.test_serve import NAME
from tests.test_serve import SHORT
from tests.test_serve import WEATHER
from tests.test_serve import _serving
from tests.test_serve import chat_run  # noqa: F401  (a fixture)


@pytest.fixture(scope='session')
def run(tmp_path_factory):
  return tiny_run.train_once(tmp_path_factory)


@pytest.fixture(scope='module')
def trained(chat_run):  # noqa: F811
  return workdir_lib.load(chat_run, devices=jax.devices()[:1])


@pytest.fixture(scope='module')
def url(trained):
  """The in-process server's base URL (no API key: lm_eval sends none)."""
  with _serving(trained) as (base, _, _):
    yield base


def _llm(url: str, **kw):
  """LangChain's ChatOpenAI on the server (requirements-dev.txt; without it, these tests skip)."""
  langchain_openai = pytest.importorskip('langchain_openai')
  return langchain_openai.ChatOpenAI(model=NAME, base_url=f'{url}/v1', api_key='unused',
                                     max_retries=0, timeout=120, **kw)


class Answer(pydantic.BaseModel):
  """An answer."""
  ok: bool
  kind: Literal['a', 'bc']
  n: int = pydantic.Field(ge=0, le=9)


class Weather(pydantic.BaseModel):
  """The weather in a city."""
  city: Literal['Oslo', 'Rome']
  days: int = pydantic.Field(ge=1, le=7)


def test_langchain_invoke_and_stream_are_the_chat_completions(url, trained):
  """ChatOpenAI's invoke: the server's greedy chat answer (the rendered prompt's greedy
  continuation, as sample.generate_text gives it); its stream: the same text (in chunks), the
  last with the token usage (stream_usage: LangChain asks for it from OpenAI's own URL only)."""
  llm = _llm(url, temperature=0, max_tokens=20, stream_usage=True)
  message = llm.invoke([('user', 'x')])
  rendered = 'u: x\na: '
  want = sample.generate_text(trained.config.model, trained.params, trained.tokenizer, rendered,
                              20, temperature=0.0)
  assert message.content == want and message.response_metadata['finish_reason'] == 'length'
  assert message.usage_metadata['input_tokens'] == len(rendered)
  assert message.usage_metadata['output_tokens'] == len(want.encode())
  chunks = list(llm.stream([('user', 'x')]))
  assert ''.join(c.content for c in chunks) == want
  usage = [c.usage_metadata for c in chunks if c.usage_metadata]
  assert usage and usage[-1]['output_tokens'] == len(want.encode())


@pytest.mark.parametrize('method', ['function_calling', 'json_schema', 'json_mode'])
def test_langchain_structured_output_by_each_method_is_a_validated_object(url, method):
  """with_structured_output(Answer, method=...): function_calling (a tool call of the schema,
  tool_choice naming it), json_schema (response_format json_schema, strict) and json_mode
  (response_format json_object: any JSON object, which the caller's schema then reads; here a
  model whose fields all have defaults, the object made to end soon with logit_bias on '}')
  each give a validated pydantic object, sampled with several seeds; Answer's schema leaves other
  keys open, which the server closes (as vLLM does: engine/grammar.closed)."""
  schema = Answer
  kw: dict = {}
  if method == 'json_mode':

    class Loose(pydantic.BaseModel):
      ok: bool = False
      kind: str = ''

    schema, kw = Loose, {'logit_bias': {str(ord('}')): 8.0}}
  for seed in range(3):
    llm = _llm(url, temperature=1.0, seed=seed, max_tokens=56, **kw)
    structured = llm.with_structured_output(schema, method=method, include_raw=True)
    out = structured.invoke([('user', 'x')])
    assert out['parsing_error'] is None, out['raw']
    assert isinstance(out['parsed'], schema), out
    if method != 'json_mode':
      jsonschema.validate(out['parsed'].model_dump(), Answer.model_json_schema())
      assert _keys(out['raw']) == {'ok', 'kind', 'n'}  # (no key of its own)


def _keys(message) -> set[str]:
  """The keys of the JSON object a structured answer came as: its content, or its tool call's."""
  return set(message.tool_calls[0]['args'] if message.tool_calls else json.loads(message.content))


def test_langchain_bind_tools_gives_tool_calls(url):
  """bind_tools with a pydantic tool and an OpenAI tool dict: tool_choice naming one, or
  "required" (the template renders no tools, so "auto" is refused: test_serve.py), whole and
  streamed: LangChain's tool_calls, arguments that the tool's schema validates, with the keys
  it names and no other (a pydantic tool's schema leaves others open: the server closes it, as
  vLLM does)."""
  schemas = {'Weather': Weather.model_json_schema(), 'wx': WEATHER['function']['parameters']}
  for choice in ('Weather', 'wx', 'required'):
    llm = _llm(url, temperature=1.0, seed=3, max_tokens=56).bind_tools(
        [Weather, WEATHER], tool_choice=choice, parallel_tool_calls=False)
    message = llm.invoke(SHORT)
    [call] = message.tool_calls
    assert choice == 'required' or call['name'] == choice
    jsonschema.validate(call['args'], schemas[call['name']])
    assert set(call['args']) == set(schemas[call['name']]['properties'])  # (no key of its own)
    assert call['id'].startswith('call_') and not message.invalid_tool_calls
    merged = None
    for chunk in llm.stream(SHORT):
      merged = chunk if merged is None else merged + chunk
    assert [(c['name'], c['args']) for c in merged.tool_calls] == [(call['name'], call['args'])]


def test_the_openai_sdks_parse_helpers_read_pydantic_objects(url):
  """The openai SDK's own helpers (create, stream and parse of a response_format: test_serve.py):
  chat.completions.stream with a pydantic response_format, its final completion's parsed object;
  parse with a strict pydantic function tool (openai.pydantic_function_tool), its call's
  parsed_arguments."""
  c = openai.OpenAI(base_url=f'{url}/v1', api_key='unused', max_retries=0, timeout=120)
  with c.chat.completions.stream(model=NAME, messages=SHORT, response_format=Answer,
                                 max_tokens=56, temperature=1.0, seed=4) as stream:
    texts = [e.delta for e in stream if e.type == 'content.delta']
    final = stream.get_final_completion()
  assert isinstance(final.choices[0].message.parsed, Answer)
  assert ''.join(texts) == final.choices[0].message.content and len(texts) > 1
  answer = c.chat.completions.parse(model=NAME, messages=SHORT, max_tokens=56, temperature=1.0,
                                    seed=4, tools=[openai.pydantic_function_tool(Weather)],
                                    tool_choice={'type': 'function',
                                                 'function': {'name': 'Weather'}})
  [call] = answer.choices[0].message.tool_calls
  assert call.function.name == 'Weather' and isinstance(call.function.parsed_arguments, Weather)


def test_lm_evals_local_chat_completions_runs_a_generation_task(url, trained, tmp_path):
  """lm_eval's `local-chat-completions` against the server, the chat template applied: each
  answer is the rendered chat's greedy continuation cut before lm_eval's stop string, and
  exact_match counts the half of the targets that are those continuations."""
  tok, model = trained.tokenizer, trained.config.model
  prompts = ['The for', 'In the ', 'An array', 'It is a']
  greedy = [sample.generate_text(model, trained.params, tok, f'u: {p}\na: ', 12,
                                 temperature=0.0).split('.')[0] for p in prompts]
  docs = [{'context': p, 'target': g if i % 2 == 0 else g + 'zz'}
          for i, (p, g) in enumerate(zip(prompts, greedy))]
  with open(tmp_path / 'chat_gen.jsonl', 'w', encoding='utf-8') as f:
    f.writelines(json.dumps(d) + '\n' for d in docs)
  (tmp_path / 'chat_gen.yaml').write_text(
      f'task: chat_gen\ndataset_path: json\ndataset_kwargs:\n  data_files:\n'
      f'    test: {tmp_path / "chat_gen.jsonl"}\ntest_split: test\noutput_type: generate_until\n'
      'doc_to_text: "{{context}}"\ndoc_to_target: "{{target}}"\ntarget_delimiter: ""\n'
      'generation_kwargs: {until: ["."], max_gen_toks: 12, do_sample: false}\n'
      'metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]\n')
  import lm_eval  # noqa: PLC0415
  from lm_eval import tasks as lm_tasks  # noqa: PLC0415
  out = lm_eval.simple_evaluate(
      model='local-chat-completions',
      model_args={'model': NAME, 'base_url': f'{url}/v1/chat/completions',
                  'tokenizer_backend': None, 'max_retries': 1},
      tasks=['chat_gen'], apply_chat_template=True, log_samples=True,
      task_manager=lm_tasks.TaskManager(include_path=str(tmp_path), include_defaults=False))
  for s in out['samples']['chat_gen']:
    assert s['resps'][0][0] == greedy[s['doc_id']]
  assert out['results']['chat_gen']['exact_match,none'] == 0.5
