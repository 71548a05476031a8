"""The GRPO program: a train.Program whose data are a task's prompts and whose step samples,
scores and updates (its objective: objective.py).

Each step (train.py's setup and loop.py's loop, as pretraining): the next batch_size /
num_samples prompts of the task (a new seeded order every pass), num_samples completions of each
sampled by the KV-cached engine (engine/, rollout.py; the rollout's log-probabilities kept),
scored by the task's reward (tasks.py), their group-relative advantages, then grpo.num_iterations
updates on that batch (state.make_train_step with objective.make_loss_fn: micro-batches, meshes,
loss scaling, the non-finite guard as in pretraining; one by default). Checkpoints, resume, signals,
metrics.jsonl, TensorBoard and W&B are the trainer's. A run stopped by SIGTERM and rerun continues
exactly: step k's prompts and rollout seeds depend only on the seed and k.

Steps with μ > 1: a step is a rollout batch and its μ updates. train.steps, optim.warmup_steps,
checkpoint.every_steps, train.eval_every and train.log_every count steps; the train state's step
and the optimizer count updates (μ a step), and the learning-rate schedule is stretched by μ
(optim.learning_rate_schedule: the curve over steps is the same whatever μ; in TRL's terms,
max_steps = μ · train.steps and warmup_steps = μ · optim.warmup_steps). A step's metrics are the
means over its updates (train/logp_mismatch and the rollout correction's statistics: its first
update's, where the trained params are the ones that sampled; the non-finite counters: after its
last). Checkpoints hold whole steps, so a run resumes at step state.step / μ with the same
prompts and seeds, exactly; num_iterations may not change on resume.
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import engine as engine_lib
from jax_pretrain import fp8
from jax_pretrain import hooks as hooks_lib
from jax_pretrain import loop as loop_lib
from jax_pretrain import multihost
from jax_pretrain import state as state_lib
from jax_pretrain import tasks
from jax_pretrain import train as train_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.errors import UserError
from jax_pretrain.grpo import config as grpo_config
from jax_pretrain.grpo import objective
from jax_pretrain.grpo.data import Prompts
from jax_pretrain.grpo.data import TaskData
from jax_pretrain.grpo.data import TaskSources
from jax_pretrain.grpo.rollout import ROLLOUT_CHUNK
from jax_pretrain.grpo.rollout import rollouts
from jax_pretrain.step_logger import StepLogger

# Step's running totals (seconds generating and updating, tokens generated and trained on).
COUNTERS = ('rollout_seconds', 'update_seconds', 'rollout_tokens', 'update_tokens')
# A step's metrics over its updates (grpo.num_iterations > 1): means, but these are the state's
# after the last update (the non-finite guard reads them) and the mismatch and the rollout
# correction's (objective.correction_stats) the first update's.
LAST_UPDATE = ('nonfinite_count', 'consecutive_nonfinite', 'loss_scale', 'loss_scale_skips')
FIRST_UPDATE = ('logp_mismatch', 'rollout_weight', 'rollout_outside', 'rollout_units',
                'rollout_weight_max', 'rollout_weight_min')


class GRPOLogger(StepLogger):
  """The step line and scalars of a GRPO step: rewards, completion lengths, the mismatch, the
  rollout correction, and how the steps' time splits between generating and updating."""

  def __init__(self, s, writer, start_step: int):
    super().__init__(s, writer, start_step)
    g = grpo_config.of(s.config).grpo
    self._beta, self._correction = g.beta, g.rollout_correction != 'none'
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
    if self._correction:
      scalars.update(correction_scalars(m))
    scalars.update(self.loss_scale_scalars(m))
    return scalars, (f'reward {m["reward"]:.3f} | accuracy {m["accuracy"]:.3f} | loss '
                     f'{m["loss"]:.4f}{kl} | length {m["completion_tokens"]:.1f} | mismatch '
                     f'{m["logp_mismatch"]:.4f} | generating {share:.0%} | {step_time:.3f} s/step'
                     f'{self.skipped(m)}')


def correction_scalars(m: dict) -> dict:
  """The rollout correction's scalars from a step's metrics (objective.correction_stats): its
  weight's mean, min and max over its units (completion tokens, or completions with
  'sequence_*'), and the share of them whose ratio was clipped or masked."""
  units = max(m['rollout_units'], 1e-9)  # (the sums are all over the same tokens' count)
  return {'train/rollout_weight_mean': m['rollout_weight'] / units,
          'train/rollout_weight_min': m['rollout_weight_min'],
          'train/rollout_weight_max': m['rollout_weight_max'],
          'train/rollout_outside': m['rollout_outside'] / units}


class GRPO(train_lib.Program[TaskSources, TaskData, 'Step']):
  """GRPO on train.py's setup and loop: the task's prompts are the data, the step samples, scores
  and updates (see the module docstring)."""

  def open_sources(self, config: config_lib.Config) -> TaskSources:
    c = grpo_config.of(config)
    g, run = c.grpo, c.checkpoint.restore_from
    if not run:
      raise UserError('GRPO fine-tunes a trained run: give it with --init=RUN (or '
                      '--config=configs/grpo.py:RUN).')
    if not g.task:
      raise UserError('no task: give --task=TRAIN.jsonl (one {"prompt", "answer"} per line; '
                      'jax_pretrain/tasks.py).')
    if not os.path.isdir(os.path.join(run, checkpoint_lib.DIRECTORY)):
      raise UserError(f'--init={run}: no checkpoints there (a training run\'s workdir).')
    load = lambda source: tasks.load(source, g.task_format, g.task_fields)
    return TaskSources(workdir_lib.load_tokenizer(run), load(g.task),
                       load(g.eval_task) if g.eval_task else [], tasks.reward_fn(g.reward))

  def check(self, resolved: config_lib.Config, sources: TaskSources) -> None:
    c = grpo_config.of(resolved)
    objective.check_batch(c)
    for items in (sources.items, sources.eval_items):
      tasks.check_lengths(items, sources.encode, c.data.seq_len, c.grpo.max_new_tokens)

  def updates_per_step(self, resolved: config_lib.Config) -> int:
    return grpo_config.of(resolved).grpo.num_iterations

  def abstract_batch(self, s: state_lib.Setup, sources: TaskSources) -> dict:
    """The update's rows: the longest training prompt + grpo.max_new_tokens."""
    return objective.update_batch(s, _width(grpo_config.of(s.config), sources))

  def loss_fn(self, s: state_lib.Setup):
    return objective.update_loss_fn(s)

  def alongside(self, resolved: config_lib.Config, sources: TaskSources,
                num_devices: int) -> float:
    """The engine's cache stays allocated beside the update (kept between rollouts)."""
    return objective.engine_cache_bytes(grpo_config.of(resolved), sources.longest(), num_devices)

  def open_data(self, resolved: config_lib.Config, sources: TaskSources,
                step: int) -> TaskData:
    c = grpo_config.of(resolved)
    prompts = Prompts(sources.items, c.train.batch_size // c.grpo.num_samples, c.train.seed,
                      step)
    return TaskData(sources.tokenizer, prompts, sources, _width(c, sources),
                    objective.engine_context(c, sources.longest()))

  def make_step(self, s: state_lib.Setup, data: TaskData, update) -> 'Step':
    c = grpo_config.of(s.config)
    g = c.grpo
    B = c.train.batch_size
    # The initial model with beta > 0, in the policy's shardings; the scoring pass scores each
    # batch with it once, and with num_iterations > 1 with the params that sampled it (logp_old).
    ref = _reference_params(s, c.checkpoint.restore_from) if g.beta else None
    score = (objective.scorer(s, objective.score_temperatures(g))
             if g.beta or g.num_iterations > 1 else None)
    eng = engine_lib.Engine(c.model, None, data.tokenizer,
                            slots=objective.rollout_slots(c), context=data.context,
                            chunk=ROLLOUT_CHUNK, mesh=s.mesh, kv_cache_dtype=g.kv_cache_dtype)
    multihost.log(
        f'grpo              {len(data.sources.items)} task items, {B // g.num_samples} prompts × '
        f'{g.num_samples} completions a step (rows of {data.width} tokens), at most '
        f'{g.max_new_tokens} new tokens, temperature {g.temperature}, reward {g.reward!r}, '
        f'beta {g.beta}' + (f', {g.num_iterations} updates a rollout batch'
                            if g.num_iterations > 1 else '') +
        f'; engine {eng.slots} slots × {eng.context} tokens over {eng.devices} devices, KV '
        f'cache {g.kv_cache_dtype}' +
        (f'; eval on {len(data.sources.eval_items)} held-out items'
         if data.sources.eval_items else ''))
    return Step(s, data, update, eng, ref, score)

  def batches(self, s: state_lib.Setup, data: TaskData):
    return data.train

  def logger(self, s, writer, step: int) -> GRPOLogger:
    return GRPOLogger(s, writer, step)

  def hooks(self, ctx: hooks_lib.Context[TaskData, 'Step']) -> list[loop_lib.Hook]:
    hooks = [*hooks_lib.profile_hooks(ctx)]
    if ctx.data.sources.eval_items:
      hooks += task_eval_hooks(ctx, ctx.step.engine)
    return hooks + hooks_lib.checkpoint_hooks(ctx)


def _width(c: grpo_config.GrpoTrainConfig, sources: TaskSources) -> int:
  """Tokens per row of the update (objective.update_width of the longest training prompt)."""
  return objective.update_width(c, sources.longest(eval_items=False))


def _reference_params(s: state_lib.Setup, run: str):
  """The run's params (the initial model) in the policy's shardings, and with model.fp8 its amax
  histories (empty where it has none: the scorer then scales from the tensors themselves, as a
  first step does)."""
  checkpointer = checkpoint_lib.Checkpointer(run, read_only=True)
  try:
    step, params = checkpointer.restore_params(s.abstract_state.params)
    histories = checkpointer.restore_fp8(s.abstract_state.fp8, step)
  finally:
    checkpointer.close()
  if histories is None and s.abstract_state.fp8 is not None:  # (empty: as a first step's)
    histories = jax.tree.map(lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding),
                             s.abstract_state.fp8)
  return params, histories


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
    # (the reference params and amax histories or None; objective.scorer's or None)
    self.ref, self.score = ref, score
    self.g = grpo_config.of(s.config).grpo
    self.stop = config_lib.stop_strings(self.g.stop)
    # This process's totals; GRPOLogger reports their growth between logged steps.
    self.counters = dict.fromkeys(COUNTERS, 0.0)

  def __call__(self, state: state_lib.TrainState, items: list):
    g, tokenizer, reward = self.g, self.data.tokenizer, self.data.sources.reward
    step = int(jax.device_get(state.step)) // g.num_iterations + 1  # (the state counts updates)
    t0 = time.perf_counter()
    self.engine.set_params(fp8.merge(state.params, state.fp8))  # (FP8: at the delayed scales)
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
    advantages_B = np.asarray(objective.group_advantages(
        jnp.asarray(rewards.reshape(len(items), g.num_samples)), g.scale_rewards)).reshape(-1)
    batch = {k: multihost.global_array(v, self.s.batch_sharding) for k, v in {
        'tokens': r.tokens_BxT1, 'mask': r.mask_BxT, 'rollout_logp': r.logp_BxT,
        'advantages': np.broadcast_to(advantages_B[:, None], r.mask_BxT.shape).copy()}.items()}
    t2 = time.perf_counter()  # (scoring the rewards is neither generating nor updating)
    # The scorer reads the tokens alone: one compiled program for both passes (the batch they
    # are added to changes its structure).
    tokens = {'tokens': batch['tokens']}
    if self.ref is not None:
      batch['ref_logp'] = self.score(*self.ref, tokens)[0]
    if g.num_iterations > 1:  # logp_old: the params that sampled, before the first update
      batch['old_logp'], *at_one = self.score(state.params, state.fp8, tokens)
      if at_one:  # (the rollout correction's, at another temperature: score_temperatures)
        batch['old_logp_at_one'] = at_one[0]
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


def task_eval_hooks(ctx: hooks_lib.Context[TaskData, 'Step'], eng) -> list[loop_lib.Hook]:
  """eval/accuracy (greedy, the task's reward) on the held-out task: before the first step of a
  new run (logged as step 0), every train.eval_every steps and at the end."""
  from jax_pretrain import evaluate  # noqa: PLC0415  (evaluate's task accuracy, the one way)
  g, sources = grpo_config.of(ctx.config).grpo, ctx.data.sources

  def accuracy(step: int, params) -> dict:
    t0 = time.perf_counter()
    eng.set_params(params)
    rewards = [r for _, r in evaluate.task_rewards(eng, sources.eval_items, sources.reward,
                                                   g.max_new_tokens,
                                                   config_lib.stop_strings(g.stop))]
    eng.set_params(None)  # (as after a rollout: the update needs the memory)
    scalars = {'eval/accuracy': tasks.accuracy(rewards), 'eval/reward': float(np.mean(rewards))}
    ctx.logger.write(step, scalars)
    multihost.log(f'eval at step {step} | accuracy {scalars["eval/accuracy"]:.4f} '
                  f'({sum(r >= 1 for r in rewards)} of {len(rewards)}, greedy) | reward '
                  f'{scalars["eval/reward"]:.4f} | {time.perf_counter() - t0:.1f}s')
    ctx.logger.pause()
    return scalars

  def at_start(info: loop_lib.StepInfo) -> None:
    if info.step == 1 and ctx.start_step == 0:
      accuracy(0, fp8.merge(info.state.params, info.state.fp8))

  return [loop_lib.Hook(at_start, every=1, phase=loop_lib.BEFORE_STEP,
                        name='eval_task_at_start'),
          loop_lib.Hook(lambda info: accuracy(info.step, fp8.merge(info.state.params,
                                                                   info.state.fp8)),
                        every=ctx.config.train.eval_every, phase=loop_lib.EVAL, at_last=True,
                        name='eval_task')]


