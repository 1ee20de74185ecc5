"""Per-batch plan of the Mosaic GPU decode with one step per KV block
(`MgpuDecodeBlockSizes.steps_by_block`; XLA, metadata only).

The step records of `gpu_prefill_mgpu_plan` split a block where a segment
(a run of pages of one shift) starts, so each step has one shift; making
them takes prefix sums and scatters, about 19 XLA launches and 37 us at
B 64 / 8K context on an H200.  Here a step is a block of `pages_per_block`
logical pages whatever their shifts: the record carries each page's shift,
and the kernel rotates the query once per run of one shift.  The records
are then the page metadata reshaped (`block_records`), and the plan is
about three fusions: the records, the row lengths and the cos / sin of
every page's shift.

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.gpu_prefill_mgpu_plan import RecordLayout, step_flags
from pallas_kernels.sizes import ceil_div, round_up


@dataclasses.dataclass(frozen=True)
class BlockRecordLayout(RecordLayout):
  """`RecordLayout` with each page's shift after the step fields.  `seg`
  holds the block's first logical page (the row of its pages' cos / sin);
  `new_seg` is unused (0)."""

  @property
  def shift(self):
    return self.max_pos + 1

  @property
  def width(self):
    return round_up(self.shift + self.pages_per_block, 32)


def block_records(page_table, page_pos, page_shift, page_len, live, *,
                  num_pages: int, page_size: int, pages_per_block: int):
  """One step record per block of `pages_per_block` logical pages.

  Args: the page metadata [B, M] and `live` (bool [B, M]: pages the query
    may see); num_pages clips physical ids (a dead entry may hold any).

  Returns:
    records: int32 [B, ceil(M / ppb), BlockRecordLayout.width]: per page its
      physical id, position, valid slots (0 if dead) and shift; per block
      its first logical page, a fix-up flag (a page not fully valid) and
      its newest valid key position;
    num_steps: int32 [B]: blocks up to the row's last live page;
    shift: int32 [B, ceil(M / ppb) * ppb]: each page's shift (0 past M).
  """
  ppb = pages_per_block
  layout = BlockRecordLayout(ppb)
  batch, num_logical = page_table.shape
  num_blocks = ceil_div(num_logical, ppb)
  pad = num_blocks * ppb - num_logical
  padded = lambda a: jnp.pad(a.astype(jnp.int32), ((0, 0), (0, pad)))
  lim = padded(jnp.where(live, page_len, 0))
  shift = padded(page_shift)
  by_block = lambda a: a.reshape(batch, num_blocks, ppb)
  lim_b, pos_b = by_block(lim), by_block(padded(page_pos))
  phys_b = by_block(padded(jnp.clip(page_table, 0, num_pages - 1)))
  fixup, max_pos = step_flags(lim_b, pos_b, page_size)
  first_page = jnp.broadcast_to(
      jnp.arange(num_blocks, dtype=jnp.int32) * ppb, (batch, num_blocks))
  column = lambda a: a.astype(jnp.int32)[..., None]
  records = jnp.concatenate(
      [phys_b, pos_b, lim_b, column(first_page),
       jnp.zeros((batch, num_blocks, 1), jnp.int32), column(fixup),
       column(max_pos), by_block(shift)], axis=-1)
  records = jnp.pad(records, ((0, 0), (0, 0),
                              (0, layout.width - records.shape[-1])))
  page = jnp.arange(num_blocks * ppb, dtype=jnp.int32)
  last_live = jnp.max(jnp.where(lim > 0, page, -1), axis=1)
  num_steps = jnp.where(last_live >= 0, last_live // ppb + 1, 0)
  return records, num_steps.astype(jnp.int32), shift
