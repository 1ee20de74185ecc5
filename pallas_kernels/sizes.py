"""Integer size arithmetic shared by the kernels, the model and the engine.

One home for ceiling division, rounding up and power-of-two sizes, so that
a tile, a page count and a shape bucket are all computed the same way.
"""

from __future__ import annotations


def ceil_div(a, b):
  """ceil(a / b) for b > 0: ints, or integer numpy / jnp arrays (exact for
  any sign of a, since it is floor division of -a)."""
  return -(-a // b)


def round_up(x: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= x."""
  return ceil_div(x, multiple) * multiple


def next_power_of_two(n: int, minimum: int = 1) -> int:
  """The smallest power of two >= max(n, minimum, 1)."""
  size = max(int(n), int(minimum), 1)
  return 1 << (size - 1).bit_length()
