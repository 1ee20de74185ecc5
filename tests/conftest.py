import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import fast_compile  # noqa: E402 - needs the path above

# Before any test starts JAX's backend (it reads XLA_FLAGS once, then).
fast_compile.enable()

# Session fixtures several modules use, defined here once: a module that
# imports a fixture gets its own definition, so a worker running two such
# modules loaded the real model (HF's load takes ~20 s) twice.
from tests.hf_fixtures import (hf_smollm2, smollm2_gguf_path,  # noqa: E402,F401
                               smollm2_ours, text_model)


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
