"""GRPO's data: the task's items and reward (read before the config is resolved), and the prompts
of each step."""
import dataclasses
from typing import Any

import numpy as np

from jax_pretrain import sample as sample_lib
from jax_pretrain import tasks


class Prompts:
  """The task items of each step: `per_step` a step, through the task in a new order every pass
  (seeded), starting after `start` steps; step k's items depend only on the seed and k."""

  def __init__(self, items: list, per_step: int, seed: int, start: int):
    self.items, self.per_step, self.seed, self.step = items, per_step, seed, start
    self._orders: dict[int, np.ndarray] = {}

  def _order(self, epoch: int) -> np.ndarray:
    if epoch not in self._orders:
      self._orders = {epoch: np.random.default_rng([self.seed % 2**32, epoch]).permutation(
          len(self.items))}
    return self._orders[epoch]

  def __iter__(self):
    return self

  def __next__(self) -> list:
    n, first = len(self.items), self.step * self.per_step
    self.step += 1
    return [self.items[self._order(i // n)[i % n]] for i in range(first, first + self.per_step)]

  def close(self) -> None:
    pass


@dataclasses.dataclass
class TaskSources:
  """What GRPO reads before the config is resolved: the init run's tokenizer, the task's items
  (train and held-out) and the reward."""
  tokenizer: Any  # the run's (data.tokenizer's kinds)
  items: list
  eval_items: list
  reward: tasks.Reward
  _ids: dict = dataclasses.field(default_factory=dict)

  def encode(self, prompt: str) -> list[int]:
    """The prompt's ids as the engine takes them, tokenized once (the length check, the rows'
    width and every step that draws it read them)."""
    if prompt not in self._ids:
      self._ids[prompt] = sample_lib.encode_prompt(self.tokenizer, prompt).tolist()
    return self._ids[prompt]

  def longest(self, eval_items: bool = True) -> int:
    """Tokens of the longest prompt, training or held-out (the engine's rows hold it) or, with
    eval_items=False, training (the update's rows hold it)."""
    items = self.items + self.eval_items if eval_items else self.items
    return max(len(self.encode(item.prompt)) for item in items)


@dataclasses.dataclass
class TaskData:
  """GRPO's data: the prompts of each step (`train`), and the rows' width in tokens."""
  tokenizer: Any  # the run's (data.tokenizer's kinds)
  train: Prompts
  sources: TaskSources
  width: int  # tokens per row of the update (update_width)
  context: int  # tokens per row of the engine's cache (engine_context)


