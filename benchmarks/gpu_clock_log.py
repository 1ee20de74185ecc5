"""The GPU's SM clock and board power while benchmark rows run.

The H200 runs the attention kernels at its power cap, where the clock
depends on the kernel (benchmarks/RESULTS.md, "The power cap and the order
of samples"); a timing table means more with the clock and power each row
ran at.  `ClockLog` polls `nvidia-smi` in the background and gives the
median clock and power over the time windows a row was sampled in.
Each reading is placed at nvidia-smi's own timestamp for it, not at its
arrival: a query can take tens of milliseconds and a stalled poll delivers
late, which would put a reading taken between rows inside the next row's
window.  The clock is the current one; `power.draw` on the H200's driver
trails load by most of a second (it ramped over 0.6-1 s after a load
began, benchmarks/RESULTS.md), so a row's power mostly shows its settling
and the rows before it.
"""

from __future__ import annotations

import datetime
import statistics
import subprocess
import threading
import time

QUERY = ("--query-gpu=timestamp,clocks.sm,power.draw",
         "--format=csv,noheader,nounits")
TIMESTAMP_FORMAT = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's, local time


class ClockLog:
  """Context manager: polls `command` (nvidia-smi) every `interval_ms` for
  GPU `device`'s SM clock (MHz) and power (W), each reading placed on the
  time.monotonic() clock at the time nvidia-smi stamped it (at its arrival
  where the stamp does not parse).  Where the command cannot start, the
  log stays empty and `during` returns None."""

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
      arrival = time.monotonic()
      fields = [f.strip() for f in line.split(",")]
      try:
        mhz, watts = float(fields[1]), float(fields[2])
      except (IndexError, ValueError):
        continue  # a header, "[N/A]" or a partial line
      self.readings.append((_monotonic_at(fields[0], arrival), mhz, watts))

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


def _monotonic_at(stamp: str, arrival: float) -> float:
  """nvidia-smi's wall-clock `stamp` on the time.monotonic() clock (via the
  offset between the two clocks now), or `arrival` if it does not parse or
  lies after the arrival (a wall clock stepped back)."""
  try:
    wall = datetime.datetime.strptime(stamp, TIMESTAMP_FORMAT).timestamp()
  except ValueError:
    return arrival
  at = wall + (time.monotonic() - time.time())
  return at if at <= arrival else arrival
