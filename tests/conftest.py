import gc
import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests import fast_compile, interpreter_cache  # noqa: E402 - needs the path above

# Before any test starts JAX's backend (it reads XLA_FLAGS once, then).
fast_compile.enable()
# The Pallas interpreters' thread programs compiled once per kernel call.
interpreter_cache.enable()

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
  parser.addoption("--slow", action="store_true",
                   help="also run the tests marked slow (the full suite; "
                        "the default run, which CI runs, skips them)")
  parser.addoption("--engine-impl", default="xla",
                   help="attention impl for the engine tests (xla on CPU CI; "
                        "gpu to rerun them on a GPU with the Pallas kernels)")


@pytest.fixture(scope="session")
def engine_impl(request):
  return request.config.getoption("--engine-impl")


@pytest.fixture
def sample_settles(monkeypatch):
  """The settle_s of every ChainTimer.sample call while the test runs; the
  samples themselves run unsettled (CPU tests need no settling)."""
  from benchmarks.kernel_timing import ChainTimer
  settles, sample = [], ChainTimer.sample

  def recorded(self, settle_s=0.0):
    settles.append(settle_s)
    return sample(self, settle_s=0.0)

  monkeypatch.setattr(ChainTimer, "sample", recorded)
  return settles


# Tests of 15 s or more under `pytest -n 2` on a 2-core machine, with their
# seconds there (--durations, 2026-12-01 23:36 UTC).  The slow tier is left
# out: it does not run by default, and skipped tests are not counted.  A
# module is named whole where its tests share a costly fixture, and a tuple
# of names runs on one worker (both HF parity modules use HF's model, ~30 s
# to load).  Names that no longer match are ignored.
LONG_TESTS = {
    "tests/test_tensor_parallel.py::test_multi_device_checks_pass_on_eight_cpu_devices": 148,
    ("tests/test_hf_lazy_parity.py", "tests/test_hf_parity.py"): 110,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_float8": 51,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret": 45,
    "tests/test_rag_serving.py": 35,
    "tests/test_cli.py::test_rag_labels_what_was_cached_before_the_run": 30,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_float8": 27,
    "tests/test_gpu_decode_blocks.py::test_parity_interpret_documents_across_blocks_llama3": 25,
    "tests/test_gpu_decode_page_fields.py::test_parity_interpret_ragged": 36,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_ragged": 24,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_float8_small_and_mixed_v_scales": 21,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_whole_pages_llama3": 19,
    "tests/test_decode_during_prefill.py::test_riders_give_the_same_tokens_and_decode_during_prefill": 19,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_mha_and_page_offset": 18,
    "tests/test_engine.py::test_compile_count_is_bounded_over_varied_requests": 17,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_segments_of_several_steps": 16,
    "tests/test_engine_faults.py::test_a_fault_in_any_stage_rolls_the_round_back": 16,
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
    skipped = any(mark.name == "skip" for mark in item.iter_markers())
    key = None if skipped else _long_key(item.nodeid)
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
  if not config.getoption("--slow"):
    slow = pytest.mark.skip(reason="slow tier: run with --slow")
    for item in items:
      if "slow" in item.keywords:
        item.add_marker(slow)
  _long_tests_first(items)
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
