"""Structured outputs and tool calls for the chat API (serve.py), by constrained decoding
(engine/grammar.py): what a request's response_format, tools and tool_choice ask the decoder for,
and how an answer reads back, as vLLM's OpenAI server does.

- response_format {"type": "json_object"}: any JSON object; {"type": "json_schema",
  "json_schema": {"name", "schema", "strict"}}: JSON that the schema validates (enforced, strict
  or not, as vLLM enforces it). The answer is the message's content.
- tools with tool_choice {"type": "function", "function": {"name": N}}: the text is the
  arguments of N (its `parameters` schema); the answer is message.tool_calls [that call], content
  null, finish_reason "stop" (OpenAI's for a named function).
- tool_choice "required": the text is a JSON array of calls, [{"name": N, "parameters": {...}},
  ...] (vLLM's form; one call at most with parallel_tool_calls false), each name one of the tools
  and its parameters what that tool's schema validates; the answer is message.tool_calls,
  finish_reason "tool_calls".
- tool_choice "auto" (the default with tools): free text, where the chat template renders
  `tools` and asks for Hermes' tool-call format (its text has `<tool_call>`: Hermes, Qwen2.5,
  Qwen3 templates), each `<tool_call>{"name": N, "arguments": {...}}</tool_call>` block of the
  answer is a call (vLLM's hermes parser): message.tool_calls, the text before the first block
  the content, finish_reason "tool_calls"; an answer without a block is content. With any other
  template, a 400 that says why (no parser of the model's tool-call format). "none": no tools.

Streamed, a call goes out as OpenAI streams it: a delta.tool_calls item with its index, id, type
and function name (arguments ''), then its arguments in chunks as they are decoded (Calls).
"""
import dataclasses
import json
import re
import uuid

from jax_pretrain.engine import grammar as grammar_lib

_NAME = '{"name":"'
_PARAMETERS = '","parameters":'
HERMES_OPEN, HERMES_CLOSE = '<tool_call>', '</tool_call>'
_HERMES = re.compile(r'<tool_call>(.*?)</tool_call>', re.DOTALL)


class RequestError(ValueError):
  """A response_format, tools or tool_choice that cannot be served: (message, param)."""

  def __init__(self, message: str, param: str):
    super().__init__(message)
    self.param = param


@dataclasses.dataclass(frozen=True)
class Plan:
  """What a chat asks of its choices: the grammar each keeps (None: free text), and how their
  text reads back: 'content', 'named' (the arguments of the tool `name`), 'required' (an array
  of calls) or 'auto' (free text, Hermes' <tool_call> blocks the calls)."""
  grammar: grammar_lib.Grammar | None = None
  kind: str = 'content'
  name: str = ''


CONTENT = Plan()  # free text (a plain chat)


def plan(response_format: dict | None, tools: list[dict] | None, tool_choice,
         parallel_tool_calls: bool | None, grammars: grammar_lib.Grammars,
         template: str = '') -> Plan:
  """The Plan of a chat's fields (the module docstring), for a chat template of this source;
  a RequestError naming the field."""
  schemas = _tool_schemas(tools or [])
  if tool_choice is None:
    tool_choice = 'auto' if schemas else 'none'
  if tool_choice == 'none' or (tool_choice == 'auto' and not schemas):
    return Plan(_response_grammar(response_format, grammars))
  if response_format not in (None, {'type': 'text'}):
    raise RequestError('response_format cannot be combined with tool calls', 'response_format')
  if tool_choice == 'auto':
    if 'tools' in template and HERMES_OPEN in template:
      return Plan(None, 'auto')
    raise RequestError(
        'tool_choice "auto" needs a chat template that renders `tools` in a tool-call format '
        'this server parses (Hermes\' <tool_call>{"name": ..., "arguments": ...}</tool_call>, '
        "as Qwen's and Hermes' templates ask); this model's does not: send tool_choice "
        '"required" or {"type": "function", "function": {"name": ...}} (the call is then '
        'decoded by its grammar), or "none"', 'tool_choice')
  if tool_choice == 'required':
    calls = {'type': 'array', 'minItems': 1, 'items': {'anyOf': [
        {'type': 'object', 'additionalProperties': False, 'required': ['name', 'parameters'],
         'properties': {'name': {'const': name}, 'parameters': schema}}
        for name, schema in schemas.items()]}}
    if parallel_tool_calls is False:
      calls['maxItems'] = 1
    return Plan(_compile(grammars, calls, 'tools'), 'required')
  name = (tool_choice.get('function') or {}).get('name') if isinstance(tool_choice, dict) else None
  if not isinstance(tool_choice, dict) or tool_choice.get('type') != 'function' or name is None:
    raise RequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                       '"function": {"name": ...}}', 'tool_choice')
  if name not in schemas:
    raise RequestError(f'tool_choice names {name!r}, which is not among the tools '
                       f'({", ".join(schemas) or "none given"})', 'tool_choice')
  return Plan(_compile(grammars, schemas[name], f'the parameters of tool {name!r}'), 'named',
              name)


def _tool_schemas(tools: list[dict]) -> dict[str, dict]:
  """{name: parameters schema} of the tools (OpenAI's function tools)."""
  out = {}
  for i, tool in enumerate(tools):
    function = tool.get('function') if isinstance(tool, dict) else None
    name = function.get('name') if isinstance(function, dict) else None
    if (not isinstance(function, dict) or tool.get('type') != 'function'
        or not isinstance(name, str) or not name):
      raise RequestError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., '
                         '"parameters": {...}}}}}', 'tools')
    schema = function.get('parameters')
    out[name] = {'type': 'object', 'properties': {}} if schema is None else schema
  return out


def _response_grammar(response_format: dict | None,
                      grammars: grammar_lib.Grammars) -> grammar_lib.Grammar | None:
  kind = (response_format or {}).get('type', 'text')
  if kind == 'text':
    return None
  if kind == 'json_object':
    return _compile(grammars, {'type': 'object'}, 'response_format')
  if kind == 'json_schema':
    spec = (response_format or {}).get('json_schema')
    schema = spec.get('schema') if isinstance(spec, dict) else None
    if not isinstance(spec, dict) or not isinstance(schema, (dict, bool)):
      raise RequestError('response_format json_schema needs a "json_schema": {"name": ..., '
                         '"schema": {...}}', 'response_format')
    name = spec.get('name')
    return _compile(grammars, schema, 'the json_schema' + (f' {name!r}' if name else ''))
  raise RequestError(f'response_format type {kind!r} is not one of "text", "json_object", '
                     '"json_schema"', 'response_format')


def _compile(grammars: grammar_lib.Grammars, schema, what: str) -> grammar_lib.Grammar:
  try:
    return grammars.json_schema(schema, what)
  except grammar_lib.GrammarError as e:
    raise RequestError(' '.join(str(e).split()), 'response_format' if 'json_schema' in what
                       or what == 'response_format' else 'tools') from None


class Calls:
  """One choice's tool calls read from its text as it grows (Plan 'named' or 'required'): each
  call's id, name and arguments (the exact text of its parameters), and what a stream has sent."""

  def __init__(self, plan: Plan):
    self.plan = plan
    self.ids: list[str] = []
    self.sent: list[int] = []  # arguments characters sent of each call

  def content(self, text: str, final: bool) -> str | None:
    """The text that is the message's content: 'auto', what comes before the first <tool_call>
    (while decoding, without an ending that may begin one); the others, none."""
    if self.plan.kind != 'auto':
      return None
    cut = text.find(HERMES_OPEN)
    if cut < 0 and not final:
      cut = next((len(text) - k for k in range(len(HERMES_OPEN) - 1, 0, -1)
                  if text.endswith(HERMES_OPEN[:k])), -1)
    return text if cut < 0 else text[:cut]

  def parse(self, text: str) -> list[tuple[str, str, bool]]:
    """(name, arguments so far, complete) of each call begun in the text."""
    if self.plan.kind == 'auto':
      return _hermes(text)
    if self.plan.kind == 'named':
      return [(self.plan.name, text, _value_end(text, 0) is not None)]
    calls, p = [], 1  # (after '[')
    while text.startswith(_NAME, p):
      end_name = text.find(_PARAMETERS, p + len(_NAME))
      if end_name < 0:
        break
      start = end_name + len(_PARAMETERS)
      end = _value_end(text, start)
      calls.append((text[p + len(_NAME):end_name], text[start:end], end is not None))
      if end is None:
        break
      p = end + 2  # (past '}' and ',' or ']')
    return calls

  def _id(self, i: int) -> str:
    while len(self.ids) <= i:
      self.ids.append(f'call_{uuid.uuid4().hex[:24]}')
      self.sent.append(0)
    return self.ids[i]

  def whole(self, text: str) -> list[dict]:
    """message.tool_calls of the text (the calls it completed; all of a named one's text)."""
    return [{'id': self._id(i), 'type': 'function', 'function': {'name': name,
                                                                 'arguments': arguments}}
            for i, (name, arguments, complete) in enumerate(self.parse(text))
            if complete or self.plan.kind == 'named']

  def delta(self, text: str) -> list[dict]:
    """delta.tool_calls for the text decoded so far (final: stable_text): a new call's opening
    item (index, id, type, name, arguments ''), then the arguments not sent yet."""
    out = []
    for i, (name, arguments, _) in enumerate(self.parse(text)):
      if i >= len(self.ids):
        out.append({'index': i, 'id': self._id(i), 'type': 'function',
                    'function': {'name': name, 'arguments': ''}})
      if len(arguments) > self.sent[i]:
        out.append({'index': i, 'function': {'arguments': arguments[self.sent[i]:]}})
        self.sent[i] = len(arguments)
    return out


def _hermes(text: str) -> list[tuple[str, str, bool]]:
  """The calls of Hermes' <tool_call> blocks closed in the text, each (name, arguments as JSON,
  True); none unless every block is a call ({"name": str, "arguments": an object}): such text is
  content, as vLLM's hermes parser leaves it."""
  calls = []
  for block in _HERMES.findall(text):
    try:
      call = json.loads(block)
    except json.JSONDecodeError:
      return []
    arguments = call.get('arguments', {}) if isinstance(call, dict) else None
    if not isinstance(call, dict) or not isinstance(call.get('name'), str) or not isinstance(
        arguments, dict):
      return []
    calls.append((call['name'], json.dumps(arguments, ensure_ascii=False), True))
  return calls


def _value_end(text: str, start: int) -> int | None:
  """Where the JSON value at text[start:] ends (compact JSON, as the grammar writes it), or None
  while it is incomplete."""
  depth, in_string, escaped = 0, False, False
  for i in range(start, len(text)):
    c = text[i]
    if in_string:
      escaped, in_string = (not escaped and c == '\\'), escaped or c != '"'
      if not in_string and depth == 0:
        return i + 1
    elif depth == 0 and i > start and c in ',}]':  # (the end of a number, true, false, null)
      return i
    elif c == '"':
      in_string = True
    elif c in '{[':
      depth += 1
    elif c in '}]':
      depth -= 1
      if depth == 0:
        return i + 1
  return None
