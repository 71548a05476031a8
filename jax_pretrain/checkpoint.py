"""Saving and restoring the train state (and the data iterator's state) with orbax.

Saves are asynchronous: training continues while the arrays are written. A checkpoint restores
into whatever shardings the caller's abstract state carries, so the mesh may change between runs.
"""
import os

from absl import logging
import jax
import orbax.checkpoint as ocp


class Checkpointer:

  def __init__(self, workdir: str, keep: int = 2):
    self.directory = os.path.join(os.path.abspath(workdir), 'checkpoints')
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True,
                                             create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)), force=True)

  def restore(self, step: int, abstract_state):
    """abstract_state: ShapeDtypeStructs with the target shardings. Returns (state, data_state)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore()))
    logging.info('restored step %d from %s', step, self.directory)
    return restored.state, restored.data

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()


def abstract_with_shardings(tree, shardings):
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                      tree, shardings)
