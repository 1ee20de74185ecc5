"""Pieces shared by the TPU (Pallas / Mosaic) lazy decode and prefill kernels.

The page metadata they take in SMEM is built in XLA by `tpu_page_metadata`.
Here:
  - `pages_per_block`: the KV block of a call, in whole pages;
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
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.lazy_attention import ContractShapes
from pallas_kernels.rope import cos_sin_from_chunks
from pallas_kernels.tpu_page_metadata import (page_len_of,
                                              page_shift_index_of,
                                              tpu_page_size_need)

# A slot position past any query limit (|positions| < 2^22 after validation).
INVALID_SLOT_POS = 1 << 30
# A shift value no page carries, so the first block always rotates.
NO_SHIFT = -(1 << 31)
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
  need = tpu_page_size_need(page_size)
  if need is not None:
    raise ValueError(f"impl='tpu' needs a k_pages page size that is {need}, "
                     f"got {page_size}")


def pages_per_block(shapes: ContractShapes, kv_dtype, block_sizes, *,
                    all_kv_heads: bool) -> int:
  """Whole pages per KV block: about block_sizes.kv_tokens_per_block tokens,
  at most M, with the double-buffered K and V blocks (of every KV head, or of
  one) within block_sizes.kv_buffer_bytes."""
  heads = shapes.num_kv_heads if all_kv_heads else 1
  # Two slots of K and of V for every page of the block.
  buffer_bytes_per_page = (4 * heads * shapes.page_size * shapes.head_dim
                           * jnp.dtype(kv_dtype).itemsize)
  pages = max(1, block_sizes.kv_tokens_per_block // shapes.page_size)
  pages = min(pages, max(1, block_sizes.kv_buffer_bytes
                         // buffer_bytes_per_page))
  return max(1, min(pages, shapes.num_logical_pages))


def kv_pool_specs():
  """in_specs of k_pages and v_pages: left in HBM, fetched by KvBlockFetcher."""
  return [pl.BlockSpec(memory_space=any_memory_space())] * 2


def kv_buffer_scratch(k_pages, v_pages, pages_per_block: int, *,
                      all_kv_heads: bool):
  """Scratch of a KvBlockFetcher: K and V buffers [2 slots, heads, pages,
  P, H] (every KV head, or one) and their DMA semaphores [(K, V), slot]."""
  num_kv_heads, _, page_size, head_dim = k_pages.shape
  shape = (2, num_kv_heads if all_kv_heads else 1, pages_per_block,
           page_size, head_dim)
  return [pltpu.VMEM(shape, k_pages.dtype), pltpu.VMEM(shape, v_pages.dtype),
          pltpu.SemaphoreType.DMA((2, 2))]


def shifted_query_scratch(shape, dtype):
  """Scratch of `ensure_shifted_queries`: the rotated queries and the shift
  they were rotated by."""
  return [pltpu.VMEM(shape, dtype), pltpu.SMEM((1,), jnp.int32)]


# ----------------------------------------------------------------- in-kernel


@dataclasses.dataclass(frozen=True)
class PageScalars:
  """SMEM scalars of one page of a KV block, read once per use site."""

  page_id: jax.Array
  start: jax.Array  # logical position of slot 0
  length: jax.Array  # valid slots
  shift_index: jax.Array  # index into the block's distinct-shift list
  needed: jax.Array  # fetched: some row of the program sees a slot of it


class PageRefs(NamedTuple):
  """SMEM refs of the fields of a `tpu_page_metadata.PageMetadata`, each
  flattened over the batch (Mp: padded pages per row, nb: blocks per row)."""

  page_ids: Any  # [B * Mp]
  page_pos: Any  # [B * Mp]
  page_info: Any  # [B * Mp]
  block_shifts: Any  # [B * Mp]
  block_num_shifts: Any  # [B * nb]
  # float8 pages only (None otherwise): f32 [B * Mp * K], the K and V scale
  # of every (page, kv head), entry (b * Mp + page) * K + head.
  k_scales: Any = None
  v_scales: Any = None


def takes_page_refs(kernel):
  """Adapts kernel(program_ref_1, program_ref_2, PageRefs, *other_refs) to
  the flat ref list Pallas passes: two per-program scalar-prefetch refs,
  then the five of PageRefs (seven with `quantized=True`: the scales), then
  the rest."""

  def body(*refs, quantized=False, **params):
    num_page_refs = len(PageRefs._fields) - (0 if quantized else 2)
    return kernel(*refs[:2], PageRefs(*refs[2:2 + num_page_refs]),
                  *refs[2 + num_page_refs:], **params)

  body.__name__ = body.__qualname__ = kernel.__name__  # the kernel's name
  return body


def read_block_pages(page_refs: PageRefs, first_page, pages_per_block: int,
                     query_max):
  """PageScalars of the pages [first_page, first_page + pages_per_block).

  A page is needed when it has valid slots and its first slot is at or
  before `query_max`, the largest query limit of the program.
  """
  pages = []
  for j in range(pages_per_block):
    info = page_refs.page_info[first_page + j]
    start = page_refs.page_pos[first_page + j]
    length = page_len_of(info)
    pages.append(PageScalars(
        page_id=page_refs.page_ids[first_page + j], start=start,
        length=length,
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


def scale_columns(scales_ref, pages, first_page, page_size: int,
                  num_kv_heads: int, head):
  """float8 page scales of one kv head as a [1, pages * P] f32 row.

  Columns of slots that are not valid (past page_len, or in pages that were
  not fetched) get 0: an unused page's scale may be anything, NaN included,
  and a P column times NaN would reach the output.
  """
  width = len(pages) * page_size
  col = lax.broadcasted_iota(jnp.int32, (1, width), 1)
  columns = jnp.zeros((1, width), jnp.float32)
  for j, page in enumerate(pages):
    valid = (col >= j * page_size) & (col < j * page_size + page.length)
    scale = scales_ref[(first_page + j) * num_kv_heads + head]
    columns = jnp.where(valid & page.needed, scale, columns)
  return columns


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
                          precision, v_scale=None):
  """One flash step: folds masked scores [R, S] and V [S, H] into the state.

  float8 V: `v_scale` [1, S] holds each column's page scale; P's columns are
  scaled rather than V's rows (same numbers: the scales are powers of two).

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
  p_v = p if v_scale is None else p * v_scale
  acc_ref[...] = alpha * acc_ref[...] + dot_p_v(p_v.astype(v.dtype), v,
                                                precision)
  rows = m_ref.shape[0]
  m_ref[...] = jnp.broadcast_to(m_next, (rows, STAT_LANES))
  l_ref[...] = jnp.broadcast_to(l_next, (rows, STAT_LANES))


def rope_chunks(rope, head_dim: int):
  """int32[NUM_TURN_CHUNKS, H] kernel input for `shift_cos_sin`."""
  return jnp.asarray(rope.turn_chunks(head_dim))
