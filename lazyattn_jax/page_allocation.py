"""Which free pages an allocation takes: first fit of a consecutive run.

The Mosaic GPU kernels copy a KV block (8 pages of 16 at 128-key steps) in
one TMA copy where its page ids are consecutive, and page by page where
they are not (`MgpuBlockSizes.copy_contiguous_blocks`).  So an allocation
takes the lowest run of consecutive free pages long enough for it (first
fit) where there is one, and otherwise the lowest-numbered free pages.  A
document allocated alone (`choose_page_rows`) then lands in one run unless
the pool is too fragmented, rather than filling the holes a finished
request's private pages left (docs/design.md, "The cache").

Both functions are pure jnp on a free mask, jit-compatible, and never fail:
the caller checks that enough pages are free (`cache_state.allocate_pages`,
`cache_state.allocate_document_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def free_run_lengths(free: jax.Array, cap: int) -> jax.Array:
  """int32[num_pages]: how many consecutive free pages start at each page
  (0 where it is taken), counted up to at least `cap`.

  By doubling: with run[i] = min(length at i, k), run[i] + run[i + k] where
  run[i] == k is min(length at i, 2k).  log2(cap) elementwise steps, which
  the host CPU runs faster than a cumulative min over the pool.
  """
  run = free.astype(jnp.int32)
  k = 1
  while k < cap:
    ahead = jnp.concatenate([run[k:], jnp.zeros((k,), jnp.int32)])[
        :run.shape[0]]
    run = run + jnp.where(run == k, ahead, 0)
    k *= 2
  return run


def choose_pages(free: jax.Array, count: jax.Array, max_count: int
                 ) -> jax.Array:
  """int32[max_count]: `count` free page ids, then -1.

  Args:
    free: bool[num_pages], True where a page is free.
    count: int32[] pages wanted (traced), at most the free pages and
      `max_count`.
    max_count: static length of the result.

  The lowest run of `count` consecutive free pages, else the `count`
  lowest-numbered free pages.
  """
  fits = free_run_lengths(free, max_count) >= count
  column = jnp.arange(max_count, dtype=jnp.int32)

  def lowest_free():
    (pages,) = jnp.nonzero(free, size=max_count, fill_value=-1)
    return pages.astype(jnp.int32)

  # The fallback's nonzero is most of the cost: only run it when needed.
  pages = lax.cond(jnp.any(fits),
                   lambda: jnp.argmax(fits).astype(jnp.int32) + column,
                   lowest_free)
  return jnp.where(column < count, pages, -1)


def choose_page_rows(free: jax.Array, counts: jax.Array, max_per_row: int
                     ) -> jax.Array:
  """int32[R, max_per_row]: each row's `counts[r]` pages (`choose_pages`
  in row order, each row's pages taken before the next chooses), -1
  after them.  The counts together must not exceed the free pages."""
  num_pages = free.shape[0]

  def one_row(free, count):
    pages = choose_pages(free, count, max_per_row)
    safe = jnp.where(pages >= 0, pages, num_pages)
    return free.at[safe].set(False, mode="drop"), pages

  _, rows = lax.scan(one_row, free, jnp.asarray(counts, jnp.int32))
  return rows
