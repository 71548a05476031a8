"""Verifiable tasks for fine-tuning and evaluation: task files, and the rewards that score a
completion against an item's answer.

A task is JSONL, one item per line: {"prompt": ..., "answer": ...}, optionally "choices": [...];
or a Hugging Face dataset, named as data sources name one (data/hub.py):
hf:NAME_OR_PATH[:CONFIG][@SPLIT], a save_to_disk directory, a local directory of data files, or a
dataset on the Hub (streamed, read in order). Built-in formats read other layouts into items
(`FORMATS`: MedQA-USMLE's 4 options, as lm-eval's medqa_4options, e.g.
hf:GBaker/MedQA-USMLE-4-options@test; GSM8K's `#### number` answers, e.g.
hf:openai/gsm8k:main@test). A field mapping, 'FIELD=COLUMN,...', reads a format's fields from
other columns (plain: 'prompt=question,answer=label,choices=options').

Rewards are registered by name (`REWARDS`: exact, choice, number) or given as a user's function,
`module:function` or `path.py:function`, called as fn(completion, item) -> float. Every mistake in
a task or a reward is a TaskError naming the file and line (FILE:LINE), the dataset and row
(hf:NAME@SPLIT:ROW, rows counted from 1), or the function.
"""
from collections.abc import Sequence
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import re
import string
from typing import Callable

from jax_pretrain.data import hub
from jax_pretrain.data import sources
from jax_pretrain.data.errors import DataError
from jax_pretrain.errors import UserError


class TaskError(UserError):
  """A task file or a reward that cannot work; the message names the file and line, or the
  function."""


@dataclasses.dataclass(frozen=True)
class Item:
  prompt: str
  answer: str
  choices: tuple[str, ...] = ()
  where: str = ''  # FILE:LINE or hf:NAME@SPLIT:ROW, for messages


Reward = Callable[[str, Item], float]
REWARDS: dict[str, Reward] = {}


def register(name: str):
  def add(fn: Reward) -> Reward:
    REWARDS[name] = fn
    return fn
  return add


def first_line(completion: str, stop: tuple[str, ...] = ()) -> str:
  """The completion up to the first newline or stop string, stripped."""
  end = len(completion)
  for s in ('\n', *stop):
    i = completion.find(s)
    if i >= 0:
      end = min(end, i)
  return completion[:end].strip()


@register('exact')
def exact(completion: str, item: Item) -> float:
  """1 when the completion's first line, stripped, is the answer."""
  return float(first_line(completion) == item.answer.strip())


_LETTER = re.compile(r'(?<![A-Za-z])\(?([A-Z])\)?(?![A-Za-z])')


def choice_letter(answer: str, choices: tuple[str, ...]) -> str:
  """The letter of an answer given as a letter or as the text of one of the choices."""
  answer = answer.strip()
  if len(answer) == 1 and answer.isalpha():
    return answer.upper()
  for letter, text in zip(string.ascii_uppercase, choices):
    if answer == text.strip():
      return letter
  return answer


@register('choice')
def choice(completion: str, item: Item) -> float:
  """1 when the first choice named in the completion, by its letter (A, (B), ...) or its text,
  is the answer."""
  letters = string.ascii_uppercase[:len(item.choices)] if item.choices else string.ascii_uppercase
  found = []  # (position, letter)
  for m in _LETTER.finditer(completion):
    if m.group(1) in letters:
      found.append((m.start(), m.group(1)))
      break
  for letter, text in zip(string.ascii_uppercase, item.choices):
    i = completion.find(text.strip()) if text.strip() else -1
    if i >= 0:
      found.append((i, letter))
  if not found:
    return 0.0
  return float(min(found)[1] == choice_letter(item.answer, item.choices))


_NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?|-?\.\d+')


def parse_number(text: str) -> float | None:
  """The first number in the text (commas as thousands separators), or None."""
  m = _NUMBER.search(text)
  return float(m.group(0).replace(',', '')) if m else None


@register('number')
def number(completion: str, item: Item) -> float:
  """1 when the first number in the completion equals the answer's number."""
  got, want = parse_number(completion), parse_number(item.answer)
  return float(got is not None and want is not None and abs(got - want) <= 1e-6 * max(1, abs(want)))


def reward_fn(spec: str) -> Reward:
  """A registered reward by name, or a user's function: 'module:function' or 'path.py:function'."""
  if spec in REWARDS:
    return REWARDS[spec]
  if ':' not in spec:
    raise TaskError(f'reward {spec!r}: no such reward; choose one of {sorted(REWARDS)} or give '
                    "your own function as 'module:function' or 'path/to/file.py:function'.")
  where, name = spec.rsplit(':', 1)
  try:
    if where.endswith('.py'):
      if not os.path.isfile(where):
        raise FileNotFoundError(f'no such file {where}')
      module_spec = importlib.util.spec_from_file_location('_jax_pretrain_reward', where)
      if module_spec is None or module_spec.loader is None:
        raise ImportError(f'no loader for {where}')
      module = importlib.util.module_from_spec(module_spec)
      module_spec.loader.exec_module(module)
    else:
      module = importlib.import_module(where)
  except Exception as e:  # noqa: BLE001  (a user's module: any error is the user's to see)
    raise TaskError(f'reward {spec}: cannot import {where} ({type(e).__name__}: {e}).') from None
  fn = getattr(module, name, None)
  if not callable(fn):
    raise TaskError(f'reward {spec}: {where} has no function {name!r}.')
  return fn


def score(fn: Reward, completion: str, item: Item) -> float:
  """fn(completion, item) as a float; a reward that raises or returns a non-number is a TaskError
  naming the function and the item."""
  name = getattr(fn, '__qualname__', repr(fn))
  try:
    value = float(fn(completion, item))
  except Exception as e:  # noqa: BLE001  (a user's reward function)
    raise TaskError(f'reward {name} failed on {item.where} ({type(e).__name__}: {e}).') from None
  if not math.isfinite(value):
    raise TaskError(f'reward {name} returned {value} on {item.where} (rewards must be finite: '
                    'one would make its whole group non-finite).')
  return value


def accuracy(rewards) -> float:
  """The share of completions that are fully right: reward >= 1 (the built-in rewards are 0 or 1,
  so for them it is the mean reward)."""
  rewards = [float(r) for r in rewards]
  return sum(r >= 1 for r in rewards) / max(len(rewards), 1)


def _plain(record: dict) -> tuple[str, str, tuple[str, ...]]:
  return record['prompt'], record['answer'], tuple(record.get('choices') or ())


def _medqa(record: dict) -> tuple[str, str, tuple[str, ...]]:
  """MedQA-USMLE 4 options (as lm-eval's medqa_4options): question, options A-D, answer letter
  (or the answer's text)."""
  options = record['options']
  letters: Sequence[str]
  if isinstance(options, dict):
    letters = sorted(options)
    choices = tuple(str(options[k]) for k in letters)
  else:
    letters, choices = string.ascii_uppercase[:len(options)], tuple(map(str, options))
  listed = '\n'.join(f'{letter}. {text}' for letter, text in zip(letters, choices))
  answer = record.get('answer_idx') or record['answer']
  return f'Question: {record["question"]}\n{listed}\nAnswer:', str(answer), choices


def _gsm8k(record: dict) -> tuple[str, str, tuple[str, ...]]:
  """GSM8K: the answer's number is after '####'."""
  answer = record['answer']
  return f'Question: {record["question"]}\nAnswer:', answer.split('####')[-1].strip(), ()


@dataclasses.dataclass(frozen=True)
class Format:
  """A layout of task records: its converter to (prompt, answer, choices), and the fields the
  converter reads, which a field mapping may name (a record without a required one is an error)."""
  convert: Callable[[dict], tuple[str, str, tuple[str, ...]]]
  required: tuple[str, ...]
  optional: tuple[str, ...] = ()


FORMATS = {'plain': Format(_plain, ('prompt', 'answer'), ('choices',)),
           'medqa': Format(_medqa, ('question', 'options'), ('answer_idx', 'answer')),
           'gsm8k': Format(_gsm8k, ('question', 'answer'))}


def _field_mapping(fields: str, format_name: str) -> dict[str, str]:
  """{FIELD: COLUMN} of 'FIELD=COLUMN,...', each FIELD one the format reads."""
  names, mapping = (*FORMATS[format_name].required, *FORMATS[format_name].optional), {}
  for part in filter(None, (p.strip() for p in fields.split(','))):
    field, sep, column = (s.strip() for s in part.partition('='))
    if not (sep and field and column):
      raise TaskError(f'task fields {fields!r}: {part!r} is not FIELD=COLUMN.')
    if field not in names:
      raise TaskError(f'task fields {fields!r}: format {format_name!r} reads no field {field!r} '
                      f'(its fields: {", ".join(names)}).')
    if field in mapping:
      raise TaskError(f'task fields {fields!r}: {field!r} is mapped twice.')
    mapping[field] = column
  return mapping


def _file_records(path: str):
  """(FILE:LINE, record) of each non-blank line of a JSONL file."""
  if not os.path.isfile(path):
    raise TaskError(f'{path}: no such task file (JSONL, one {{"prompt", "answer"}} per line).')
  with open(path, encoding='utf-8') as f:
    for n, line in enumerate(f, 1):
      where = f'{path}:{n}'
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise TaskError(f'{where}: not valid JSON ({e.msg}).') from None
      if not isinstance(record, dict):
        raise TaskError(f'{where}: a task line is a JSON object, got {type(record).__name__}.')
      yield where, record


def _dataset_records(source: str, format_name: str, mapping: dict[str, str]):
  """(hf:NAME@SPLIT:ROW, record) of each row of a dataset, opened as data sources open it
  (data/hub.py), rows counted from 1. The columns the format needs are checked first where the
  dataset declares its columns (a streamed one may not)."""
  name, split = hub.parse(source)
  where = hub.spec(name, split)
  try:
    ds, _ = hub.open_dataset(name, split)
  except DataError as e:
    raise TaskError(str(e)) from None
  columns = ds.column_names
  if columns is not None:
    for field in dict.fromkeys((*FORMATS[format_name].required, *mapping)):
      column = mapping.get(field, field)
      if column not in columns:
        why = (f'named by the task field {field}={column}' if field in mapping else
               f'which format {format_name!r} reads; name the column to read instead in the '
               f'task fields: {field}=COLUMN')
        raise TaskError(f'{where}: no column {column!r} (columns: {", ".join(columns)}), {why}.')
  for n, record in enumerate(ds, 1):
    yield f'{where}:{n}', record


def load(source: str, format_name: str = 'plain', fields: str = '') -> list[Item]:
  """The items of a task: a JSONL file, or a Hugging Face dataset hf:NAME_OR_PATH[:CONFIG][@SPLIT]
  (as data sources name one), in the layout `format_name`. `fields`, 'FIELD=COLUMN,...', names
  the column each of the format's fields is read from where it is not the field's own name (plain:
  'prompt=question,answer=label,choices=options'). Every bad record is a TaskError naming FILE:LINE,
  or hf:NAME@SPLIT:ROW."""
  if format_name not in FORMATS:
    raise TaskError(f'task format {format_name!r}: choose one of {sorted(FORMATS)}.')
  convert, mapping = FORMATS[format_name].convert, _field_mapping(fields, format_name)
  records = (_dataset_records(source, format_name, mapping)
             if sources.HfDataset.claims(source) else _file_records(source))
  items = []
  for where, record in records:
    missing = next((column for column in mapping.values() if column not in record), None)
    if missing is not None:
      raise TaskError(f'{where}: no {missing!r} field (task fields {fields!r}).')
    record = {**record, **{field: record[column] for field, column in mapping.items()}}
    try:
      prompt, answer, choices = convert(record)
    except KeyError as e:
      raise TaskError(f'{where}: no {e.args[0]!r} field (format {format_name!r}).') from None
    except (TypeError, AttributeError) as e:
      raise TaskError(f'{where}: not a {format_name!r} record ({type(e).__name__}: {e}).'
                      ) from None
    if not isinstance(prompt, str) or not prompt:
      raise TaskError(f'{where}: "prompt" must be a non-empty string.')
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
      raise TaskError(f'{where}: "answer" must be a string or a number.')
    items.append(Item(prompt, str(answer), tuple(str(c) for c in choices), where))
  if not items:
    raise TaskError(f'{source}: no task items.')
  return items


def check_lengths(items: list[Item], encode, context: int, new_tokens: int) -> None:
  """A prompt that leaves no room for new_tokens in the model's context is a TaskError."""
  for item in items:
    n = len(encode(item.prompt))
    if n + new_tokens > context:
      raise TaskError(f'{item.where}: the prompt is {n} tokens; with {new_tokens} new tokens it '
                      f'exceeds the context of {context}. Shorten it or lower the new tokens.')
