"""A pretraining run: train.py's setup and loop with the pretraining hooks, listed in
`Pretraining.hooks`.

  pretrain.train_and_evaluate(config, workdir)   # what `python -m jax_pretrain.main` runs

Pretraining's own hooks live here: the held-out loss, and those that run after training has
produced a state (lm_eval, the end-of-run sample), so that train.py imports none of lm_eval,
sample, engine or serve. Those of every program (checkpointing, profiling) are hooks.py's.
"""
import time
from typing import Callable

from absl import logging
import ml_collections

from jax_pretrain import config as config_lib
from jax_pretrain import data as data_lib
from jax_pretrain import fp8
from jax_pretrain import hooks as hooks_lib
from jax_pretrain import loop as loop_lib
from jax_pretrain import metrics as metrics_lib
from jax_pretrain import multihost
from jax_pretrain import sample as sample_lib
from jax_pretrain import state as state_lib
from jax_pretrain import train as train_lib
from jax_pretrain.step_logger import StepLogger


class Pretraining(train_lib.Program[data_lib.Sources, data_lib.Data, Callable]):
  """Pretraining and SFT: train.Program's data (data.train's text or SFT examples) and step, with
  the hooks below."""

  def hooks(self, ctx: hooks_lib.Context[data_lib.Data, Callable]) -> list[loop_lib.Hook]:
    """Every hook of a pretraining run (loop.py says when each phase runs). The step metrics (the
    console line, TensorBoard, W&B) and the non-finite check are the loop's `metrics` and `checks`
    (train.py)."""
    t = ctx.config.train
    return [
        *hooks_lib.profile_hooks(ctx),  # BEFORE_STEP / AFTER_STEP: train.profile_steps
        eval_hook(ctx),  # EVAL: every train.eval_every steps and at the end
        *hooks_lib.checkpoint_hooks(ctx),  # SAVE: checkpoint.every_steps, the end, a stop
        *([lm_eval_hook(ctx)] if t.lm_eval_tasks else []),  # AFTER_SAVE
        *([sample_hook(ctx)] if t.sample_prompt and t.sample_tokens > 0 else []),  # END
    ]

  def check(self, resolved: config_lib.Config, sources: data_lib.Sources) -> None:
    """Checks before any work: a misspelt lm_eval task fails now, not after the first steps."""
    if resolved.train.lm_eval_tasks:
      from jax_pretrain import lm_eval as lm_eval_lib  # noqa: PLC0415
      lm_eval_lib.check_tasks(resolved.train)


def train_and_evaluate(config: config_lib.Config | ml_collections.ConfigDict, workdir: str,
                       devices=None) -> dict[str, float]:
  """Trains per the config (train.train takes it), writing logs and checkpoints to workdir;
  returns the last metrics."""
  return train_lib.train(config, workdir, Pretraining(), devices)


def run_eval(eval_step, params, data: data_lib.Data, s: state_lib.Setup, logger: StepLogger,
             step: int) -> dict:
  """The held-out loss of params over data.eval_batches(), written and logged at `step`."""
  nll, count = state_lib.summed_loss(eval_step, params, data.eval_batches(), s.batch_sharding)
  loss = nll / max(count, 1.0)
  scalars = {'eval/loss': loss, 'eval/ppl': metrics_lib.perplexity(loss)}
  logger.write(step, scalars)
  multihost.log(f'eval at step {step} | loss {loss:.4f} | ppl {scalars["eval/ppl"]:.2f}')
  return scalars


def eval_hook(ctx: hooks_lib.Context) -> loop_lib.Hook:
  """The held-out loss every train.eval_every steps and at the end (eval/loss, eval/ppl)."""
  s = ctx.setup
  eval_step = state_lib.jit_eval_step(s, ctx.data.tokenizer.pad_id)

  def evaluate(info: loop_lib.StepInfo) -> dict:
    return run_eval(eval_step, info.state.params, ctx.data, s, ctx.logger, info.step)
  return loop_lib.Hook(evaluate, every=s.config.train.eval_every, phase=loop_lib.EVAL,
                       at_last=True, name='eval')


def run_lm_eval(params, tokenizer, config: config_lib.Config, logger: StepLogger,
                step: int) -> None:
  """train.lm_eval_tasks through lm-evaluation-harness, logged as lm_eval/TASK/METRIC. A failure of
  the harness or its tasks (a task's download, a task the model cannot run:
  lm_eval.harness_failed) is a warning and training goes on; one of our code (the model, the
  engine, the device) stops the run like any other error."""
  from jax_pretrain import lm_eval as lm_eval_lib  # noqa: PLC0415
  params = multihost.gather(params, on_device=True)  # every process takes part, 0 evaluates
  if multihost.is_main():
    t0 = time.perf_counter()
    try:
      scalars = lm_eval_lib.evaluate_during_training(config, params, tokenizer)
    except Exception as e:  # (the harness raises many kinds; ours are raised again)
      if not lm_eval_lib.harness_failed(e):
        raise
      logging.warning('lm_eval at step %d failed, training goes on: %s: %s', step,
                      type(e).__name__, str(e).splitlines()[0] if str(e) else '')
      return
    logger.write(step, scalars)
    shown = ' | '.join(f'{k[len("lm_eval/"):]} {v:.4f}' for k, v in scalars.items())
    multihost.log(f'lm_eval at step {step} | {shown} ({time.perf_counter() - t0:.1f}s)')


def lm_eval_hook(ctx: hooks_lib.Context) -> loop_lib.Hook:
  """train.lm_eval_tasks after the save (a failing task costs no training), every
  train.lm_eval_every steps (0: at every eval) and at the end."""
  t = ctx.config.train

  def lm_eval(info: loop_lib.StepInfo) -> None:
    # (with model.fp8 the engine runs at the state's delayed scales: its amax histories beside)
    run_lm_eval(fp8.merge(info.state.params, info.state.fp8), ctx.data.tokenizer, ctx.config,
                ctx.logger, info.step)
  return loop_lib.Hook(lm_eval, every=t.lm_eval_every or t.eval_every, phase=loop_lib.AFTER_SAVE,
                       at_last=True, name='lm_eval')


def sample_hook(ctx: hooks_lib.Context) -> loop_lib.Hook:
  """A continuation of train.sample_prompt from the final model, printed."""
  t = ctx.config.train

  def sample(info: loop_lib.StepInfo) -> None:
    # (every process takes part, process 0 samples; with model.fp8, at the delayed scales)
    params = multihost.gather(fp8.merge(info.state.params, info.state.fp8))
    if multihost.is_main():
      text = sample_lib.generate_text(ctx.config.model, params,
                                      ctx.data.tokenizer, t.sample_prompt, t.sample_tokens,
                                      seed=t.seed)
      multihost.log(f'sample: {t.sample_prompt!r} -> {text!r}')
  return loop_lib.Hook(sample, phase=loop_lib.END, name='sample')
