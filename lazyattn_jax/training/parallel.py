"""Data parallelism over the local devices with jax.sharding.

One mesh axis, "data", over the devices: every batch array is split along
its first (batch) axis, parameters and optimizer state are replicated.  XLA
inserts the gradient all-reduce.  With one device this is plain jit.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from lazyattn_jax.training.errors import TrainingInputError

DATA_AXIS = "data"


def check_device_count(num_devices: int | None, name: str = "devices"):
  """TrainingInputError naming `name` unless `num_devices` is None (all)
  or lies in [1, local devices]; cheap, so trainers call it before they
  load anything."""
  count = len(jax.local_devices())
  if num_devices is not None and not 1 <= num_devices <= count:
    raise TrainingInputError(f"{name} must lie in [1, {count}], got "
                             f"{num_devices}")


def data_mesh(num_devices: int | None = None) -> Mesh:
  """A 1-D mesh over the first `num_devices` local devices (default all)."""
  check_device_count(num_devices)
  devices = jax.local_devices()
  if num_devices is not None:
    devices = devices[:num_devices]
  return Mesh(np.asarray(devices), (DATA_AXIS,))


def check_batch_size(mesh: Mesh, batch_size: int):
  """Raises TrainingInputError unless the batch splits evenly."""
  n = mesh.devices.size
  if batch_size % n:
    raise TrainingInputError(f"batch size {batch_size} must be a multiple of "
                             f"the {n} devices")


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def replicate(tree, mesh: Mesh):
  """`tree`'s arrays placed whole on every device of the mesh."""
  return jax.device_put(tree, replicated(mesh))


def shard_batch(tree, mesh: Mesh):
  """`tree`'s host arrays split along their first axis over the mesh."""
  return jax.device_put(tree, batch_sharded(mesh))


def peak_memory_bytes(mesh: Mesh) -> int | None:
  """The largest peak of device memory in use over the mesh's devices, or
  None where the backend does not say (CPU)."""
  peaks = []
  for device in mesh.devices.flat:
    try:
      stats = device.memory_stats() or {}
    except Exception:  # backends without memory statistics
      stats = {}
    if "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None
