"""Per-batch plan of the Mosaic GPU prefill kernel (XLA, metadata only).

Each batch row's work is flattened into *steps*: one step is one KV block of
`block_kv / page_size` logical pages of one segment (a run of live pages with
one shift, `gpu_prefill.prefill_segments`).  A step's int32 record
(`RecordLayout`) holds the pages' physical ids, positions and valid-slot
counts (0 for a page outside the segment, dead, or past M), the segment
index, a new-segment flag, a fix-up flag (some page not fully valid) and the
newest valid key position.  Per CTA the plan counts the steps that hold a
page its rows can see (steps are in page order, so that is a prefix), and
each record ends with its segment's cos/sin (with
MgpuBlockSizes(cos_sin_in_records=False) the plan holds them per segment
beside the records instead); where the kernel rotates the query itself
(MgpuBlockSizes.rotates_query_in_kernel, the 16-bit default) the plan also
holds each query row's cos / sin, from which the kernel rotates the raw
query.  The plan depends only on the page metadata and q_pos: a model makes
it once per forward pass and every layer reuses it.  Every step's index and
count is elementwise in a few per-row counts of segment starts that one XLA
reduction makes (`gpu_segment_counts`).

Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import WG_ROWS, MgpuBlockSizes
from pallas_kernels import gpu_segment_counts
from pallas_kernels.gpu_segment_counts import (SegmentCounts,
                                               carried_blocks,
                                               carried_through,
                                               segment_counts,
                                               steps_before_pages)
from pallas_kernels.rope import RopeConfig, cos_sin_from_chunks
from pallas_kernels.sizes import ceil_div, round_up

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class PageFieldOffsets:
  """Offsets of the per-page fields that lead every int32 step record:
  the step's pages' physical ids, positions and valid slots."""

  pages_per_block: int

  @property
  def phys(self):
    return 0

  @property
  def pos(self):
    return self.pages_per_block

  @property
  def lim(self):
    return 2 * self.pages_per_block


@dataclasses.dataclass(frozen=True)
class RecordLayout(PageFieldOffsets):
  """Field offsets of one int32 step record; with `cos_sin_dim` = H, the
  record ends with its segment's cos and sin (f32 [2, H/2], as int32
  bits; MgpuBlockSizes.cos_sin_in_records)."""

  cos_sin_dim: int = 0

  @property
  def seg(self):
    return 3 * self.pages_per_block

  @property
  def new_seg(self):
    return self.seg + 1

  @property
  def fixup(self):
    return self.seg + 2

  @property
  def max_pos(self):
    return self.seg + 3

  @property
  def cos_sin(self):
    # 128-byte aligned; the fields before it are padded to there.
    return round_up(self.seg + 4, 32)

  @property
  def width(self):
    # A multiple of 32 int32 (128 bytes): the TMA copy's byte count must
    # split evenly over the 128 threads that arrive on the barrier.
    return self.cos_sin + round_up(self.cos_sin_dim, 32)

  def segment(self, rec_ref, batch, row):
    """The row of step `row`'s cos / sin: its segment's index."""
    return rec_ref[batch, row, self.seg]


def step_flags(lim, pos, page_size: int):
  """A step record's fix-up flag (a page of the step not fully valid) and
  newest valid key position (INT32_MIN if none), from its pages' valid
  slots and positions ([..., ppb] each)."""
  fixup = common.fold_last_axis(jnp.logical_or, lim < page_size)
  max_pos = common.fold_last_axis(
      jnp.maximum, jnp.where(lim > 0, pos + lim - 1, INT32_MIN))
  return fixup, max_pos


def max_steps(num_logical_pages: int, pages_per_block: int) -> int:
  """Static bound on the steps of one batch row.

  Steps = sum over segments of the blocks its page range touches <= the
  number of blocks + (segments - 1) <= cdiv(M, ppb) + M - 1.
  """
  return ceil_div(num_logical_pages, pages_per_block) + num_logical_pages


def step_records(page_table, page_pos, page_shift, page_len, live, *,
                 num_pages, page_size, pages_per_block, cos_sin_of=None,
                 counts: SegmentCounts | None = None):
  """Flattens each batch row's work into KV steps (see the module docstring).

  `cos_sin_of` (optional): int32 shifts [...] -> f32 cos / sin [..., 2,
  H/2] (`segment_cos_sin`); given, each record ends with its segment's
  cos and sin as int32 bits (RecordLayout(ppb, cos_sin_dim=H);
  MgpuBlockSizes.cos_sin_in_records), computed per step, so they join the
  records' one scatter.  `counts`: `segment_counts` of the same pages, if
  the caller made them (`plan_prefill`, with its token blocks' ends).

  Returns:
    records: int32 [B, S_max, RecordLayout.width];
    num_steps: int32 [B];
    step_first_page: int32 [B, S_max], first page of each step that belongs
      to its segment (INT32_MAX past the row's steps), nondecreasing;
    shift: int32 [B, M], shift of segment j (entries past the count are 0).

  Built block by block: a block of `pages_per_block` logical pages holds
  one step per segment piece in it (a segment carried over from the block
  before, then one per segment starting in the block), and a step's index
  is the steps of the blocks before it plus its piece's index.  Steps in
  block order are steps in segment order, since segments are runs of
  pages.  Past `segment_counts`' one reduction every array is [B, NB, ppb]
  or [B, NB, ppb, ppb] elementwise work, gathers of the counts and one
  scatter (docs/kernels.md).
  """
  batch, num_logical = page_table.shape
  ppb = pages_per_block
  num_blocks = ceil_div(num_logical, ppb)
  s_max = max_steps(num_logical, ppb)
  if counts is None:
    counts = segment_counts(page_pos, page_shift, live, pages_per_block=ppb)
  by_block = functools.partial(gpu_segment_counts.by_block,
                               pages_per_block=ppb)
  live_b = by_block(live, mode="constant")
  shift_b = by_block(page_shift)
  blocks = jnp.broadcast_to(jnp.arange(num_blocks, dtype=jnp.int32),
                            (batch, num_blocks))
  carried = carried_blocks(counts, blocks, ppb).astype(jnp.int32)  # [B, NB]
  rank = counts.rank
  starts_in = rank[..., -1]
  starts_before = counts.starts_before[:, :num_blocks]
  count = starts_in + carried
  steps_through = (counts.starts_before[:, 1:]
                   + carried_through(counts, blocks, ppb))
  step_base = steps_through - count
  num_steps = steps_through[:, -1]
  block_first = jnp.arange(num_blocks, dtype=jnp.int32) * ppb
  # Piece j of a block: its pages with piece == j (-1: before any segment).
  piece = rank + carried[..., None] - 1  # [B, NB, ppb]
  j = jnp.arange(ppb, dtype=jnp.int32)
  in_piece = piece[:, :, None, :] == j[None, None, :, None]  # [B,NB,j,i]
  valid = j[None, None, :] < count[..., None]  # [B, NB, j]
  expand = lambda a: jnp.broadcast_to(a[:, :, None, :],
                                      (batch, num_blocks, ppb, ppb))
  lim = jnp.where(in_piece & expand(live_b), expand(by_block(page_len)), 0)
  pos = expand(by_block(page_pos))
  phys = expand(jnp.clip(by_block(page_table), 0, num_pages - 1))
  seg = starts_before[..., None] - carried[..., None] + j
  new_seg = (j > 0) | (carried[..., None] == 0)
  fixup, max_pos = step_flags(lim, pos, page_size)
  slot = j  # a page's index in its block, on the last axis of in_piece
  first_in_piece = common.fold_last_axis(
      jnp.minimum, jnp.where(in_piece, slot[None, None, None, :], ppb))
  step_first = block_first[None, :, None] + first_in_piece
  i32 = lambda x: x.astype(jnp.int32)
  fields = [phys, pos, lim, i32(seg)[..., None], i32(new_seg)[..., None],
            i32(fixup)[..., None], max_pos[..., None]]
  layout = RecordLayout(ppb)
  if cos_sin_of is not None:
    # A step's segment shift: that of its piece's live pages (all one
    # segment's); a piece with none is never a new segment, so never
    # rotates, and takes shift 0.
    piece_shift = common.fold_last_axis(
        jnp.maximum,
        jnp.where(in_piece & expand(live_b), expand(shift_b), INT32_MIN))
    cos_sin = cos_sin_of(jnp.where(piece_shift == INT32_MIN, 0, piece_shift))
    bits = jax.lax.bitcast_convert_type(cos_sin, jnp.int32)
    layout = RecordLayout(ppb, cos_sin_dim=2 * cos_sin.shape[-1])
    fields = [*fields, jnp.zeros((batch, num_blocks, ppb, layout.cos_sin
                                  - layout.seg - 4), jnp.int32),
              bits.reshape(batch, num_blocks, ppb, layout.cos_sin_dim)]
  candidates = jnp.concatenate(fields, axis=-1)  # [B, NB, j, fields]
  candidates = jnp.pad(candidates, ((0, 0), (0, 0), (0, 0),
                                    (0, layout.width - candidates.shape[-1])))
  target = jnp.where(valid, step_base[..., None] + j, s_max)
  target = target.reshape(batch, num_blocks * ppb)
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  records = jnp.zeros((batch, s_max, layout.width), jnp.int32).at[
      rows, target].set(candidates.reshape(batch, -1, layout.width),
                        mode="drop")
  step_first = jnp.full((batch, s_max), INT32_MAX, jnp.int32).at[
      rows, target].set(step_first.reshape(batch, -1), mode="drop")
  # Segment j's shift, scattered from its first page.
  start_b = (rank - jnp.pad(rank, ((0, 0), (0, 0), (1, 0)))[..., :ppb]) > 0
  seg_of_start = (starts_before[..., None] + rank - 1).reshape(batch, -1)
  dest = jnp.where(start_b.reshape(batch, -1), seg_of_start, num_logical)
  shift = jnp.zeros((batch, num_logical), jnp.int32).at[rows, dest].set(
      shift_b.reshape(batch, -1), mode="drop")
  return records, num_steps.astype(jnp.int32), step_first, shift


def segment_cos_sin(shift, rope: RopeConfig, head_dim: int):
  """f32 [..., 2, H/2]: cos and sin of each shift [...] (exact); of each
  segment's shift [B, M] in the plans."""
  half = head_dim // 2
  chunks = jnp.asarray(rope.turn_chunks(head_dim)[:, :half])
  cos, sin = cos_sin_from_chunks(shift[..., None], chunks)
  return jnp.stack([cos, sin], axis=-2)


class PrefillPlan(NamedTuple):
  """Per-batch metadata of the kernel (XLA), the same for every layer.

  Computed by `plan_prefill` from the page metadata and q_pos only, so a
  model can compute it once per forward pass and hand it to every layer's
  `lazy_prefill_mgpu_planned` (as FlashInfer's plan/run split does); layers
  that sit at different offsets of one page array pass `page_offset`.
  """

  n_steps: jax.Array  # int32 [B, tiles]: steps each CTA runs
  min_row: jax.Array  # int32 [B, T_pad / 64]: oldest q_pos of a token block
  records: jax.Array  # int32 [B, steps, width]: step records
  cos_sin: jax.Array  # f32 [B, M, 2, H / 2]: per-segment cos / sin; with
  #                     cos_sin_in_records (in the records) [B, M, 2, 0]
  row_pos: jax.Array  # int32 [B, T_pad]: q_pos, PADDING_ROW for padding
  # int16 [B, T_pad, H]: each row's cos | sin of R(q_pos) in Q15, zero on
  # padding rows (MgpuBlockSizes.rotates_query_in_kernel), else [B, T_pad, 0]
  query_cos_sin: jax.Array


# The query table's cos / sin are int16 multiples of 1 / Q15_ONE.
Q15_ONE = 32767


def query_cos_sin_table(row_pos, rope: RopeConfig, head_dim: int):
  """int16 [B, T_pad, H]: each row's cos | sin of R(q_pos) in Q15 (error
  under 2e-5, far below the 16-bit query's rounding), zero on padding rows
  (row_pos < 0), so those rows rotate to zero: the table from which the
  kernel rotates the raw query (MgpuBlockSizes.rotates_query_in_kernel)."""
  cos_sin = segment_cos_sin(jnp.maximum(row_pos, 0), rope, head_dim)
  q15 = jnp.round(cos_sin * jnp.float32(Q15_ONE)).astype(jnp.int16)
  q15 = jnp.where((row_pos >= 0)[..., None, None], q15, jnp.int16(0))
  return q15.reshape(*row_pos.shape, head_dim)


def check_plan_fits(plan: PrefillPlan, layout: RecordLayout,
                    block_sizes: MgpuBlockSizes, *, t_pad: int, group: int,
                    head_dim: int) -> int:
  """The plan's CTA tiles; raises ValueError, naming the mismatch, unless
  `plan` was made for these block sizes (`layout`: their step records), a
  query padded to `t_pad` tokens, `group` query heads per kv head and head
  dim `head_dim`."""
  if plan.records.shape[-1] != layout.width:
    raise ValueError(
        f"plan records are {plan.records.shape[-1]} wide; these block sizes "
        f"need {layout.width} (cos_sin_in_records="
        f"{block_sizes.cos_sin_in_records}): make the plan with the kernel's "
        "block sizes")
  num_tiles, nwg = plan.n_steps.shape[1], block_sizes.num_compute_wgs
  if num_tiles * nwg != t_pad // WG_ROWS * group:
    raise ValueError(f"plan has {num_tiles} tiles; q_rot with T_pad {t_pad} "
                     f"and group {group} needs {t_pad // WG_ROWS * group} "
                     f"units over {nwg} warpgroups")
  if (block_sizes.rotates_query_in_kernel
      and plan.query_cos_sin.shape[-1] != head_dim):
    raise ValueError(
        "the kernel rotates the query from the plan's table of its cos / "
        f"sin, which is [..., {plan.query_cos_sin.shape[-1]}], not [..., "
        f"{head_dim}]: make the plan with the kernel's block sizes")
  return num_tiles


def padded_query_len(q_len: int, group: int, num_compute_wgs: int) -> int:
  """Tokens the kernel works on: whole 64-token blocks, and as many blocks
  that the (block, query head) units split evenly over the CTAs."""
  blocks = ceil_div(q_len, WG_ROWS)
  while (blocks * group) % num_compute_wgs:
    blocks += 1
  return blocks * WG_ROWS


def plan_prefill(page_table, page_pos, page_shift, page_len, q_pos, *, rope,
                 group, head_dim, num_pages, page_size,
                 block_sizes: MgpuBlockSizes | None = None) -> PrefillPlan:
  """The layer-independent XLA work before the kernel (see PrefillPlan).

  `num_pages` is the number of pages one layer's page ids index (the plan's
  physical ids are clipped to it; `page_offset` is added in the kernel).
  """
  block_sizes = block_sizes or MgpuBlockSizes()
  batch, q_len = q_pos.shape
  nwg = block_sizes.num_compute_wgs
  ppb = block_sizes.block_kv // page_size
  t_pad = padded_query_len(q_len, group, nwg)
  row_pos = jnp.where(q_pos >= 0, q_pos, common.PADDING_ROW)
  row_pos = jnp.pad(row_pos, ((0, 0), (0, t_pad - q_len)),
                    constant_values=common.PADDING_ROW)
  # Each 64-token block's newest and oldest q_pos, in one reduction.
  by_rows = row_pos.reshape(batch, t_pad // WG_ROWS, WG_ROWS)
  tile_newest, min_row = jax.lax.reduce(
      (by_rows, by_rows), (jnp.int32(INT32_MIN), jnp.int32(INT32_MAX)),
      lambda x, y: (jnp.maximum(x[0], y[0]), jnp.minimum(x[1], y[1])), (2,))
  if tile_newest.shape[1] <= 16:  # unrolled: fuses into its users
    newest = common.fold_last_axis(jnp.maximum, tile_newest)
  else:
    newest = jnp.max(tile_newest, axis=1)
  live = ((page_len > 0) & (page_pos <= newest[:, None])
          & (newest[:, None] >= 0))
  counts = segment_counts(page_pos, page_shift, live, pages_per_block=ppb,
                          tile_newest=tile_newest)
  in_records = block_sizes.cos_sin_in_records
  cos_sin_of = functools.partial(segment_cos_sin, rope=rope,
                                 head_dim=head_dim)
  records, num_steps, _, shift = step_records(
      page_table, page_pos, page_shift, page_len, live, num_pages=num_pages,
      page_size=page_size, pages_per_block=ppb,
      cos_sin_of=cos_sin_of if in_records else None, counts=counts)
  # Steps are in page order: a token block's steps are those starting before
  # the last page it can see.
  block_steps = jnp.minimum(steps_before_pages(counts, counts.tile_ends, ppb),
                            num_steps[:, None])  # [B, TB]
  # A CTA runs the steps of the newest token block among its units.
  num_tiles = t_pad // WG_ROWS * group // nwg
  unit_block = (np.arange(num_tiles * nwg) // group).reshape(num_tiles, nwg)
  n_steps = block_steps[:, unit_block[:, 0]]
  for unit in range(1, nwg):
    n_steps = jnp.maximum(n_steps, block_steps[:, unit_block[:, unit]])
  if in_records:  # the kernel reads none: a placeholder, as decode's
    cos_sin = jnp.zeros((*page_table.shape, 2, 0), jnp.float32)
  else:
    cos_sin = cos_sin_of(shift)
  if block_sizes.rotates_query_in_kernel:
    query_cos_sin = query_cos_sin_table(row_pos, rope, head_dim)
  else:  # the query is rotated before the kernel: a placeholder
    query_cos_sin = jnp.zeros((batch, t_pad, 0), jnp.int16)
  return PrefillPlan(n_steps, min_row, records, cos_sin, row_pos,
                     query_cos_sin)
