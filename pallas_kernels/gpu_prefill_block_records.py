"""Step records of the Mosaic GPU prefill with one step per KV block
(`MgpuBlockSizes.steps_by_block`; XLA, metadata only).

Segment steps (`gpu_prefill_mgpu_plan.step_records`) split a block where
a segment starts, so each step has one shift; flattening a row into them
takes prefix sums and scatters, about 16 XLA launches and 26 us of device
time at the 512-token chunk on an H200.  Here a step is a block of
`pages_per_block` logical pages whatever their shifts, as in the decode
(`gpu_decode_block_plan`): the record is the block's page metadata
reshaped, plus per-block fields reduced over its pages (which the
prefill's two compute warpgroups would otherwise both derive on the scalar
unit at every step): flags, and the block's passes, one per distinct
shift of its live pages (a document boundary inside the block makes two),
each masked to its shift's pages.  The last pass is the last live page's
shift, whose cos / sin the record carries, so the query's usual rotation
(a new document starting) costs no trigonometry in the kernel.

Design: docs/kernels.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

from pallas_kernels.gpu_decode_block_plan import BlockRecordLayout
from pallas_kernels.sizes import ceil_div, round_up

INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class PrefillBlockLayout(BlockRecordLayout):
  """Field offsets of one int32 prefill block record: per page its physical
  id, position, valid slots (0 if dead) and shift (`BlockRecordLayout`),
  then the block's fix-up flag (some page not fully valid), newest valid
  key position (INT32_MIN if none), the shift of its last live page (0 if
  none), its number of passes (one per distinct shift of its live pages,
  at least one) and the shift of each pass (the last live page's last),
  and, with `cos_sin_dim` = H, the cos and sin of the last live page's
  shift (f32 [2, H/2] as int32 bits, 128-byte aligned)."""

  cos_sin_dim: int = 0

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
  def passes(self):
    return self.fixup + 3

  @property
  def pass_shift(self):
    return self.fixup + 4

  @property
  def cos_sin(self):
    return round_up(self.pass_shift + self.pages_per_block, 32)

  @property
  def width(self):
    # A multiple of 32 int32 (128 bytes), as RecordLayout's.
    return self.cos_sin + round_up(self.cos_sin_dim, 32)


def prefill_block_records(page_table, page_pos, page_shift, page_len, live, *,
                          num_pages: int, page_size: int,
                          pages_per_block: int, cos_sin_of=None):
  """int32 [B, ceil(M / ppb), PrefillBlockLayout.width]: one record per
  block of `pages_per_block` logical pages (see the module docstring).

  Args: the page metadata [B, M] and `live` (bool [B, M]: pages the query
    may see; a dead page's slots are 0); num_pages clips physical ids (a
    dead entry may hold any).  Pages past M are dead.  `cos_sin_of`
    (optional): int32 shifts [...] -> f32 [..., 2, H/2]; given, each record
    ends with the cos and sin of its last live page's shift.
  """
  ppb = pages_per_block
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
  # Pass order: each other shift where its first live page is, then the
  # last live page's (so a document running on into the next block is
  # the shift the query is left rotated to).
  before = slot[None, :] < slot[:, None]  # [p, q]: q before p
  seen = jnp.any(before & has_keys[..., None, :]
                 & (shift[..., None, :] == shift[..., :, None]), axis=-1)
  other = has_keys & ~seen & (shift != last_shift[..., None])
  rank = jnp.sum(before & other[..., None, :], axis=-1)
  n_other = jnp.sum(other, axis=-1)
  kth = jnp.sum(jnp.where(other[..., None, :]
                          & (rank[..., None, :] == slot[:, None]),
                          shift[..., None, :], 0), axis=-1)  # [.., k]
  n_other_k = n_other[..., None]
  pass_shift = jnp.where(slot < n_other_k, kth,
                         jnp.where(slot == n_other_k, last_shift[..., None],
                                   0))
  flags = jnp.stack([fixup.astype(jnp.int32), max_pos, last_shift,
                     (n_other + 1).astype(jnp.int32)], axis=-1)
  fields = [phys, pos, lim, shift, flags, pass_shift.astype(jnp.int32)]
  cos_sin_dim = 0
  if cos_sin_of is not None:
    bits = lax.bitcast_convert_type(cos_sin_of(last_shift), jnp.int32)
    cos_sin_dim = bits.shape[-1] * 2
    gap = PrefillBlockLayout(ppb, cos_sin_dim).cos_sin - 5 * ppb - 4
    fields += [jnp.zeros((batch, num_blocks, gap), jnp.int32),
               bits.reshape(batch, num_blocks, cos_sin_dim)]
  records = jnp.concatenate(fields, axis=-1)
  layout = PrefillBlockLayout(ppb, cos_sin_dim)
  return jnp.pad(records, ((0, 0), (0, 0),
                           (0, layout.width - records.shape[-1])))


def block_steps_of_tiles(page_ends, pages_per_block: int):
  """int32 [B, tiles]: the blocks each token block runs, from its page
  end (1 + the last live page it can see, 0 if none)."""
  return ((page_ends + pages_per_block - 1) // pages_per_block).astype(
      jnp.int32)
