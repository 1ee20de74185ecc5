"""Tests that need several devices.  On CPU, JAX makes them with
XLA_FLAGS=--xla_force_host_platform_device_count=8, which must be set
before JAX starts, so the main test process (one device) skips these and
tests/test_tensor_parallel.py runs this directory in a subprocess with the
flag.  To run them directly:

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
      python -m pytest tests/multi_device
"""

import os

import jax
import pytest

DEVICES = 8
_HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
  if jax.device_count() >= DEVICES:
    return
  skip = pytest.mark.skip(
      reason=f"needs {DEVICES} devices (tests/test_tensor_parallel.py runs "
             "these in a subprocess that has them)")
  for item in items:
    if str(item.fspath).startswith(_HERE):
      item.add_marker(skip)
