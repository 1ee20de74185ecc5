"""Lazy (deferred-RoPE) paged attention decode on GPU: Pallas, Triton lowering.

Decode (T == 1) is memory bound: the figure of merit is KV bytes read per
second.  A decode step is small (tens of microseconds at small batch), so
besides streaming KV well the step must not spend its time in a chain of small
XLA kernels: everything but the final split combine happens in one kernel.

- Grid (kv_splits, K, B).  A program takes the G query heads of one kv head
  of one batch row as the rows of its tiles (GQA grouping: each KV byte is
  read once for all G heads), padded to at least 16 rows for the tensor-core
  dot, and streams a slice of that row's KV.
- The KV of a row is cut into blocks of `pages_per_block` logical pages.  A
  *work item* is a (block, distinct shift among the block's live pages) pair.
  Shifts change per document, not per page, so a block almost always has one
  item; a block where two documents meet has two, each scoring only its own
  columns.  Pages no query can see (unused, or past q_pos) make no item, so
  their blocks are never read.
- Prologue (in the kernel): scan the row's page metadata in chunks, mark the
  item leaders, compact the items with a prefix sum into a per-program scratch
  list in global memory.  Every program of a row does this redundantly; it
  reads a few KB of metadata against hundreds of KB of KV.
- Main loop: one flat loop over the program's share of the items (no nested
  loop, so Triton can software-pipeline the KV loads).  Per item the query
  rows are rotated to R(q_pos - shift) q with one cos/sin vector of length H
  (exact range reduction, rope.cos_sin_from_chunks), the block's K and V are
  gathered with masked loads (invalid slots are never read) and an online
  softmax in base 2 is updated.  Keys are never rotated.
- Programs write unnormalised partial results (acc, running max m, sum l);
  XLA combines the splits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import GpuBlockSizes, decode_kv_splits
from pallas_kernels.lazy_attention import contract_shapes
from pallas_kernels.masked_softmax import merge_splits
from pallas_kernels.rope import NUM_TURN_CHUNKS, RopeConfig, cos_sin_from_chunks
from pallas_kernels.sizes import ceil_div, next_power_of_two


def scan_pages_for(pages_per_block: int) -> int:
  """Pages the prologue scans per step: a power-of-two multiple of
  pages_per_block, about 256, with the [pages, pages_per_block] leader test
  kept near 4K elements so long contexts cost steps, not registers."""
  return max(pages_per_block,
             min(256, next_power_of_two(4096 // pages_per_block)))


def _list_work_items(q_pos, page_pos_ref, page_len_ref, page_shift_ref,
                     item_block_ref, item_shift_ref, *, pages_per_block,
                     num_logical_pages):
  """Writes this row's work items, in page order; returns their count.

  A live page (valid, not after q_pos) leads an item unless an earlier live
  page of its block has the same shift.  item_block_ref / item_shift_ref hold
  num_logical_pages + 1 entries; the last is a dump slot for masked lanes.
  """
  scan_pages = scan_pages_for(pages_per_block)
  blocks_per_scan = scan_pages // pages_per_block
  num_scans = ceil_div(num_logical_pages, scan_pages)
  block_in_scan = lax.broadcasted_iota(jnp.int32, (blocks_per_scan,
                                                   pages_per_block), 0)
  slot = lax.broadcasted_iota(jnp.int32, (blocks_per_scan, pages_per_block),
                              1)
  earlier = (lax.broadcasted_iota(jnp.int32, (1, pages_per_block,
                                              pages_per_block), 2)
             < lax.broadcasted_iota(jnp.int32, (1, pages_per_block,
                                                pages_per_block), 1))

  def scan_body(scan, count):
    block = scan * blocks_per_scan + block_in_scan
    page = block * pages_per_block + slot  # [blocks, pages_per_block]
    in_row = page < num_logical_pages
    page = jnp.minimum(page, num_logical_pages - 1)
    shift = page_shift_ref[page]
    live = (in_row & (page_len_ref[page] > 0) & (page_pos_ref[page] <= q_pos)
            & (q_pos >= 0))
    same = ((shift[:, :, None] == shift[:, None, :]) & live[:, None, :]
            & earlier)
    leader = live & (jnp.max(same.astype(jnp.int32), axis=2) == 0)
    leader = leader.reshape(scan_pages)
    rank = jnp.cumsum(leader.astype(jnp.int32)) - 1
    dest = jnp.where(leader, count + rank, num_logical_pages)
    plgpu.store(item_block_ref.at[dest], block.reshape(scan_pages),
                mask=leader)
    plgpu.store(item_shift_ref.at[dest], shift.reshape(scan_pages),
                mask=leader)
    return count + jnp.sum(leader.astype(jnp.int32))

  return lax.fori_loop(0, num_scans, scan_body, jnp.int32(0))


def _decode_kernel(scale_ref, q_pos_ref, q_ref, chunks_ref, page_table_ref,
                   page_pos_ref, page_len_ref, page_shift_ref, k_ref, v_ref,
                   *refs, kv_splits, group, rows, pages_per_block, page_size,
                   block_k, num_pages, num_logical_pages, interpret,
                   compute_dtype, quantized):
  # float8 pages bring their per-page scales after the pools.
  scale_refs = refs[:2] if quantized else None
  acc_ref, m_ref, l_ref, item_block_ref, item_shift_ref = refs[
      2 if quantized else 0:]
  split = pl.program_id(0)
  batch_row = pl.program_id(2)
  q_pos = q_pos_ref[batch_row, 0]

  num_items = _list_work_items(
      q_pos, page_pos_ref, page_len_ref, page_shift_ref, item_block_ref,
      item_shift_ref, pages_per_block=pages_per_block,
      num_logical_pages=num_logical_pages)
  if not interpret:
    # The item list is read back by other threads of this program.
    plgpu.debug_barrier()
  per_split = lax.div(num_items + (kv_splits - 1), kv_splits)
  first = split * per_split
  end = jnp.minimum(first + per_split, num_items)

  # Query rows (the G heads of this kv head, padded) and their rotate_half,
  # read through a column permutation: rotate_half(x)[h] = -x[h + H/2] for
  # h < H/2, x[h - H/2] otherwise.
  head_dim = q_ref.shape[-1]
  row = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)
  lane = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
  real_row = row < group
  row_index = jnp.minimum(row, group - 1)
  scale = scale_ref[0]  # sm_scale * log2(e): scores in base 2
  q = plgpu.load(q_ref.at[row_index, lane], mask=real_row,
                 other=0.0).astype(jnp.float32) * scale
  partner = plgpu.load(q_ref.at[row_index, (lane + head_dim // 2) % head_dim],
                       mask=real_row, other=0.0).astype(jnp.float32) * scale
  q_half = jnp.where(lane < head_dim // 2, -partner, partner)
  chunk_rows = common.load_chunk_rows(chunks_ref)

  def body(i, carry):
    block = item_block_ref[i]
    shift = item_shift_ref[i]
    # R(q_pos - shift) q = q cos(a) + rotate_half(q) sin(a), a exact in int32.
    cos, sin = cos_sin_from_chunks(q_pos - shift, chunk_rows)
    q_s = (q * cos[None, :] + q_half * sin[None, :]).astype(compute_dtype)
    (k,), v, position, scales = common.load_kv_block(
        k_ref, v_ref, page_table_ref, page_pos_ref, page_len_ref, block,
        pages_per_block=pages_per_block, page_size=page_size,
        block_k=block_k, num_pages=num_pages,
        num_logical_pages=num_logical_pages,
        column_filter=lambda page, pos: ((page_shift_ref[page] == shift)
                                         & (pos <= q_pos)),
        scale_refs=scale_refs)
    k_scale, v_scale = scales if quantized else (None, None)
    visible = jnp.broadcast_to(position[None, :] <= q_pos, (rows, block_k))
    return common.softmax_step(carry,
                               common.block_scores((q_s,), (k,), k_scale), v,
                               visible, v_scale, compute_dtype)

  acc, m, l = lax.fori_loop(first, end, body,
                            common.softmax_init(rows, head_dim))
  real = real_row[:, 0]
  plgpu.store(acc_ref, acc, mask=real_row)
  plgpu.store(m_ref, m, mask=real)
  plgpu.store(l_ref, l, mask=real)


def lazy_decode_gpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                    page_len, q_pos, *, rope: RopeConfig, sm_scale,
                    interpret: bool = False,
                    block_sizes: GpuBlockSizes | None = None, k_scales=None,
                    v_scales=None):
  """Decode step (T == 1) of the lazy attention contract on GPU.

  Same arguments and result as `pallas_kernels.lazy_attention` (inputs are
  validated there); `sm_scale` is an f32 scalar array.  float8 pages come
  with `k_scales` / `v_scales` [K, num_pages]; the kernel widens each tile
  to q's dtype and scales scores and P by the column's page scale.  `interpret=True` runs
  the Pallas kernel in generic interpret mode (CPU).  `block_sizes` overrides
  the tuned/default tiles.
  """
  if q.shape[1] != 1:
    raise ValueError(f"lazy_decode_gpu needs T == 1, got q shape {q.shape}")
  shapes = contract_shapes(q, k_pages, page_table)
  # The prologue scans whole blocks in power-of-two steps.
  tiles = common.kv_tiles("decode", shapes, q.dtype, block_sizes,
                          power_of_two_pages=True)
  batch, num_heads, head_dim = shapes.batch, shapes.num_heads, shapes.head_dim
  num_kv_heads, group = shapes.num_kv_heads, shapes.group
  num_pages, page_size = shapes.num_pages, shapes.page_size
  num_logical_pages = shapes.num_logical_pages
  kv_splits = decode_kv_splits(
      tiles.block_sizes, batch=batch, num_kv_heads=num_kv_heads,
      num_blocks=ceil_div(num_logical_pages, tiles.pages_per_block))
  rows = next_power_of_two(group, minimum=16)
  scale = (jnp.asarray(sm_scale, jnp.float32)
           * jnp.float32(common.LOG2_E)).reshape(1)
  chunks = jnp.asarray(rope.turn_chunks(head_dim))

  kernel = functools.partial(
      _decode_kernel, kv_splits=kv_splits, group=group, rows=rows,
      pages_per_block=tiles.pages_per_block, page_size=page_size,
      block_k=tiles.block_k, num_pages=num_pages,
      num_logical_pages=num_logical_pages, interpret=interpret,
      compute_dtype=q.dtype, quantized=k_scales is not None)
  row_meta = pl.BlockSpec((None, num_logical_pages), lambda s, h, b: (b, 0))
  kv_spec = pl.BlockSpec((None, num_pages * page_size, head_dim),
                         lambda s, h, b: (h, 0, 0))
  program_out = lambda *shape: pl.BlockSpec(
      (None, None, None) + shape, lambda s, h, b: (b, h, s) + (0,) * len(shape))
  partial_shape = lambda *shape: jax.ShapeDtypeStruct(
      (batch, num_kv_heads, kv_splits) + shape, jnp.float32)
  scratch_shape = jax.ShapeDtypeStruct(
      (batch, num_kv_heads, kv_splits, num_logical_pages + 1), jnp.int32)
  acc, m, l, _, _ = pl.pallas_call(
      kernel,
      grid=(kv_splits, num_kv_heads, batch),
      in_specs=[
          common.whole_array_spec((1,)),  # scale
          common.whole_array_spec((batch, 1)),  # q_pos
          pl.BlockSpec((None, None, group, head_dim),
                       lambda s, h, b: (b, h, 0, 0)),  # q as [B, K, G, H]
          common.whole_array_spec((NUM_TURN_CHUNKS, head_dim)),
          row_meta,  # page_table
          row_meta,  # page_pos
          row_meta,  # page_len
          row_meta,  # page_shift
          kv_spec,
          kv_spec,
          *common.scale_specs(k_scales, lambda s, h, b: (h, 0)),
      ],
      out_specs=[
          program_out(rows, head_dim),  # acc
          program_out(rows),  # m
          program_out(rows),  # l
          program_out(num_logical_pages + 1),  # item blocks (scratch)
          program_out(num_logical_pages + 1),  # item shifts (scratch)
      ],
      out_shape=[
          partial_shape(rows, head_dim),
          partial_shape(rows),
          partial_shape(rows),
          scratch_shape,
          scratch_shape,
      ],
      compiler_params=common.compiler_params(tiles.block_sizes),
      interpret=interpret,
      name="lazy_decode",
  )(scale, q_pos, q.reshape(batch, num_kv_heads, group, head_dim), chunks,
    page_table, page_pos, page_len, page_shift, common.flat_pages(k_pages),
    common.flat_pages(v_pages),
    *([] if k_scales is None else [k_scales, v_scales]))

  # acc [B, K, splits, G, H], m and l [B, K, splits, G]; scores in base 2.
  out = merge_splits(acc[:, :, :, :group], m[..., :group], l[..., :group],
                     axis=2, exp=jnp.exp2)
  return out.reshape(batch, 1, num_heads, head_dim).astype(q.dtype)
