"""Step records of the Mosaic GPU prefill with one step per KV block
(`MgpuBlockSizes.steps_by_block`; XLA, metadata only).

Segment steps (`gpu_prefill_mgpu_plan.step_records`) split a block where
a segment starts, so each step has one shift; flattening a row into them
takes prefix sums and scatters, about 16 XLA launches and 26 us of device
time at the 512-token chunk on an H200.  Here a step is a block of
`pages_per_block` logical pages whatever their shifts, as in the decode
(`gpu_decode_block_plan`): the record is the block's page metadata
reshaped, plus four per-block flags reduced over its pages (which the
prefill's two compute warpgroups would otherwise both derive on the scalar
unit at every step).  The kernel rotates the query to the shift of the
block's last live page, and a block with live pages of other shifts
(a document boundary inside it) takes one more pass per other shift.

Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.gpu_decode_block_plan import BlockRecordLayout
from pallas_kernels.sizes import ceil_div, round_up

INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class PrefillBlockLayout(BlockRecordLayout):
  """Field offsets of one int32 prefill block record: per page its physical
  id, position, valid slots (0 if dead) and shift (`BlockRecordLayout`),
  then the block's fix-up flag (some page not fully valid), newest valid
  key position (INT32_MIN if none), the shift of its last live page (0 if
  none: the one the query is rotated to) and whether a live page has
  another shift (the block needs more than one pass)."""

  @property
  def fixup(self):
    return 4 * self.pages_per_block

  @property
  def max_pos(self):
    return self.fixup + 1

  @property
  def last_shift(self):
    return self.fixup + 2

  @property
  def mixed(self):
    return self.fixup + 3

  @property
  def width(self):
    # A multiple of 32 int32 (128 bytes), as RecordLayout's.
    return round_up(self.mixed + 1, 32)


def prefill_block_records(page_table, page_pos, page_shift, page_len, live, *,
                          num_pages: int, page_size: int,
                          pages_per_block: int):
  """int32 [B, ceil(M / ppb), PrefillBlockLayout.width]: one record per
  block of `pages_per_block` logical pages (see the module docstring).

  Args: the page metadata [B, M] and `live` (bool [B, M]: pages the query
    may see; a dead page's slots are 0); num_pages clips physical ids (a
    dead entry may hold any).  Pages past M are dead.
  """
  ppb = pages_per_block
  layout = PrefillBlockLayout(ppb)
  batch, num_logical = page_table.shape
  num_blocks = ceil_div(num_logical, ppb)
  pad = num_blocks * ppb - num_logical
  by_block = lambda a: jnp.pad(a.astype(jnp.int32), ((0, 0), (0, pad))
                               ).reshape(batch, num_blocks, ppb)
  phys = by_block(jnp.clip(page_table, 0, num_pages - 1))
  pos = by_block(page_pos)
  lim = by_block(jnp.where(live, page_len, 0))
  shift = by_block(page_shift)
  has_keys = lim > 0
  fixup = jnp.any(lim < page_size, axis=-1)
  max_pos = jnp.max(jnp.where(has_keys, pos + lim - 1, INT32_MIN), axis=-1)
  slot = jnp.arange(ppb, dtype=jnp.int32)
  last = jnp.max(jnp.where(has_keys, slot, -1), axis=-1)
  last_shift = jnp.sum(jnp.where(slot == last[..., None], shift, 0), axis=-1)
  mixed = jnp.any(has_keys & (shift != last_shift[..., None]), axis=-1)
  flags = jnp.stack([fixup.astype(jnp.int32), max_pos, last_shift,
                     mixed.astype(jnp.int32)], axis=-1)
  records = jnp.concatenate([phys, pos, lim, shift, flags], axis=-1)
  return jnp.pad(records, ((0, 0), (0, 0),
                           (0, layout.width - records.shape[-1])))


def block_steps_of_tiles(page_ends, pages_per_block: int):
  """int32 [B, tiles]: the blocks each token block runs, from its page
  end (1 + the last live page it can see, 0 if none)."""
  return ((page_ends + pages_per_block - 1) // pages_per_block).astype(
      jnp.int32)
