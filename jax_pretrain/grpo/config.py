"""The grpo config group: GRPO's fields, their check, and the configs that have them.

The trainer's config (config.defaults()) has no grpo group: `python -m jax_pretrain.grpo` and
configs/grpo.py add it (defaults(), with_group); resolved, such a config is a GrpoTrainConfig
(`of` gives it to GRPO's code), and config.resolve checks the group (_resolve), because this
module registers it (config.register). Resolving a pretraining config imports neither this
module nor the tasks and data.hub modules its check reads (tests/test_architecture.py).
"""
import dataclasses

import ml_collections

from jax_pretrain import config as config_lib
from jax_pretrain import model as model_lib
from jax_pretrain.config import SAFE
from jax_pretrain.config import STREAM
from jax_pretrain.config import check
from jax_pretrain.config import choice
from jax_pretrain.config import field

# The rollout correction's modes (TRL's vllm_importance_sampling_mode values; 'none': off).
ROLLOUT_CORRECTIONS = ('sequence_mask', 'sequence_truncate', 'token_mask', 'token_truncate',
                       'none')
_UPDATES = ("the checkpoint's train state counts optimizer updates, grpo.num_iterations of them a "
            'step, and its learning-rate schedule is stretched by it')


@dataclasses.dataclass(frozen=True)
class GrpoConfig:
  """The grpo group: the task, its rollouts and the objective."""
  task: str = field('', STREAM, 'required by grpo: the training task, JSONL of {"prompt", '
      '"answer"[, "choices"]} or hf:NAME[:CONFIG][@SPLIT] (jax_pretrain/tasks.py; --task)')
  eval_task: str = field('', SAFE, 'held-out task: eval/accuracy at step 0, every train.eval_every '
      "steps and at the end ('': none; --eval_task)")
  task_format: str = field('plain', STREAM, "layout of the task files: 'plain' | 'medqa' | 'gsm8k'")
  task_fields: str = field('', STREAM, "'FIELD=COLUMN,...': the column each of the format's fields "
      "is read from (e.g. 'prompt=question,answer=label'; '': their own names)")
  reward: str = field('exact', SAFE, "'exact' | 'choice' | 'number' | 'module:function' | "
      "'path.py:function'")
  num_samples: int = field(16, STREAM, 'completions sampled per prompt (a group); train.batch_size '
      'counts completions, so batch_size / num_samples prompts a step')
  max_new_tokens: int = field(64, SAFE, 'tokens generated per completion at most')
  rollout_slots: int = field(0, SAFE, "completions decoded at once over all devices (the engine's "
      'KV-cache rows, split over the devices; rounded up to a multiple of them); 0: all of a '
      "step's (train.batch_size)")
  kv_cache_dtype: str = field('auto', SAFE, "what the rollout engine's KV cache stores keys and "
      "values in: 'auto' (the compute dtype) | 'fp8' (e4m3) | 'int8', 8 bits with a float32 scale "
      "per head and position (vLLM's --kv-cache-dtype)")
  temperature: float = field(1.0, SAFE, 'rollout sampling temperature (TRL: 1.0)')
  stop: str = field('\\n', SAFE, "a completion ends at this text (backslash escapes read; '': only "
      'at EOS or max_new_tokens); rewards see the text before it')
  beta: float = field(0.0, SAFE, 'KL penalty (k3) against the initial model; 0: no reference model '
      'is held (TRL: 0.0)')
  scale_rewards: str = field('group', SAFE, "'group': advantages divided by the group's std (+ "
      "1e-4, TRL's) | 'none'")
  epsilon: float = field(0.2, SAFE, 'the importance ratio is clipped to [1 - epsilon, 1 + '
      'epsilon_high] (TRL: 0.2); acts only where a rollout batch is reused (num_iterations > 1)')
  epsilon_high: float = field(0.0, SAFE, "the clip range's upper side; 0: epsilon (TRL's None; "
      "DAPO's clip-higher: 0.28)")
  use_bias_correction_kl: bool = field(True, SAFE, 'the k3 KL term times the importance ratio, the '
      "unbiased reverse-KL gradient (TRL's default and name); False: k3 alone (tunix)")
  num_iterations: int = field(1, _UPDATES, "optimizer updates per rollout batch (TRL's "
      'num_iterations, μ): the later ones reuse it with the clipped objective; train.steps, '
      'warmup_steps and every step cadence count rollout batches')
  rollout_correction: str = field('sequence_mask', SAFE, "each token's loss times the weight "
      "exp(logp_train - logp_rollout), the training forward's log-probability against the "
      "engine's, summed over the completion ('sequence_*') or per token ('token_*'), clipped to "
      "[rollout_correction_min, _max] ('*_truncate') or 0 outside it ('*_mask') | 'none' (TRL's "
      "vllm_importance_sampling_correction and _mode)")
  rollout_correction_min: float = field(0.0, SAFE, "the rollout weight's lower bound; 0: none "
      "(TRL's vllm_importance_sampling_clip_min None)")
  rollout_correction_max: float = field(3.0, SAFE, "the rollout weight's upper bound; 0: none "
      "(TRL's vllm_importance_sampling_clip_max)")


@dataclasses.dataclass(frozen=True)
class GrpoTrainConfig(config_lib.Config):
  """A GRPO run's config: the trainer's groups and grpo."""
  grpo: GrpoConfig = dataclasses.field(default_factory=GrpoConfig)


FIELDS = config_lib.fields(GrpoConfig)


def _resolve(g: GrpoConfig) -> None:
  """The grpo group's values on their own (what they need of a run: program.GRPO.check)."""
  check(g.num_samples >= 2, f'grpo.num_samples={g.num_samples}: a group needs at least 2 '
        'completions (advantages compare them).')
  check(g.max_new_tokens > 0, f'grpo.max_new_tokens={g.max_new_tokens} must be positive.')
  check(g.temperature > 0, f'grpo.temperature={g.temperature} must be positive (rollouts '
        'sample).')
  check(g.beta >= 0, f'grpo.beta={g.beta} must be >= 0.')
  check(0 < g.epsilon < 1, f'grpo.epsilon={g.epsilon} must be in (0, 1) (the ratio is clipped '
        'to [1 - epsilon, 1 + epsilon_high]).')
  check(g.epsilon_high >= 0, f'grpo.epsilon_high={g.epsilon_high} must be >= 0 (0: epsilon).')
  check(g.rollout_slots >= 0, f'grpo.rollout_slots={g.rollout_slots} must be >= 0 (0: all).')
  check(g.num_iterations >= 1, f'grpo.num_iterations={g.num_iterations} must be >= 1 (optimizer '
        'updates per rollout batch).')
  try:
    config_lib.unescape(g.stop)
  except ValueError as e:
    raise config_lib.ConfigError(f'grpo.stop={g.stop!r}: not a string with readable backslash '
                                 f'escapes ({e}); e.g. \'\\n\' for a newline.') from None
  choice(g, 'grpo', 'scale_rewards', ('group', 'none'))
  choice(g, 'grpo', 'kv_cache_dtype', tuple(model_lib.KV_CACHE_DTYPES))
  _resolve_correction(g)
  from jax_pretrain import tasks  # noqa: PLC0415  (it loads the data package: only here)
  choice(g, 'grpo', 'task_format', tuple(tasks.FORMATS))


def _resolve_correction(g: GrpoConfig) -> None:
  """The rollout correction's mode and bounds (TRL's checks of its vllm_importance_sampling_*)."""
  choice(g, 'grpo', 'rollout_correction', ROLLOUT_CORRECTIONS)
  low, high = g.rollout_correction_min, g.rollout_correction_max
  check(low >= 0, f'grpo.rollout_correction_min={low} must be >= 0 (0: no lower bound).')
  check(high >= 0, f'grpo.rollout_correction_max={high} must be >= 0 (0: no upper bound).')
  check(not high or low < high, f'grpo.rollout_correction_min={low} must be less than '
        f'grpo.rollout_correction_max={high}.')
  check(not g.rollout_correction.endswith('_truncate') or bool(low or high),
        f'grpo.rollout_correction={g.rollout_correction!r} clips the weight: give it a bound '
        '(grpo.rollout_correction_max or _min; both are 0, none).')


GROUP = config_lib.register(config_lib.Group('grpo', GrpoTrainConfig, _resolve,
                                             config_file='configs/grpo.py:PRESET',
                                             program='python -m jax_pretrain.grpo'))


def defaults() -> ml_collections.ConfigDict:
  """The trainer's defaults and the grpo group's."""
  return config_lib.defaults(GROUP)


def with_group(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """A copy of config c with the grpo group at its defaults (c's own if it has one)."""
  return config_lib.from_dict(c.to_dict(), groups=(GROUP,))


def of(c: config_lib.Config) -> GrpoTrainConfig:
  """c as a GRPO run's config (with the grpo group); a ConfigError for a config without it."""
  if not isinstance(c, GrpoTrainConfig):
    raise config_lib.ConfigError('GRPO needs a config with the grpo group, e.g. '
                                 '--config=configs/grpo.py:RUN (or :PRESET).')
  return c

