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
- A complete-looking checkpoint whose files are damaged (missing, truncated, undecodable: see
  checkpoint_errors.kind), or whose arrays do not match the digests computed on the device when
  it was saved, is moved to STEP.damaged and the previous one is used. A file not found is first
  read again once after the step's directories were listed again (a network file system's client
  may have cached an old listing). When every checkpoint is damaged the run stops rather than
  start over from step 0.
- Any other failure to read a checkpoint (an I/O error, a device out of memory, an orbax error)
  says nothing about the files: the run stops naming the step and the cause, and no checkpoint is
  moved. Transient I/O errors (EIO, a stale NFS handle, a timeout) are first tried again
  (RETRY_DELAYS).
"""
import dataclasses
import os
import shutil
import threading
import time
from typing import Any, Callable

from absl import logging
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers as policies

from jax_pretrain import checkpoint_errors as errors_lib
from jax_pretrain import multihost
from jax_pretrain.checkpoint_errors import DamagedCheckpoint
from jax_pretrain.errors import UserError

DIRECTORY = 'checkpoints'  # under the workdir
_FREE_SPACE_MARGIN = 1.1  # free space wanted before a save, as a multiple of the state's bytes
# Seconds to wait before each new try of a read that failed with a transient I/O error; after the
# last, the restore stops. (A module constant: tests shrink it.)
RETRY_DELAYS = (1.0, 4.0, 16.0)
DAMAGED_SUFFIX = '.damaged'  # a step set aside: STEP.damaged, beside the checkpoints


class CheckpointError(UserError):
  """A checkpoint that cannot be used or written; the message says which and why."""


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


def _digests_later(tree) -> Callable[[], dict[str, list[int]]]:
  """{path: [plain sum, weighted sum]} of every array, in two halves: the reductions dispatched
  now, one program per array, from the arrays as they are now (training may donate them once this
  returns: the programs are queued before its next step); and a function that waits for them and
  reads the sums (a save calls it in the background). A device runs the programs in turn, so the
  temporaries are one array's bits, never the whole state's."""
  pending = [(_path_str(p), _DIGEST_PROGRAMS.get(_signature(x), _digest_one)(x))
             for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  return lambda: {name: [int(v) for v in jax.device_get(d)] for name, d in pending}


# _digest_one compiled ahead of time (Checkpointer.prepare), by _signature; where a signature is
# missing, the jitted _digest_one compiles it at its first call.
_DIGEST_PROGRAMS: dict[tuple, Any] = {}


def _signature(x) -> tuple:
  return x.shape, np.dtype(x.dtype), x.sharding


def _compile_digests(abstract_tree) -> None:
  for x in jax.tree.leaves(abstract_tree):
    if _signature(x) not in _DIGEST_PROGRAMS:
      _DIGEST_PROGRAMS[_signature(x)] = _digest_one.lower(x).compile()


class _DigestsHandler(ocp.JsonCheckpointHandler):
  """The 'digests' item: JSON as JsonCheckpointHandler writes it, from a function of no arguments
  (_digests_later's second half) called where orbax writes it, in the background of an
  asynchronous save, before the checkpoint is complete."""

  async def _save_fn(self, x, directory):
    await super()._save_fn(x(), directory)


@ocp.args.register_with_handler(_DigestsHandler, for_save=True)
@dataclasses.dataclass
class _DigestsSave(ocp.args.CheckpointArgs):
  item: Callable[[], dict[str, list[int]]]


@ocp.args.register_with_handler(_DigestsHandler, for_restore=True)
@dataclasses.dataclass
class _DigestsRestore(ocp.args.CheckpointArgs):
  pass


def _verify(tree, saved: dict[str, list[int]], prefix: str = '') -> None:
  """Raises DamagedCheckpoint naming the first array whose digest differs."""
  for name, value in _digests_later(tree)().items():
    name = f'{prefix}{name}'
    if name in saved and saved[name] != value:
      raise DamagedCheckpoint(f'{name!r} does not match the digest written with it (the file was '
                              'changed or damaged after the save)')


def _size(num_bytes: float) -> str:
  for unit, scale in (('GB', 1e9), ('MB', 1e6), ('KB', 1e3)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:.3g} {unit}'
  return f'{num_bytes:.0f} bytes'


def _options(read_only: bool, **kwargs) -> ocp.CheckpointManagerOptions:
  """Options that a reader (read_only) needs no orbax warning to correct."""
  if read_only:
    kwargs.update(save_interval_steps=0, max_to_keep=None, preservation_policy=None)
  return ocp.CheckpointManagerOptions(read_only=read_only, create=not read_only,
                                      cleanup_tmp_directories=not read_only, **kwargs)


def _remove_temporary(directory: str, step: int | None) -> None:
  """Removes what a failed save of `step` left (its temporary directory; process 0)."""
  if multihost.is_main() and step is not None and os.path.isdir(directory):
    for name in os.listdir(directory):
      if name.startswith(f'{step}.orbax-checkpoint-tmp'):
        shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def _steps_named(directory: str, suffix: str = '') -> list[int]:
  """The steps of the directories STEP + suffix in `directory`, oldest first."""
  try:
    names = os.listdir(directory)
  except OSError:
    return []
  return sorted(int(name[:len(name) - len(suffix)]) for name in names
                if name.endswith(suffix) and name[:len(name) - len(suffix)].isdigit())


def _read(what: str, where: str, read, relist):
  """(read(), None), or (None, the error) when it shows the checkpoint `where`'s files damaged
  (checkpoint_errors.kind).

  A file not found is read again once, after RETRY_DELAYS[0] and relist() and a new listing of
  the step's directories (a network file system's client, NFS, may answer from an attribute
  cache that a listing renews); found missing again, the step is damaged. A transient I/O error
  is tried again after each of RETRY_DELAYS; one that persists, and any other failure, raise
  CheckpointError naming the step, the cause and what to do, and nothing is moved. With several
  processes they agree (one collective per try): the most serious outcome on any process is what
  all do. A CheckpointError from read() (a checkpoint that does not fit the config) passes
  through.
  """
  tries, listed_again = 0, ''  # transient failures; the file not found, read again
  while True:
    result, error, kind = None, None, errors_lib.OK
    try:
      result = read()
    except CheckpointError:
      raise
    except Exception as e:  # noqa: BLE001  (sorted by kind; the rest stops the run below)
      error, kind = e, errors_lib.kind(e)
    kind = errors_lib.KINDS[-int(multihost.minimum(-errors_lib.KINDS.index(kind)))]
    if kind == errors_lib.OK:
      if listed_again:
        logging.warning('%s checkpoint %s: read after its directories were listed again (a file '
                        'was not found at first: %s).', what, where, listed_again)
      return result, None
    error = error or RuntimeError('failed on another process (see its log)')
    if kind == errors_lib.MISSING and not listed_again:
      listed_again = errors_lib.cause(error)
      time.sleep(RETRY_DELAYS[0])
      relist()
      for _ in os.walk(where):
        pass
      continue
    if kind in (errors_lib.MISSING, errors_lib.DAMAGED):
      return None, error
    tries += kind == errors_lib.TRANSIENT
    if kind != errors_lib.TRANSIENT or tries > len(RETRY_DELAYS):
      raise _read_failed(what, where, error, kind, tries) from error
    logging.warning('%s checkpoint %s: %s; trying again in %g s (try %d of %d).', what, where,
                    errors_lib.cause(error), RETRY_DELAYS[tries - 1], tries, len(RETRY_DELAYS) + 1)
    time.sleep(RETRY_DELAYS[tries - 1])


def _read_failed(what: str, where: str, error: BaseException, kind: str,
                 tries: int) -> CheckpointError:
  """The error that stops a read which failed for a reason other than damage."""
  if kind == errors_lib.TRANSIENT:
    advice = (f'it failed {tries} times over {sum(RETRY_DELAYS):g} s: check the file system '
              '(disk, mount, network) and run the same command to resume.')
  else:
    advice = (f'fix the cause and run the same command to resume (if this checkpoint itself '
              f'cannot be read, move {where} out of {os.path.dirname(where)} to resume from the '
              'one before).')
  return CheckpointError(f'{what} checkpoint {where} failed: {errors_lib.described(error)}. No '
                         f'checkpoint was moved or deleted; {advice}')


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
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={'state': ocp.StandardCheckpointHandler(**limit),
                       'config': ocp.JsonCheckpointHandler(), 'digests': _DigestsHandler()},
        options=_options(read_only, enable_async_checkpointing=async_save,
                         preservation_policy=policies.AnyPreservationPolicy(keep_policies)))
    self._pending: int | None = None  # the step being saved in the background
    self._preparing: threading.Thread | None = None  # prepare's compiles (None: none started)
    if not read_only:  # said by the line a lost process ends the run with
      multihost.set_resume_hint(self.resume_hint)

  def prepare(self, abstract_state) -> None:
    """Compiles the digests' programs for a state of these shapes and shardings (one per array
    shape) in a background thread, so that the first save, which dispatches them in its blocking
    part, does not compile them there. A save waits for it. The thread is this Checkpointer's:
    close() joins it on every path (a compile in flight cannot be cancelled, and one still running
    when the interpreter exits aborts the process inside XLA)."""
    self.wait_prepared()  # (one at a time)

    def compile_all():
      try:
        _compile_digests(abstract_state)
      except Exception as e:  # noqa: BLE001  (then the save compiles them, and reports a failure)
        logging.warning('compiling the checkpoint digests ahead of time failed: %s', e)
    self._preparing = threading.Thread(target=compile_all, name='checkpoint digests')
    self._preparing.start()

  def wait_prepared(self) -> None:
    """Waits until prepare's compiles are done (at once where none runs)."""
    if self._preparing is not None:
      self._preparing.join()
      self._preparing = None

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, config: dict, metrics: dict[str, float] | None = None) -> None:
    """Starts an asynchronous save; raises CheckpointError if the disk lacks room for it, or if
    it (or the previous save) failed. Every process calls it, at the same steps.

    What blocks (training may change the state's arrays once it returns): the digests' reductions
    dispatched on the devices (not waited for), and orbax's part: copying the arrays to host
    memory. In the background: reading the digests, writing the arrays, the config and the
    digests (a checkpoint is complete only with all three)."""
    if self._pending is not None:
      self.wait()  # orbax would wait too; here a failure of that save is named by its own step
    self.wait_prepared()
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
          digests=_DigestsSave(_digests_later(state))), metrics=metrics, force=True)
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
    """Removes what the failed save left and raises a CheckpointError naming the step and the
    cause."""
    _remove_temporary(self.directory, step)
    self._manager.reload()
    raise CheckpointError(f'saving step {step if step is not None else "?"} to {self.directory} '
                          f'failed: {errors_lib.cause(error)}. {self.last_complete()}') from error

  def last_complete(self) -> str:
    last = self.latest_step()
    return (f'The last complete checkpoint is step {last}.' if last is not None else
            'No checkpoint was completed yet.')

  def resume_hint(self) -> str:
    """Where a restarted run resumes, read from the directory alone (no orbax state, no
    collective: it runs on the heartbeat thread while the main thread may be stuck in a save).
    A step's directory has its final name only once every process wrote it."""
    steps = _steps_named(self.directory)
    if not steps:
      return f'no checkpoint was completed yet in {self.directory}'
    return f'the last complete checkpoint is step {steps[-1]} in {self.directory}'

  def damaged_steps(self) -> list[int]:
    """The steps set aside as damaged (STEP.damaged directories), oldest first."""
    return _steps_named(self.directory, DAMAGED_SUFFIX)

  def saved_config(self, step: int) -> dict:
    """The config a checkpoint was saved with (raises what orbax raised: see latest_config)."""
    return dict(self._manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore()))['config'])

  def latest_config(self) -> tuple[int, dict] | None:
    """(step, config) of the newest checkpoint whose config reads, or None if there is none.
    Damage and failures are handled as in restore_latest: a run is never checked against nothing
    because a config could not be read."""
    return self._newest('reading the config of', self.saved_config)

  def _checked(self, step: int, abstract, key: str | None = None) -> dict:
    """The step's digests, after checking that its state (or state[key]) has the shapes of
    `abstract`; FileNotFoundError without a state directory."""
    metadata = self._manager.item_metadata(step)
    if 'state' not in metadata:
      raise FileNotFoundError('its state directory is missing')
    check_shapes(metadata['state'] if key is None else metadata['state'][key], abstract,
                 f'checkpoint {os.path.join(self.directory, str(step))}')
    return dict(self._manager.restore(step, args=ocp.args.Composite(
        digests=_DigestsRestore()))['digests'])

  def restore_latest(self, abstract_state):
    """(step, state) of the newest checkpoint that restores and verifies, or None if there is none.

    A checkpoint whose files are damaged, or whose arrays differ from their digests, is moved
    aside with a warning in favour of the previous one; when all are damaged, CheckpointError.
    One that does not fit the config (another model), or cannot be read for another reason (an
    I/O error that persists, a device out of memory), raises CheckpointError rather than silently
    starting over, every checkpoint kept as it is.
    """
    def restore(step: int):
      saved = self._checked(step, abstract_state)
      state = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state)))['state']
      _verify(state, saved)
      return state
    return self._newest('restoring', restore)

  def _newest(self, what: str, read):
    """(step, read(step)) of the newest step that reads (_read), setting damaged ones aside;
    None when there are no checkpoints. A workdir whose checkpoints are all damaged (now or
    before: only STEP.damaged directories left) raises CheckpointError: starting over from step 0
    is the user's decision."""
    for step in reversed(self.all_steps()):
      result, damage = _read(what, os.path.join(self.directory, str(step)),
                             lambda step=step: read(step), self._manager.reload)
      if damage is None:
        return step, result
      if step in self.all_steps():  # (not if it went away meanwhile: nothing to set aside)
        self._set_aside(step, damage)
    damaged = self.damaged_steps()
    if damaged:
      names = ', '.join(f'{step}{DAMAGED_SUFFIX}' for step in damaged)
      raise CheckpointError(
          f'every checkpoint in {self.directory} is damaged and was set aside ({names}, kept '
          'for inspection), so the run does not start over on its own. To train from step 0, '
          f'use a new --workdir, or move the .damaged directories out of {self.directory}.')
    return None

  def _set_aside(self, step: int, error: BaseException) -> None:
    """Renames a damaged step to STEP.damaged (kept for inspection), so that the resumed run can
    save that step again."""
    damaged = os.path.join(self.directory, f'{step}{DAMAGED_SUFFIX}')
    logging.warning('checkpoint %s/%d is damaged (%s); moved to %s, trying the previous one.',
                    self.directory, step, errors_lib.cause(error), damaged)
    if multihost.is_main():
      if os.path.exists(damaged):
        shutil.rmtree(damaged)
      os.rename(os.path.join(self.directory, str(step)), damaged)
    multihost.barrier(f'checkpoint set aside {step}')
    self._manager.reload()

  def restore_fp8(self, abstract_fp8, step: int):
    """A step's FP8 amax histories (TrainState.fp8) placed as abstract_fp8, verified; None where
    it has none (a run without model.fp8, an import) or none are wanted (abstract_fp8 None)."""
    if abstract_fp8 is None or not (self._manager.item_metadata(step).get('state') or {}).get(
        'fp8'):
      return None
    return self.restore_params(abstract_fp8, step, key='fp8')[1]

  def restore_params(self, abstract_params, step: int | None = None, key: str = 'params'):
    """Only the params of a checkpoint (e.g. another run's, to continue pretraining from),
    verified against their digests (or another part of its state: `key`)."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise CheckpointError(f'no checkpoint in {self.directory}')
    if step not in self.all_steps():
      raise CheckpointError(f'no checkpoint of step {step} in {self.directory}; its steps are '
                            f'{", ".join(map(str, self.all_steps()))}.')
    # The standard handler restores whole trees only; the PyTree handler reads the same files and
    # can skip the optimizer state (which may differ in structure between runs).
    reader = ocp.CheckpointManager(self.directory, options=_options(read_only=True),
                                   item_handlers={'state': ocp.PyTreeCheckpointHandler()})
    abstract = {key: abstract_params}
    restore_args = jax.tree.map(lambda x: ocp.ArrayRestoreArgs(sharding=x.sharding, dtype=x.dtype),
                                abstract)

    def read():  # (metadata damaged or unreadable: as the arrays)
      saved = self._checked(step, abstract_params, key=key)
      params = reader.restore(step, args=ocp.args.Composite(state=ocp.args.PyTreeRestore(
          abstract, restore_args=restore_args, partial_restore=True)))['state'][key]
      _verify(params, saved, prefix=f'{key}/')
      return params
    try:
      params, damage = _read('reading the params of', os.path.join(self.directory, str(step)),
                             read, self._manager.reload)
    finally:
      reader.close()
    if damage is not None:  # (another run's: read, not set aside)
      raise CheckpointError(f'checkpoint {os.path.join(self.directory, str(step))} is damaged: '
                            f'{errors_lib.cause(damage)}. Use another step (--step) or '
                            're-export it.') from damage
    return step, params

  def close(self) -> None:
    """Waits for the save in flight and for prepare's compiles, on every path (a failed save
    included), then closes orbax's manager."""
    try:
      self.wait()
    finally:
      try:
        self.wait_prepared()
      finally:
        self._manager.close()


def scalars_for_ranking(metrics: dict[str, float]) -> dict[str, float] | None:
  """The metrics orbax ranks checkpoints by, when this step has an eval loss."""
  if 'eval/loss' in metrics and np.isfinite(metrics['eval/loss']):
    return {'eval/loss': float(metrics['eval/loss'])}
  return None
