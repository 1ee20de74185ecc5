import gc
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


# Tests of 10 s or more under `pytest -n 2` on a 2-core machine, with their
# seconds there (--durations).  A module is named whole where its tests share
# a costly fixture, and a tuple of names runs on one worker (both HF parity
# modules use HF's model, ~20 s to load).  Names that no longer match are
# ignored.
LONG_TESTS = {
    "tests/test_tensor_parallel.py::test_multi_device_checks_pass_on_eight_cpu_devices": 85,
    "tests/test_rag_serving.py": 62,
    ("tests/test_hf_lazy_parity.py", "tests/test_hf_parity.py"): 64,
    "tests/test_notebook.py": 38,
    "tests/test_cli.py::test_demo_shows_cache_hits_on_reuse": 35,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_float8": 40,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_one_warpgroup_page8": 29,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_float8_small_and_mixed_v_scales": 48,
    "tests/test_tensor_parallel.py::test_two_processes_serve_one_engine_in_lockstep": 26,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_ragged": 24,
    "tests/test_quality_hotpotqa.py": 24,
    "tests/test_default_quality.py::test_embedded_model_loads_its_sink_by_default": 22,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_odd_group_pads_a_token_block": 22,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret": 21,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_float8": 20,
    "tests/test_engine_faults.py::test_churn_soak_with_failing_steps": 17,
    "tests/test_decode_during_prefill.py::test_riders_give_the_same_tokens_and_decode_during_prefill": 16,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_fast_path": 15,
    "tests/test_cli.py::test_rag_labels_what_was_cached_before_the_run": 14,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_whole_pages_llama3": 13,
    "tests/test_tensor_parallel.py::test_benchmark_runs_one_and_two_devices_side_by_side": 11,
    "tests/test_training_finetune.py::test_two_devices_give_the_loss_of_one": 11,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_mha_and_page_offset": 10,
}


def _long_key(nodeid: str):
  for key in LONG_TESTS:
    for name in key if isinstance(key, tuple) else (key,):
      if nodeid == name or nodeid.startswith((name + "::", name + "[")):
        return key
  return None


def _long_tests_first(items):
  """Reorders `items` so that each of two xdist workers starts on half the
  long tests (longest first, shared greedily) and then has half the rest.

  --dist worksteal hands the first worker the first half of the list and
  the second worker the other half, then moves tests from the end of one's
  queue to the other when it runs dry.  Long tests at the start of each
  half run early, and the last tests of both workers are short ones.  Each
  worker also keeps about half the in-process tests: one process compiling
  nearly all of the suite's programs runs out of memory mappings (65530
  by default; each program maps a few) and crashes inside XLA.
  """
  groups = {key: [] for key in LONG_TESTS}
  rest = []
  for item in items:
    key = _long_key(item.nodeid)
    (groups[key] if key else rest).append(item)
  shares, seconds = ([], []), [0, 0]
  for key in sorted(LONG_TESTS, key=LONG_TESTS.get, reverse=True):
    lighter = seconds.index(min(seconds))
    shares[lighter].extend(groups[key])
    seconds[lighter] += LONG_TESTS[key] if groups[key] else 0
  cut = max(0, len(items) // 2 - len(shares[0]))
  items[:] = shares[0] + rest[:cut] + shares[1] + rest[cut:]


# Each compiled program holds a few memory mappings until it is dropped, and
# Linux allows a process 65530 (vm.max_map_count); past that XLA crashes
# while compiling.  A worker of `pytest -n 2` ended the suite with ~53000
# (measured), so a worker drops its compiled programs between modules once
# it holds many (the next modules compile theirs again).
MAX_MAPPINGS = 45000


def _mappings() -> int:
  try:
    with open("/proc/self/maps") as maps:
      return sum(1 for _ in maps)
  except OSError:  # not Linux
    return 0


@pytest.hookimpl(trylast=True)  # after the module's fixtures are torn down
def pytest_runtest_teardown(item, nextitem):
  if nextitem is not None and (getattr(nextitem, "module", None) is
                               getattr(item, "module", None)):
    return
  if _mappings() > MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()


def pytest_collection_modifyitems(config, items):
  _long_tests_first(items)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
