"""The GPU's SM clock and board power while benchmark rows run.

The H200 runs the attention kernels at its power cap, where the clock
depends on the kernel (benchmarks/RESULTS.md, "The power cap and the order
of samples"); a timing table means more with the clock and power each row
ran at.  `ClockLog` polls `nvidia-smi` in the background and gives the
median clock and power over the time windows a row was sampled in.
"""

from __future__ import annotations

import statistics
import subprocess
import threading
import time

QUERY = ("--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits")


class ClockLog:
  """Context manager: polls `command` (nvidia-smi) every `interval_ms` for
  GPU `device`'s SM clock (MHz) and power (W), each reading stamped with
  time.monotonic() on arrival.  Where the command cannot start, the log
  stays empty and `during` returns None."""

  def __init__(self, interval_ms: int = 100, device: int = 0,
               command=("nvidia-smi",)):
    self.args = [*command, *QUERY, f"--loop-ms={interval_ms}", f"--id={device}"]
    self.readings = []  # (monotonic seconds, MHz, W)
    self._process = None
    self._reader = None

  def __enter__(self):
    try:
      self._process = subprocess.Popen(self.args, stdout=subprocess.PIPE,
                                       stderr=subprocess.DEVNULL, text=True)
    except OSError:
      return self
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    return self

  def _read(self):
    for line in self._process.stdout:
      fields = [f.strip() for f in line.split(",")]
      try:
        mhz, watts = float(fields[0]), float(fields[1])
      except (IndexError, ValueError):
        continue  # a header, "[N/A]" or a partial line
      self.readings.append((time.monotonic(), mhz, watts))

  def __exit__(self, *exc):
    if self._process is not None:
      self._process.terminate()
      self._process.wait()
      self._reader.join(timeout=1.0)
    return False

  def during(self, windows):
    """(median MHz, median W) of the readings inside any of `windows`
    ([(start, end)] in time.monotonic() seconds), or None if none."""
    inside = [(mhz, watts) for t, mhz, watts in self.readings
              if any(start <= t <= end for start, end in windows)]
    if not inside:
      return None
    return (statistics.median(m for m, _ in inside),
            statistics.median(w for _, w in inside))
