"""benchmarks/mgpu_prefill_check.py samples its rows round-robin: every
round takes one sample of each row, in reverse order every other round,
each settled first (SETTLE_S: under the GPU's power cap a row is timed at
its own clock); failed rows pass their note through."""

from __future__ import annotations

from benchmarks.mgpu_prefill_check import (SAMPLES, SETTLE_S,
                                           _sample_round_robin)


class _FakeTimer:

  def __init__(self, name, log, seconds):
    self.name, self.log, self.seconds = name, log, list(seconds)

  def sample(self, settle_s=0.0):
    self.log.append(self.name)
    self.settled = getattr(self, "settled", []) + [settle_s]
    return self.seconds.pop(0)


def test_rows_are_sampled_round_robin():
  log = []
  timers = {
      "a": _FakeTimer("a", log, [1.0 + i for i in range(SAMPLES)]),
      "broken": "failed: ValueError: too big",
      "b": _FakeTimer("b", log, [2.0] * SAMPLES),
  }
  rows = _sample_round_robin(timers)
  assert log[:6] == ["a", "b", "b", "a", "a", "b"]
  assert SETTLE_S > 0
  assert timers["a"].settled == timers["b"].settled == [SETTLE_S] * SAMPLES
  assert log.count("a") == log.count("b") == SAMPLES
  assert rows == [("a", 1.0 + SAMPLES // 2, ""),
                  ("broken", None, "failed: ValueError: too big"),
                  ("b", 2.0, "")]

