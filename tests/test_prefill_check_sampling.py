"""benchmarks/mgpu_prefill_check.py samples its rows round-robin: every
round takes one sample of each row, in reverse order every other round,
each settled first (SETTLE_S: under the GPU's power cap a row is timed at
its own clock); failed rows pass their note through; over several tables
each row's ratio to cuDNN is taken against its own table's cuDNN row."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.kernel_timing import SETTLE_S, perturb_dependent_ops
from benchmarks.mgpu_prefill_check import main, row_selected
from benchmarks.prefill_check_tables import (SAMPLES, print_table,
                                             print_tables_summary,
                                             sample_round_robin,
                                             table_ratios)


class _FakeTimer:

  def __init__(self, name, log, seconds):
    self.name, self.log, self.seconds = name, log, list(seconds)

  def sample(self, settle_s=0.0):
    self.log.append(self.name)
    self.settled = getattr(self, "settled", []) + [settle_s]
    self.timed_window = (len(self.log), len(self.log) + 0.5)
    return self.seconds.pop(0)


def test_rows_are_sampled_round_robin():
  log = []
  timers = {
      "a": _FakeTimer("a", log, [1.0 + i for i in range(SAMPLES)]),
      "broken": "failed: ValueError: too big",
      "b": _FakeTimer("b", log, [2.0] * SAMPLES),
  }
  windows = {}
  rows = sample_round_robin(timers, windows)
  assert log[:6] == ["a", "b", "b", "a", "a", "b"]
  assert SETTLE_S > 0
  assert timers["a"].settled == timers["b"].settled == [SETTLE_S] * SAMPLES
  assert log.count("a") == log.count("b") == SAMPLES
  # Each row's timed windows, one a sample, in its order (for the clock).
  assert windows["a"][:3] == [(1, 1.5), (4, 4.5), (5, 5.5)]
  assert len(windows["b"]) == SAMPLES and "broken" not in windows
  assert rows == [("a", 1.0 + SAMPLES // 2, ""),
                  ("broken", None, "failed: ValueError: too big"),
                  ("b", 2.0, "")]


def test_the_table_prints_the_ratio_to_three_decimals(capsys):
  """0.896x must not print as 0.90 beside a 0.9 bar."""
  print_table([("chunk512", "cudnn", 1.0, 1.0, "1620 MHz, 690 W"),
               ("chunk512", "mgpu[x]", 1.0 / 0.896, 1.0, "1760 MHz, 689 W")])
  out = capsys.readouterr().out
  assert " 0.896  1760 MHz, 689 W" in out and "0.90 " not in out


def test_a_given_settle_reaches_every_sample():
  log = []
  timers = {"a": _FakeTimer("a", log, [1.0] * SAMPLES)}
  sample_round_robin(timers, settle_s=1.25)
  assert timers["a"].settled == [1.25] * SAMPLES


def test_a_negative_settle_is_refused(capsys):
  with pytest.raises(SystemExit):
    main(["--settle-s", "-1"])
  assert "--settle-s must be >= 0, got -1.0" in capsys.readouterr().err


def test_a_table_count_below_one_is_refused(capsys):
  with pytest.raises(SystemExit):
    main(["--tables", "0"])
  assert "--tables must be >= 1, got 0" in capsys.readouterr().err


def _table(cudnn_s, lazy_s):
  rows = [("chunk512", "cudnn", cudnn_s, 1.0, ""),
          ("chunk512", "mgpu[x]", lazy_s, 1.0, "")]
  return rows


def test_each_tables_ratio_is_against_its_own_cudnn_row():
  ratios = table_ratios(_table(0.5, 0.55) + [
      ("chunk512", "broken", None, 1.0, "failed: E"),
      ("chunk128", "mgpu[x]", 0.3, 1.0, "")])  # no cuDNN row there
  assert ratios == {("chunk512", "cudnn"): 1.0,
                    ("chunk512", "mgpu[x]"): pytest.approx(0.5 / 0.55)}


def test_the_summary_prints_median_low_high_and_every_table(capsys):
  # Ratios 0.833, 0.947 and 0.952 in that order: median 0.947, where the
  # ratio of the median seconds (1.0 / 1.2) would read 0.833.
  per_table = [_table(1.0, 1.2), _table(0.9, 0.95), _table(2.0, 2.1)]
  print_tables_summary(per_table)
  line = [l for l in capsys.readouterr().out.splitlines()
          if "mgpu[x]" in l][0]
  assert line.split()[2:] == ["0.947", "0.833", "0.952", "0.833", "0.947",
                              "0.952"]


def test_the_summary_counts_a_row_that_failed_in_some_tables(capsys):
  failed = [("chunk512", "cudnn", 1.0, 1.0, ""),
            ("chunk512", "mgpu[x]", None, 1.0, "failed: E")]
  print_tables_summary([_table(0.9, 1.0), failed])
  line = [l for l in capsys.readouterr().out.splitlines()
          if "mgpu[x]" in l][0]
  assert line.endswith("0.900 (1 failed)")


@pytest.mark.parametrize("name,picked", [
    ("mgpu[k128w2s2-qreg-csrec-sched]", True),
    ("jax-mgpu[q64k128s2]", False),  # "mgpu[" begins no word of it
    ("mgpu per-layer (plan once)", True),
    ("kernel[k128w2s2-qreg-csrec-sched]", True),
    ("kernel bare[k128w2s2-qreg-csrec-sched]", False),
    ("kernel+3 ops[k128w2s2-qreg-csrec-sched]", False),
    ("cudnn", False),
])
def test_rows_are_picked_by_the_start_of_a_word(name, picked):
  assert row_selected(name, ["mgpu[", "per-layer", "kernel["]) is picked


@pytest.mark.parametrize("count", [1, 3])
def test_dependent_ops_leave_the_plan_and_launch_apart(count):
  """The kernel+N ops rows' perturbation: the step counts come out as they
  went in (the run-time zero adds nothing), through `count` reductions that
  XLA keeps apart (one launch each before the kernel)."""
  n_steps = jnp.asarray(np.arange(8, dtype=np.int32).reshape(2, 4))
  records = jnp.ones((2, 3, 5), jnp.int32)

  def plan_after(zero, n_steps, records):
    args = ("q", "k", "v", (n_steps, records))
    return perturb_dependent_ops(count)(args, zero)[3]

  out = jax.jit(plan_after)(jnp.float32(0), n_steps, records)
  np.testing.assert_array_equal(out[0], n_steps)
  np.testing.assert_array_equal(out[1], records)
  hlo = jax.jit(plan_after).lower(jnp.float32(0), n_steps,
                                  records).compile().as_text()
  entry = hlo[hlo.index("ENTRY"):]
  assert entry.count(" fusion(") == count + 1  # the reductions, the last add


def test_the_split_cudnn_rows_keys_are_the_context_and_the_chunk():
  # "cudnn-split" times cuDNN on the chunk's own problem: the context's
  # keys unmasked and the chunk's own keys causal.
  from benchmarks.mgpu_prefill_cases import build_inputs
  from benchmarks.mgpu_prefill_check import dense_split
  from benchmarks.kernel_cases import dense_from_pages
  context, q_len = 64, 32
  inputs = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0),
                        batch=2, q_len=q_len, context=context)
  table, pos = inputs[3], np.asarray(inputs[4])
  k_ctx, v_ctx, k_chunk, v_chunk = dense_split(inputs[8], inputs[9], context)
  chunk_pages = pos[0] >= context
  assert chunk_pages.sum() * 16 == q_len and not chunk_pages[:-2].any()
  np.testing.assert_array_equal(
      k_chunk, dense_from_pages(inputs[1], table[:, chunk_pages]))
  np.testing.assert_array_equal(
      v_ctx, dense_from_pages(inputs[2], table[:, ~chunk_pages]))
  assert k_ctx.shape[1] == context and v_chunk.shape[1] == q_len
