"""Tests that need several devices.  On CPU, JAX makes them with
XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be set
before JAX starts, so the main test process (one device) skips these and
tests/test_tensor_parallel.py runs this directory in a subprocess with the
flag.  To run them directly:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python -m pytest tests/multi_device

On a machine with 2 or more GPUs they run as they are (cases needing more
devices than there are skip); `--engine-impl gpu` runs the engines with
the Pallas kernels.
"""

import os

import jax
import pytest

MIN_DEVICES = 2
_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
  if jax.device_count() >= MIN_DEVICES:
    return
  skip = pytest.mark.skip(
      reason="needs several devices (tests/test_tensor_parallel.py runs "
             "these in a subprocess that has 8)")
  for item in items:
    if str(item.fspath).startswith(_HERE):
      item.add_marker(skip)
