"""benchmarks/mgpu_prefill_check.py samples its rows round-robin: every
round takes one sample of each row, in reverse order every other round,
each settled first (SETTLE_S: under the GPU's power cap a row is timed at
its own clock); failed rows pass their note through."""

from __future__ import annotations

import pytest

from benchmarks.mgpu_prefill_check import (SAMPLES, SETTLE_S,
                                           _sample_round_robin, main,
                                           print_table)


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
  rows = _sample_round_robin(timers, windows)
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
  _sample_round_robin(timers, settle_s=1.25)
  assert timers["a"].settled == [1.25] * SAMPLES


def test_a_negative_settle_is_refused(capsys):
  with pytest.raises(SystemExit):
    main(["--settle-s", "-1"])
  assert "--settle-s must be >= 0, got -1.0" in capsys.readouterr().err
