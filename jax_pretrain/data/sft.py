"""Supervised fine-tuning data (data.format='sft'): examples -> ids with a completion mask -> rows.

A source is JSONL files (.jsonl, .jsonl.gz, .jsonl.zst), one example per line:
  {"prompt": "...", "completion": "..."}   the prompt is encoded as a document starts (with the
                                           tokenizer's own specials, e.g. Llama 3's BOS), the
                                           completion without; then EOS
  {"messages": [{"role": ..., "content": ...}, ...]}   rendered once with the tokenizer's chat
                                           template and encoded once, as Hugging Face's
                                           apply_chat_template(tokenize=True) does (data/chat.py);
                                           the tokens of the assistant turns are the completion,
                                           the rest is prompt; then EOS (unless the text ends
                                           with it)
Only completion tokens (and the EOS) are loss targets.

Examples are packed in file order into rows of seq_len + 1 tokens (a row holds as many whole
examples as fit; the rest is padding), and the rows are what the pipeline shuffles, mixes and
batches, like pretraining's windows. A row is
  tokens    int32 [seq_len + 1]  the examples, then pad_id
  weights   float32 [seq_len]    1 where target t (tokens[t + 1]) is a completion token of the same
                                 example as input t; 0 for prompt tokens, padding and the first
                                 token of the next example
  segments  int32 [seq_len]      1, 2, ... per example of the row, 0 for padding: attention stays
                                 inside an example (kernels/attention.py), so a packed row scores
                                 each example as if it were alone
An example longer than seq_len + 1 tokens is a bad record: an error naming its file and line, or
skipped and counted with data.on_bad_record=skip.
"""
import dataclasses
import json
import os

from absl import logging
import numpy as np

from jax_pretrain.data import chat
from jax_pretrain.data import formats
from jax_pretrain.data import sources as sources_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError

_JSONL_FORMATS = (formats.Jsonl, formats.CompressedJsonl)
_SKIP_HINT = ('(Set data.on_bad_record=skip to skip such examples and count them.)')


def _string_error(obj: dict, key: str) -> str | None:
  """What is wrong with obj[key] as a string; None: nothing."""
  if key not in obj:
    return f'no "{key}" field'
  if not isinstance(obj[key], str):
    return f'"{key}" is {type(obj[key]).__name__}, not a string'
  return None


def _messages_error(messages) -> str | None:
  """What is wrong with an example's "messages"; None: nothing."""
  if not isinstance(messages, list) or not messages:
    return '"messages" must be a non-empty list'
  for m in messages:
    if not (isinstance(m, dict) and isinstance(m.get('role'), str)
            and isinstance(m.get('content'), str)):
      return 'each message must be an object with string "role" and "content"'
  if not any(m['role'] == 'assistant' for m in messages):
    return 'no "assistant" message (nothing to train on)'
  return None


Tokens = tuple[np.ndarray, np.ndarray]  # (ids int32 [n], is_target bool [n]) of one example


def example_tokens(line: str, template: chat.ChatTemplate | None, tokenizer,
                   where: str) -> tuple[Tokens | None, str | None]:
  """((ids, is_target), None) of one example, its EOS included, or (None, what is wrong). Raises
  DataError for messages without a chat template (not the record's fault)."""
  obj = json.loads(line)  # formats checked that it is a JSON object
  if 'messages' in obj:
    if template is None:
      raise DataError(f'{where}: "messages" needs a chat template, but the tokenizer has none '
                      f'({tokenizer_lib.CHAT_TEMPLATE_FILE}, or a "chat_template" in the '
                      f'{tokenizer_lib.HF_CONFIG_FILE} beside it). Give {{"prompt", '
                      '"completion"} examples, or set data.tokenizer to a tokenizer directory '
                      'that has one.')
    error = _messages_error(obj['messages'])
    if error:
      return None, error
    try:
      ids, is_target = chat.example_ids(template, obj['messages'], tokenizer)
    except ValueError as e:
      return None, str(e)
    if len(ids) and ids[-1] == tokenizer.eos_id:  # (the template's text ends with EOS)
      return (ids, is_target | (np.arange(len(ids)) == len(ids) - 1)), None
    return _with_eos(ids, is_target, tokenizer), None
  error = _string_error(obj, 'prompt')
  if error:
    return None, error + (' (an SFT example is {"prompt", "completion"} or {"messages"})'
                          if 'completion' not in obj else '')
  error = _string_error(obj, 'completion')
  if error:
    return None, error
  prompt: str = obj['prompt']
  completion: str = obj['completion']
  if not completion:
    return None, '"completion" is empty'
  prompt_ids = _encode(tokenizer, prompt, True)
  completion_ids = _encode(tokenizer, completion, False)
  return _with_eos(np.concatenate([prompt_ids, completion_ids]),
                   np.arange(len(prompt_ids) + len(completion_ids)) >= len(prompt_ids),
                   tokenizer), None


def _encode(tokenizer, text: str, specials: bool) -> np.ndarray:
  if not text:
    return np.zeros(0, np.int32)
  if isinstance(tokenizer, tokenizer_lib.HfTokenizer):
    return tokenizer.encode(text, add_special_tokens=specials)
  return np.asarray(tokenizer.encode(text), np.int32)


def _with_eos(ids: np.ndarray, is_target: np.ndarray, tokenizer) -> Tokens:
  """The example's tokens, then EOS (a target)."""
  return (np.append(ids, tokenizer.eos_id).astype(np.int32),
          np.append(is_target, True).astype(bool))


@dataclasses.dataclass
class Examples:
  """A source's examples, tokenized and concatenated."""
  name: str
  weight: float
  tokens: np.ndarray     # int32 [N]
  is_target: np.ndarray  # bool [N]: a completion token (or the EOS)
  ends: np.ndarray       # int64 [num_examples]: where each example ends in tokens

  def __len__(self) -> int:
    return len(self.ends)

  def take(self, lo: int, hi: int) -> 'Examples':
    """Examples [lo, hi)."""
    start = int(self.ends[lo - 1]) if lo else 0
    stop = int(self.ends[hi - 1]) if hi else 0
    return Examples(self.name, self.weight, self.tokens[start:stop], self.is_target[start:stop],
                    self.ends[lo:hi] - start)


def read_examples(source: sources_lib.Source, tokenizer, options: sources_lib.ReadOptions,
                  seq_len: int, template: chat.ChatTemplate | None) -> Examples:
  """Reads and tokenizes one source's examples (in file order); bad ones raise or are counted."""
  if not (isinstance(source, sources_lib.Files) and source.is_text
          and all(fmt in _JSONL_FORMATS for _, fmt in source.files)):
    raise DataError(f"{source.text}: data.format='sft' reads JSONL files (.jsonl, .jsonl.gz, "
                    '.jsonl.zst) of {"prompt", "completion"} or {"messages"} examples.')
  ids, targets, skipped, records = [], [], 0, 0
  for path, fmt in source.text_files:
    if os.path.getsize(path) == 0:
      raise DataError(f'{path}: empty file.')
    for item in fmt.work_items(path, formats.WHOLE_LINE):
      for n, line, error in formats.read(item):
        records += 1
        where = formats.location(item, n)
        example = None
        if error is None:
          assert line is not None  # a record has its text or its error (formats.Record)
          example, error = example_tokens(line, template, tokenizer, where)
        if example is not None:
          x, t = example
          if len(x) > seq_len + 1:
            error = (f'the example is {len(x)} tokens, more than data.seq_len + 1 = '
                     f'{seq_len + 1}; raise data.seq_len or shorten it')
        if error is not None:
          if options.on_bad_record != 'skip':
            raise DataError(f'{where}: {error}. {_SKIP_HINT}')
          skipped += 1
          continue
        ids.append(x)
        targets.append(t)
  if not ids:
    raise DataError(f'{source.text}: no usable example ({skipped} of {records} lines were bad).')
  if skipped:
    logging.warning('%s: skipped %d bad examples of %d', source.text, skipped, records)
  ends = np.cumsum([len(x) for x in ids], dtype=np.int64)
  return Examples(source.text, source.weight, np.concatenate(ids), np.concatenate(targets), ends)


class PackedRows:
  """A grain random-access source: row i = whole examples packed in order (module docstring)."""

  def __init__(self, examples: Examples, seq_len: int, pad_id: int):
    self.examples, self.seq_len, self.pad_id = examples, seq_len, pad_id
    lengths = np.diff(examples.ends, prepend=0)
    firsts, used = [0], 0
    for k, n in enumerate(lengths):  # greedy, in order: a new row when the next does not fit
      if used + n > seq_len + 1:
        firsts.append(k)
        used = 0
      used += n
    self.firsts = np.asarray(firsts + [len(lengths)], np.int64)

  def __len__(self) -> int:
    return len(self.firsts) - 1 if len(self.examples) else 0

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    ex, T = self.examples, self.seq_len
    first, end = int(self.firsts[i]), int(self.firsts[i + 1])
    start = int(ex.ends[first - 1]) if first else 0
    stop = int(ex.ends[end - 1])
    n = stop - start
    tokens_T1 = np.full(T + 1, self.pad_id, np.int32)
    tokens_T1[:n] = ex.tokens[start:stop]
    segments_T1 = np.zeros(T + 1, np.int32)
    segments_T1[:n] = np.repeat(np.arange(1, end - first + 1, dtype=np.int32),
                                np.diff(ex.ends[first:end], prepend=start))
    is_target_T1 = np.zeros(T + 1, bool)
    is_target_T1[:n] = ex.is_target[start:stop]
    same_T = segments_T1[1:] == segments_T1[:-1]
    weights_T = (is_target_T1[1:] & same_T).astype(np.float32)
    return {'tokens': tokens_T1, 'weights': weights_T, 'segments': segments_T1[:-1]}

  def fill(self) -> float:
    """The share of the rows' tokens that are examples' (not padding)."""
    return len(self.examples.tokens) / max(1, len(self) * (self.seq_len + 1))

  def __repr__(self):
    return f'PackedRows({self.examples.name}, {len(self.examples)} examples, {len(self)} rows)'


def packed_sources(sources, seq_len: int, val_ratio: float, pad_id: int
                   ) -> tuple[list[PackedRows], list[PackedRows]]:
  """(train rows, eval rows) per source of a loader.Sources; eval is data.val's examples, else the
  last val_ratio of each training source's examples."""
  template = chat.tokenizer_template(sources.tokenizer)
  tok, options = sources.tokenizer, sources.options
  train, val = [], []
  for source in sources.train:
    ex = read_examples(source, tok, options, seq_len, template)
    held = 0 if sources.val else min(len(ex) - 1, int(round(len(ex) * val_ratio)))
    if not sources.val and val_ratio > 0 and len(ex) > 1:
      held = max(held, 1)
    train.append(PackedRows(ex.take(0, len(ex) - held), seq_len, pad_id))
    if held:
      val.append(PackedRows(ex.take(len(ex) - held, len(ex)), seq_len, pad_id))
  for source in sources.val:
    val.append(PackedRows(read_examples(source, tok, options, seq_len, template), seq_len, pad_id))
  for rows in train + val:
    ex = rows.examples
    logging.info('%s: %d examples, %d tokens (%d completion), %d rows of %d (%.0f%% filled)',
                 ex.name, len(ex), len(ex.tokens), int(ex.is_target.sum()), len(rows),
                 seq_len + 1, 100 * rows.fill())
  return train, val
