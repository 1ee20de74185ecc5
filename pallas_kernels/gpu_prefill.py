"""Lazy (deferred-RoPE) paged attention prefill on GPU: Pallas, Triton lowering.

Prefill (T > 1) is compute bound: the figure of merit is FLOP/s against the
matmul peak.  The layout of the work:

- Query rows are GQA-grouped: row r of kv head k is token r // G, head
  k * G + r % G.  A program takes `block_q` consecutive rows of one (batch
  row, kv head), so one stream of KV serves all G heads of the group.
  Grid (row tiles, K, B).
- The logical pages of a batch row form *segments*: maximal runs of
  consecutive live pages with one shift (in practice: one document, or the
  query's own pages).  The wrapper (XLA, metadata only) lists them.
- A program loops over segments; per segment it rotates its query tile once
  by -shift (one cos/sin vector for all rows, applied to the f32 R(q_pos) q
  the wrapper computed, in two head-dim halves) and casts it to the KV dtype;
  an inner loop then streams the segment's KV in blocks of `pages_per_block`
  pages, flash style (online softmax, base 2; scores as the sum of one dot
  per head-dim half).  The inner loop has no nested loop, so Triton
  software-pipelines its loads.  Keys are never rotated.
- Causal skipping: the wrapper computes, per row tile, the last logical page
  that any row of the tile can see (page_pos <= the tile's largest q_pos), for
  any page order; the program stops there.  The per-element mask keeps
  correctness inside the last blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import GpuBlockSizes
from pallas_kernels.lazy_attention import contract_shapes
from pallas_kernels.rope import NUM_TURN_CHUNKS, RopeConfig
from pallas_kernels.sizes import next_power_of_two


def prefill_segments(page_shift, live):
  """Runs of consecutive live pages with equal shift, per batch row.

  Args:
    page_shift: int32 [B, M].
    live: bool [B, M].

  Returns:
    segments: int32 [B, M, 3], (first page, end page, shift) of segment j in
      segments[:, j]; a segment's range may hold pages that are not live
      (they end a run and are masked in the kernel), never a live page of
      another shift.  Entries past the row's count are 0 and never read.
    segment_of_page: int32 [B, M], index of the segment whose range holds
      each page (-1 before the first segment).
  """
  batch, num_pages = page_shift.shape
  page = jnp.arange(num_pages, dtype=jnp.int32)
  prev_shift = jnp.pad(page_shift, ((0, 0), (1, 0)))[:, :num_pages]
  prev_live = jnp.pad(live, ((0, 0), (1, 0)))[:, :num_pages]
  starts = live & ~(prev_live & (prev_shift == page_shift))
  segment_of_page = common.prefix_sum(starts.astype(jnp.int32)) - 1
  num_segments = segment_of_page[:, -1] + 1
  last_live = jnp.max(jnp.where(live, page, -1), axis=1)
  dest = jnp.where(starts, segment_of_page, num_pages)
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  start_page = jnp.zeros((batch, num_pages), jnp.int32).at[rows, dest].set(
      jnp.broadcast_to(page, (batch, num_pages)), mode="drop")
  shift = jnp.zeros((batch, num_pages), jnp.int32).at[rows, dest].set(
      page_shift, mode="drop")
  # A segment ends where the next begins; the last one after the last live
  # page.
  next_start = jnp.pad(start_page, ((0, 0), (0, 1)))[:, 1:]
  segment = jnp.arange(num_pages, dtype=jnp.int32)[None, :]
  end_page = jnp.where(segment + 1 < num_segments[:, None], next_start,
                       last_live[:, None] + 1)
  return jnp.stack([start_page, end_page, shift], axis=-1), segment_of_page


def _prefill_kernel(tile_end_ref, segments_ref, segment_of_page_ref,
                    row_pos_ref, q_rot_ref, chunks_ref, page_table_ref,
                    page_pos_ref, page_len_ref, k_ref, v_ref, *refs,
                    pages_per_block, page_size, block_k, num_pages,
                    num_logical_pages, compute_dtype, quantized):
  # float8 pages bring their per-page scales after the pools.
  scale_refs = refs[:2] if quantized else None
  (o_ref,) = refs[2 if quantized else 0:]
  # Pages [0, tile_end) hold every page a row of this tile can see.
  tile_end = tile_end_ref[pl.program_id(2), pl.program_id(0)]
  last_segment = segment_of_page_ref[jnp.maximum(tile_end - 1, 0)]
  num_segments = jnp.where(tile_end > 0, last_segment + 1, 0)
  row_pos = row_pos_ref[...]  # int32 [R]
  rows, head_dim = o_ref.shape
  half = head_dim // 2
  chunk_rows = common.load_chunk_rows(chunks_ref, half)

  def segment_body(j, carry):
    first_page = segments_ref[j, 0]
    end_page = jnp.minimum(segments_ref[j, 1], tile_end)
    shift = segments_ref[j, 2]
    # Rotate the query tile by -shift once per segment.  It is re-read here
    # (from L2) in two head-dim halves rather than kept in registers across
    # the KV loop, and scored against K in the same halves, so only the
    # rotated halves in the KV dtype stay live.
    q_parts = common.rotate_row_halves(
        q_rot_ref[:, pl.ds(0, half)], q_rot_ref[:, pl.ds(half, half)],
        shift, chunk_rows, compute_dtype)

    def block_body(block, carry):
      k_parts, v, position, scales = common.load_kv_block(
          k_ref, v_ref, page_table_ref, page_pos_ref, page_len_ref, block,
          pages_per_block=pages_per_block, page_size=page_size,
          block_k=block_k, num_pages=num_pages,
          num_logical_pages=num_logical_pages,
          column_filter=lambda page, pos: ((page >= first_page)
                                           & (page < end_page)),
          key_parts=2, scale_refs=scale_refs)
      k_scale, v_scale = scales if quantized else (None, None)
      visible = position[None, :] <= row_pos[:, None]
      return common.softmax_step(
          carry, common.block_scores(q_parts, k_parts, k_scale), v, visible,
          v_scale, compute_dtype)

    first_block = lax.div(first_page, pages_per_block)
    end_block = lax.div(end_page + (pages_per_block - 1), pages_per_block)
    return lax.fori_loop(first_block, end_block, block_body, carry)

  acc, _, l = lax.fori_loop(0, num_segments, segment_body,
                            common.softmax_init(rows, head_dim))
  safe_l = jnp.where(l > 0, l, 1.0)
  out = jnp.where((l > 0)[:, None], acc / safe_l[:, None], 0.0)
  o_ref[...] = out.astype(o_ref.dtype)


def tile_page_ends(row_pos, page_pos, live, block_q):
  """int32 [B, tiles]: 1 + the last live page any row of the tile can see."""
  batch, num_rows = row_pos.shape
  num_pages = page_pos.shape[1]
  tile_newest = jnp.max(row_pos.reshape(batch, num_rows // block_q, block_q),
                        axis=-1)
  page = jnp.arange(num_pages, dtype=jnp.int32)
  seen = live[:, None, :] & (page_pos[:, None, :] <= tile_newest[:, :, None])
  return jnp.max(jnp.where(seen, page, -1), axis=-1) + 1


def lazy_prefill_gpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                     page_len, q_pos, *, rope: RopeConfig, sm_scale,
                     interpret: bool = False,
                     block_sizes: GpuBlockSizes | None = None, k_scales=None,
                     v_scales=None):
  """Prefill (T > 1) of the lazy attention contract on GPU (Triton).

  Arguments, options and result as for `gpu_decode.lazy_decode_gpu`
  (float8 pages included).
  """
  shapes = contract_shapes(q, k_pages, page_table)
  tiles = common.kv_tiles("prefill", shapes, q.dtype, block_sizes)
  batch, q_len, head_dim = shapes.batch, shapes.q_len, shapes.head_dim
  num_kv_heads, group = shapes.num_kv_heads, shapes.group
  num_pages, page_size = shapes.num_pages, shapes.page_size
  num_logical_pages = shapes.num_logical_pages
  # Small inputs: no tile larger than the (power-of-two padded) rows.
  block_q = min(tiles.block_sizes.block_q,
                next_power_of_two(q_len * group, minimum=16))

  q_rot, row_pos = common.grouped_query_rows(
      q, q_pos, rope, sm_scale, num_kv_heads, rows_multiple=block_q)
  num_rows = row_pos.shape[1]
  num_tiles = num_rows // block_q
  newest = jnp.max(q_pos, axis=1)
  live = ((page_len > 0) & (page_pos <= newest[:, None])
          & (newest[:, None] >= 0))
  segments, segment_of_page = prefill_segments(page_shift, live)
  tile_end = tile_page_ends(row_pos, page_pos, live, block_q)
  chunks = jnp.asarray(rope.turn_chunks(head_dim))

  kernel = functools.partial(
      _prefill_kernel, pages_per_block=tiles.pages_per_block,
      page_size=page_size, block_k=tiles.block_k, num_pages=num_pages,
      num_logical_pages=num_logical_pages, compute_dtype=q.dtype,
      quantized=k_scales is not None)
  per_row = lambda shape: pl.BlockSpec((None,) + shape,
                                       lambda t, h, b: (b,) + (0,) * len(shape))
  tile_rows = pl.BlockSpec((None, None, block_q, head_dim),
                           lambda t, h, b: (b, h, t, 0))
  kv_spec = pl.BlockSpec((None, num_pages * page_size, head_dim),
                         lambda t, h, b: (h, 0, 0))
  out = pl.pallas_call(
      kernel,
      grid=(num_tiles, num_kv_heads, batch),
      in_specs=[
          common.whole_array_spec((batch, num_tiles)),  # tile_end
          per_row((num_logical_pages, 3)),  # segments
          per_row((num_logical_pages,)),  # segment_of_page
          pl.BlockSpec((None, block_q), lambda t, h, b: (b, t)),  # row_pos
          tile_rows,  # q_rot
          common.whole_array_spec((NUM_TURN_CHUNKS, head_dim)),
          per_row((num_logical_pages,)),  # page_table
          per_row((num_logical_pages,)),  # page_pos
          per_row((num_logical_pages,)),  # page_len
          kv_spec,
          kv_spec,
          *common.scale_specs(k_scales, lambda t, h, b: (h, 0)),
      ],
      out_specs=tile_rows,
      out_shape=jax.ShapeDtypeStruct((batch, num_kv_heads, num_rows, head_dim),
                                     q.dtype),
      compiler_params=common.compiler_params(tiles.block_sizes),
      interpret=interpret,
      name="lazy_prefill",
  )(tile_end, segments, segment_of_page, row_pos, q_rot, chunks,
    page_table, page_pos, page_len, common.flat_pages(k_pages),
    common.flat_pages(v_pages),
    *([] if k_scales is None else [k_scales, v_scales]))
  return common.rows_to_heads(out, q_len, group)
