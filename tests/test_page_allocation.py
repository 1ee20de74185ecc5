"""lazyattn_jax/page_allocation.py: first fit of a run of consecutive free
pages, against brute force on random free masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.page_allocation import (choose_page_rows, choose_pages,
                                          free_run_lengths)


def _true_runs(free):
  n = len(free)
  return np.array([next((j for j in range(n - i) if not free[i + j]), n - i)
                   for i in range(n)])


def _first_fit(free, count):
  runs = _true_runs(free)
  starts = np.nonzero(runs >= count)[0]
  if len(starts):
    return list(range(starts[0], starts[0] + count))
  return list(np.nonzero(free)[0][:count])


@pytest.mark.parametrize("num_pages", [1, 7, 64, 200])
@pytest.mark.parametrize("cap", [1, 5, 32])
def test_free_run_lengths_match_brute_force_up_to_the_cap(num_pages, cap):
  rng = np.random.default_rng(num_pages * 100 + cap)
  for p_free in (0.2, 0.6, 0.95):
    free = rng.random(num_pages) < p_free
    got = np.asarray(free_run_lengths(jnp.asarray(free), cap))
    true = _true_runs(free)
    np.testing.assert_array_equal(np.minimum(got, cap), np.minimum(true, cap))
    assert np.all(got <= true)


def test_choose_pages_first_fit_then_lowest_free():
  choose = jax.jit(choose_pages, static_argnums=2)
  rng = np.random.default_rng(0)
  for trial in range(40):
    free = rng.random(48) < 0.6
    count = int(rng.integers(0, min(12, free.sum()) + 1))
    pages = np.asarray(choose(jnp.asarray(free), jnp.int32(count), 12))
    assert pages[:count].tolist() == _first_fit(free, count), trial
    assert np.all(pages[count:] == -1)


def test_choose_page_rows_takes_each_row_in_order():
  free = np.zeros(20, bool)
  free[[0, 2, 3, 5, 6, 7, 12, 13, 14, 15, 16]] = True
  rows = np.asarray(choose_page_rows(jnp.asarray(free),
                                     jnp.array([3, 2, 0, 4, 2], jnp.int32), 4))
  # 3 -> 5-7; 2 -> 2-3; 0 -> none; 4 -> 12-15; 2: runs left are 0 and 16,
  # single pages, so the lowest free pages.
  np.testing.assert_array_equal(rows, [
      [5, 6, 7, -1], [2, 3, -1, -1], [-1, -1, -1, -1], [12, 13, 14, 15],
      [0, 16, -1, -1]])
