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
# The Mosaic GPU interpreter runs each warpgroup as its own XLA CPU program,
# whose barrier waits may block threads of XLA's CPU pool (one per core by
# default): on two cores a float8 CTA's third warpgroup then never runs and
# the kernel never finishes.  Read when JAX starts its CPU backend.
os.environ.setdefault("NPROC", "8")

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


# Tests of 20 s or more under `pytest -n 3` on a 2-core machine, with their
# seconds there (--durations, 2026-12-03 23:15 UTC; three of them trimmed
# since).  The slow tier is left out: it does not run by default, and
# skipped tests are not counted.  A module is named whole where its tests
# share a costly fixture, and a tuple of names runs on one worker (both HF
# parity modules use HF's model, ~30 s to load).  A name stands for all its
# parameters.  Names that no longer match are ignored.
LONG_TESTS = {
    "tests/test_tensor_parallel.py::test_multi_device_checks_pass_on_eight_cpu_devices":
        200,
    ("tests/test_hf_lazy_parity.py", "tests/test_hf_parity.py"): 166,
    "tests/test_gpu_kernels.py::test_parity_interpret": 71,
    "tests/test_tpu_kernels.py::test_tpu_kernel_parity_interpret": 67,
    "tests/test_cli.py::test_rag_labels_what_was_cached_before_the_run": 54,
    "tests/test_fp8_kernels.py::test_float8_pages_match_reference_and_unquantized_truth":
        46,
    "tests/test_rag_serving.py": 44,
    "tests/test_lazy_attention.py::test_reference_and_xla_match_float64_truth":
        44,
    "tests/test_prefill_query_rope_in_kernel.py::test_parity_interpret": 43,
    "tests/test_cli.py::test_bad_input_exits_2_with_one_line": 41,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_contiguous_pages":
        35,
    "tests/test_quality_kernels.py::test_kernels_on_the_recompute_layout": 32,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_float8": 27,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_contiguous_pages":
        27,
    "tests/test_cache_properties.py::TestCacheProperties::runTest": 26,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_whole_pages_llama3":
        26,
    "tests/test_cli.py::test_bad_model_or_option_exits_2_with_one_line": 25,
    "tests/test_arch_parity.py::test_lazy_request_matches_hf_greedy_tokens":
        25,
    "tests/test_engine_faults.py::test_a_fault_in_any_stage_rolls_the_round_back":
        25,
    "tests/test_prefill_query_rope_in_kernel.py::test_plan_holds_the_table_only_where_the_kernel_rotates":
        23,
    "tests/test_gpu_prefill_mgpu.py::test_parity_interpret_segments_of_several_steps":
        23,
    "tests/test_qwen_tokenizer.py::test_engine_wraps_a_string_query_in_chatml":
        23,
    "tests/test_server_cli.py::test_serve_answers_over_http_and_stops_on_sigterm":
        22,
    "tests/test_engine_quality.py::test_engine_equals_the_dense_layout": 21,
    "tests/test_fp8_engine.py::test_float8_pool_serves_every_mode_close_to_float32":
        20,
    "tests/test_gpu_decode_mgpu.py::test_parity_interpret_float8_small_and_mixed_v_scales":
        20,
}


def _long_key(nodeid: str):
  for key in LONG_TESTS:
    for name in key if isinstance(key, tuple) else (key,):
      if nodeid == name or nodeid.startswith((name + "::", name + "[")):
        return key
  return None


def _xdist_workers() -> int:
  """The run's xdist workers (1 without xdist): set in each worker."""
  return max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def _long_tests_first(items, workers: int):
  """Reorders `items` so that each of the xdist workers starts on its share
  of the long tests (longest first, shared greedily) and then has its part
  of the rest.

  --dist worksteal hands the workers consecutive, equal slices of the list
  (each the remaining tests over the remaining workers), then moves tests
  from the end of one's queue to another when it runs dry.  Long tests at
  the start of each slice run early, and the last tests of every worker
  are short ones.  Each worker also keeps its part of the in-process
  tests: one process compiling nearly all of the suite's programs runs out
  of memory mappings (65530 by default; each program maps a few) and
  crashes inside XLA.
  """
  groups = {key: [] for key in LONG_TESTS}
  rest = []
  for item in items:
    skipped = any(mark.name == "skip" for mark in item.iter_markers())
    key = None if skipped else _long_key(item.nodeid)
    (groups[key] if key else rest).append(item)
  shares = [[] for _ in range(workers)]
  seconds = [0] * workers
  for key in sorted(LONG_TESTS, key=LONG_TESTS.get, reverse=True):
    lighter = seconds.index(min(seconds))
    shares[lighter].extend(groups[key])
    seconds[lighter] += LONG_TESTS[key] if groups[key] else 0
  ordered = []
  for worker, share in enumerate(shares):
    # The slice worksteal will hand this worker, as it computes it.
    size = (len(items) - len(ordered)) // (workers - worker)
    take = max(0, size - len(share))
    ordered += share + rest[:take]
    rest = rest[take:]
  items[:] = ordered + rest


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
  _long_tests_first(items, _xdist_workers())
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
