"""Shape buckets: round sizes up to powers of two so compiles stay bounded."""

from __future__ import annotations


def power_of_two_bucket(n: int, minimum: int = 1, maximum: int | None = None) -> int:
  """Smallest power of two >= max(n, minimum), capped at `maximum`."""
  size = max(int(n), int(minimum), 1)
  bucket = 1 << (size - 1).bit_length()
  if maximum is not None:
    bucket = min(bucket, maximum)
  return bucket


def round_up(n: int, multiple: int) -> int:
  return -(-int(n) // multiple) * multiple
