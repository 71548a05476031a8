"""Loss, perplexity and bits per byte of a trained model, per source of a mixture.

  python -m jax_pretrain.evaluate --workdir=runs/x [--data=SOURCES] [--max_tokens=1000000]
  python -m jax_pretrain.evaluate --workdir=runs/x --task=HELDOUT.jsonl [--reward=exact]
      [--task_format=plain|medqa|gsm8k] [--task_fields=prompt=COL,answer=COL] [--max_new_tokens=32]

--task: the greedy accuracy on a task file (one {"prompt", "answer"} per line;
jax_pretrain/tasks.py) under a reward (exact, choice, number, or a user's module:function /
path.py:function), the completions decoded by the engine that serve and lm_eval use.

--data takes a source list in data.train's syntax ('a.jsonl:0.7,tfds:name@validation,embedded',
prepared directories (their --split, default val), token files; docs/data.md). Without it, the
run's own held-out data: data.val, or the last data.val_ratio of each data.train source, as in
training (what data.open_batches holds out).

Each source is read in order as windows of seq_len + 1 tokens starting every seq_len tokens, so
each token of its first max_tokens is a target exactly once (the last window padded with pad_id,
which the loss ignores). EOS targets count, as in training.

A fine-tuned run (data.format='sft') is scored as it trained: its held-out examples (or --data's
JSONL examples), packed, on completion tokens only; no bits per byte.

Bits per byte = total NLL in nats / ln 2 / UTF-8 bytes of the evaluated text, so models with
different tokenizers compare. The bytes are those of the detokenized targets, decoded one document
(EOS-delimited) at a time: the text the targets stand for, since decode(encode(document)) is the
document for the byte tokenizer and for sentencepiece models with byte fallback. Sources without
text (token files with no tokenizer, synthetic tokens) have no bits per byte. The eval data itself
comes from the data package: data.eval_sets.
"""
import dataclasses
import json
import math
import time

from absl import flags

from jax_pretrain import cli
from jax_pretrain import data as data_lib
from jax_pretrain import metrics as metrics_lib
from jax_pretrain import state as state_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.errors import UserError


@dataclasses.dataclass
class Result:
  source: str
  weight: float
  tokens: int = 0  # targets evaluated (pad excluded)
  nll: float = 0.0  # summed over them, in nats
  bytes: int | None = None  # UTF-8 bytes of their text; None: no text

  @property
  def loss(self) -> float:
    return self.nll / max(self.tokens, 1)

  @property
  def perplexity(self) -> float:
    return metrics_lib.perplexity(self.loss)

  @property
  def bits_per_byte(self) -> float | None:
    return self.nll / math.log(2) / self.bytes if self.bytes else None

  def as_dict(self) -> dict:
    return dict(dataclasses.asdict(self), loss=self.loss, perplexity=self.perplexity,
                bits_per_byte=self.bits_per_byte)


def evaluate(workdir: str, data: str = '', *, step: int | None = None, max_tokens: int = 1_000_000,
             batch_size: int = 0, split: str = 'val', devices=None) -> list[Result]:
  """One Result per source, then (for several) their total. max_tokens: per source, 0 for all;
  batch_size 0: the run's train.eval_batch_size."""
  run = workdir_lib.load(workdir, step, devices)
  config, tokenizer, setup = run.config, run.tokenizer, run.setup
  B = batch_size or config.train.eval_batch_size
  if B % setup.mesh.size:
    raise UserError(f'--batch_size={B} is not a multiple of the {setup.mesh.size} devices.')
  eval_step = state_lib.jit_eval_step(setup, tokenizer.pad_id)
  results = []
  for eval_set in data_lib.eval_sets(config, tokenizer, B, data, split, max_tokens):
    nll, count = state_lib.summed_loss(eval_step, run.params, eval_set.batches,
                                       setup.batch_sharding)
    results.append(Result(eval_set.name, eval_set.weight, int(count), nll, eval_set.bytes))
  if len(results) > 1:
    known = [r.bytes for r in results if r.bytes is not None]
    results.append(Result('all', sum(r.weight for r in results), sum(r.tokens for r in results),
                          sum(r.nll for r in results),
                          sum(known) if len(known) == len(results) else None))
  return results


def task_rewards(eng, items: list, reward, max_new_tokens: int,
                 stop: tuple[str, ...] = ()) -> list[tuple[str, float]]:
  """Each item's greedy completion and its reward: the task's prompts decoded by `eng`
  (engine.Engine: the decoder serve, lm_eval and GRPO use) up to max_new_tokens or a stop
  string, scored by `reward` (tasks.reward_fn)."""
  from jax_pretrain import engine as engine_lib  # noqa: PLC0415
  from jax_pretrain import sample as sample_lib  # noqa: PLC0415
  from jax_pretrain import tasks  # noqa: PLC0415
  sequences = eng.generate([
      engine_lib.Sequence(prompt=sample_lib.encode_prompt(eng.tokenizer, item.prompt).tolist(),
                          max_new_tokens=max_new_tokens, stop=stop) for item in items])
  return [(seq.text, tasks.score(reward, seq.text, item)) for seq, item in zip(sequences, items)]


def format_table(results: list[Result]) -> str:
  width = max(len('source'), *(len(r.source) for r in results))
  lines = [f'{"source":<{width}}  {"weight":>6}  {"tokens":>11}  {"bytes":>11}  {"loss":>7}  '
           f'{"ppl":>8}  {"bits/byte":>9}']
  for r in results:
    b = '-' if r.bytes is None else f'{r.bytes:,}'
    bpb = '-' if r.bits_per_byte is None else f'{r.bits_per_byte:.4f}'
    lines.append(f'{r.source:<{width}}  {r.weight:>6.3g}  {r.tokens:>11,}  {b:>11}  '
                 f'{r.loss:>7.4f}  {r.perplexity:>8.3f}  {bpb:>9}')
  return '\n'.join(lines)


def main_task(f) -> None:
  """--task: greedy accuracy on a task file under its reward."""
  from jax_pretrain import tasks  # noqa: PLC0415
  t0 = time.perf_counter()
  from jax_pretrain import config as config_lib  # noqa: PLC0415
  from jax_pretrain import engine as engine_lib  # noqa: PLC0415
  from jax_pretrain import sample as sample_lib  # noqa: PLC0415
  items = tasks.load(f.task, f.task_format, f.task_fields)
  reward = tasks.reward_fn(f.reward)
  run = workdir_lib.load(f.workdir, f.step)
  context = run.config.data.seq_len
  tasks.check_lengths(items, lambda text: sample_lib.encode_prompt(run.tokenizer, text), context,
                      f.max_new_tokens)
  eng = engine_lib.Engine(run.config.model, run.engine_params, run.tokenizer,
                          slots=16, context=context)
  stop = config_lib.stop_strings(f.stop)
  scored = task_rewards(eng, items, reward, f.max_new_tokens, stop)
  rewards = [r for _, r in scored]
  accuracy, mean = tasks.accuracy(rewards), sum(rewards) / len(rewards)
  print(f'{f.task}: accuracy {accuracy:.4f} ({sum(r >= 1 for r in rewards)} of {len(items)} right '
        f'under reward {f.reward!r}; mean reward {mean:.4f}; greedy, at most {f.max_new_tokens} '
        f'new tokens; {time.perf_counter() - t0:.1f}s)')
  if f.json:
    with open(f.json, 'w', encoding='utf-8') as out:
      json.dump({'accuracy': accuracy, 'reward': mean, 'items': [
          {'where': item.where, 'answer': item.answer, 'completion': text, 'reward': r}
          for item, (text, r) in zip(items, scored)]}, out, indent=2)


def main():
  f = flags.FLAGS
  if f.task:
    main_task(f)
    return
  t0 = time.perf_counter()
  results = evaluate(f.workdir, f.data, step=f.step, max_tokens=f.max_tokens,
                     batch_size=f.batch_size, split=f.split)
  print(format_table(results))
  limit = (f'; the first {f.max_tokens:,} tokens of each source, in whole windows'
           if f.max_tokens else '')
  print(f'({time.perf_counter() - t0:.1f}s{limit})')
  if f.json:
    with open(f.json, 'w', encoding='utf-8') as out:
      json.dump([r.as_dict() for r in results], out, indent=2)


if __name__ == '__main__':
  cli.define_run_flags()
  flags.DEFINE_string('data', '', "Sources, in data.train's syntax; '' : the run's held-out data.")
  flags.DEFINE_string('split', 'val', 'Split of prepared-data directories in --data.')
  flags.DEFINE_integer('max_tokens', 1_000_000, 'Tokens evaluated per source at most; 0: all.')
  flags.DEFINE_integer('batch_size', 0, "Sequences per batch; 0: the run's eval_batch_size.")
  flags.DEFINE_string('json', '', 'Also write the results to this JSON file.')
  flags.DEFINE_string('task', '', 'A task file (JSONL of prompt/answer): print the greedy accuracy '
                      'under --reward instead of the loss (jax_pretrain/tasks.py).')
  flags.DEFINE_string('task_format', 'plain', 'Layout of --task: plain | medqa | gsm8k.')
  flags.DEFINE_string('task_fields', '', "--task's columns: 'FIELD=COLUMN,...' (e.g. "
                      "'prompt=question,answer=label'); '': the fields' own names.")
  flags.DEFINE_string('reward', 'exact', "--task's reward: exact | choice | number | "
                      'module:function | path.py:function.')
  flags.DEFINE_integer('max_new_tokens', 32, '--task: tokens generated per prompt at most.')
  flags.DEFINE_string('stop', '', "--task: a completion ends at this text (backslash escapes "
                      "read: '\\n' scores as GRPO's eval/accuracy does); '': at EOS or "
                      'max_new_tokens.')
  cli.run(main)
