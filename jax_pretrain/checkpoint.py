"""Checkpoints with orbax: asynchronous saves, last K plus best N by eval loss, exact resume.

A checkpoint holds the whole train state (params, optimizer state, step, non-finite counters), the
data iterator's state and the resolved config. Arrays restore into whatever shardings the caller's
abstract state carries, so a checkpoint written on 8 devices restores on 1 and the other way round.
orbax writes each checkpoint under a temporary name and renames it when complete, so a process
killed mid-save leaves only a temporary directory, which is never restored; a complete-looking
checkpoint that fails to restore is skipped with a warning in favour of the previous one.
"""
import os

from absl import logging
import jax
from jax.experimental import multihost_utils
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jax_pretrain.errors import UserError


DIRECTORY = 'checkpoints'  # under the workdir


class CheckpointError(UserError):
  """A checkpoint that cannot be used or written; the message says which and why."""


def abstract_with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _path_str(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def check_shapes(saved, wanted, where: str) -> None:
  """Raises CheckpointError naming the first parameter whose shape or presence differs."""
  saved_leaves = {_path_str(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(saved)
                  if hasattr(x, 'shape')}
  for path, x in jax.tree_util.tree_leaves_with_path(wanted):
    name = _path_str(path)
    if name not in saved_leaves:
      raise CheckpointError(f'{where} has no {name!r}, which the config needs (shape '
                            f'{tuple(x.shape)}): was it written by a different model?')
    if saved_leaves[name] != tuple(x.shape):
      raise CheckpointError(f'{where}: {name!r} has shape {saved_leaves[name]} in the checkpoint '
                            f'but {tuple(x.shape)} in the config.')


class Checkpointer:
  """Saves and restores train state, data state and config under workdir/checkpoints."""

  def __init__(self, workdir: str, *, keep: int = 2, keep_best: int = 0, async_save: bool = True,
               read_only: bool = False, save_concurrent_gb: int = 0):
    """save_concurrent_gb: GB of arrays written at once (0: orbax's default); each array being
    written takes about its size again in host memory (compression buffers)."""
    limit = {'save_concurrent_gb': save_concurrent_gb} if save_concurrent_gb else {}
    self.directory = os.path.join(os.path.abspath(workdir), DIRECTORY)
    keep_policies = [policies.LatestN(n=max(keep, 1))]
    if keep_best > 0:
      keep_policies.append(policies.BestN(get_metric_fn=lambda m: m['eval/loss'], reverse=True,
                                          n=keep_best, keep_checkpoints_without_metrics=False))
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={'state': ocp.StandardCheckpointHandler(**limit),
                       'data': ocp.JsonCheckpointHandler(), 'config': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=async_save, create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only,
            preservation_policy=policies.AnyPreservationPolicy(keep_policies)))

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict, config: dict,
           metrics: dict[str, float] | None = None) -> None:
    """Starts an asynchronous save; raises CheckpointError if this or the previous save failed."""
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
          config=ocp.args.JsonSave(config)), metrics=metrics, force=True)
    except Exception as e:  # pylint: disable=broad-except  (disk full, permissions, ...)
      raise CheckpointError(f'saving step {step} to {self.directory} failed: {e}. The training '
                            'state in memory is intact, and so are the earlier checkpoints.') from e

  def wait(self) -> None:
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointError(f'an asynchronous save to {self.directory} failed: {e}') from e

  def _restore(self, step: int, abstract_state, with_data: bool):
    where = f'checkpoint {os.path.join(self.directory, str(step))}'
    check_shapes(self._manager.item_metadata(step)['state'], abstract_state, where)
    items = {'state': ocp.args.StandardRestore(abstract_state)}
    if with_data:
      items['data'] = ocp.args.JsonRestore()
    return self._manager.restore(step, args=ocp.args.Composite(**items))

  def restore_latest(self, abstract_state):
    """(step, state, data_state) of the newest checkpoint that restores, or None if there is none.

    A checkpoint whose files are damaged is skipped with a warning; one that does not fit the
    config (another model) raises CheckpointError rather than silently starting over.
    """
    for step in reversed(self.all_steps()):
      try:
        restored = self._restore(step, abstract_state, with_data=True)
      except CheckpointError:
        raise
      except Exception as e:  # pylint: disable=broad-except  (truncated or missing files)
        self._set_aside(step, e)
        continue
      return step, restored['state'], dict(restored['data'])
    return None

  def _set_aside(self, step: int, error: Exception) -> None:
    """Renames a damaged step to STEP.damaged (kept for inspection), so that the resumed run can
    save that step again."""
    damaged = os.path.join(self.directory, f'{step}.damaged')
    logging.warning('checkpoint %s/%d is damaged (%s: %s); moved to %s, trying the previous one.',
                    self.directory, step, type(error).__name__, error, damaged)
    if jax.process_index() == 0:
      os.rename(os.path.join(self.directory, str(step)), damaged)
    multihost_utils.sync_global_devices(f'checkpoint set aside {step}')
    self._manager.reload()

  def restore_params(self, abstract_params, step: int | None = None):
    """Only the params of a checkpoint (e.g. another run's, to continue pretraining from)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    where = f'checkpoint {os.path.join(self.directory, str(step))}'
    check_shapes(self._manager.item_metadata(step)['state']['params'], abstract_params, where)
    # The standard handler restores whole trees only; the PyTree handler reads the same files and
    # can skip the optimizer state (which may differ in structure between runs).
    reader = ocp.CheckpointManager(self.directory,
                                   item_handlers={'state': ocp.PyTreeCheckpointHandler()},
                                   options=ocp.CheckpointManagerOptions(read_only=True))
    abstract = {'params': abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
                                abstract)
    try:
      restored = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          abstract, restore_args=restore_args, partial_restore=True)))
    finally:
      reader.close()
    return step, restored['state']['params']

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self._manager.close()


def scalars_for_ranking(metrics: dict[str, float]) -> dict[str, float] | None:
  """The metrics orbax ranks checkpoints by, when this step has an eval loss."""
  if 'eval/loss' in metrics and np.isfinite(metrics['eval/loss']):
    return {'eval/loss': float(metrics['eval/loss'])}
  return None
