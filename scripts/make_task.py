r"""Writes a small verifiable task with a held-out split, for fine-tuning on the CPU in minutes.

  python scripts/make_task.py --output-dir data/reverse --task reverse --train 2000 --heldout 200
  python -m jax_pretrain.main --config=configs/sft.py --workdir=runs/sft_reverse \
      --config.checkpoint.restore_from=runs/default --config.data.train=data/reverse/sft.jsonl \
      --config.optim.learning_rate=5e-4 --config.train.steps=150
  python -m jax_pretrain.evaluate --workdir=runs/sft_reverse --task=data/reverse/heldout.jsonl \
      --max_new_tokens=8

Files in --output-dir:
  train.jsonl    {"prompt", "answer"} per line: GRPO's --task
  sft.jsonl      the same items as {"prompt", "completion"}, the completion being the answer and a
                 newline (the `exact` reward reads the first line, so the model learns to stop)
  heldout.jsonl  {"prompt", "answer"}, no prompt of train.jsonl: `evaluate --task`, GRPO's
                 --eval_task
  prefs.jsonl    the train items as DPO's preference pairs {"prompt", "chosen", "rejected"}: the
                 answer chosen over a wrong one (reverse: the letters as given; copy: reversed;
                 add: off by 1 or 10), each with its newline (python -m jax_pretrain.dpo)
  heldout_prefs.jsonl  the heldout items as such pairs (DPO's --config.data.val)

Tasks (prompt -> answer):
  add      two numbers of two digits: '47+85=' -> '132'
  reverse  3 to 6 lowercase letters, reversed: 'rev kqzm=' -> 'mzqk'
  copy     3 to 6 lowercase letters, copied: 'copy kqzm=' -> 'kqzm'

The same arguments write the same files. Items are drawn without repeating a prompt; train and
heldout are disjoint by prompt.
"""
import argparse
import json
import os
import random
import string

from jax_pretrain import cli
from jax_pretrain.errors import UserError


def _letters(rng: random.Random) -> str:
  return ''.join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))


def _add(rng: random.Random) -> tuple[str, str]:
  a, b = rng.randint(10, 99), rng.randint(10, 99)
  return f'{a}+{b}=', str(a + b)


def _reverse(rng: random.Random) -> tuple[str, str]:
  s = _letters(rng)
  return f'rev {s}=', s[::-1]


def _copy(rng: random.Random) -> tuple[str, str]:
  s = _letters(rng)
  return f'copy {s}=', s


TASKS = {'add': _add, 'reverse': _reverse, 'copy': _copy}


def wrong_answer(task: str, prompt: str, answer: str, rng: random.Random) -> str:
  """A wrong answer to the item, the kind of mistake a model makes on it: reverse's letters as
  given, copy's reversed, add's sum off by 1 or 10; where that is the answer (a palindrome), the
  answer rotated by a letter, else cut by one."""
  if task == 'add':
    return str(int(answer) + rng.choice((-10, -1, 1, 10)))
  letters = prompt.split(' ', 1)[1][:-1]
  for wrong in (letters if task == 'reverse' else letters[::-1], answer[1:] + answer[0]):
    if wrong != answer:
      return wrong
  return answer[:-1]


def make_items(task: str, count: int, seed: int) -> list[tuple[str, str]]:
  """count (prompt, answer) pairs of the task with distinct prompts, in a seeded order."""
  draw, rng, items = TASKS[task], random.Random(f'{task}:{seed}'), {}
  attempts = 0
  while len(items) < count:
    attempts += 1
    if attempts > 100 * count:
      raise UserError(f'task {task!r} has too few distinct prompts for {count} items '
                      f'({len(items)} found); lower --train or --heldout.')
    prompt, answer = draw(rng)
    items.setdefault(prompt, answer)
  return list(items.items())


def _write(path: str, records: list[dict]) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r) + '\n')
  os.replace(tmp, path)


def write_task(output_dir: str, task: str, train: int, heldout: int, seed: int) -> None:
  """train.jsonl, sft.jsonl, heldout.jsonl, prefs.jsonl and heldout_prefs.jsonl (module
  docstring) into output_dir."""
  if train < 1 or heldout < 1:
    raise UserError(f'--train and --heldout must be at least 1 (got {train} and {heldout}).')
  items = make_items(task, train + heldout, seed)
  os.makedirs(output_dir, exist_ok=True)
  _write(os.path.join(output_dir, 'train.jsonl'),
         [{'prompt': p, 'answer': a} for p, a in items[:train]])
  _write(os.path.join(output_dir, 'sft.jsonl'),
         [{'prompt': p, 'completion': a + '\n'} for p, a in items[:train]])
  _write(os.path.join(output_dir, 'heldout.jsonl'),
         [{'prompt': p, 'answer': a} for p, a in items[train:]])
  rng = random.Random(f'{task}:{seed}:wrong')
  pairs = [{'prompt': p, 'chosen': a + '\n', 'rejected': wrong_answer(task, p, a, rng) + '\n'}
           for p, a in items]
  _write(os.path.join(output_dir, 'prefs.jsonl'), pairs[:train])
  _write(os.path.join(output_dir, 'heldout_prefs.jsonl'), pairs[train:])


def main() -> None:
  cli.output_policy()
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
  p.add_argument('--output-dir', required=True)
  p.add_argument('--task', default='reverse', choices=sorted(TASKS))
  p.add_argument('--train', type=int, default=2000, help='items in train.jsonl and sft.jsonl')
  p.add_argument('--heldout', type=int, default=200, help='items in heldout.jsonl')
  p.add_argument('--seed', type=int, default=0)
  a = p.parse_args()
  with cli.user_errors():
    write_task(a.output_dir, a.task, a.train, a.heldout, a.seed)
  print(f'wrote {a.output_dir}/train.jsonl, sft.jsonl, prefs.jsonl ({a.train} items), '
        f'heldout.jsonl and heldout_prefs.jsonl ({a.heldout} items) of task {a.task!r}, seed '
        f'{a.seed}')


if __name__ == '__main__':
  main()
