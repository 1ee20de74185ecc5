"""benchmarks/gpu_clock_log.py on CPU: a stand-in for nvidia-smi prints
readings; the log keeps those inside a row's windows, and stays empty where
the command cannot start."""

from __future__ import annotations

import sys
import time

from benchmarks.gpu_clock_log import QUERY, ClockLog

# Prints "MHz, W" every 10 ms, a header and an "[N/A]" line first; checks
# it was asked for the clock and power.
FAKE_SMI = (
    "import sys, time\n"
    f"assert {QUERY[0]!r} in sys.argv, sys.argv\n"
    "print('clocks.current.sm [MHz], power.draw [W]', flush=True)\n"
    "print('[N/A], [N/A]', flush=True)\n"
    "mhz = 1700\n"
    "while True:\n"
    "  print(f'{mhz}, 690.5', flush=True)\n"
    "  mhz += 1\n"
    "  time.sleep(0.01)\n")


def test_readings_inside_the_windows_give_their_medians():
  with ClockLog(command=(sys.executable, "-c", FAKE_SMI)) as log:
    deadline = time.monotonic() + 10.0  # a slow start on a busy machine
    while len(log.readings) < 20 and time.monotonic() < deadline:
      time.sleep(0.05)
    window = (log.readings[10][0], log.readings[-1][0])
  assert len(log.readings) >= 20
  assert all(w == 690.5 for _, _, w in log.readings)
  mhz, watts = log.during([window])
  inside = [m for t, m, _ in log.readings if window[0] <= t <= window[1]]
  assert watts == 690.5 and min(inside) <= mhz <= max(inside)
  assert min(inside) > log.readings[0][1]  # only the window's readings
  assert log.during([(0.0, 1.0)]) is None


def test_a_missing_command_leaves_the_log_empty():
  with ClockLog(command=("/nonexistent/nvidia-smi",)) as log:
    pass
  assert log.readings == [] and log.during([(0.0, time.monotonic())]) is None
