"""Checkpoints with orbax: asynchronous saves, last K plus best N by eval loss, verified restores.

A checkpoint holds the whole train state (params, optimizer state, step, non-finite counters; the
step is also the data position), the resolved config, and a digest of every array. Arrays restore
into whatever shardings the caller's abstract state carries, so a checkpoint written on 8 devices
restores on 1 and the other way round.

What can go wrong, and what happens:
- A process killed mid-save leaves only a temporary directory, which is never restored.
- A save that fails (disk full, I/O error), in the foreground or in the background, is reported
  by the next `check()` (every step) naming the step and the cause; its temporary directory is
  removed. Before each save the free space is compared with the state's size.
- A complete-looking checkpoint whose files are damaged, or whose arrays do not match the digests
  computed on the device when it was saved, is moved to STEP.damaged and the previous one is used.
"""
import logging as pylogging
import os
import re
import shutil

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jax_pretrain import multihost
from jax_pretrain.errors import UserError

DIRECTORY = 'checkpoints'  # under the workdir
_FREE_SPACE_MARGIN = 1.1  # free space wanted before a save, as a multiple of the state's bytes


class CheckpointError(UserError):
  """A checkpoint that cannot be used or written; the message says which and why."""


class DamagedCheckpoint(Exception):
  """A checkpoint's arrays differ from the digests written with them."""


def abstract_with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)


def _path_str(path) -> str:
  return '/'.join(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def check_shapes(saved, wanted, where: str) -> None:
  """Raises CheckpointError naming the first parameter whose shape or presence differs."""
  saved_leaves = {_path_str(p): tuple(x.shape)
                  for p, x in jax.tree_util.tree_leaves_with_path(saved) if hasattr(x, 'shape')}
  for path, x in jax.tree_util.tree_leaves_with_path(wanted):
    name = _path_str(path)
    if name not in saved_leaves and name.startswith('loss_scale/'):
      raise CheckpointError(f'{where} has no loss scale, which float16 training keeps: it was '
                            'written before float16 runs had loss scaling. Start a new run from '
                            'its params: --config.checkpoint.restore_from=WORKDIR --workdir=NEW '
                            '(fresh optimizer and data order).')
    if name not in saved_leaves:
      raise CheckpointError(f'{where} has no {name!r}, which the config needs (shape '
                            f'{tuple(x.shape)}): was it written by a different model?')
    if saved_leaves[name] != tuple(x.shape):
      raise CheckpointError(f'{where}: {name!r} has shape {saved_leaves[name]} in the checkpoint '
                            f'but {tuple(x.shape)} in the config.')


@jax.jit
def _digest_one(x: jax.Array) -> jax.Array:
  """Two 32-bit sums of an array's bits, uint32 [2]: plain, and weighted by 2i + 1 for the flat
  index i (odd weights, so any change to a single 32-bit word changes it). Integer sums wrap, so
  the result does not depend on how the array is sharded or summed. The weighted sum is taken
  axis by axis, sum_i(b_i * i) = sum over axes of stride * sum_k(k * (b summed over the other
  axes)[k]), without reshaping a sharded array or making an index array: the only temporary as
  large as x is its bits (on the CPU, where XLA does not fuse the bit cast into the sums)."""
  bits = jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{x.dtype.itemsize * 8}'))
  bits = bits.astype(jnp.uint32)  # (8-, 16- and 32-bit arrays: the state has no 64-bit ones)
  total = jnp.sum(bits, dtype=jnp.uint32)
  weighted = total
  for axis in range(x.ndim):
    stride = int(np.prod(x.shape[axis + 1:], dtype=np.int64))
    others = tuple(a for a in range(x.ndim) if a != axis)
    per_k = jnp.sum(bits, axis=others, dtype=jnp.uint32)
    k = jnp.arange(x.shape[axis], dtype=jnp.uint32)
    weighted += jnp.uint32(2 * stride % 2**32) * jnp.sum(per_k * k, dtype=jnp.uint32)
  return jnp.stack([total, weighted])


def digests(tree) -> dict[str, list[int]]:
  """{path: [plain sum, weighted sum]} of every array, computed on the devices one array at a
  time: the temporaries are one array's bits, not the whole state's (a 1.2B-parameter state on
  the CPU needed 30 GB computed at once)."""
  return {_path_str(p): [int(v) for v in jax.device_get(_digest_one(x))]
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _verify(tree, saved: dict[str, list[int]] | None, prefix: str = '') -> None:
  """Raises DamagedCheckpoint naming the first array whose digest differs (saved None: a
  checkpoint from before digests, not verified)."""
  if not saved:
    return
  for name, value in digests(tree).items():
    name = f'{prefix}{name}'
    if name in saved and saved[name] != value:
      raise DamagedCheckpoint(f'{name!r} does not match the digest written with it (the file was '
                              'changed or damaged after the save)')


def _size(num_bytes: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('KB', 1e3)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:.3g} {unit}'
  return f'{num_bytes:.0f} bytes'


def _cause(error: Exception) -> str:
  """The gist of an orbax/tensorstore error: the OS error when there is one (their messages
  repeat long paths), else the start of the message."""
  text = str(error).strip()
  found = re.search(r'([A-Z][A-Za-z ]+) \[os_error_code=.?(\d+)', text)
  if found:
    return f'{found.group(1)} (errno {found.group(2)})'
  return text.splitlines()[0][:300] if text else type(error).__name__


def _options(read_only: bool, **kwargs) -> ocp.CheckpointManagerOptions:
  """Options that a reader (read_only) needs no orbax warning to correct."""
  if read_only:
    kwargs.update(save_interval_steps=0, max_to_keep=None, preservation_policy=None)
  return ocp.CheckpointManagerOptions(read_only=read_only, create=not read_only,
                                      cleanup_tmp_directories=not read_only, **kwargs)


def _manager(directory: str, **kwargs) -> ocp.CheckpointManager:
  """A CheckpointManager, made without orbax's warning that a reader's directory is read only."""
  verbosity = logging.get_verbosity()
  logging.set_verbosity(logging.ERROR)
  try:
    return ocp.CheckpointManager(directory, **kwargs)
  finally:
    logging.set_verbosity(verbosity)


class _OrbaxFailureTracebacks(pylogging.Filter):
  """Drops the tracebacks orbax logs for a failed background save: the CheckpointError raised for
  it says what failed in one line (and chains the exception)."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    return not (record.levelno >= pylogging.ERROR and record.exc_info
                and f'{os.sep}orbax{os.sep}' in record.pathname)


_ORBAX_FILTER = _OrbaxFailureTracebacks()


class Checkpointer:
  """Saves and restores the train state and config under workdir/checkpoints."""

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
    self._manager = _manager(
        self.directory,
        item_handlers={'state': ocp.StandardCheckpointHandler(**limit),
                       'config': ocp.JsonCheckpointHandler(),
                       'digests': ocp.JsonCheckpointHandler(),
                       'data': ocp.JsonCheckpointHandler()},  # (written before 2026-11-23)
        options=_options(read_only, enable_async_checkpointing=async_save,
                         preservation_policy=policies.AnyPreservationPolicy(keep_policies)))
    self._pending: int | None = None  # the step being saved in the background
    logging.get_absl_logger().addFilter(_ORBAX_FILTER)  # (once: a filter is added only once)
    if not read_only:  # said by the line a lost process ends the run with
      multihost.set_resume_hint(self.resume_hint)

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, config: dict, metrics: dict[str, float] | None = None) -> None:
    """Starts an asynchronous save; raises CheckpointError if the disk lacks room for it, or if
    it (or the previous save) failed. Every process calls it, at the same steps."""
    if self._pending is not None:
      self.wait()  # orbax would wait too; here a failure of that save is named by its own step
    needed = sum(x.nbytes for x in jax.tree.leaves(state))
    free = shutil.disk_usage(self.directory).free
    if multihost.any_process(free < needed * _FREE_SPACE_MARGIN):
      raise CheckpointError(
          f'saving step {step}: {self.directory} has {_size(free)} free, but the checkpoint '
          f'needs about {_size(needed)}. {self.last_complete()} Free some space (or lower '
          'checkpoint.keep) and run the same command to resume.')
    try:
      self._manager.save(step, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config),
          digests=ocp.args.JsonSave(digests(state))), metrics=metrics, force=True)
    except Exception as e:  # noqa: BLE001  (disk full, permissions, ...)
      self._failed(step, e)
    self._pending = step

  def check(self) -> None:
    """Raises CheckpointError if the background save has failed; cheap: call it every step (with
    several processes, at the same steps on all: they agree through an all-gather)."""
    if self._pending is None:
      return
    if not multihost.all_processes(not self._manager.is_saving_in_progress()):
      return
    self.wait()  # finished everywhere: returns at once, or raises the failure orbax kept

  def wait(self) -> None:
    """Blocks until the background save is complete; raises CheckpointError if it failed on any
    process."""
    step, self._pending = self._pending, None
    error = None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      error = e
    if multihost.any_process(error is not None):
      self._failed(step, error or RuntimeError('the save failed on another process'))

  def _failed(self, step: int | None, error: Exception):
    """Removes the temporary directory the failed save left and raises a CheckpointError naming
    the step and the cause."""
    if multihost.is_main() and step is not None and os.path.isdir(self.directory):
      for name in os.listdir(self.directory):
        if name.startswith(f'{step}.orbax-checkpoint-tmp'):
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)
    self._manager.reload()
    raise CheckpointError(f'saving step {step if step is not None else "?"} to {self.directory} '
                          f'failed: {_cause(error)}. {self.last_complete()}') from error

  def last_complete(self) -> str:
    last = self.latest_step()
    return (f'The last complete checkpoint is step {last}.' if last is not None else
            'No checkpoint was completed yet.')

  def resume_hint(self) -> str:
    """Where a restarted run resumes, read from the directory alone (no orbax state, no
    collective: it runs on the heartbeat thread while the main thread may be stuck in a save).
    A step's directory has its final name only once every process wrote it."""
    try:
      steps = [int(name) for name in os.listdir(self.directory) if name.isdigit()]
    except OSError:
      steps = []
    if not steps:
      return f'no checkpoint was completed yet in {self.directory}'
    return f'the last complete checkpoint is step {max(steps)} in {self.directory}'

  def saved_config(self, step: int) -> dict | None:
    """The config a checkpoint was saved with (None if it cannot be read)."""
    try:
      return dict(self._manager.restore(step, args=ocp.args.Composite(
          config=ocp.args.JsonRestore()))['config'])
    except Exception:  # noqa: BLE001  (damaged: restore_latest deals with it)
      return None

  def _saved_digests(self, step: int) -> dict | None:
    if 'digests' not in (self._manager.item_metadata(step) or {}):
      return None  # written before digests existed
    try:
      return dict(self._manager.restore(step, args=ocp.args.Composite(
          digests=ocp.args.JsonRestore()))['digests'])
    except Exception:  # noqa: BLE001
      return None

  def restore_latest(self, abstract_state):
    """(step, state) of the newest checkpoint that restores and verifies, or None if there is none.

    A checkpoint whose files are damaged, or whose arrays differ from their digests, is moved
    aside with a warning in favour of the previous one; one that does not fit the config (another
    model) raises CheckpointError rather than silently starting over.
    """
    for step in reversed(self.all_steps()):
      where = f'checkpoint {os.path.join(self.directory, str(step))}'
      try:
        check_shapes(self._manager.item_metadata(step)['state'], abstract_state, where)
        state = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state)))['state']
        _verify(state, self._saved_digests(step))
      except CheckpointError:
        raise
      except Exception as e:  # noqa: BLE001  (truncated, missing, altered files)
        self._set_aside(step, e)
        continue
      return step, state
    return None

  def _set_aside(self, step: int, error: Exception) -> None:
    """Renames a damaged step to STEP.damaged (kept for inspection), so that the resumed run can
    save that step again."""
    damaged = os.path.join(self.directory, f'{step}.damaged')
    logging.warning('checkpoint %s/%d is damaged (%s: %s); moved to %s, trying the previous one.',
                    self.directory, step, type(error).__name__, error, damaged)
    if multihost.is_main():
      if os.path.exists(damaged):
        shutil.rmtree(damaged)
      os.rename(os.path.join(self.directory, str(step)), damaged)
    multihost.barrier(f'checkpoint set aside {step}')
    self._manager.reload()

  def restore_params(self, abstract_params, step: int | None = None):
    """Only the params of a checkpoint (e.g. another run's, to continue pretraining from),
    verified against their digests."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    if step not in self.all_steps():
      raise CheckpointError(f'no checkpoint of step {step} in {self.directory}; its steps are '
                            f'{", ".join(map(str, self.all_steps()))}.')
    where = f'checkpoint {os.path.join(self.directory, str(step))}'
    check_shapes(self._manager.item_metadata(step)['state']['params'], abstract_params, where)
    # The standard handler restores whole trees only; the PyTree handler reads the same files and
    # can skip the optimizer state (which may differ in structure between runs).
    reader = _manager(self.directory, item_handlers={'state': ocp.PyTreeCheckpointHandler()},
                      options=_options(read_only=True))
    abstract = {'params': abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
                                abstract)
    try:
      restored = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          abstract, restore_args=restore_args, partial_restore=True)))
    finally:
      reader.close()
    params = restored['state']['params']
    try:
      _verify(params, self._saved_digests(step), prefix='params/')
    except DamagedCheckpoint as e:
      raise CheckpointError(f'{where}: {e}. Use another step (--step) or re-export it.') from None
    return step, params

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
