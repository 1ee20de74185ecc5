"""Shape buckets: round sizes up so compiles stay bounded.

Batch rows and page counts round up to powers of two
(`pallas_kernels.sizes.next_power_of_two`).  Token lengths do too
up to `LINEAR_FROM`, then to multiples of it: a 4160-token prompt pads to
5120, not 8192, while a workload still sees at most max_len / 1024 + 10
length buckets.
"""

from __future__ import annotations

from pallas_kernels.sizes import next_power_of_two, round_up

LINEAR_FROM = 1024


def length_bucket(n: int, minimum: int = 16) -> int:
  """Bucket of a token length: powers of two, then multiples of LINEAR_FROM."""
  if n <= LINEAR_FROM:
    return next_power_of_two(n, minimum)
  return round_up(int(n), LINEAR_FROM)
