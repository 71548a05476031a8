"""The dpo config group: DPO's fields, their check, and the configs that have them.

The trainer's config (config.defaults()) has no dpo group: `python -m jax_pretrain.dpo` and
configs/dpo.py add it (defaults()); resolved, such a config is a DpoTrainConfig (`of` gives it to
DPO's code), and config.resolve checks the group (_resolve), because this module registers it
(config.register), as grpo/config.py registers grpo's.
"""
import dataclasses

import ml_collections

from jax_pretrain import config as config_lib
from jax_pretrain.config import SAFE
from jax_pretrain.config import STREAM
from jax_pretrain.config import check
from jax_pretrain.config import choice
from jax_pretrain.config import field

LOSS_TYPES = ('sigmoid', 'hinge', 'ipo', 'robust')  # TRL 1.16's loss_type values DPO has


@dataclasses.dataclass(frozen=True)
class DpoConfig:
  """The dpo group: the objective, the reference model, the pairs' truncation."""
  loss_type: str = field('sigmoid', SAFE, "'sigmoid' (DPO) | 'hinge' (SLiC) | 'ipo' (IPO, each "
      "log-ratio over its completion's tokens) | 'robust' (robust DPO): TRL's loss_type")
  beta: float = field(0.1, SAFE, "the deviation from the reference model's cost (TRL: 0.1; "
      "ipo's tau)")
  label_smoothing: float = field(0.0, SAFE, "robust's chance that a preference label is flipped, "
      'in [0, 0.5) (TRL reads it in robust alone)')
  rpo_alpha: float = field(0.0, SAFE, "the chosen completions' NLL (their token mean) times this "
      "is added to the loss (RPO; TRL's loss_type [..., 'sft'] with loss_weights [1, alpha]); 0: "
      'none')
  precompute_ref_logps: bool = field(False, SAFE, "the reference model's log-probabilities of "
      'every pair computed once before training, so that no reference model is held (TRL\'s '
      'precompute_ref_log_probs); False: the init\'s params held frozen, scoring each batch')
  max_prompt_tokens: int = field(0, STREAM, "a prompt keeps its last this many tokens (TRL's "
      'max_prompt_length, before 1.0); 0: all')
  max_completion_tokens: int = field(0, STREAM, 'a completion keeps its first this many tokens '
      "(TRL's max_completion_length, before 1.0); 0: all. Then each sequence keeps its first "
      "data.seq_len + 1 tokens (TRL's max_length, keep_start)")


@dataclasses.dataclass(frozen=True)
class DpoTrainConfig(config_lib.Config):
  """A DPO run's config: the trainer's groups and dpo."""
  dpo: DpoConfig = dataclasses.field(default_factory=DpoConfig)


FIELDS = config_lib.fields(DpoConfig)


def _resolve(d: DpoConfig) -> None:
  """The dpo group's values on their own (TRL's checks of the same DPOConfig fields)."""
  choice(d, 'dpo', 'loss_type', LOSS_TYPES)
  check(d.beta > 0, f'dpo.beta={d.beta} must be positive.')
  if d.loss_type == 'robust':
    check(0 <= d.label_smoothing < 0.5, f'dpo.label_smoothing={d.label_smoothing} must lie in '
          "[0, 0.5) for dpo.loss_type='robust' (the chance that a label is flipped).")
  else:
    check(d.label_smoothing == 0, f'dpo.label_smoothing={d.label_smoothing} acts only with '
          f"dpo.loss_type='robust' (TRL 1.16's {d.loss_type!r} has none): set it to 0 or use "
          'robust.')
  check(d.rpo_alpha >= 0, f'dpo.rpo_alpha={d.rpo_alpha} must be >= 0 (0: no NLL term).')
  check(d.max_prompt_tokens >= 0, f'dpo.max_prompt_tokens={d.max_prompt_tokens} must be >= 0 '
        '(0: all).')
  check(d.max_completion_tokens >= 0, f'dpo.max_completion_tokens={d.max_completion_tokens} '
        'must be >= 0 (0: all).')


GROUP = config_lib.register(config_lib.Group('dpo', DpoTrainConfig, _resolve,
                                             config_file='configs/dpo.py:PRESET',
                                             program='python -m jax_pretrain.dpo'))


def defaults() -> ml_collections.ConfigDict:
  """The trainer's defaults and the dpo group's."""
  return config_lib.defaults(GROUP)


def of(c: config_lib.Config) -> DpoTrainConfig:
  """c as a DPO run's config (with the dpo group); a ConfigError for a config without it."""
  if not isinstance(c, DpoTrainConfig):
    raise config_lib.ConfigError('DPO needs a config with the dpo group, e.g. '
                                 '--config=configs/dpo.py:RUN (or :PRESET).')
  return c
