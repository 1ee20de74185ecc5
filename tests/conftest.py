import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import fast_compile  # noqa: E402 - needs the path above

# Before any test starts JAX's backend (it reads XLA_FLAGS once, then).
fast_compile.enable()


def _has_gpu() -> bool:
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


def pytest_addoption(parser):
  parser.addoption("--engine-impl", default="xla",
                   help="attention impl for the engine tests (xla on CPU CI; "
                        "gpu to rerun them on a GPU with the Pallas kernels)")


@pytest.fixture(scope="session")
def engine_impl(request):
  return request.config.getoption("--engine-impl")


def pytest_collection_modifyitems(config, items):
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
