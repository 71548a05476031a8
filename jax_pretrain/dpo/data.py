"""DPO's data: preference pairs read and tokenized once (before the config is resolved), as TRL's
DPOTrainer prepares them (1.16: trl/trainer/dpo_trainer.py, _prepare_dataset and
DataCollatorForPreference), and the batches of each step.

A source is JSONL files (.jsonl, .jsonl.gz, .jsonl.zst), one pair a line, Parquet files, one pair
a row, or a Hugging Face dataset (hf:NAME_OR_PATH[@SPLIT], opened as the trainer's data sources
open one: data/hub.py), one pair a row, in one of TRL's forms:
  {"prompt": "...", "chosen": "...", "rejected": "..."}      text: the prompt tokenized as a
      document starts (the tokenizer's specials, e.g. Llama 3's BOS), prompt + completion + EOS
      tokenized whole, the completion where the two diverge (TRL's common_prefix_length)
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   conversational: rendered
      with the run's chat template (the prompt with the generation prompt), no EOS added
  {"chosen": ..., "rejected": ...}   implicit prompt (either form): their shared beginning is
      the prompt (TRL's extract_prompt)
Truncation: a prompt keeps its last dpo.max_prompt_tokens, a completion its first
dpo.max_completion_tokens (0: all; TRL's max_prompt_length and max_completion_length before 1.0),
then each sequence its first data.seq_len + 1 tokens (TRL 1.16's max_length, keep_start); a pair
whose prompt alone fills them is dropped, as TRL drops it, and counted. A bad line or row is one
error naming its file and line (FILE:row N, hf:NAME@SPLIT:ROW).
"""
from collections.abc import Iterable
from collections.abc import Iterator
import dataclasses
import itertools
import json
import os
from typing import Any

from absl import logging
import numpy as np

from jax_pretrain.data import chat
from jax_pretrain.data import formats
from jax_pretrain.data import hub
from jax_pretrain.data import sources as sources_lib
from jax_pretrain.data import tokenizer as tokenizer_lib
from jax_pretrain.data.errors import DataError
from jax_pretrain.grpo.data import Prompts

_JSONL_FORMATS = (formats.Jsonl, formats.CompressedJsonl)
_FORMS = ('a DPO pair is {"prompt", "chosen", "rejected"} (text, or lists of {"role", "content"} '
          'messages) or {"chosen", "rejected"} with the prompt their shared beginning')


@dataclasses.dataclass(frozen=True)
class Pair:
  """One preference pair's ids: the prompt's, and each completion's (int32)."""
  prompt: np.ndarray
  chosen: np.ndarray
  rejected: np.ndarray


def extract_prompt(chosen, rejected) -> tuple[Any, Any, Any]:
  """(prompt, chosen, rejected) of an implicit-prompt pair: TRL's extract_prompt (the shared
  beginning, of strings or message lists; a string's space before the difference stays with
  the completions)."""
  idx = 0
  for idx in range(min(len(chosen), len(rejected))):
    if chosen[idx] != rejected[idx]:
      if chosen[idx - 1] == ' ':
        idx -= 1
      break
  return chosen[:idx], chosen[idx:], rejected[idx:]


def _is_messages(x) -> bool:
  return isinstance(x, list) and all(
      isinstance(m, dict) and isinstance(m.get('role'), str) and isinstance(m.get('content'), str)
      for m in x)


def _fields(obj: dict) -> tuple[Any, Any, Any] | str:
  """(prompt, chosen, rejected), all strings or all message lists, or what is wrong."""
  if not isinstance(obj, dict) or 'chosen' not in obj or 'rejected' not in obj:
    return 'no "chosen" and "rejected" fields: ' + _FORMS
  chosen, rejected = obj['chosen'], obj['rejected']
  if chosen == rejected:
    return '"chosen" and "rejected" are the same (a pair that prefers nothing)'
  if obj.get('prompt') is None or (isinstance(obj['prompt'], str) and _is_messages(chosen)):
    # (a table's row without a prompt has it null: the implicit form too)
    if not (isinstance(chosen, str) and isinstance(rejected, str)
            or _is_messages(chosen) and _is_messages(rejected)):
      return '"chosen" and "rejected" must both be strings or both lists of messages: ' + _FORMS
    if not chosen or not rejected:
      return '"chosen" or "rejected" is empty'
    return extract_prompt(chosen, rejected)
  values = (obj['prompt'], chosen, rejected)
  if not (all(isinstance(v, str) for v in values) or all(_is_messages(v) for v in values)):
    return ('"prompt", "chosen" and "rejected" must all be strings or all lists of messages: '
            + _FORMS)
  return values


def _encode(tokenizer, text: str, specials: bool) -> list[int]:
  if isinstance(tokenizer, tokenizer_lib.HfTokenizer):
    return tokenizer.encode(text, add_special_tokens=specials).tolist()
  return np.asarray(tokenizer.encode(text), np.int32).tolist() if text else []


def encode_pair(prompt, chosen, rejected, tokenizer,
                template: chat.ChatTemplate | None) -> Pair | str:
  """The pair's ids as TRL's tokenize_fn makes them, or what is wrong: prompt, prompt + chosen
  and prompt + rejected tokenized whole (text: + EOS; messages: rendered with the chat
  template once and encoded once as transformers encodes it: chat.py), the completions starting
  where they diverge from the prompt's ids."""
  if isinstance(prompt, str):
    p = _encode(tokenizer, prompt, True)
    pc = _encode(tokenizer, prompt + chosen, True) + [tokenizer.eos_id]
    pr = _encode(tokenizer, prompt + rejected, True) + [tokenizer.eos_id]
  else:
    if template is None:
      return (f'lists of messages need a chat template, but the tokenizer has none '
              f'({tokenizer_lib.CHAT_TEMPLATE_FILE}, or a "chat_template" in the '
              f'{tokenizer_lib.HF_CONFIG_FILE} beside it); give text pairs')
    try:
      p, pc, pr = (tokenizer.encode_rendered(
          template.render(messages, add_generation_prompt=generate))[0].tolist()
                   for messages, generate in ((prompt, True), (prompt + chosen, False),
                                              (prompt + rejected, False)))
    except Exception as e:  # noqa: BLE001  (jinja2's errors: the template's, for this pair)
      return f'the chat template failed on this pair: {e}'
  n = min(len(os.path.commonprefix([p, pc])), len(os.path.commonprefix([p, pr])))
  if n == 0:
    return 'the prompt has no tokens (the completions need a context)'
  if len(pc) == n or len(pr) == n:
    return '"chosen" or "rejected" adds no tokens to the prompt'
  as_ids = lambda x: np.asarray(x, np.int32)
  return Pair(as_ids(p[:n]), as_ids(pc[n:]), as_ids(pr[n:]))


def truncate(pair: Pair, max_prompt: int, max_completion: int, max_length: int) -> Pair | None:
  """The module docstring's truncation; None where the prompt alone fills max_length."""
  prompt = pair.prompt[-max_prompt:] if max_prompt else pair.prompt
  if len(prompt) >= max_length:
    return None
  keep = max_length - len(prompt)
  if max_completion:
    keep = min(keep, max_completion)
  return Pair(prompt, pair.chosen[:keep], pair.rejected[:keep])


def _file_records(path: str, fmt) -> Iterator[tuple[str, Any, str | None]]:
  """(FILE:LINE or FILE:row N, the record, what is wrong or None) of each pair in a JSONL or
  Parquet file."""
  if fmt is formats.Parquet:
    import pyarrow  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415
    try:
      rows = pq.read_table(path).to_pylist()
    except (pyarrow.ArrowException, OSError) as e:
      raise DataError(f'{path}: not a readable Parquet file ({e}).') from None
    for n, row in enumerate(rows, 1):
      yield f'{path}:row {n}', row, None
    return
  if fmt not in _JSONL_FORMATS:
    raise DataError(f'{path}: DPO reads JSONL (.jsonl, .jsonl.gz, .jsonl.zst) or Parquet files '
                    'of preference pairs, or a Hugging Face dataset (hf:NAME[@SPLIT]).')
  if os.path.getsize(path) == 0:
    raise DataError(f'{path}: empty file.')
  for item in fmt.work_items(path, formats.WHOLE_LINE):
    for n, line, error in formats.read(item):
      yield formats.location(item, n), None if line is None else json.loads(line), error


def _dataset_records(text: str) -> Iterator[tuple[str, Any, str | None]]:
  """(hf:NAME@SPLIT:ROW, the record, None) of each row of a Hugging Face dataset, opened as the
  trainer's data sources open it (data/hub.py), rows counted from 1."""
  name, split = hub.parse(text)
  ds, _ = hub.open_dataset(name, split)
  for n, row in enumerate(ds, 1):
    yield f'{hub.spec(name, split)}:{n}', row, None


def read_pairs(records: Iterable[tuple[str, Any, str | None]], tokenizer, template,
               limits: tuple[int, int, int]) -> tuple[list[Pair], int]:
  """(the records' pairs in order, truncated; how many were dropped for a prompt that fills
  max_length). records: (where, record, what is wrong or None). limits: (max prompt, max
  completion, max sequence tokens). A bad record raises a DataError naming it."""
  pairs, dropped = [], 0
  for where, record, error in records:
    if error is None:
      fields = _fields(record)
      pair = fields if isinstance(fields, str) else encode_pair(*fields, tokenizer, template)
      if isinstance(pair, str):
        error = pair
    if error is not None:
      raise DataError(f'{where}: {error}.')
    assert isinstance(pair, Pair)
    kept = truncate(pair, *limits)
    if kept is None:
      dropped += 1
    else:
      pairs.append(kept)
  return pairs, dropped


def width(pairs: list[Pair], seq_len: int) -> int:
  """Tokens per sequence of the rows: the longest pair's, such that the model's inputs (all but
  the last token) are a multiple of 8 long (cuDNN's fused attention trains on no odd length),
  and at most data.seq_len of them."""
  longest = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs)
  return min(-(-(longest - 1) // 8) * 8, seq_len) + 1


def rows(pairs: list, length: int, pad_id: int, ref_logps: np.ndarray | None = None,
         rpo: bool = False, size: int = 0) -> dict[str, np.ndarray]:
  """The batch of these pairs (objective's layout: sequences of `length` tokens, padded with
  pad_id), `size` rows (0: one a pair; more: padding rows with pairs 0). ref_logps: theirs
  [len(pairs), 2], else zeros (scored on the device)."""
  B = size or len(pairs)
  tokens = np.full((B, 2, length), pad_id, np.int32)
  mask = np.zeros((B, 2, length - 1), np.float32)
  for b, p in enumerate(pairs):
    for k, completion in enumerate((p.chosen, p.rejected)):
      ids = np.concatenate([p.prompt, completion])
      tokens[b, k, :len(ids)] = ids
      mask[b, k, len(p.prompt) - 1:len(ids) - 1] = 1.0
  batch = {'tokens': tokens.reshape(B, 2 * length), 'mask': mask.reshape(B, -1),
           'ref_logps': np.zeros((B, 2), np.float32), 'pairs': np.zeros((B, 1), np.float32)}
  batch['pairs'][:len(pairs)] = 1.0
  if ref_logps is not None:
    batch['ref_logps'][:len(pairs)] = ref_logps
  if rpo:  # (the batch's pairs over its chosen completion tokens, on every row)
    chosen_tokens = max(float(mask[:, 0].sum()), 1.0)
    batch['rpo_scale'] = np.full((B, 1), len(pairs) / chosen_tokens, np.float32)
  return batch


@dataclasses.dataclass
class PairSources:
  """What DPO reads before the config is resolved: the init run's tokenizer, the training and
  held-out pairs (data.val's, or the last data.val_ratio of data.train's), and the rows' width."""
  tokenizer: Any  # the run's (data.tokenizer's kinds)
  train: list[Pair]
  eval: list[Pair]
  length: int  # tokens per sequence of a row (width)
  dropped: int  # pairs whose prompt alone fills data.seq_len + 1 (TRL drops them too)


def open_pairs(train: str, val: str, val_ratio: float, tokenizer, limits: tuple[int, int],
               seq_len: int) -> PairSources:
  """data.train's and data.val's pairs, tokenized with the run's tokenizer (its chat template
  for messages). limits: dpo.max_prompt_tokens, dpo.max_completion_tokens."""
  template = chat.tokenizer_template(tokenizer)
  full = (*limits, seq_len + 1)

  def read(setting: str, what: str) -> tuple[list[Pair], int]:
    records: list[Iterable[tuple[str, Any, str | None]]] = []
    for source in sources_lib.parse(setting, what):
      if isinstance(source, sources_lib.HfDataset):
        records.append(_dataset_records(source.text))
      elif isinstance(source, sources_lib.Files) and source.is_text:
        records += [_file_records(path, fmt) for path, fmt in source.text_files]
      else:
        raise DataError(f'{what}: {source.text}: DPO reads JSONL or Parquet files of preference '
                        'pairs, or a Hugging Face dataset (hf:NAME[@SPLIT]).')
    return read_pairs(itertools.chain(*records), tokenizer, template, full)

  pairs, dropped = read(train, 'data.train')
  if val:
    held, more = read(val, 'data.val')
    dropped += more
  else:
    n = min(len(pairs) - 1, int(round(len(pairs) * val_ratio)))
    if val_ratio > 0 and len(pairs) > 1:
      n = max(n, 1)
    pairs, held = pairs[:len(pairs) - n], pairs[len(pairs) - n:]
  if not pairs:
    raise DataError(f'data.train={train!r}: no pair to train on ({dropped} dropped: their prompt '
                    f'fills data.seq_len + 1 = {seq_len + 1} tokens).')
  if dropped:
    logging.warning('dropped %d pairs whose prompt fills data.seq_len + 1 = %d tokens', dropped,
                    seq_len + 1)
  return PairSources(tokenizer, pairs, held, width(pairs + held, seq_len), dropped)


@dataclasses.dataclass
class PairData:
  """DPO's data: each step's pairs (`train`: Prompts over the training pairs' indices) and the
  sources."""
  train: Prompts
  sources: PairSources
