"""The DPO program: a train.Program whose data are preference pairs and whose step scores them
with the reference model and updates the policy (its objective: objective.py).

Each step (train.py's setup and loop.py's loop, as pretraining): the next train.batch_size pairs
(a new seeded order every pass through them), their reference log-probabilities (the init
run's params, held frozen in the policy's shardings without optimizer state, scoring each batch;
or with dpo.precompute_ref_logps scored once before training, after which no reference is held),
then one update (state.make_train_step with objective.make_loss_fn: micro-batches, meshes, loss
scaling, the non-finite guard as in pretraining). Checkpoints, resume, signals, metrics.jsonl,
TensorBoard and W&B are the trainer's; step k's pairs depend only on the seed and k, so a run
stopped and rerun continues exactly. The held-out pairs (data.val, or the last data.val_ratio of
data.train) are evaluated every train.eval_every steps and at the end: eval/loss and TRL's
metrics under eval/.
"""
import os
import time

import jax
import numpy as np

from jax_pretrain import checkpoint as checkpoint_lib
from jax_pretrain import config as config_lib
from jax_pretrain import hooks as hooks_lib
from jax_pretrain import loop as loop_lib
from jax_pretrain import multihost
from jax_pretrain import state as state_lib
from jax_pretrain import train as train_lib
from jax_pretrain import workdir as workdir_lib
from jax_pretrain.dpo import config as dpo_config
from jax_pretrain.dpo import data as data_lib
from jax_pretrain.dpo import objective
from jax_pretrain.errors import UserError
from jax_pretrain.grpo.data import Prompts
from jax_pretrain.step_logger import StepLogger


class DPOLogger(StepLogger):
  """The step line and scalars of a DPO step: the loss and TRL's metrics (objective.METRICS)."""

  def __init__(self, s, writer, start_step: int):
    super().__init__(s, writer, start_step)
    self._pairs = s.config.train.batch_size

  def report(self, step: int, m: dict, step_time: float) -> tuple[dict, str]:
    scalars = {'train/loss': m['loss'], 'train/lr': m['lr'], 'train/grad_norm': m['grad_norm'],
               'train/nonfinite_skips': m['nonfinite_count'],
               **{f'train/{k}': m[k] for k in objective.METRICS},
               'perf/step_time': step_time, 'perf/pairs_per_sec': self._pairs / step_time}
    scalars.update(self.loss_scale_scalars(m))
    return scalars, (f'loss {m["loss"]:.4f} | accuracy {m["rewards/accuracies"]:.3f} | margin '
                     f'{m["rewards/margins"]:.4f} | lr {m["lr"]:.2e} | grad_norm '
                     f'{m["grad_norm"]:.3f} | {step_time:.3f} s/step{self.skipped(m)}')


class DPO(train_lib.Program[data_lib.PairSources, data_lib.PairData, 'Step']):
  """DPO on train.py's setup and loop (see the module docstring)."""

  def open_sources(self, config: config_lib.Config) -> data_lib.PairSources:
    c = dpo_config.of(config)
    run = c.checkpoint.restore_from
    if not run:
      raise UserError('DPO fine-tunes a trained run, its reference model: give it with '
                      '--init=RUN (or --config=configs/dpo.py:RUN).')
    if not os.path.isdir(os.path.join(run, checkpoint_lib.DIRECTORY)):
      raise UserError(f'--init={run}: no checkpoints there (a training run\'s workdir).')
    if not c.data.train:
      raise UserError('no preference pairs: give --config.data.train=PAIRS.jsonl (one {"prompt", '
                      '"chosen", "rejected"} a line).')
    return data_lib.open_pairs(c.data.train, c.data.val, c.data.val_ratio,
                               workdir_lib.load_tokenizer(run),
                               (c.dpo.max_prompt_tokens, c.dpo.max_completion_tokens),
                               c.data.seq_len)

  def abstract_batch(self, s: state_lib.Setup, sources: data_lib.PairSources) -> dict:
    c = dpo_config.of(s.config)
    return objective.update_batch(s, c.train.batch_size, sources.length, c.dpo.rpo_alpha > 0)

  def loss_fn(self, s: state_lib.Setup):
    return objective.update_loss_fn(s)

  def alongside(self, resolved: config_lib.Config, sources: data_lib.PairSources,
                num_devices: int) -> float:
    """The held reference params, at most whole on each device (none with precompute)."""
    return objective.reference_bytes(dpo_config.of(resolved))

  def open_data(self, resolved: config_lib.Config, sources: data_lib.PairSources,
                step: int) -> data_lib.PairData:
    t = resolved.train
    return data_lib.PairData(Prompts(list(range(len(sources.train))), t.batch_size, t.seed, step),
                             sources)

  def make_step(self, s: state_lib.Setup, data: data_lib.PairData, update) -> 'Step':
    c = dpo_config.of(s.config)
    d, sources = c.dpo, data.sources
    score = objective.scorer(s)
    ref = _reference_params(s, c.checkpoint.restore_from)
    step = Step(s, sources, update, score, None if d.precompute_ref_logps else ref)
    if d.precompute_ref_logps:
      t0 = time.perf_counter()
      step.table = {'train': step.score_all(sources.train, ref),
                    'eval': step.score_all(sources.eval, ref)}
      del ref  # (no reference model is held from here on)
      multihost.log(f'scored the reference log-probabilities of {len(sources.train)} + '
                    f'{len(sources.eval)} pairs in {time.perf_counter() - t0:.1f}s')
    multihost.log(
        f'dpo               {len(sources.train)} pairs ({len(sources.eval)} held out, '
        f'{sources.dropped} dropped), {c.train.batch_size} a step, sequences of '
        f'{sources.length} tokens, loss {d.loss_type!r}, beta {d.beta}'
        + (f', rpo_alpha {d.rpo_alpha}' if d.rpo_alpha else '')
        + ('; reference precomputed' if d.precompute_ref_logps else '; reference held'))
    return step

  def batches(self, s: state_lib.Setup, data: data_lib.PairData):
    return data.train

  def logger(self, s, writer, step: int) -> DPOLogger:
    return DPOLogger(s, writer, step)

  def hooks(self, ctx: hooks_lib.Context[data_lib.PairData, 'Step']) -> list[loop_lib.Hook]:
    hooks = [*hooks_lib.profile_hooks(ctx)]
    if ctx.data.sources.eval:
      hooks += eval_hooks(ctx)
    return hooks + hooks_lib.checkpoint_hooks(ctx)


def _reference_params(s: state_lib.Setup, run: str):
  """The run's params (the reference model) in the policy's shardings."""
  checkpointer = checkpoint_lib.Checkpointer(run, read_only=True)
  try:
    return checkpointer.restore_params(s.abstract_state.params)[1]
  finally:
    checkpointer.close()


class Step:
  """One DPO step, as the loop calls it: (state, the step's pair indices) -> (state, metrics):
  the pairs' batch, their reference log-probabilities, one update."""

  def __init__(self, s: state_lib.Setup, sources: data_lib.PairSources, update, score, ref):
    self.s, self.sources, self.update, self.score, self.ref = s, sources, update, score, ref
    self.rpo = dpo_config.of(s.config).dpo.rpo_alpha > 0
    self.table: dict[str, np.ndarray] = {}  # (precomputed: 'train', 'eval' -> float32 [N, 2])

  def batch(self, pairs: list, ref_logps: np.ndarray | None) -> dict:
    """The pairs' batch on the devices (train.batch_size rows), its ref_logps given or scored."""
    host = data_lib.rows(pairs, self.sources.length, self.sources.tokenizer.pad_id, ref_logps,
                         self.rpo, size=self.s.config.train.batch_size)
    batch = {k: multihost.global_array(v, self.s.batch_sharding) for k, v in host.items()}
    if ref_logps is None:
      batch['ref_logps'] = self.score(self.ref, batch)
    return batch

  def chunks(self, pairs: list):
    """(start, the pairs) of train.batch_size at a time (the last one short)."""
    B = self.s.config.train.batch_size
    return ((i, pairs[i:i + B]) for i in range(0, len(pairs), B))

  def score_all(self, pairs: list, ref) -> np.ndarray:
    """The reference's log-probabilities of every pair, float32 [len(pairs), 2], on the host."""
    out = np.zeros((len(pairs), 2), np.float32)
    for i, chunk in self.chunks(pairs):
      host = data_lib.rows(chunk, self.sources.length, self.sources.tokenizer.pad_id,
                           size=self.s.config.train.batch_size)
      batch = {k: multihost.global_array(host[k], self.s.batch_sharding)
               for k in ('tokens', 'mask')}
      out[i:i + len(chunk)] = np.asarray(multihost.gather(self.score(ref, batch)))[:len(chunk)]
    return out

  def __call__(self, state: state_lib.TrainState, indices: list):
    table = self.table.get('train')
    batch = self.batch([self.sources.train[i] for i in indices],
                       table[indices] if table is not None else None)
    return self.update(state, batch)


def eval_hooks(ctx: hooks_lib.Context[data_lib.PairData, Step]) -> list[loop_lib.Hook]:
  """eval/loss and TRL's metrics over the held-out pairs: before the first step of a new run
  (logged as step 0: the init's log-probabilities; its rewards are 0, the policy being the
  reference), every train.eval_every steps and at the end."""
  step, s = ctx.step, ctx.setup
  evaluate = objective.evaluator(s, objective.update_loss_fn(s))
  pairs = ctx.data.sources.eval

  def run(step_number: int, params) -> dict:
    t0 = time.perf_counter()
    table = step.table.get('eval')
    totals = None
    for i, chunk in step.chunks(pairs):
      sums = evaluate(params,
                      step.batch(chunk, table[i:i + len(chunk)] if table is not None else None))
      totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    loss, count, metrics = jax.device_get(totals)
    scalars = {'eval/loss': float(loss / count),
               **{f'eval/{k}': float(v / count) for k, v in metrics.items()}}
    ctx.logger.write(step_number, scalars)
    multihost.log(f'eval at step {step_number} | loss {scalars["eval/loss"]:.4f} | accuracy '
                  f'{scalars["eval/rewards/accuracies"]:.4f} | margin '
                  f'{scalars["eval/rewards/margins"]:.4f} | logps chosen '
                  f'{scalars["eval/logps/chosen"]:.3f} rejected '
                  f'{scalars["eval/logps/rejected"]:.3f} ({len(pairs)} pairs, '
                  f'{time.perf_counter() - t0:.1f}s)')
    ctx.logger.pause()
    return scalars

  def at_start(info: loop_lib.StepInfo) -> None:
    if info.step == 1 and ctx.start_step == 0:
      run(0, info.state.params)

  return [loop_lib.Hook(at_start, every=1, phase=loop_lib.BEFORE_STEP, name='eval_at_start'),
          loop_lib.Hook(lambda info: run(info.step, info.state.params),
                        every=ctx.config.train.eval_every, phase=loop_lib.EVAL, at_last=True,
                        name='eval')]
