"""GRPO (group relative policy optimization) with verifiable rewards: the objective, and the
program that fine-tunes a trained run with it.

  python -m jax_pretrain.grpo --workdir=OUT --init=RUN --task=TRAIN.jsonl \
      [--eval_task=HELDOUT.jsonl] [--config=configs/grpo.py] [--config.grpo.num_samples=16 ...]

Each step (train.py's setup and loop.py's loop, as pretraining): the next batch_size /
num_samples prompts of the task (a new seeded order every pass), num_samples completions of each
sampled by the KV-cached engine (engine.py; the rollout's log-probabilities kept), scored by the
task's reward (tasks.py), their group-relative advantages, then grpo.num_iterations updates on
that batch (state.make_train_step with this module's loss: micro-batches, meshes, loss scaling,
the non-finite guard as in pretraining; one by default). Checkpoints, resume, signals,
metrics.jsonl, TensorBoard and W&B are the trainer's. A run stopped by SIGTERM and rerun continues
exactly: step k's prompts and rollout seeds depend only on the seed and k.

The defaults are TRL's GRPOTrainer's (1.16: trl/trainer/grpo_config.py and grpo_trainer.py), and
tests/test_grpo.py checks the loss, the advantages, the log-probabilities and every parameter's
gradient against TRL's own code on an exported model. Per prompt, G completions are sampled and
scored; each completion's advantage is its reward against its group's:

  A_i = (r_i - mean(r_group)) / (std(r_group, ddof=1) + ADVANTAGE_EPS)

(scale_rewards='group'; TRL divides by torch's std, the ddof=1 one, + 1e-4, a constant of its
code; tunix uses ddof=1 and 1e-6). The policy loss per completion token t is the clipped
importance-ratio objective (PPO's, as GRPO and TRL use it), with the KL penalty against the
frozen initial model as TRL computes it by default (use_bias_correction_kl=True, from DeepSeek-V3.2:
the k3 estimator times the ratio, so that its gradient is the unbiased reverse-KL one),

  ratio_t = exp(logp_t - logp_old_t)
  loss_t  = -min(ratio_t · A, clip(ratio_t, 1 - epsilon, 1 + epsilon_high) · A)
            + beta · ratio_t · (exp(logp_ref_t - logp_t) - (logp_ref_t - logp_t) - 1)

(grpo.use_bias_correction_kl=False drops that ratio_t: k3 alone, tunix's and TRL's before it; the
value is the same where the ratio is 1, the gradient is not: the corrected one adds
beta · k3_t · d logp_t.) The KL term is there only when beta > 0 (beta 0: no reference model is
held; with beta > 0 the initial params are held in the policy's shardings and score each batch
once). Token-level aggregation (DAPO, TRL's default loss_type 'dapo'): the sum of loss_t over
every completion token of the batch divided by their count (TRL's num_items_in_batch, the
generation batch's completion tokens over all processes), so long completions weigh by their
tokens. Defaults (TRL's GRPOConfig): beta 0.0, epsilon 0.2 (epsilon_high = epsilon),
scale_rewards 'group', temperature 1.0, num_iterations 1, use_bias_correction_kl True; the guide's
learning rate 1e-5 and 16 samples (configs/grpo.py).

logp is that of the distribution the rollouts sample, softmax(logits / temperature) over the whole
vocabulary, as TRL scores it (its fused LM head divides the logits by the temperature; at
temperature 1, the model's own); logp_ref too.

logp_old, the log-probability of the policy that sampled, at the update's precision. With one
update per rollout batch (num_iterations=1, TRL's and tunix's default) the policy that sampled is
the one being updated, so logp_old is this forward's own log-probability, held constant (the
re-score with the training forward that the ratio needs, at no extra pass; TRL does the same:
per_token_logps.detach()): the ratio is 1 in value and the gradient is the policy gradient
A · d logp. With num_iterations = μ > 1 the batch is reused for μ updates (each one optimizer
step over the whole batch, as TRL's μ iterations over its generation batch), and logp_old is
scored once, before the first, by a separate forward of the batch with the params that sampled
(the reference model's scoring function, on the policy's params): the first update's ratio is 1
up to the two programs' rounding, the later ones' move away from 1 and clipping acts
(train/clip_fraction). A separate pass, not the first update's forward kept: the train step
returns sums over its micro-batches, not per-token arrays, and TRL scores old_per_token_logps
the same way (a no-grad forward when the batch is generated). The pass costs a forward of the
batch per rollout, a third of an update, only when μ > 1.

Steps with μ > 1: a step is a rollout batch and its μ updates. train.steps, optim.warmup_steps,
checkpoint.every_steps, train.eval_every and train.log_every count steps; the train state's step
and the optimizer count updates (μ a step), and the learning-rate schedule is stretched by μ
(optim.learning_rate_schedule: the curve over steps is the same whatever μ; in TRL's terms,
max_steps = μ · train.steps and warmup_steps = μ · optim.warmup_steps). A step's metrics are the
means over its updates (train/logp_mismatch: its first update's, where the trained params are the
ones that sampled; the non-finite counters: after its last). Checkpoints hold whole steps, so a
run resumes at step state.step / μ with the same prompts and seeds, exactly; num_iterations may
not change on resume.

The rollout's own log-probabilities (the engine's, over the ids it may sample) are compared
with the training forward's: train/logp_mismatch, the mean absolute gap per completion token.
The EOS that ends a completion is one of its trained tokens, so that a policy learns to stop.
"""
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from jax_pretrain import PRESETS_DIR
from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import engine as engine_lib
from jax_pretrain import loop as loop_lib
from jax_pretrain import multihost
from jax_pretrain import sample as sample_lib
from jax_pretrain import state as state_lib
from jax_pretrain import tasks
from jax_pretrain import train as train_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.errors import UserError

ADVANTAGE_EPS = 1e-4  # TRL's (grpo_trainer.py: advantages / (std_rewards + 1e-4)); tunix: 1e-6
# Decoding steps per engine call in rollouts: one host round trip per 16 tokens (nothing streams;
# a row's tokens do not depend on it). 16 against 8 measured 4% faster on one H100 (BENCHMARKS.md).
ROLLOUT_CHUNK = 16
EPSILON = 0.2  # TRL's epsilon (and epsilon_high): the clip range of the importance ratio
# Step's running totals (seconds generating and updating, tokens generated and trained on).
COUNTERS = ('rollout_seconds', 'update_seconds', 'rollout_tokens', 'update_tokens')
# A step's metrics over its updates (grpo.num_iterations > 1): means, but these are the state's
# after the last update (the non-finite guard reads them) and the mismatch the first update's.
LAST_UPDATE = ('nonfinite_count', 'consecutive_nonfinite', 'loss_scale', 'loss_scale_skips')
FIRST_UPDATE = ('logp_mismatch',)


def group_advantages(rewards_PxG: jax.Array, scale: str = 'group') -> jax.Array:
  """Advantages of P groups of G completions: reward minus the group mean, over the group's std
  (ddof=1) with scale='group', or unscaled with scale='none'."""
  rewards_PxG = rewards_PxG.astype(jnp.float32)
  centered_PxG = rewards_PxG - jnp.mean(rewards_PxG, axis=1, keepdims=True)
  if scale == 'none':
    return centered_PxG
  return centered_PxG / (jnp.std(rewards_PxG, axis=1, keepdims=True, ddof=1) + ADVANTAGE_EPS)


def token_terms(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_BxT: jax.Array,
                ref_logp_BxT: jax.Array | None = None, *, epsilon: float = EPSILON,
                epsilon_high: float | None = None, beta: float = 0.0,
                bias_correction_kl: bool = True):
  """Per token: (loss_t of the formula above, whether the clipped branch is the smaller one, and
  the KL term that beta multiplies, or None when beta is 0). advantages_BxT: each token's
  completion's advantage. The KL term is k3 × ratio with bias_correction_kl (TRL's default), k3
  alone without: like TRL's `kl` metric, it is the term the loss holds."""
  epsilon_high = epsilon if epsilon_high is None else epsilon_high
  a_BxT = advantages_BxT.astype(jnp.float32)
  ratio_BxT = jnp.exp(logp_BxT - old_logp_BxT)
  unclipped_BxT = ratio_BxT * a_BxT
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - epsilon, 1.0 + epsilon_high) * a_BxT
  per_token_BxT = -jnp.minimum(unclipped_BxT, clipped_BxT)
  kl_BxT = None
  if beta:
    delta_BxT = ref_logp_BxT - logp_BxT
    kl_BxT = jnp.exp(delta_BxT) - delta_BxT - 1.0
    if bias_correction_kl:
      kl_BxT = kl_BxT * ratio_BxT
    per_token_BxT = per_token_BxT + beta * kl_BxT
  return per_token_BxT, clipped_BxT < unclipped_BxT, kl_BxT


def objective(logp_BxT: jax.Array, old_logp_BxT: jax.Array, advantages_B: jax.Array,
              mask_BxT: jax.Array, ref_logp_BxT: jax.Array | None = None, *,
              epsilon: float = EPSILON, epsilon_high: float | None = None,
              beta: float = 0.0, bias_correction_kl: bool = True) -> tuple[jax.Array, dict]:
  """(loss, metrics) of the formula above: B completions (rows), T token positions; mask_BxT 1 at
  completion tokens (prompt and padding 0). logp_BxT is differentiated; the rest are constants."""
  mask_BxT = mask_BxT.astype(jnp.float32)
  a_BxT = jnp.broadcast_to(advantages_B.astype(jnp.float32)[:, None], logp_BxT.shape)
  per_token_BxT, clipped_BxT, kl_BxT = token_terms(
      logp_BxT, old_logp_BxT, a_BxT, ref_logp_BxT, epsilon=epsilon, epsilon_high=epsilon_high,
      beta=beta, bias_correction_kl=bias_correction_kl)
  tokens = jnp.maximum(jnp.sum(mask_BxT), 1.0)
  metrics = {'clip_fraction': jnp.sum(clipped_BxT * mask_BxT) / tokens}
  if kl_BxT is not None:
    metrics['kl'] = jnp.sum(kl_BxT * mask_BxT) / tokens
  return jnp.sum(per_token_BxT * mask_BxT) / tokens, metrics


def make_loss_fn(model, beta: float, temperature: float = 1.0, bias_correction_kl: bool = True):
  """The train step's loss (state.make_train_step's loss_fn): (params, batch) -> (the per-token
  loss summed over completion tokens, (their count, {clip_fraction, logp_mismatch[, kl]} sums)).

  batch: 'tokens' int32 [B, T+1]; float32 [B, T] 'mask' (1 where target t is a completion
  token), 'advantages' (its completion's advantage), 'rollout_logp' (the engine's log-probability
  of it, at temperature 1), with beta > 0 'ref_logp' (the initial model's, at `temperature`), and
  with num_iterations > 1 'old_logp' (the sampling params', at `temperature`: logp_old).
  logp is that of the sampling distribution, softmax(logits / temperature), as TRL scores it;
  without 'old_logp', logp_old is this forward's own, held constant (see the module docstring).
  The mismatch compares temperature-1 log-probabilities, the engine's scale."""
  temperatures = (temperature,) if temperature == 1.0 else (temperature, 1.0)

  def loss_fn(params, batch):
    logp_BxT, *untempered = state_lib.target_logprobs(model, params, batch, temperatures)
    held_BxT = jax.lax.stop_gradient(logp_BxT)
    at_one_BxT = jax.lax.stop_gradient(untempered[0]) if untempered else held_BxT
    mask_BxT = batch['mask']
    per_token_BxT, clipped_BxT, kl_BxT = token_terms(
        logp_BxT, batch.get('old_logp', held_BxT), batch['advantages'], batch.get('ref_logp'),
        beta=beta, bias_correction_kl=bias_correction_kl)
    sums = {'clip_fraction': jnp.sum(clipped_BxT * mask_BxT),
            'logp_mismatch': jnp.sum(jnp.abs(at_one_BxT - batch['rollout_logp']) * mask_BxT)}
    if kl_BxT is not None:
      sums['kl'] = jnp.sum(kl_BxT * mask_BxT)
    return jnp.sum(per_token_BxT * mask_BxT), (jnp.sum(mask_BxT), sums)
  return loss_fn


@dataclasses.dataclass
class Rollouts:
  """num_samples completions of each prompt, as a training batch: rows grouped by prompt."""
  tokens_BxT1: np.ndarray  # int32: prompt, completion (with its EOS, if one ended it), pad_id
  mask_BxT: np.ndarray  # float32: 1 where the target tokens_BxT1[:, t + 1] is a completion token
  logp_BxT: np.ndarray  # float32: the rollout's log-probability of each such target (else 0)
  completions: list[str]  # the text (before a stop string) that the reward scores
  lengths: np.ndarray  # int32 [B]: completion tokens, EOS included


def rollouts(eng, prompts: list[list[int]], num_samples: int, *, max_new_tokens: int,
             temperature: float, seed: int, pad_id: int, eos_id: int | None = None,
             stop: tuple[str, ...] = (), width: int = 0) -> Rollouts:
  """Samples num_samples completions of each prompt with the engine (KV-cached, batched; sample
  k of prompt p uses the seed seed + p and stream k, so a run's rollouts are reproducible) and
  keeps each sampled token's log-probability. A completion that ended with EOS (eos_id given)
  has it as its last token; one that ended at a stop string keeps the token that completed it.
  width: the rows' tokens (0: the longest row's)."""
  sequences = eng.generate([
      engine_lib.Sequence(prompt=list(prompt), max_new_tokens=max_new_tokens,
                          temperature=temperature, seed=(seed + p) % 2**32, stream=k, stop=stop)
      for p, prompt in enumerate(prompts) for k in range(num_samples)])
  rows = []
  for seq in sequences:
    new, logp = list(seq.tokens), list(seq.logprobs)
    if eos_id is not None and seq.eos_logprob is not None:
      new, logp = new + [eos_id], logp + [seq.eos_logprob]
    rows.append((seq.prompt, new, logp))
  width = width or max(len(prompt) + len(new) for prompt, new, _ in rows)
  tokens = np.full((len(rows), width), pad_id, np.int32)
  mask = np.zeros((len(rows), width - 1), np.float32)
  logps = np.zeros((len(rows), width - 1), np.float32)
  for b, (prompt, new, logp) in enumerate(rows):
    start, end = len(prompt), len(prompt) + len(new)
    tokens[b, :end] = prompt + new
    mask[b, start - 1:end - 1] = 1.0  # target t is token t + 1
    logps[b, start - 1:end - 1] = logp
  return Rollouts(tokens, mask, logps, [s.text for s in sequences],
                  np.array([len(new) for _, new, _ in rows], np.int32))


def stop_strings(g) -> tuple[str, ...]:
  """grpo.stop with its backslash escapes read ('\\n' -> a newline); () for ''."""
  return (config_lib.unescape(g.stop),) if g.stop else ()


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
  tokenizer: object
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

  def longest(self) -> int:
    """Tokens of the longest prompt, training or held-out (the engine's rows hold it)."""
    return max(len(self.encode(item.prompt)) for item in self.items + self.eval_items)


@dataclasses.dataclass
class TaskData:
  """GRPO's data: the prompts of each step (`train`), and the rows' width in tokens."""
  tokenizer: object
  train: Prompts
  sources: TaskSources
  width: int  # tokens per row of the update (update_width)
  context: int  # tokens per row of the engine's cache (engine_context)


class GRPOLogger(train_lib.StepLogger):
  """The step line and scalars of a GRPO step: rewards, completion lengths, the mismatch, and how
  the steps' time splits between generating and updating."""

  def __init__(self, s, writer, start_step: int):
    super().__init__(s, writer, start_step)
    self._beta = s.config.grpo.beta
    self._last = dict.fromkeys(COUNTERS, 0.0)

  def report(self, step: int, m: dict, step_time: float) -> tuple[dict, str]:
    """The counters (Step.counters) are this process's totals: their growth since the last
    report splits the steps' time between generating and updating."""
    delta = {k: m[k] - v for k, v in self._last.items()}
    self._last = {k: m[k] for k in COUNTERS}
    busy = max(delta['rollout_seconds'] + delta['update_seconds'], 1e-9)
    share = delta['rollout_seconds'] / busy
    scalars = {'train/loss': m['loss'], 'train/lr': m['lr'], 'train/grad_norm': m['grad_norm'],
               'train/nonfinite_skips': m['nonfinite_count'], 'train/reward': m['reward'],
               'train/accuracy': m['accuracy'], 'train/clip_fraction': m['clip_fraction'],
               'train/logp_mismatch': m['logp_mismatch'],
               'train/completion_tokens': m['completion_tokens'],
               'train/reward_std': m['reward_std'], 'perf/step_time': step_time,
               'perf/generation_share': share,
               'perf/rollout_tokens_per_sec': delta['rollout_tokens'] / max(
                   delta['rollout_seconds'], 1e-9),
               'perf/update_tokens_per_sec': delta['update_tokens'] / max(
                   delta['update_seconds'], 1e-9)}
    kl = ''
    if self._beta:
      scalars['train/kl'] = m['kl']
      kl = f' | kl {m["kl"]:.4f}'
    scalars.update(self.loss_scale_scalars(m))
    return scalars, (f'reward {m["reward"]:.3f} | accuracy {m["accuracy"]:.3f} | loss '
                     f'{m["loss"]:.4f}{kl} | length {m["completion_tokens"]:.1f} | mismatch '
                     f'{m["logp_mismatch"]:.4f} | generating {share:.0%} | {step_time:.3f} s/step'
                     f'{self.skipped(m)}')


class GRPO(train_lib.Program):
  """GRPO on train.py's setup and loop: the task's prompts are the data, the step samples, scores
  and updates (see the module docstring)."""

  def open_sources(self, config: ml_collections.ConfigDict) -> TaskSources:
    g, run = config.grpo, config.checkpoint.restore_from
    if not run:
      raise UserError('GRPO fine-tunes a trained run: give it with --init=RUN (or '
                      '--config=configs/grpo.py:RUN).')
    if not g.task:
      raise UserError('no task: give --task=TRAIN.jsonl (one {"prompt", "answer"} per line; '
                      'jax_pretrain/tasks.py).')
    if not os.path.isdir(os.path.join(run, checkpoint_lib.DIRECTORY)):
      raise UserError(f'--init={run}: no checkpoints there (a training run\'s workdir).')
    load = lambda source: tasks.load(source, g.task_format, g.task_fields)
    self.sources = TaskSources(workdir_lib.load_tokenizer(run), load(g.task),
                               load(g.eval_task) if g.eval_task else [], tasks.reward_fn(g.reward))
    return self.sources

  def check(self, resolved: ml_collections.ConfigDict) -> None:
    g = resolved.grpo
    check_batch(resolved)
    for items in (self.sources.items, self.sources.eval_items):
      tasks.check_lengths(items, self.sources.encode, resolved.data.seq_len, g.max_new_tokens)

  def alongside(self, resolved: ml_collections.ConfigDict, sources: TaskSources,
                num_devices: int) -> float:
    """The engine's cache stays allocated beside the update (kept between rollouts)."""
    return engine_lib.cache_bytes(config_lib.model_config(resolved), rollout_slots(resolved),
                                  engine_context(resolved, sources.longest()), num_devices)

  def open_data(self, resolved: ml_collections.ConfigDict, sources: TaskSources,
                step: int) -> TaskData:
    g = resolved.grpo
    longest = max(len(sources.encode(item.prompt)) for item in sources.items)
    width = update_width(resolved, longest)
    prompts = Prompts(sources.items, resolved.train.batch_size // g.num_samples,
                      resolved.train.seed, step)
    return TaskData(sources.tokenizer, prompts, sources, width,
                    engine_context(resolved, sources.longest()))

  def compile(self, s: state_lib.Setup, data: TaskData):
    c, g = s.config, s.config.grpo
    B = c.train.batch_size
    update = train_lib.compile_step(s, data.tokenizer.pad_id, update_batch(s, data.width),
                                    update_loss_fn(s))
    # The initial model with beta > 0, in the policy's shardings; the scoring pass scores each
    # batch with it once, and with num_iterations > 1 with the params that sampled it (logp_old).
    ref = _reference_params(s, c.checkpoint.restore_from) if g.beta else None
    score = _scorer(s, g.temperature) if g.beta or g.num_iterations > 1 else None
    eng = engine_lib.Engine(config_lib.model_config(c), None, data.tokenizer,
                            slots=rollout_slots(c), context=data.context, chunk=ROLLOUT_CHUNK,
                            mesh=s.mesh)
    multihost.log(
        f'grpo              {len(data.sources.items)} task items, {B // g.num_samples} prompts × '
        f'{g.num_samples} completions a step (rows of {data.width} tokens), at most '
        f'{g.max_new_tokens} new tokens, temperature {g.temperature}, reward {g.reward!r}, '
        f'beta {g.beta}' + (f', {g.num_iterations} updates a rollout batch'
                            if g.num_iterations > 1 else '') +
        f'; engine {eng.slots} slots × {eng.context} tokens over {eng.devices} devices' +
        (f'; eval on {len(data.sources.eval_items)} held-out items'
         if data.sources.eval_items else ''))
    self.engine = eng
    return Step(s, data, update, eng, ref, score)

  def batches(self, s: state_lib.Setup, data: TaskData):
    return data.train

  def updates_per_step(self, resolved: ml_collections.ConfigDict) -> int:
    return resolved.grpo.num_iterations

  def logger(self, s, writer, step: int) -> GRPOLogger:
    return GRPOLogger(s, writer, step)

  def hooks(self, ctx: train_lib.Context) -> list[loop_lib.Hook]:
    hooks = [*train_lib.profile_hooks(ctx)]
    if ctx.data.sources.eval_items:
      hooks += task_eval_hooks(ctx, self.engine)
    return hooks + train_lib.checkpoint_hooks(ctx)


def check_batch(c: ml_collections.ConfigDict) -> None:
  """A step's completions (train.batch_size) make whole groups (grpo.num_samples each)."""
  if c.train.batch_size % c.grpo.num_samples:
    raise config_lib.ConfigError(
        f'train.batch_size={c.train.batch_size} (completions a step) is not a multiple of '
        f'grpo.num_samples={c.grpo.num_samples} (completions a prompt).')


def update_loss_fn(s: state_lib.Setup):
  """The update's loss for the resolved config (make_loss_fn with its beta, temperature and KL
  correction)."""
  g = s.config.grpo
  return make_loss_fn(s.model, g.beta, g.temperature, g.use_bias_correction_kl)


def update_batch(s: state_lib.Setup, width: int) -> dict:
  """The update's batch, abstract (ShapeDtypeStructs in the batch sharding): batch_size rows of
  `width` tokens (make_loss_fn says what each array holds)."""
  B, T = s.config.train.batch_size, width - 1
  row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=s.batch_sharding)
  batch = {'tokens': row((B, T + 1), jnp.int32), 'mask': row((B, T), jnp.float32),
           'advantages': row((B, T), jnp.float32), 'rollout_logp': row((B, T), jnp.float32)}
  if s.config.grpo.beta:
    batch['ref_logp'] = row((B, T), jnp.float32)
  if s.config.grpo.num_iterations > 1:
    batch['old_logp'] = row((B, T), jnp.float32)
  return batch


def update_width(c: ml_collections.ConfigDict, longest_prompt: int) -> int:
  """Tokens per row of the update: room for the longest prompt + grpo.max_new_tokens, such that
  the model's inputs (all but the last token) are a multiple of 8 long (cuDNN's fused attention
  trains on no odd length), and at most data.seq_len of them."""
  inputs = -(-(longest_prompt + c.grpo.max_new_tokens - 1) // 8) * 8
  return min(inputs, c.data.seq_len) + 1


def rollout_slots(c: ml_collections.ConfigDict) -> int:
  """Completions the engine decodes at once over all devices (its KV cache's rows):
  grpo.rollout_slots, or all of a step's."""
  return c.grpo.rollout_slots or c.train.batch_size


def engine_context(c: ml_collections.ConfigDict, longest_prompt: int) -> int:
  """Tokens per row of the engine's cache: the longest prompt + grpo.max_new_tokens (what a
  completion can reach), not data.seq_len."""
  return longest_prompt + c.grpo.max_new_tokens


def _reference_params(s: state_lib.Setup, run: str):
  """The run's params (the initial model) in the policy's shardings."""
  checkpointer = checkpoint_lib.Checkpointer(run, read_only=True)
  try:
    return checkpointer.restore_params(s.abstract_state.params)[1]
  finally:
    checkpointer.close()


def _scorer(s: state_lib.Setup, temperature: float):
  """score(params, batch) -> float32 [B, T]: each target's log-probability at the sampling
  temperature, jitted for params in the policy's shardings, micro-batch by micro-batch as the
  train step goes (no gradient, so no more memory than its forward). It scores the reference
  model's logp_ref and, with num_iterations > 1, the sampling policy's logp_old."""
  A = s.run.grad_accum_steps

  def score(params, batch):
    def one(tokens_MxT1):
      return state_lib.target_logprobs(s.model, params, {'tokens': tokens_MxT1},
                                       (temperature,))[0]
    tokens_BxT1 = batch['tokens']
    B, T1 = tokens_BxT1.shape
    logp_AxMxT = jax.lax.map(one, tokens_BxT1.reshape(B // A, A, T1).swapaxes(0, 1))
    return logp_AxMxT.swapaxes(0, 1).reshape(B, T1 - 1)
  return jax.jit(score, in_shardings=(s.state_shardings.params, s.batch_sharding),
                 out_shardings=s.batch_sharding)


def combine_updates(updates: list[dict]) -> dict:
  """A step's metrics from its updates' (in order): the means, but LAST_UPDATE's the last's and
  FIRST_UPDATE's the first's (see the module docstring). One update: its metrics, as they are."""
  if len(updates) == 1:
    return updates[0]
  pick = {**dict.fromkeys(LAST_UPDATE, -1), **dict.fromkeys(FIRST_UPDATE, 0)}
  return {k: updates[pick[k]][k] if k in pick else jnp.mean(jnp.stack([m[k] for m in updates]))
          for k in updates[0]}


class Step:
  """One GRPO step, as the loop calls it: (state, the step's task items) -> (state, metrics): a
  rollout batch, then grpo.num_iterations updates on it (their metrics: combine_updates)."""

  def __init__(self, s: state_lib.Setup, data: TaskData, update, eng, ref, score):
    self.s, self.data, self.update, self.engine = s, data, update, eng
    self.ref, self.score = ref, score  # (the reference params or None; _scorer's or None)
    self.g = config_lib.grpo_config(s.config)
    self.stop = stop_strings(self.g)
    # This process's totals; GRPOLogger reports their growth between logged steps.
    self.counters = dict.fromkeys(COUNTERS, 0.0)

  def __call__(self, state: state_lib.TrainState, items: list):
    g, tokenizer, reward = self.g, self.data.tokenizer, self.data.sources.reward
    step = int(jax.device_get(state.step)) // g.num_iterations + 1  # (the state counts updates)
    t0 = time.perf_counter()
    self.engine.set_params(state.params)
    seed = int(np.random.SeedSequence([self.s.config.train.seed % 2**32,
                                       step]).generate_state(1)[0])
    r = rollouts(self.engine, [self.data.sources.encode(item.prompt) for item in items],
                 g.num_samples, max_new_tokens=g.max_new_tokens, temperature=g.temperature,
                 seed=seed, pad_id=tokenizer.pad_id, eos_id=tokenizer.eos_id, stop=self.stop,
                 width=self.data.width)
    self.engine.set_params(None)  # (the update needs the memory; the next step converts anew)
    t1 = time.perf_counter()
    self.counters['rollout_seconds'] += t1 - t0
    rewards = np.array([tasks.score(reward, text, items[b // g.num_samples])
                        for b, text in enumerate(r.completions)], np.float32)
    advantages_B = np.asarray(group_advantages(
        jnp.asarray(rewards.reshape(len(items), g.num_samples)), g.scale_rewards)).reshape(-1)
    batch = {k: multihost.global_array(v, self.s.batch_sharding) for k, v in {
        'tokens': r.tokens_BxT1, 'mask': r.mask_BxT, 'rollout_logp': r.logp_BxT,
        'advantages': np.broadcast_to(advantages_B[:, None], r.mask_BxT.shape).copy()}.items()}
    t2 = time.perf_counter()  # (scoring the rewards is neither generating nor updating)
    if self.ref is not None:
      batch['ref_logp'] = self.score(self.ref, batch)
    if g.num_iterations > 1:  # logp_old: the params that sampled, before the first update
      batch['old_logp'] = self.score(state.params, batch)
    updates = []
    for _ in range(g.num_iterations):
      state, metrics = self.update(state, batch)
      updates.append(metrics)
    # The next rollout samples with these params: waiting here costs nothing, and times the
    # update apart from the generation.
    jax.block_until_ready(state)
    self.counters['update_seconds'] += time.perf_counter() - t2
    self.counters['rollout_tokens'] += int(r.lengths.sum())
    self.counters['update_tokens'] += g.num_iterations * int(
        (r.tokens_BxT1 != tokenizer.pad_id).sum())
    metrics = dict(combine_updates(updates), reward=float(rewards.mean()),
                   accuracy=tasks.accuracy(rewards),
                   reward_std=float(rewards.reshape(len(items), -1).std(axis=1, ddof=1).mean()),
                   completion_tokens=float(r.lengths.mean()), **self.counters)
    return state, metrics


def task_eval_hooks(ctx: train_lib.Context, eng) -> list[loop_lib.Hook]:
  """eval/accuracy (greedy, the task's reward) on the held-out task: before the first step of a
  new run (logged as step 0), every train.eval_every steps and at the end."""
  from jax_pretrain import evaluate  # noqa: PLC0415  (evaluate's task accuracy, the one way)
  g, sources = ctx.config.grpo, ctx.data.sources

  def accuracy(step: int, params) -> dict:
    t0 = time.perf_counter()
    eng.set_params(params)
    rewards = [r for _, r in evaluate.task_rewards(eng, sources.eval_items, sources.reward,
                                                   g.max_new_tokens, stop_strings(g))]
    scalars = {'eval/accuracy': tasks.accuracy(rewards), 'eval/reward': float(np.mean(rewards))}
    ctx.logger.write(step, scalars)
    multihost.log(f'eval at step {step} | accuracy {scalars["eval/accuracy"]:.4f} '
                  f'({sum(r >= 1 for r in rewards)} of {len(rewards)}, greedy) | reward '
                  f'{scalars["eval/reward"]:.4f} | {time.perf_counter() - t0:.1f}s')
    ctx.logger.pause()
    return scalars

  def at_start(info: loop_lib.StepInfo) -> None:
    if info.step == 1 and ctx.start_step == 0:
      accuracy(0, info.state.params)

  return [loop_lib.Hook(at_start, every=1, phase=loop_lib.BEFORE_STEP, at_last=False,
                        name='eval_task_at_start'),
          loop_lib.Hook(lambda info: accuracy(info.step, info.state.params),
                        every=ctx.config.train.eval_every, phase=loop_lib.EVAL, name='eval_task')]


def _init_into_config(argv: list[str]) -> list[str]:
  """--init=RUN is --config=FILE:RUN (the config file takes the run's model and seq_len): the
  --config value is rewritten before flags are parsed. The last --init counts, as absl's; `--init
  RUN` and `--config FILE` are read as `--init=RUN` and `--config=FILE`."""
  joined = []
  for a in argv:
    if joined and joined[-1] in ('--init', '--config'):
      joined[-1] = f'{joined[-1]}={a}'
    else:
      joined.append(a)
  argv = joined
  init = next((a.split('=', 1)[1] for a in reversed(argv) if a.startswith('--init=')), '')
  if not init:
    return argv
  given = [i for i, a in enumerate(argv) if a.startswith('--config=')]
  out = list(argv)
  if given:
    value = out[given[0]].split('=', 1)[1]
    if ':' not in value:
      out[given[0]] = f'--config={value}:{init}'
  else:
    out.insert(1, f'--config={PRESETS_DIR}/grpo.py:{init}')
  return out


def main(workdir: str, config_holder, flag_values, start_processes) -> None:
  from jax_pretrain import cli  # noqa: PLC0415
  from jax_pretrain import runtime  # noqa: PLC0415
  runtime.configure()
  start_processes()
  config = cli.config_value(config_holder)
  for field in ('task', 'eval_task'):
    if flag_values[field]:
      config.grpo[field] = flag_values[field]
  init = flag_values['init']
  if init and os.path.normpath(config.checkpoint.restore_from) != os.path.normpath(init):
    raise UserError(f'--init={init} but the config restores from '
                    f'{config.checkpoint.restore_from!r}: give one of them.')
  with multihost.peer_failures():
    train_lib.train(config, workdir, GRPO())


if __name__ == '__main__':
  sys.argv = _init_into_config(sys.argv)
  from absl import flags  # noqa: I001
  from jax_pretrain import cli
  _CONFIG = cli.define_config('grpo.py', 'Config file (configs/grpo.py); its model and seq_len '
                             'are the --init run\'s. Fields: --config.grpo.FIELD=VALUE, ...')
  _WORKDIR = flags.DEFINE_string('workdir', None, 'Directory of this GRPO run (config, logs, '
                                 'TensorBoard, checkpoints).', required=True)
  _INIT = flags.DEFINE_string('init', '', 'The trained run to fine-tune (its workdir).')
  _TASK = flags.DEFINE_string('task', '', 'Training task: JSONL of {"prompt", "answer"} '
                              '(sets grpo.task).')
  _EVAL_TASK = flags.DEFINE_string('eval_task', '', 'Held-out task for eval/accuracy (sets '
                                   'grpo.eval_task).')
  _START_PROCESSES = cli.define_process_flags()
  cli.run(lambda: main(_WORKDIR.value, _CONFIG, {'init': _INIT.value, 'task': _TASK.value,
                                                 'eval_task': _EVAL_TASK.value},
                       _START_PROCESSES))
