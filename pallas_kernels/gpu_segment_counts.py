"""Segment starts counted per KV block, for the Mosaic GPU kernels' step
plans (XLA, metadata only).

A segment is a run of live pages with one shift (`gpu_prefill.prefill_segments`);
the prefill and decode plans split each batch row's pages into steps, one
per segment piece in each KV block of `pages_per_block` pages
(`gpu_prefill_mgpu_plan.step_records`).  Every step's index and every
token block's step count follow, elementwise, from a few counts per row
(`SegmentCounts`), which `segment_counts` makes in one XLA reduction: the
plan's time is launches of small XLA ops, not their work.

Design: docs/kernels.md.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_common as common
from pallas_kernels.sizes import ceil_div

# Past this many KV blocks a row's counts over blocks are prefix sums in
# two levels (gpu_common.prefix_sum) instead of one quadratic reduction.
BLOCKS_IN_ONE_SUM = 128


class SegmentCounts(NamedTuple):
  """Per batch row, what every step of the row derives from (`segment_counts`):
  the segment starts counted before each KV block, the live pages' extent
  and, given token blocks' newest positions, each token block's page end.
  Everything else of the plan is elementwise in these and the pages."""

  rank: jax.Array  # int32 [B, NB, ppb]: starts in the block up to each page
  starts_before: jax.Array  # int32 [B, NB + 1]: starts in blocks < j
  aligned_before: jax.Array  # int32 [B, NB + 1]: blocks < j whose first
  #                            page starts a segment
  first_live: jax.Array  # int32 [B]: first live page (NB * ppb if none)
  last_live: jax.Array  # int32 [B]: last live page (-1 if none)
  tile_ends: jax.Array | None  # int32 [B, TB]: 1 + the last live page a
  #                              token block can see (0 if none)


def by_block(a, pages_per_block, mode="edge"):
  """[B, M] -> [B, NB, ppb]; pages past M repeat the last page ("edge") or
  are 0 / False ("constant")."""
  batch, num_logical = a.shape
  num_blocks = ceil_div(num_logical, pages_per_block)
  pad = num_blocks * pages_per_block - num_logical
  return jnp.pad(a, ((0, 0), (0, pad)), mode=mode).reshape(
      batch, num_blocks, pages_per_block)


def _sum_and_max(x, y):
  return x[0] + y[0], jnp.maximum(x[1], y[1])


def segment_counts(page_pos, page_shift, live, *, pages_per_block,
                   tile_newest=None) -> SegmentCounts:
  """The counts of `SegmentCounts`, in one XLA reduction over KV blocks.

  A segment starts at a live page whose page before is dead or has another
  shift.  Within a block the starts are counted by unrolled adds over its
  `pages_per_block` pages; over blocks, each count is a masked sum and each
  extent a max, all stacked into one variadic reduction (one launch: the
  plan is launch bound, docs/kernels.md).  Past BLOCKS_IN_ONE_SUM blocks
  the quadratic sums give way to `gpu_common.prefix_sum`.
  `tile_newest` (int32 [B, TB], optional): each token block's newest
  q_pos; given, `tile_ends` is computed in the same reduction.
  """
  ppb = pages_per_block
  batch, num_logical = live.shape
  num_blocks = ceil_div(num_logical, ppb)
  prev_live = jnp.pad(live, ((0, 0), (1, 0)))[:, :num_logical]
  prev_shift = jnp.pad(page_shift, ((0, 0), (1, 0)))[:, :num_logical]
  starts = by_block(live & ~(prev_live & (prev_shift == page_shift)), ppb,
                    "constant")
  live_b = by_block(live, ppb, "constant")
  rank = [starts[..., 0].astype(jnp.int32)]
  for i in range(1, ppb):
    rank.append(rank[-1] + starts[..., i])
  starts_in, first_starts = rank[-1], rank[0]  # [B, NB]
  rank = jnp.stack(rank, axis=-1)
  page = jnp.arange(num_blocks * ppb, dtype=jnp.int32).reshape(num_blocks,
                                                                 ppb)
  padded = num_blocks * ppb

  def block_max(select, value):  # over a block's pages: [..., ppb] -> [...]
    return common.fold_last_axis(jnp.maximum, jnp.where(select, value, -1))

  # Maxes over blocks: the last live page, the first (as padded - 1 - page)
  # and each token block's last visible page.
  extents = jnp.stack([block_max(live_b, page),
                       block_max(live_b, padded - 1 - page)], axis=1)
  if tile_newest is not None:
    pos_b = by_block(page_pos, ppb)
    seen = (live_b[:, None] & (pos_b[:, None]
                               <= tile_newest[:, :, None, None]))
    extents = jnp.concatenate([extents, block_max(seen, page)], axis=1)
  # extents: int32 [B, 2 (+ TB), NB]
  if num_blocks <= BLOCKS_IN_ONE_SUM:
    before = (jnp.arange(num_blocks + 1, dtype=jnp.int32)[:, None]
              > jnp.arange(num_blocks, dtype=jnp.int32)[None])  # [NB+1, NB]
    sums = jnp.concatenate(
        [jnp.where(before, starts_in[:, None], 0),
         jnp.where(before, first_starts[:, None], 0),
         jnp.zeros_like(extents)], axis=1)
    maxes = jnp.concatenate(
        [jnp.full((batch, 2 * (num_blocks + 1), num_blocks), -1, jnp.int32),
         extents], axis=1)
    sums, maxes = jax.lax.reduce((sums, maxes), (jnp.int32(0), jnp.int32(-1)),
                                 _sum_and_max, (2,))
    starts_before = sums[:, :num_blocks + 1]
    aligned_before = sums[:, num_blocks + 1:2 * (num_blocks + 1)]
    maxes = maxes[:, 2 * (num_blocks + 1):]
  else:
    exclusive = lambda x: jnp.pad(
        common.prefix_sum(x, block=BLOCKS_IN_ONE_SUM), ((0, 0), (1, 0)))
    starts_before = exclusive(starts_in)
    aligned_before = exclusive(first_starts)
    maxes = jnp.max(extents, axis=-1)
  tile_ends = maxes[:, 2:] + 1 if tile_newest is not None else None
  return SegmentCounts(rank, starts_before, aligned_before,
                       padded - 1 - maxes[:, 1], maxes[:, 0], tile_ends)


def _gather_rows(a, index):
  """a[b, index[b, ...]] for int32 a [B, L] and index [B, ...] in range."""
  return jnp.take_along_axis(a, index.reshape(a.shape[0], -1),
                             axis=1).reshape(index.shape)


def _carried_range(counts: SegmentCounts, block, pages_per_block):
  """(first, last) block whose first page lies after the first live page
  and at or before the last, each [B, 1, ...] to broadcast with `block`."""
  expand = lambda x: x.reshape(x.shape + (1,) * (block.ndim - 1))
  return (expand(counts.first_live // pages_per_block + 1),
          expand(counts.last_live // pages_per_block))


def carried_blocks(counts: SegmentCounts, block, pages_per_block):
  """Whether block `block` (int32 [B, ...]) begins inside a segment that
  started in a block before it (its first step is that segment's piece):
  its first page is at or before the last live page, after the first, and
  does not start a segment itself.  So carried blocks are a range of
  blocks less those whose first page starts a segment."""
  lo, hi = _carried_range(counts, block, pages_per_block)
  num_blocks = counts.rank.shape[1]
  first_starts = _gather_rows(counts.rank[..., 0],
                              jnp.clip(block, 0, num_blocks - 1))
  return (lo <= block) & (block <= hi) & (first_starts == 0)


def carried_through(counts: SegmentCounts, block, pages_per_block):
  """Carried blocks among blocks 0..block (int32 [B, ...], may be -1), in
  closed form from the range of `carried_blocks` and `aligned_before`."""
  lo, hi = _carried_range(counts, block, pages_per_block)
  last = jnp.minimum(block, hi)
  num_blocks = counts.rank.shape[1]
  at = lambda j: _gather_rows(counts.aligned_before,
                              jnp.clip(j, 0, num_blocks))
  in_range = last - lo + 1 - (at(last + 1) - at(lo))
  return jnp.where(last >= lo, in_range, 0)


def steps_before_pages(counts: SegmentCounts, page_end, pages_per_block):
  """int32 [B, ...]: the steps of each row whose first page is before
  `page_end` (int32 [B, ...], 0..NB * ppb): every step of the blocks before
  the end's block, then in that block a carried piece (its first page is
  the block's) and the segments starting before the end."""
  ppb = pages_per_block
  num_blocks = counts.rank.shape[1]
  block, inner = page_end // ppb, page_end % ppb
  inside = jnp.clip(block, 0, num_blocks - 1)
  rank_flat = counts.rank.reshape(counts.rank.shape[0], -1)
  starts_in_block = jnp.where(
      inner > 0, _gather_rows(rank_flat, jnp.clip(
          inside * ppb + inner - 1, 0, num_blocks * ppb - 1)), 0)
  carried = carried_blocks(counts, block, ppb) & (inner > 0)
  return (_gather_rows(counts.starts_before, block) + starts_in_block
          + carried.astype(jnp.int32)
          + carried_through(counts, block - 1, ppb))
