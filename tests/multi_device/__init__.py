"""Tests that need several devices (see conftest.py)."""

import jax
import pytest


def needs_devices(n: int):
  """Skips the calling test where JAX has fewer than `n` devices."""
  if jax.device_count() < n:
    pytest.skip(f"needs {n} devices, JAX has {jax.device_count()}")
