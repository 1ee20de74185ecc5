"""Shape buckets: round sizes up so compiles stay bounded.

Batch rows and page counts round up to powers of two.  Token lengths do too
up to `LINEAR_FROM`, then to multiples of it: a 4160-token prompt pads to
5120, not 8192, while a workload still sees at most max_len / 1024 + 10
length buckets.
"""

from __future__ import annotations

LINEAR_FROM = 1024


def power_of_two_bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
  """Smallest power of two >= max(n, minimum), capped at `maximum`."""
  size = max(int(n), int(minimum), 1)
  bucket = 1 << (size - 1).bit_length()
  if maximum is not None:
    bucket = min(bucket, maximum)
  return bucket


def length_bucket(n: int, minimum: int = 16) -> int:
  """Bucket of a token length: powers of two, then multiples of LINEAR_FROM."""
  if n <= LINEAR_FROM:
    return power_of_two_bucket(n, minimum)
  return -(-int(n) // LINEAR_FROM) * LINEAR_FROM
