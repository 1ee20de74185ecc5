"""Orbax checkpoints of a training run: the train state (a pytree of
arrays) and a JSON record (step, recipe, loss history) per saved step.

A checkpoint saved at step s holds the state after s steps; resuming runs
step s next.  Restoring takes the live state as the template, so arrays
come back with its shapes, dtypes and shardings.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp

from lazyattn_jax.training.errors import TrainingInputError


class Checkpoints:
  """The checkpoints under `directory`, the newest `keep` kept."""

  def __init__(self, directory, keep: int = 2):
    if keep < 1:
      raise TrainingInputError(f"keep must be >= 1, got {keep}")
    self.directory = os.path.abspath(os.fspath(directory))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    self._manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    """The newest saved step, or None."""
    return self._manager.latest_step()

  def save(self, step: int, state, record: dict):
    """Saves `state` and the JSON-able `record` as step `step` (the array
    copy to the host happens now; the file writes may finish later)."""
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        record=ocp.args.JsonSave(record)), force=True)

  def record(self, step: int) -> dict:
    """The JSON record of step `step` alone, without reading any array (so
    it can be checked before the state is restored)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        record=ocp.args.JsonRestore()))
    return restored["record"]

  def restore(self, step: int, template):
    """(state, record) of step `step`, arrays laid out like `template`."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
        template)
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract),
        record=ocp.args.JsonRestore()))
    return restored["state"], restored["record"]

  def close(self):
    """Waits for pending writes and releases the manager."""
    self._manager.wait_until_finished()
    self._manager.close()
