"""Block steps whose records the decode kernel reads from the page metadata
itself (`MgpuDecodeBlockSizes.fields_in_kernel`; Mosaic GPU).

With block steps (`gpu_decode_block_plan`) a step's record is the page
metadata of its block, reshaped.  Made in XLA, that is a launch (and the
q_pos clean-up another) before the kernel on every whole call.  Here the
producer copies a step's fields straight from the caller's arrays, one
128-byte TMA copy per field (32 pages: the block's and its neighbours'),
and the compute warpgroup reads them through `PageFieldsRecord`, which
also applies liveness (a page is live if it holds slots and its position
is at most q_pos).  XLA then only counts each row's steps (`plan_fields`).

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_decode_block_plan import (BlockRecordLayout,
                                                   block_step_counts)
from pallas_kernels.sizes import round_up

# int32 per field copy: 128 bytes, as a record (the copy's bytes must split
# evenly over the warpgroup's 128 threads).
FIELD_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class PageFieldsLayout:
  """Offsets, in one ring slot, of the four copied fields of a step's
  chunk of FIELD_CHUNK pages: physical id, position, slots, shift.  A
  record view (`PageFieldsRecord`) adds the step's place in its chunk."""

  pages_per_block: int

  phys = 0
  pos = FIELD_CHUNK
  lim = 2 * FIELD_CHUNK
  shift = 3 * FIELD_CHUNK
  width = 4 * FIELD_CHUNK

  @property
  def blocks_per_chunk(self):
    return FIELD_CHUNK // self.pages_per_block

  segment = BlockRecordLayout.segment  # a step is a block, as there


class PageFieldsRecord:
  """A step's record, read from its ring slot once its copy has arrived:
  `rec[layout.F + j]` is field F of the step's page j; the slots (F = lim)
  are 0 for a page that is not live, so the record reads as a
  `BlockRecordLayout` record made in XLA."""

  def __init__(self, slot_ref, row, q_pos, layout: PageFieldsLayout):
    base = lax.rem(row, jnp.int32(layout.blocks_per_chunk)) * (
        layout.pages_per_block)
    # The fields the compute warpgroup reads (positions, slots, shifts),
    # each loaded and tested once per step here, outside the step's
    # branches (mask, V fix-up, rotations), which all read them.
    self._fields = {}
    for j in range(layout.pages_per_block):
      pos = slot_ref[base + layout.pos + j]
      lim = slot_ref[base + layout.lim + j]
      self._fields[layout.pos + j] = pos
      self._fields[layout.lim + j] = jnp.where(
          (lim > 0) & (pos <= q_pos), lim, 0)
      self._fields[layout.shift + j] = slot_ref[base + layout.shift + j]

  def __getitem__(self, index: int):
    return self._fields[index]


def producer_calls(field_refs, *, layout: PageFieldsLayout, page_offset,
                   num_pages: int) -> dict:
  """`produce_kv_ring`'s page_ids and copy_record for the four field refs
  (table, pos, len, shift; each int32 [B, M'])."""
  def page_ids(batch, row):
    first = row * layout.pages_per_block
    # Clipped into the pool: a dead entry may hold any id (its slots are
    # masked and its V rows zeroed).
    return [jnp.clip(field_refs[0][batch, first + j] + page_offset, 0,
                     num_pages - 1) for j in range(layout.pages_per_block)]

  def copy_record(batch, row, dst, barrier):
    # The chunk of each field that holds the step's pages, into the slot.
    chunk = lax.div(row, jnp.int32(layout.blocks_per_chunk)) * FIELD_CHUNK
    for i, ref in enumerate(field_refs):
      plgpu.copy_gmem_to_smem(ref.at[batch, pl.ds(chunk, FIELD_CHUNK)],
                              dst.at[pl.ds(i * FIELD_CHUNK, FIELD_CHUNK)],
                              barrier)

  return dict(page_ids=page_ids, copy_record=copy_record)


def check_fields(fields):
  """(the page table, the other three fields) of a page-fields plan's
  records; ValueError unless each spans whole chunks."""
  table, *others = fields
  if len(others) != 3 or any(f.shape != table.shape for f in others):
    raise ValueError("page fields must be four arrays of one shape, got "
                     f"{[f.shape for f in fields]}")
  if table.shape[-1] % FIELD_CHUNK:
    raise ValueError(f"page fields of {table.shape[-1]} pages must be "
                     f"whole chunks of {FIELD_CHUNK}")
  return table, others


def plan_fields(page_table, page_pos, page_shift, page_len, live, *,
                pages_per_block: int):
  """(steps of each row, int32 [B]; the four fields, each int32 [B, M']):
  M' is M rounded up to whole chunks of FIELD_CHUNK pages (dead pages
  appended; only then are the fields copied).  `live`: bool [B, M], the
  pages the query may see (the kernel applies the same rule itself)."""
  num_logical = page_table.shape[1]
  width = round_up(num_logical, FIELD_CHUNK)
  fields = [a.astype(jnp.int32)
            for a in (page_table, page_pos, page_len, page_shift)]
  if width != num_logical:
    fields = [jnp.pad(a, ((0, 0), (0, width - num_logical)))
              for a in fields]
  return block_step_counts(live, pages_per_block), tuple(fields)
