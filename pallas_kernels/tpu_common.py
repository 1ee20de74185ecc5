"""Pieces shared by the TPU (Pallas / Mosaic) lazy decode and prefill kernels.

Outside the kernels (plain XLA, in the wrappers):
  - the page metadata is padded to whole KV blocks and flattened to 1-D int32
    arrays for scalar prefetch into SMEM;
  - for every (row, KV block) the distinct page shifts are listed once, so a
    kernel rotates the query once per distinct shift, not once per page;
  - per program, the number of KV blocks that hold any visible key.

Inside the kernels (Mosaic):
  - `KvBlockFetcher`: page-by-page DMA of one KV block from HBM into a VMEM
    slot, skipping pages that no row of the program can see;
  - `block_columns`: logical position and shift index of every slot of a block,
    built from the SMEM scalars;
  - `shift_cos_sin`: exact range-reduced cos/sin of one shift (rope.py);
  - `online_softmax_update`: one flash-attention step over one KV block.

Conventions: a VMEM K/V buffer is [2 slots, heads, pages_per_block, P, H], one
tile-padded [P, H] slab per page, so every DMA lands tile-aligned.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.rope import cos_sin_from_chunks
from pallas_kernels.sizes import ceil_div

# A slot position past any query limit (|positions| < 2^22 after validation).
INVALID_SLOT_POS = 1 << 30
# The query limit of a padding row: below every slot position.
NO_QUERY = -(1 << 30)
# A shift value no page carries, so the first block always rotates.
NO_SHIFT = -(1 << 31)
# page_info packs the valid-slot count (low bits) and the index of the page's
# shift in its block's distinct-shift list (high bits).
_INFO_SHIFT_BITS = 16
_INFO_LEN_MASK = (1 << _INFO_SHIFT_BITS) - 1
MAX_PAGE_SIZE = _INFO_LEN_MASK
# Score lanes for the running max / sum scratch: replicated over a full vreg
# row (128 lanes) so they never need a 1-lane layout.
STAT_LANES = 128


def any_memory_space():
  """HBM-resident operand (no automatic VMEM blocking) across jax versions."""
  if hasattr(pl, "ANY"):
    return pl.ANY
  return pltpu.MemorySpace.ANY  # releases that dropped pl.ANY


def interpret_params(interpret):
  """pallas_call's `interpret` argument for the TPU kernels.

  True -> TPU-semantics interpretation with default settings; an
  InterpretParams instance is used as given; False -> the Mosaic kernel.
  """
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  return pltpu.InterpretParams() if interpret else False


def compute_dtype(dtype):
  """(MXU operand dtype, dot precision) for K/V pages of `dtype`.

  bfloat16 pages go to the MXU as bf16 with f32 accumulation; float32 pages
  use full f32 precision; float16 (no f16 MXU path on TPU) is upcast to f32.
  """
  if jnp.dtype(dtype) == jnp.bfloat16:
    return jnp.bfloat16, None
  return jnp.float32, lax.Precision.HIGHEST


def sublane_rows(dtype) -> int:
  """Rows of one native VMEM tile: 8 for 32-bit, 16 for 16-bit dtypes."""
  return 8 * (4 // jnp.dtype(dtype).itemsize)


def check_page_size(page_size: int):
  # Pages are folded into one [pages * P, H] matrix; Mosaic folds the page
  # axis cheaply only when P is a multiple of the 8-row sublane tile.
  if page_size % 8 or page_size > MAX_PAGE_SIZE:
    raise ValueError(
        f"impl='tpu' needs a k_pages page size that is a multiple of 8 (and at"
        f" most {MAX_PAGE_SIZE}), got {page_size}")


def pages_per_block(kv_tokens: int, page_size: int, num_logical_pages: int,
                    buffer_bytes_per_page: int, buffer_budget: int) -> int:
  """Whole pages per KV block: ~kv_tokens, within the VMEM budget and M."""
  pages = max(1, kv_tokens // page_size)
  pages = min(pages, max(1, buffer_budget // buffer_bytes_per_page))
  return max(1, min(pages, num_logical_pages))


def build_page_metadata(page_table, page_pos, page_shift, page_len, *,
                        num_physical_pages: int, pages_per_block: int):
  """Pads the page axis to whole blocks and lists distinct shifts per block.

  Args:
    page_table, page_pos, page_shift, page_len: int32[B, M] (the contract).
    num_physical_pages: size of the pool's page axis (page ids are clamped
      into it, so a stray id can never address memory outside the pool).
    pages_per_block: pages per KV block.

  Returns:
    dict of int32 arrays, each flattened row-major for SMEM:
      page_ids [B * Mp], page_start [B * Mp] (page_pos), page_info [B * Mp]
      (page_len | shift_index << 16), block_shifts [B * Mp] (slot d of block
      i holds its d-th distinct shift), block_num_shifts [B * nb] (>= 1);
    and the padded [B, Mp] page_pos / page_len for `visible_block_counts`.
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
  num_shifts = jnp.maximum(jnp.sum(is_first, axis=-1), 1).astype(jnp.int32)
  slot_of = is_first[..., :, None] & (rank[..., :, None] ==
                                      jnp.arange(ppb)[None, None, None, :])
  block_shifts = jnp.sum(jnp.where(slot_of, shifts[..., :, None], 0), axis=-2)

  page_info = (page_len.reshape(batch, num_blocks, ppb) |
               (shift_index << _INFO_SHIFT_BITS))
  flat = lambda x: x.reshape(-1).astype(jnp.int32)
  return dict(
      page_ids=flat(page_ids),
      page_start=flat(page_pos),
      page_info=flat(page_info),
      block_shifts=flat(block_shifts),
      block_num_shifts=flat(num_shifts),
      padded_page_pos=page_pos,
      padded_page_len=page_len,
  )


def visible_block_counts(padded_page_pos, padded_page_len, query_max,
                         pages_per_block: int):
  """int32[B, X]: KV blocks up to the last page any query of a program sees.

  query_max: int32[B, X], the largest query limit of each program (NO_QUERY
  for programs of padding rows only).  Pages after the last visible one are
  causally masked for every row of the program, so the kernel never fetches
  them; earlier pages are still masked slot by slot.
  """
  num_pages = padded_page_pos.shape[1]
  visible = ((padded_page_len[:, None, :] > 0) &
             (padded_page_pos[:, None, :] <= query_max[:, :, None]))
  last = jnp.max(jnp.where(visible, jnp.arange(1, num_pages + 1), 0), axis=-1)
  return ceil_div(last, pages_per_block).astype(jnp.int32)


def batch_rows_per_call(pages_per_row: int, blocks_per_row: int,
                        budget_bytes: int) -> int:
  """Batch rows per kernel call so that the SMEM metadata fits the budget."""
  row_bytes = 4 * (4 * pages_per_row + blocks_per_row + 4)
  return max(1, budget_bytes // row_bytes)


def run_in_batch_chunks(fn, batched_args, batch: int, rows_per_call: int):
  """fn over batch chunks of at most rows_per_call rows, concatenated.

  batched_args: arrays with the batch on axis 0.  fn returns a tuple of
  arrays with the batch on axis 0.
  """
  if rows_per_call >= batch:
    return fn(*batched_args)
  pieces = []
  for start in range(0, batch, rows_per_call):
    stop = min(batch, start + rows_per_call)
    pieces.append(fn(*(a[start:stop] for a in batched_args)))
  return tuple(jnp.concatenate(parts, axis=0) for parts in zip(*pieces))


# ----------------------------------------------------------------- in-kernel


def page_len_of(info):
  return info & _INFO_LEN_MASK


def page_shift_index_of(info):
  return info >> _INFO_SHIFT_BITS


@dataclasses.dataclass(frozen=True)
class PageScalars:
  """SMEM scalars of one page of a KV block, read once per use site."""

  page_id: jax.Array
  start: jax.Array  # logical position of slot 0
  length: jax.Array  # valid slots
  shift_index: jax.Array  # index into the block's distinct-shift list
  needed: jax.Array  # fetched: some row of the program sees a slot of it


def read_block_pages(page_ids_ref, page_start_ref, page_info_ref, first_page,
                     pages_per_block: int, query_max):
  """PageScalars of the pages [first_page, first_page + pages_per_block).

  A page is needed when it has valid slots and its first slot is at or
  before `query_max`, the largest query limit of the program.
  """
  pages = []
  for j in range(pages_per_block):
    info = page_info_ref[first_page + j]
    start = page_start_ref[first_page + j]
    length = page_len_of(info)
    pages.append(PageScalars(
        page_id=page_ids_ref[first_page + j], start=start, length=length,
        shift_index=page_shift_index_of(info),
        needed=(length > 0) & (start <= query_max)))
  return pages


class KvBlockFetcher:
  """Double-buffered DMA of the pages of one KV block, HBM -> VMEM slot.

  Pages that are not `needed` (empty, or past every query of the program)
  are neither fetched nor waited for; their slots keep stale data that the
  masks and `zero_unfilled_value_slots` neutralise.  start() and wait() take
  the same PageScalars predicate, so every started copy is waited for once.
  """

  def __init__(self, k_hbm, v_hbm, k_buf, v_buf, sems, *, head_start):
    self._k_hbm, self._v_hbm = k_hbm, v_hbm
    self._k_buf, self._v_buf = k_buf, v_buf
    self._sems = sems
    self._head_start = head_start
    self._num_heads = k_buf.shape[1]

  def _page_copies(self, page: PageScalars, slot, j):
    # [heads, 1, P, H] views: one strided DMA over the KV heads of a page.
    heads = pl.ds(self._head_start, self._num_heads)
    src_k = self._k_hbm.at[heads, pl.ds(page.page_id, 1)]
    src_v = self._v_hbm.at[heads, pl.ds(page.page_id, 1)]
    dst_k = self._k_buf.at[slot, :, pl.ds(j, 1)]
    dst_v = self._v_buf.at[slot, :, pl.ds(j, 1)]
    return (pltpu.make_async_copy(src_k, dst_k, self._sems.at[0, slot]),
            pltpu.make_async_copy(src_v, dst_v, self._sems.at[1, slot]))

  def _for_needed_pages(self, pages, slot, action):
    for j, page in enumerate(pages):
      copies = self._page_copies(page, slot, j)

      @pl.when(page.needed)
      def _():
        for copy in copies:
          action(copy)

  def start(self, pages, slot):
    self._for_needed_pages(pages, slot, lambda c: c.start())

  def wait(self, pages, slot):
    self._for_needed_pages(pages, slot, lambda c: c.wait())

  def stream(self, block_pages, first_block, end_block, compute_block):
    """Runs compute_block(block, slot, pages) for blocks [first, end), each
    block's pages fetched into slot (block - first) % 2 while the previous
    block computes; V slots that must not count are zeroed first."""

    @pl.when(first_block < end_block)
    def _():
      self.start(block_pages(first_block), 0)

      def block_step(block, carry):
        slot = lax.rem(block - first_block, 2)

        @pl.when(block + 1 < end_block)
        def _():
          self.start(block_pages(block + 1), 1 - slot)

        pages = block_pages(block)
        self.wait(pages, slot)
        zero_unfilled_value_slots(self._v_buf, slot, pages)
        compute_block(block, slot, pages)
        return carry

      lax.fori_loop(first_block, end_block, block_step, 0)


def reset_accumulators(acc_ref, m_ref, l_ref, cached_shift_ref):
  """Online-softmax state at a program's start; no shifted queries cached."""
  acc_ref[...] = jnp.zeros_like(acc_ref)
  m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
  l_ref[...] = jnp.zeros_like(l_ref)
  cached_shift_ref[0] = jnp.int32(NO_SHIFT)


def ensure_shifted_queries(q_shifted_ref, cached_shift_ref, shift,
                           rotate_queries):
  """Rotates the queries by -shift unless they already are (consecutive
  blocks of one document share a shift: one rotation per document)."""

  @pl.when(shift != cached_shift_ref[0])
  def _():
    q_shifted_ref[...] = rotate_queries(shift).astype(q_shifted_ref.dtype)
    cached_shift_ref[0] = shift


def zero_unfilled_value_slots(v_buf, slot, pages):
  """Zeroes V slots past page_len, and whole pages that were not fetched.

  Their attention weight is exactly 0, but 0 * NaN is NaN: padding slots may
  hold anything (the contract allows NaN), and unfetched pages hold stale
  data.  Only pages with such slots are touched (rare: ragged document ends,
  empty pages, the partial last page).
  """
  _, _, _, page_size, head_dim = v_buf.shape
  for j, page in enumerate(pages):
    filled = jnp.where(page.needed, page.length, 0)

    @pl.when(filled < page_size)
    def _():
      rows = lax.broadcasted_iota(jnp.int32, (page_size, head_dim), 0)
      view = v_buf.at[slot, :, pl.ds(j, 1)]
      view[...] = jnp.where(rows < filled, view[...],
                            jnp.zeros((), v_buf.dtype))


def block_columns(pages, page_size: int):
  """Per-slot metadata of one KV block, as [1, pages * P] vectors.

  Returns:
    slot_pos: logical position of each slot, INVALID_SLOT_POS past page_len.
    slot_shift_index: index of the slot's page shift in the block's list.
  """
  width = len(pages) * page_size
  col = lax.broadcasted_iota(jnp.int32, (1, width), 1)
  limit = jnp.zeros((1, width), jnp.int32)
  start = jnp.zeros((1, width), jnp.int32)
  shift_index = jnp.zeros((1, width), jnp.int32)
  for j, page in enumerate(pages):
    in_page = col >= j * page_size  # later pages overwrite earlier ones
    limit = jnp.where(in_page, j * page_size + page.length, limit)
    start = jnp.where(in_page, page.start - j * page_size, start)
    shift_index = jnp.where(in_page, page.shift_index, shift_index)
  slot_pos = jnp.where(col < limit, start + col, INVALID_SLOT_POS)
  return slot_pos, shift_index


def shift_cos_sin(chunks_ref, shift):
  """cos/sin rows [1, H] (float32) of angle `shift` * inv_freq, exact."""
  chunks = chunks_ref[...]
  rows = [chunks[j:j + 1, :] for j in range(chunks.shape[0])]
  positions = jnp.full((1, chunks.shape[1]), shift, jnp.int32)
  return cos_sin_from_chunks(positions, rows)


def rotate_by_minus_shift(q_rot, q_rot_half, cos, sin):
  """R(-s) applied to R(q_pos) q: gives R(q_pos - s) q (float32)."""
  return q_rot * cos - q_rot_half * sin


def load_block_rows(buf, slot, head, dtype):
  """[pages, P, H] of one head in a slot, folded to [pages * P, H] in dtype."""
  x = buf[slot, head]
  pages, page_size, head_dim = x.shape
  packing = 4 // jnp.dtype(x.dtype).itemsize
  if page_size % (8 * packing):
    # A packed (e.g. bf16) page smaller than its 16-row tile cannot be folded
    # in place; fold it in float32, where 8 rows make a tile.
    x = x.astype(jnp.float32)
  return x.reshape(pages * page_size, head_dim).astype(dtype)


def dot_q_kt(q, k, precision):
  """[R, H] x [S, H] -> [R, S] float32 scores."""
  return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def dot_p_v(p, v, precision):
  """[R, S] x [S, H] -> [R, H] float32."""
  return lax.dot_general(p, v, (((1,), (0,)), ((), ())), precision=precision,
                         preferred_element_type=jnp.float32)


def online_softmax_update(scores, keep, v, m_ref, l_ref, acc_ref, *,
                          precision):
  """One flash step: folds masked scores [R, S] and V [S, H] into the state.

  m_ref / l_ref: [R, STAT_LANES] running max / sum (lane replicated);
  acc_ref: [R, H] unnormalised output.  Masked scores become -inf, and a row
  that has seen nothing keeps max -inf with a safe exponent base of 0, so
  exp() gives exact zeros and never NaN.
  """
  scores = jnp.where(keep, scores, -jnp.inf)
  m_prev = m_ref[...][:, :1]
  l_prev = l_ref[...][:, :1]
  m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1, keepdims=True))
  m_base = jnp.where(m_next == -jnp.inf, 0.0, m_next)
  p = jnp.exp(scores - m_base)
  alpha = jnp.exp(m_prev - m_base)
  l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
  acc_ref[...] = alpha * acc_ref[...] + dot_p_v(p.astype(v.dtype), v,
                                                precision)
  rows = m_ref.shape[0]
  m_ref[...] = jnp.broadcast_to(m_next, (rows, STAT_LANES))
  l_ref[...] = jnp.broadcast_to(l_next, (rows, STAT_LANES))


def rope_chunks(rope, head_dim: int):
  """int32[NUM_TURN_CHUNKS, H] kernel input for `shift_cos_sin`."""
  return jnp.asarray(rope.turn_chunks(head_dim))
