"""A tokenizer's chat template and the one rendering of a chat, for serving and for SFT alike.

The template is the tokenizer directory's (tokenizer.chat_template_source: chat_template.jinja,
else tokenizer_config.json's "chat_template"), or a file given to the server (serve
--chat_template). A conversation is rendered ONCE, as transformers' apply_chat_template renders it
(the same sandboxed jinja2 environment, its globals and filters, and its {% generation %} tag),
and the text is encoded ONCE as apply_chat_template(tokenize=True) encodes it (the tokenizer's
encode_rendered: special tokens' text to their ids, nothing added): the ids SFT trains on are the
ids transformers (and vLLM on an HF export) would give the same conversation, and a chat request's
prompt is the same conversation's ids up to the generation prompt.

SFT trains on the assistant turns: each token whose characters overlap an assistant turn's span
in the rendered text (transformers' return_assistant_tokens_mask rule). The spans are
- the {% generation %}...{% endgeneration %} blocks, where the template marks them (TRL's training
  templates do), tracked while rendering, as transformers tracks them;
- otherwise found by rendering prefixes: assistant turn i starts where the conversation before it,
  rendered with the generation prompt, ends (it must be the start of the whole), and is the text
  that rendering the conversation through it adds to that, as far as the whole has it there.
  A template that renders an earlier turn differently once others follow keeps its end (Qwen3's
  drops the <think> at its start; the turn is then the longest end of it that the whole has
  there: its answer and <|im_end|>). A template whose conversation before a turn is not the start
  of the whole (a generation prompt that the turns do not have) has its example refused, with
  the hint to mark the turns with {% generation %}. (Serving needs no spans: any template
  serves.)
"""
import contextvars
import datetime
import json
import re

import numpy as np

from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError

_REASONING_FIELDS = ('reasoning_content', 'thinking', 'reasoning')  # transformers' aliases
_GENERATION_TAG = re.compile(r'\{%-?\s*generation\s*-?%\}')
# The spans of the {% generation %} blocks being rendered (in this thread), and what is rendered.
_TRACKING: contextvars.ContextVar[tuple[list[str], list[tuple[int, int]]] | None] = (
    contextvars.ContextVar('generation_spans', default=None))


def _environment():
  """transformers' chat template environment (utils/chat_template_utils.py): immutable sandbox,
  trim_blocks, lstrip_blocks, loopcontrols, {% generation %}, tojson without HTML escapes,
  raise_exception, strftime_now."""
  import jinja2  # noqa: PLC0415
  from jinja2 import ext  # noqa: PLC0415
  from jinja2 import nodes  # noqa: PLC0415
  from jinja2 import sandbox  # noqa: PLC0415

  class Generation(ext.Extension):
    """{% generation %}...{% endgeneration %}: its output's span, recorded while tracking."""
    tags = {'generation'}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(('name:endgeneration',), drop_needle=True)
      return nodes.CallBlock(self.call_method('_span'), [], [], body).set_lineno(lineno)

    def _span(self, caller) -> str:
      text = caller()
      tracking = _TRACKING.get()
      if tracking is not None:
        blocks, spans = tracking
        start = len(''.join(blocks))
        spans.append((start, start + len(text)))
      return text

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  env = sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True, extensions=[Generation, 'jinja2.ext.loopcontrols'])
  env.filters['tojson'] = tojson
  env.globals['raise_exception'] = raise_exception
  env.globals['strftime_now'] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env


def _as_transformers_passes(messages: list[dict]) -> list[dict]:
  """The messages as apply_chat_template gives them to the template: keys whose value is None
  dropped, a reasoning under any of its names also as reasoning_content and thinking."""
  out = []
  for m in messages:
    m = {k: v for k, v in m.items() if v is not None}
    reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
    if reasoning is not None:
      m = {'thinking': reasoning, **m, 'reasoning_content': reasoning}
    out.append(m)
  return out


class ChatTemplate:
  """A chat template, rendered as transformers' apply_chat_template renders it, with the
  tokenizer's special tokens (bos_token, eos_token, pad_token) as variables. `where` names it in
  the errors of a template that does not parse (its file); a failing render raises ValueError
  without it (a server's answer shows no path of the server's)."""

  def __init__(self, template: str, specials: dict[str, str], where: str):
    import jinja2  # noqa: PLC0415
    self.where, self.specials, self.source = where, specials, template
    try:
      self._template = _environment().from_string(template)
    except jinja2.exceptions.TemplateError as e:
      raise DataError(f'{where}: the chat template does not parse ({e}).') from None
    self._error = jinja2.exceptions.TemplateError
    self.marks_generation = bool(_GENERATION_TAG.search(template))

  def _render(self, messages: list[dict], add_generation_prompt: bool,
              spans: list[tuple[int, int]] | None = None, tools: list[dict] | None = None) -> str:
    """The text; the {% generation %} blocks' spans appended to spans if given; tools: a chat
    request's (OpenAI's function tools, as transformers passes them)."""
    blocks: list[str] = []
    token = _TRACKING.set((blocks, spans) if spans is not None else None)
    try:
      blocks.extend(self._template.generate(
          messages=_as_transformers_passes(messages), tools=tools, documents=None,
          add_generation_prompt=add_generation_prompt, **self.specials))
      return ''.join(blocks)
    except self._error as e:
      raise ValueError(f'the chat template failed: {e}') from None
    finally:
      _TRACKING.reset(token)

  def render(self, messages: list[dict], add_generation_prompt: bool,
             tools: list[dict] | None = None) -> str:
    """The conversation's text (ValueError: the template failed), with the request's tools."""
    return self._render(messages, add_generation_prompt, tools=tools)

  def assistant_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The conversation's text (no generation prompt) and the character span of each assistant
    turn in it (the module docstring); ValueError for a template that fails or whose turns cannot
    be told apart."""
    if self.marks_generation:
      spans: list[tuple[int, int]] = []
      return self._render(messages, False, spans), spans
    full = self._render(messages, False)
    spans, pos = [], 0
    for i, m in enumerate(messages):
      if m['role'] != 'assistant':
        continue
      before = self._render(messages[:i], True)
      through = self._render(messages[:i + 1], False)
      turn = through[len(before):]  # the turn as rendered last
      kept = (_kept(full, len(before), turn, m['content'])
              if full.startswith(before) and through.startswith(before) else 0)
      if not (kept and len(before) >= pos):
        raise ValueError(
            f'the chat template does not render the conversation before message {i} (an '
            'assistant turn), with the generation prompt, as the start of the whole, or keeps '
            "nothing of that turn, so its tokens cannot be found by rendering prefixes; mark the "
            'assistant turns with {% generation %}...{% endgeneration %} in the template (as '
            "TRL's training templates do)")
      spans.append((len(before), len(before) + kept))
      pos = len(before) + kept
    return full, spans


def _kept(text: str, start: int, turn: str, content: str) -> int:
  """How much of turn text keeps at start: all of it, or (a turn rendered differently once others
  follow it, as Qwen3's without its <think>) the longest end of it that text has there, if that
  holds the turn's answer (its content after any </think>); else 0."""
  if text.startswith(turn, start):
    return len(turn)
  n = next((n for n in range(len(turn) - 1, 0, -1) if text.startswith(turn[-n:], start)), 0)
  answer = content.split('</think>')[-1].strip()
  return n if n and answer in turn[-n:] else 0


def find_template(directories: list[str]) -> ChatTemplate | None:
  """The chat template of the first of directories that has one (chat_template.jinja, else
  tokenizer_config.json's), with that directory's special tokens; None if none has."""
  for directory in directories:
    source = tokenizer_lib.chat_template_source(directory)
    if source is not None:
      return ChatTemplate(source[0], tokenizer_lib.hf_special_tokens(directory), source[1])
  return None


def tokenizer_template(tokenizer, path: str | None = None) -> ChatTemplate | None:
  """The chat template in path (a file: serve --chat_template), else the tokenizer's (in
  tokenizer.directory: data.tokenizer's directory, or its file's; a run keeps it in its
  tokenizer/), or None; the special tokens are the tokenizer directory's either way."""
  directory = tokenizer.directory
  if path:
    if not hasattr(tokenizer, 'encode_rendered'):
      raise DataError(f'{path}: this run has no text tokenizer (token ids only) to encode a '
                      'rendered chat with.')
    return template_file(path, tokenizer_lib.hf_special_tokens(directory) if directory else {})
  return find_template([directory] if directory else [])


def template_file(path: str, specials: dict[str, str] | None = None) -> ChatTemplate:
  """The chat template in a file (DataError: missing, unreadable or not a template)."""
  return ChatTemplate(tokenizer_lib.read_chat_template(path), specials or {}, path)


def prompt_ids(template: ChatTemplate, messages: list[dict], tokenizer,
               tools: list[dict] | None = None) -> np.ndarray:
  """int32 [n]: a chat request's prompt: the conversation (and its tools) rendered once with the
  generation prompt, encoded once as transformers encodes it. ValueError: the template failed."""
  ids, _ = tokenizer.encode_rendered(template.render(messages, add_generation_prompt=True,
                                                     tools=tools))
  return ids


def example_ids(template: ChatTemplate, messages: list[dict],
                tokenizer) -> tuple[np.ndarray, np.ndarray]:
  """(ids int32 [n], is_target bool [n]) of an SFT conversation: rendered once, encoded once;
  a target where a token's characters overlap an assistant turn's span. ValueError: the template
  failed or its turns cannot be told apart."""
  text, spans = template.assistant_spans(messages)
  ids, offsets_Nx2 = tokenizer.encode_rendered(text)
  is_target = np.zeros(len(ids), bool)
  for start, end in spans:
    is_target |= (offsets_Nx2[:, 1] > start) & (offsets_Nx2[:, 0] < end)
  return ids, is_target
