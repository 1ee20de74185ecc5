"""Page metadata of the TPU (Pallas / Mosaic) kernels, built in XLA.

The contract's [B, M] page arrays become the kernels' scalar-prefetch (SMEM)
operands: the page axis is padded to whole KV blocks, each page's valid-slot
count and shift index are packed into one int32, and for every (row, KV
block) the distinct page shifts are listed once, so that a kernel rotates
the query once per distinct shift, not once per page.  Also here: how many
KV blocks each program must visit (causal skipping), the split of large
batches into kernel calls whose metadata fits in SMEM, and the page sizes
the kernels take.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.sizes import ceil_div

# The query limit of a padding row: below every slot position.
NO_QUERY = -(1 << 30)
# page_info packs the valid-slot count (low bits) and the index of the page's
# shift in its block's distinct-shift list (high bits).
_INFO_SHIFT_BITS = 16
_INFO_LEN_MASK = (1 << _INFO_SHIFT_BITS) - 1
MAX_PAGE_SIZE = _INFO_LEN_MASK


def tpu_page_size_need(page_size: int) -> str | None:
  """What the TPU kernels need of a page size that `page_size` lacks ("a
  multiple of 8 ..."), or None where they take it.  The kernels check it at
  trace time (tpu_common.check_page_size), the engine when it is built."""
  # Pages are folded into one [pages * P, H] matrix; Mosaic folds the page
  # axis cheaply only when P is a multiple of the 8-row sublane tile.
  if page_size % 8 or page_size > MAX_PAGE_SIZE:
    return f"a multiple of 8 (and at most {MAX_PAGE_SIZE})"
  return None


class PageMetadata(NamedTuple):
  """Per-page and per-block metadata, the page axis padded to Mp = nb * ppb
  pages (padding pages have length 0 and are never read).  The fields are
  the kernels' scalar-prefetch operands (tpu_common.PageRefs), in order."""

  page_ids: jax.Array  # int32 [B, Mp], physical page, clipped into the pool
  page_pos: jax.Array  # int32 [B, Mp], logical position of slot 0
  page_info: jax.Array  # int32 [B, Mp], page_len | shift_index << 16
  block_shifts: jax.Array  # int32 [B, Mp]: [b, i * ppb + d] = block i's
  #                          d-th distinct shift
  block_num_shifts: jax.Array  # int32 [B, nb], distinct shifts (>= 1)

  @property
  def pages_per_row(self) -> int:  # Mp
    return self.page_ids.shape[1]


def build_page_metadata(page_table, page_pos, page_shift, page_len, *,
                        num_physical_pages: int,
                        pages_per_block: int) -> PageMetadata:
  """Pads the page axis to whole blocks and lists distinct shifts per block.

  Args:
    page_table, page_pos, page_shift, page_len: int32[B, M] (the contract).
    num_physical_pages: size of the pool's page axis (page ids are clamped
      into it, so a stray id can never address memory outside the pool).
    pages_per_block: pages per KV block.
  """
  batch, num_logical = page_table.shape
  ppb = pages_per_block
  num_blocks = ceil_div(num_logical, ppb)
  pad = num_blocks * ppb - num_logical

  def pad_pages(x):
    return jnp.pad(x, ((0, 0), (0, pad)))

  page_ids = pad_pages(jnp.clip(page_table, 0, num_physical_pages - 1))
  page_pos = pad_pages(page_pos)
  page_len = pad_pages(page_len)  # padding pages: length 0, never read
  page_shift = pad_pages(page_shift)

  # Distinct shifts of each block among its used pages, in order of first use
  # (the first one usually continues the previous block's document, so the
  # kernel's cached rotated query stays valid).
  used = (page_len > 0).reshape(batch, num_blocks, ppb)
  shifts = page_shift.reshape(batch, num_blocks, ppb)
  same = (used[..., :, None] & used[..., None, :] &
          (shifts[..., :, None] == shifts[..., None, :]))  # [B, nb, j, i]
  earlier = jnp.arange(ppb)[None, :] < jnp.arange(ppb)[:, None]  # i < j
  is_first = used & ~jnp.any(same & earlier, axis=-1)
  rank = jnp.cumsum(is_first.astype(jnp.int32), axis=-1) - 1
  first_page = jnp.argmax(same, axis=-1)  # first page sharing j's shift
  shift_index = jnp.where(used, jnp.take_along_axis(rank, first_page, -1), 0)
  num_shifts = jnp.maximum(jnp.sum(is_first, axis=-1), 1)
  slot_of = is_first[..., :, None] & (rank[..., :, None] ==
                                      jnp.arange(ppb)[None, None, None, :])
  block_shifts = jnp.sum(jnp.where(slot_of, shifts[..., :, None], 0), axis=-2)

  page_info = (page_len.reshape(batch, num_blocks, ppb) |
               (shift_index << _INFO_SHIFT_BITS))
  rows = lambda x: x.reshape(batch, -1).astype(jnp.int32)
  return PageMetadata(
      page_ids=rows(page_ids), page_pos=rows(page_pos),
      page_info=rows(page_info), block_shifts=rows(block_shifts),
      block_num_shifts=rows(num_shifts))


def page_len_of(info):
  """Valid slots of a page, from its page_info."""
  return info & _INFO_LEN_MASK


def page_shift_index_of(info):
  """Index of a page's shift in its block's list, from its page_info."""
  return info >> _INFO_SHIFT_BITS


def query_limits(q_pos):
  """int32 q_pos with NO_QUERY for padding rows (q_pos < 0)."""
  return jnp.where(q_pos >= 0, q_pos, NO_QUERY).astype(jnp.int32)


def visible_block_counts(meta: PageMetadata, query_max,
                         pages_per_block: int):
  """int32[B, X]: KV blocks up to the last page any query of a program sees.

  query_max: int32[B, X], the largest query limit of each program (NO_QUERY
  for programs of padding rows only).  Pages after the last visible one are
  causally masked for every row of the program, so the kernel never fetches
  them; earlier pages are still masked slot by slot.
  """
  num_pages = meta.pages_per_row
  visible = ((page_len_of(meta.page_info)[:, None, :] > 0) &
             (meta.page_pos[:, None, :] <= query_max[:, :, None]))
  last = jnp.max(jnp.where(visible, jnp.arange(1, num_pages + 1), 0), axis=-1)
  return ceil_div(last, pages_per_block).astype(jnp.int32)


def gather_page_scales(k_scales, v_scales, meta: PageMetadata) -> list:
  """[K scales, V scales], each f32 [B, Mp * K]: the float8 scale of every
  (logical page, kv head) of each row, entry page * K + head (the kernels'
  SMEM layout), from the pool's scales [K, num_pages]; [] for 16-bit
  pools (k_scales None)."""
  if k_scales is None:
    return []
  return [jnp.transpose(scales[:, meta.page_ids], (1, 2, 0)).reshape(
      meta.page_ids.shape[0], -1) for scales in (k_scales, v_scales)]


def call_in_batch_chunks(call, meta: PageMetadata, program_scalars, operands,
                         *, max_metadata_bytes: int, page_scales=()):
  """Runs a kernel call over chunks of the batch whose metadata fits SMEM.

  call(scalars, operands) runs the kernel on one chunk: `scalars` are the
  kernel's scalar-prefetch operands, flattened to 1-D (`program_scalars`,
  then the fields of `meta`), `operands` its batch-leading inputs.
  It returns a tuple of batch-leading arrays; the chunks' are concatenated.

  Args:
    program_scalars: int32 [B, X] arrays, one entry per program of a row
      (X query tiles or KV splits).
    operands: arrays with the batch on axis 0.
    max_metadata_bytes: SMEM budget of one call's scalars (all of them:
      program scalars, page metadata and scales); a call takes at least
      one row.
    page_scales: float8 pages only: the K and V scales of
      `gather_page_scales`, passed after the fields of `meta`.
  """
  scalars = [*program_scalars, *meta, *page_scales]
  batch = meta.page_ids.shape[0]
  # Every scalar operand is batch-leading: a row's share is its bytes per
  # row (a prefill passes two per query tile, so this grows with T).
  row_bytes = sum(math.prod(x.shape[1:]) * x.dtype.itemsize
                  for x in scalars)
  rows_per_call = max(1, max_metadata_bytes // row_bytes)

  def chunk_call(*batched):
    chunk_scalars = batched[:len(scalars)]
    return call([x.reshape(-1) for x in chunk_scalars],
                list(batched[len(scalars):]))

  batched = [*scalars, *operands]
  if rows_per_call >= batch:
    return chunk_call(*batched)
  pieces = []
  for start in range(0, batch, rows_per_call):
    stop = min(batch, start + rows_per_call)
    pieces.append(chunk_call(*(a[start:stop] for a in batched)))
  return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*pieces))
