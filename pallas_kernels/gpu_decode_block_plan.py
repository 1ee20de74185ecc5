"""Per-batch plan of the Mosaic GPU decode with one step per KV block
(`MgpuDecodeBlockSizes.steps_by_block`; XLA, metadata only).

The step records of `gpu_prefill_mgpu_plan` split a block where a segment
(a run of pages of one shift) starts, so each step has one shift; making
them takes prefix sums and scatters, about 19 XLA launches and 37 us at
B 64 / 8K context on an H200.  Here a step is a block of `pages_per_block`
logical pages whatever their shifts: the record carries each page's shift,
and the kernel rotates the query once per run of one shift.  The records
are then the page metadata reshaped and concatenated (`block_records`;
the step's fix-up flag and newest key position the kernel derives itself,
`block_flags`), and the plan is the records, the row lengths and (unless
the kernel computes them) the cos / sin of every page's shift.

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.gpu_prefill_mgpu_plan import INT32_MIN, PageFieldOffsets
from pallas_kernels.sizes import ceil_div, round_up


@dataclasses.dataclass(frozen=True)
class BlockRecordLayout(PageFieldOffsets):
  """Field offsets of one int32 block record: per page its physical id,
  position, valid slots (0 if dead) and shift, nothing else.  The step's
  fix-up flag and newest key position are the kernel's to derive from the
  pages' fields (`block_flags`), so the plan is one concatenation with no
  reduction over the pages of a block."""

  @property
  def shift(self):
    return 3 * self.pages_per_block

  @property
  def width(self):
    # A multiple of 32 int32 (128 bytes), as RecordLayout's.
    return round_up(4 * self.pages_per_block, 32)

  def segment(self, rec_ref, batch, row):
    """The row of step `row`'s cos / sin: its block's first logical page."""
    del rec_ref, batch
    return row * self.pages_per_block


def block_flags(rec, layout: BlockRecordLayout, page_size: int):
  """(fix-up flag: some page of the block not fully valid, newest valid
  key position or INT32_MIN) of a block record, on the scalar unit: the
  values `step_flags` gives a segment step's record."""
  fixup, max_pos = False, jnp.int32(INT32_MIN)
  for j in range(layout.pages_per_block):
    lim, pos = rec[layout.lim + j], rec[layout.pos + j]
    fixup = fixup | (lim < page_size)
    max_pos = jnp.where(lim > 0, jnp.maximum(max_pos, pos + lim - 1),
                        max_pos)
  return fixup, max_pos


def block_records(page_table, page_pos, page_shift, page_len, live, *,
                  num_pages: int, page_size: int, pages_per_block: int):
  """One step record per block of `pages_per_block` logical pages.

  Args: the page metadata [B, M] and `live` (bool [B, M]: pages the query
    may see); num_pages clips physical ids (a dead entry may hold any).

  Returns:
    records: int32 [B, ceil(M / ppb), BlockRecordLayout.width]: per page its
      physical id, position, valid slots (0 if dead) and shift;
    num_steps: int32 [B]: blocks up to the row's last live page;
    shift: int32 [B, ceil(M / ppb) * ppb]: each page's shift (0 past M).
  """
  del page_size  # the kernel derives the fix-up flag (block_flags)
  ppb = pages_per_block
  layout = BlockRecordLayout(ppb)
  batch, num_logical = page_table.shape
  num_blocks = ceil_div(num_logical, ppb)
  pad = num_blocks * ppb - num_logical
  padded = lambda a: jnp.pad(a.astype(jnp.int32), ((0, 0), (0, pad)))
  lim = padded(jnp.where(live, page_len, 0))
  shift = padded(page_shift)
  by_block = lambda a: a.reshape(batch, num_blocks, ppb)
  records = jnp.concatenate(
      [by_block(padded(jnp.clip(page_table, 0, num_pages - 1))),
       by_block(padded(page_pos)), by_block(lim), by_block(shift)], axis=-1)
  records = jnp.pad(records, ((0, 0), (0, 0),
                              (0, layout.width - records.shape[-1])))
  return records, block_step_counts(live, ppb), shift


def block_step_counts(live, pages_per_block: int):
  """int32 [B]: each row's steps of whole blocks, up to the block of its
  last live page (bool `live` [B, M]); 0 for a row with none."""
  page = jnp.arange(live.shape[1], dtype=jnp.int32)
  last_live = jnp.max(jnp.where(live, page, -1), axis=1)
  return jnp.where(last_live >= 0, last_live // pages_per_block + 1,
                   0).astype(jnp.int32)
