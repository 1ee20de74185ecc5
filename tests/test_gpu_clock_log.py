"""benchmarks/gpu_clock_log.py on CPU: a stand-in for nvidia-smi prints
readings; the log keeps those inside a row's windows, and stays empty where
the command cannot start."""

from __future__ import annotations

import sys
import time

import pytest

from benchmarks.gpu_clock_log import QUERY, ClockLog


def fake_smi(lag_s=0.0, stamp=True):
  """A stand-in nvidia-smi: a header and an "[N/A]" line, then "timestamp,
  MHz, W" every 10 ms, each stamped `lag_s` before it is printed (or with
  an unparsable stamp); it checks it was asked for the clock and power."""
  return (
      "import sys, time\n"
      f"assert {QUERY[0]!r} in sys.argv, sys.argv\n"
      "print('timestamp, clocks.current.sm [MHz], power.draw [W]', "
      "flush=True)\n"
      "print('[N/A], [N/A], [N/A]', flush=True)\n"
      "mhz = 1700\n"
      "while True:\n"
      f"  t = time.time() - {lag_s}\n"
      "  ms = int(t * 1000) % 1000\n"
      + ("  stamp = time.strftime('%Y/%m/%d %H:%M:%S', time.localtime(t)) "
         "+ f'.{ms:03d}'\n" if stamp else "  stamp = '[N/A]'\n") +
      "  print(f'{stamp}, {mhz}, 690.5', flush=True)\n"
      "  mhz += 1\n"
      "  time.sleep(0.01)\n")


def wait_for_readings(log, count):
  deadline = time.monotonic() + 10.0  # a slow start on a busy machine
  while len(log.readings) < count and time.monotonic() < deadline:
    time.sleep(0.005)
  return time.monotonic()


def test_readings_inside_the_windows_give_their_medians():
  with ClockLog(command=(sys.executable, "-c", fake_smi())) as log:
    wait_for_readings(log, 20)
    window = (log.readings[10][0], log.readings[-1][0])
  assert len(log.readings) >= 20
  assert all(w == 690.5 for _, _, w in log.readings)
  mhz, watts = log.during([window])
  inside = [m for t, m, _ in log.readings if window[0] <= t <= window[1]]
  assert watts == 690.5 and min(inside) <= mhz <= max(inside)
  assert min(inside) > log.readings[0][1]  # only the window's readings
  assert log.during([(0.0, 1.0)]) is None


@pytest.mark.parametrize("stamp", [True, False], ids=["stamped", "unstamped"])
def test_readings_sit_at_their_stamps_not_their_arrival(stamp):
  # Stamped a second before they are printed: placed a second back.
  with ClockLog(command=(sys.executable, "-c",
                         fake_smi(lag_s=1.0, stamp=stamp))) as log:
    wait_for_readings(log, 5)
    count = len(log.readings)
    seen = wait_for_readings(log, count + 1)
    newest = log.readings[count][0]
  assert len(log.readings) > count
  if stamp:
    assert newest < seen - 0.9
  else:  # at arrival, just before it was seen
    assert seen - 0.9 < newest <= seen


def test_a_missing_command_leaves_the_log_empty():
  with ClockLog(command=("/nonexistent/nvidia-smi",)) as log:
    pass
  assert log.readings == [] and log.during([(0.0, time.monotonic())]) is None
