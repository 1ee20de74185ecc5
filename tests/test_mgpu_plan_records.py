"""The Mosaic kernels' step records (gpu_prefill_mgpu_plan.step_records)
and the counts they come from (gpu_segment_counts) against a plain loop
over segments and blocks, on random page metadata:
dead pages, partial pages, shifts that change inside a block, rows of
more than one prefix-sum block (gpu_common.prefix_sum)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_common import prefix_sum
from pallas_kernels.gpu_prefill_mgpu_plan import (INT32_MAX, INT32_MIN,
                                                  RecordLayout, max_steps,
                                                  step_records)
from pallas_kernels.gpu_segment_counts import (BLOCKS_IN_ONE_SUM,
                                               segment_counts,
                                               steps_before_pages)

PAGE_SIZE = 4


def segments_by_loop(shift, live):
  """(first, end, shift) of each run of live pages with one shift; a run's
  range reaches the next run's first page (the last one: past the last live
  page), as `prefill_segments` documents."""
  starts = [p for p in range(len(shift)) if live[p] and not (
      p > 0 and live[p - 1] and shift[p - 1] == shift[p])]
  if not starts:
    return []
  last_live = max(p for p in range(len(shift)) if live[p])
  ends = starts[1:] + [last_live + 1]
  return [(s, e, int(shift[s])) for s, e in zip(starts, ends)]


def records_by_loop(table, pos, shift, length, live, *, num_pages, ppb):
  """One batch row: (records [steps, fields], step_first, shifts)."""
  num_logical = len(table)
  layout = RecordLayout(ppb)
  records, step_first = [], []
  segments = segments_by_loop(shift, live)
  for seg, (first, end, _) in enumerate(segments):
    for block in range(first // ppb, -(-end // ppb)):
      rec = np.zeros(layout.width, np.int64)
      lims = []
      for i in range(ppb):
        page = block * ppb + i
        clipped = min(page, num_logical - 1)
        inside = first <= page < end and page < num_logical
        lim = int(length[clipped]) if inside and live[clipped] else 0
        rec[layout.phys + i] = min(max(int(table[clipped]), 0), num_pages - 1)
        rec[layout.pos + i] = pos[clipped]
        rec[layout.lim + i] = lim
        lims.append((lim, int(pos[clipped])))
      rec[layout.seg] = seg
      rec[layout.new_seg] = int(block == first // ppb)
      rec[layout.fixup] = int(any(lim < PAGE_SIZE for lim, _ in lims))
      rec[layout.max_pos] = max((p + lim - 1 for lim, p in lims if lim > 0),
                                default=INT32_MIN)
      records.append(rec)
      step_first.append(max(block * ppb, first))
  return records, step_first, [s for _, _, s in segments]


def random_metadata(rng, batch, num_logical):
  """Documents of 1, 3 or 8 pages (one shift each, sometimes a shift that
  changes inside a document), some pages dead, some partial."""
  doc_pages = int(rng.choice([1, 3, 8]))
  shift = ((np.arange(num_logical) // doc_pages)[None] * 16
           + rng.integers(0, 2, (batch, num_logical)) * 1000
           * (rng.random() < 0.3))
  live = rng.random((batch, num_logical)) < rng.choice([0.0, 0.4, 0.9, 1.0])
  length = rng.integers(1, PAGE_SIZE + 1, (batch, num_logical))
  pos = np.arange(num_logical)[None].repeat(batch, 0) * PAGE_SIZE
  table = rng.permutation(batch * num_logical).reshape(batch, num_logical)
  as_i32 = lambda a: np.ascontiguousarray(a).astype(np.int32)
  return as_i32(table), as_i32(pos), as_i32(shift), as_i32(length), live


# (258, 2): 129 blocks, one past BLOCKS_IN_ONE_SUM: the prefix sums over
# blocks in two levels.
@pytest.mark.parametrize("num_logical,ppb",
                         [(5, 1), (33, 2), (70, 8), (258, 2)])
def test_step_records_match_a_loop(num_logical, ppb):
  batch = 3
  num_pages = batch * num_logical
  plan = jax.jit(functools.partial(
      step_records, num_pages=num_pages, page_size=PAGE_SIZE,
      pages_per_block=ppb))
  if num_logical == 258:
    assert -(-num_logical // ppb) == BLOCKS_IN_ONE_SUM + 1
  rng = np.random.default_rng(num_logical)
  for _ in range(12):
    table, pos, shift, length, live = random_metadata(rng, batch,
                                                      num_logical)
    records, num_steps, step_first, shifts = plan(table, pos, shift, length,
                                                  live)
    records, step_first = np.asarray(records), np.asarray(step_first)
    assert records.shape[1] == max_steps(num_logical, ppb)
    for b in range(batch):
      want, want_first, want_shifts = records_by_loop(
          table[b], pos[b], shift[b], length[b], live[b],
          num_pages=num_pages, ppb=ppb)
      steps = len(want)
      assert int(num_steps[b]) == steps
      if steps:
        np.testing.assert_array_equal(records[b, :steps], np.stack(want))
      assert not records[b, steps:].any(), "records past the row's steps"
      assert step_first[b, :steps].tolist() == want_first
      assert (step_first[b, steps:] == INT32_MAX).all()
      assert np.asarray(shifts)[b, :len(want_shifts)].tolist() == want_shifts


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 576])
def test_prefix_sum_matches_cumsum_across_blocks(length):
  x = np.random.default_rng(length).integers(-40, 50, (3, length))
  got = jax.jit(prefix_sum)(jnp.asarray(x, jnp.int32))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, axis=-1))


@pytest.mark.parametrize("num_logical,ppb", [(5, 1), (33, 2), (70, 8),
                                             (258, 2)])
def test_steps_before_every_page_end_count_the_step_records(num_logical,
                                                            ppb):
  """steps_before_pages (closed form from segment_counts) against counting
  the records' first pages, at every page end 0..M; segment_counts'
  extents and token blocks' ends against NumPy."""
  batch, num_tiles = 3, 4
  rng = np.random.default_rng(num_logical + 7)
  ends = jnp.arange(num_logical + 1, dtype=jnp.int32)

  @jax.jit
  def closed_form(table, pos, shift, length, live, tile_newest):
    counts = segment_counts(pos, shift, live, pages_per_block=ppb,
                            tile_newest=tile_newest)
    every_end = steps_before_pages(
        counts, jnp.broadcast_to(ends, (batch, ends.size)), ppb)
    _, num_steps, step_first, _ = step_records(
        table, pos, shift, length, live, num_pages=batch * num_logical,
        page_size=PAGE_SIZE, pages_per_block=ppb)
    return counts, every_end, num_steps, step_first

  for _ in range(8):
    table, pos, shift, length, live = random_metadata(rng, batch,
                                                      num_logical)
    tile_newest = rng.integers(-3, num_logical * PAGE_SIZE + 3,
                               (batch, num_tiles)).astype(np.int32)
    tile_newest[0, 0] = INT32_MIN  # a token block of padding rows only
    counts, every_end, num_steps, step_first = closed_form(
        table, pos, shift, length, live, tile_newest)
    step_first = np.asarray(step_first)
    for b in range(batch):
      want = [(step_first[b] < e).sum() for e in range(num_logical + 1)]
      assert np.asarray(every_end)[b].tolist() == want
      assert want[-1] == int(num_steps[b])
      live_pages = np.flatnonzero(live[b])
      padded = -(-num_logical // ppb) * ppb
      assert int(counts.first_live[b]) == (live_pages[0] if live_pages.size
                                           else padded)
      assert int(counts.last_live[b]) == (live_pages[-1] if live_pages.size
                                          else -1)
      for t in range(num_tiles):
        seen = np.flatnonzero(live[b] & (pos[b] <= tile_newest[b, t]))
        assert int(counts.tile_ends[b, t]) == (seen[-1] + 1 if seen.size
                                               else 0)
