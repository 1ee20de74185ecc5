"""Lazy (deferred-RoPE) paged attention decode on GPU: Pallas, Triton lowering.

Decode (T == 1) is memory bound: the figure of merit is KV bytes read per
second.  The layout of the work:

- Grid (kv_splits, K, B).  A program takes the G query heads of one kv head
  of one batch row as the rows of its tiles (GQA grouping: each KV byte is
  read once for all G heads), padded to at least 16 rows for the tensor-core
  dot, and streams a slice of that row's KV.
- The KV of a row is cut into blocks of `pages_per_block` logical pages.  The
  wrapper (XLA, metadata only) lists the *work items* of each row: one per
  (block, distinct page shift among the block's live pages), in page order.
  Shifts change per document, not per page, so a block almost always has one
  item; a block where two documents meet has two, each scoring only its own
  columns.  Pages no query can see (unused, or past q_pos) make no item, so
  their blocks are never read.
- A program runs one flat loop over its share of the items (no nested loop,
  so Triton can software-pipeline the KV loads): rotate the query rows by
  -shift with one cos/sin vector, gather the block's K and V with masked loads
  (invalid slots are never read), online softmax in base 2.
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
from pallas_kernels.gpu_block_sizes import (GpuBlockSizes, block_sizes_for,
                                            decode_kv_splits)
from pallas_kernels.rope import NUM_TURN_CHUNKS, RopeConfig


def decode_work_items(page_shift, live, pages_per_block):
  """Work items of each batch row: (block, shift) pairs, in page order.

  Args:
    page_shift: int32 [B, M].
    live: bool [B, M], pages some query row may see (valid and not after it).
    pages_per_block: pages per KV block.

  Returns:
    items: int32 [B, M, 2], (block index, shift) of item i in items[:, i];
      entries past num_items are 0 and never read.
    num_items: int32 [B].
  """
  batch, num_pages = page_shift.shape
  page = jnp.arange(num_pages, dtype=jnp.int32)
  slot_in_block = page % pages_per_block
  # A live page leads an item unless an earlier live page of its block has
  # the same shift.  At most pages_per_block - 1 shifted compares, one fusion.
  leader = live
  for d in range(1, pages_per_block):
    prev_shift = jnp.pad(page_shift, ((0, 0), (d, 0)))[:, :num_pages]
    prev_live = jnp.pad(live, ((0, 0), (d, 0)))[:, :num_pages]
    same = prev_live & (prev_shift == page_shift) & (slot_in_block >= d)
    leader = leader & ~same
  position = jnp.cumsum(leader.astype(jnp.int32), axis=1) - 1
  num_items = position[:, -1] + 1
  dest = jnp.where(leader, position, num_pages)  # non-leaders are dropped
  values = jnp.stack(
      [jnp.broadcast_to(page // pages_per_block, page_shift.shape),
       page_shift], axis=-1)
  rows = jnp.arange(batch, dtype=jnp.int32)[:, None]
  items = jnp.zeros((batch, num_pages, 2), jnp.int32).at[rows, dest].set(
      values, mode="drop")
  return items, num_items


def _decode_kernel(num_items_ref, items_ref, row_pos_ref, q_rot_ref,
                   q_rot_half_ref, chunks_ref, page_table_ref, page_pos_ref,
                   page_len_ref, page_shift_ref, k_ref, v_ref,
                   acc_ref, m_ref, l_ref, *, kv_splits, group,
                   pages_per_block, page_size, block_k, num_pages,
                   num_logical_pages):
  split = pl.program_id(0)
  batch_row = pl.program_id(2)
  num_items = num_items_ref[batch_row]
  per_split = lax.div(num_items + (kv_splits - 1), kv_splits)
  first = split * per_split
  end = jnp.minimum(first + per_split, num_items)

  q_rot = q_rot_ref[...]  # f32 [R, H]
  q_rot_half = q_rot_half_ref[...]
  row_pos = row_pos_ref[...]  # int32 [R]
  newest = jnp.max(row_pos)  # the token's q_pos (rows are its G heads)
  chunk_rows = common.load_chunk_rows(chunks_ref)
  rows, head_dim = q_rot.shape

  def body(i, carry):
    block = items_ref[i, 0]
    shift = items_ref[i, 1]
    q_s = common.rotate_rows(q_rot, q_rot_half, shift, chunk_rows,
                             k_ref.dtype)
    k, v, position = common.load_kv_block(
        k_ref, v_ref, page_table_ref, page_pos_ref, page_len_ref, block,
        pages_per_block=pages_per_block, page_size=page_size,
        block_k=block_k, num_pages=num_pages,
        num_logical_pages=num_logical_pages,
        column_filter=lambda page, pos: ((page_shift_ref[page] == shift)
                                         & (pos <= newest)))
    visible = position[None, :] <= row_pos[:, None]
    return common.softmax_step(carry, q_s, k, v, visible)

  acc, m, l = lax.fori_loop(first, end, body,
                            common.softmax_init(rows, head_dim))
  real_row = lax.broadcasted_iota(jnp.int32, (rows,), 0) < group
  plgpu.store(acc_ref, acc, mask=real_row[:, None])
  plgpu.store(m_ref, m, mask=real_row)
  plgpu.store(l_ref, l, mask=real_row)


def combine_splits(acc, m, l):
  """Merges per-split partial softmax results (base 2) along axis 2.

  acc: f32 [B, K, S, G, H]; m, l: f32 [B, K, S, G].  Rows that saw no key
  (l == 0 in every split) come out as zeros.
  """
  m_total = jnp.max(m, axis=2, keepdims=True)
  weight = jnp.exp2(m - m_total)
  l_total = jnp.sum(weight * l, axis=2)
  acc_total = jnp.sum(weight[..., None] * acc, axis=2)
  safe_l = jnp.where(l_total > 0, l_total, 1.0)
  return jnp.where((l_total > 0)[..., None], acc_total / safe_l[..., None],
                   0.0)


def decode_prologue(q, page_pos, page_shift, page_len, q_pos, *,
                    rope: RopeConfig, sm_scale, num_kv_heads, rows,
                    pages_per_block):
  """The XLA work before the kernel: query rows and the work items.

  Returns (q_rot, q_rot_half, row_pos, items, num_items); see
  gpu_common.grouped_query_rows and decode_work_items.
  """
  q_rot, q_rot_half, row_pos = common.grouped_query_rows(
      q, q_pos, rope, sm_scale, num_kv_heads, rows_multiple=rows)
  newest = q_pos[:, 0]
  live = ((page_len > 0) & (page_pos <= newest[:, None])
          & (newest[:, None] >= 0))
  items, num_items = decode_work_items(page_shift, live, pages_per_block)
  return q_rot, q_rot_half, row_pos, items, num_items


def lazy_decode_gpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                    page_len, q_pos, *, rope: RopeConfig, sm_scale,
                    interpret: bool = False,
                    block_sizes: GpuBlockSizes | None = None):
  """Decode step (T == 1) of the lazy attention contract on GPU.

  Same arguments and result as `pallas_kernels.lazy_attention` (inputs are
  validated there); `sm_scale` is an f32 scalar array.  `interpret=True` runs
  the Pallas kernel in generic interpret mode (CPU).  `block_sizes` overrides
  the tuned/default tiles.
  """
  batch, q_len, num_heads, head_dim = q.shape
  if q_len != 1:
    raise ValueError(f"lazy_decode_gpu needs T == 1, got q shape {q.shape}")
  common.check_power_of_2_head_dim(head_dim)
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  num_logical_pages = page_table.shape[1]
  if block_sizes is None:
    block_sizes = block_sizes_for("decode", dtype=q.dtype, head_dim=head_dim,
                                  group=group, page_size=page_size)
  pages_per_block, block_k = common.kv_block_geometry(page_size,
                                                      block_sizes.block_kv)
  num_blocks = -(-num_logical_pages // pages_per_block)
  kv_splits = decode_kv_splits(block_sizes, batch=batch,
                               num_kv_heads=num_kv_heads,
                               num_blocks=num_blocks)
  rows = max(16, common.next_power_of_2(group))

  q_rot, q_rot_half, row_pos, items, num_items = decode_prologue(
      q, page_pos, page_shift, page_len, q_pos, rope=rope, sm_scale=sm_scale,
      num_kv_heads=num_kv_heads, rows=rows, pages_per_block=pages_per_block)
  chunks = jnp.asarray(rope.turn_chunks(head_dim))

  kernel = functools.partial(
      _decode_kernel, kv_splits=kv_splits, group=group,
      pages_per_block=pages_per_block, page_size=page_size, block_k=block_k,
      num_pages=num_pages, num_logical_pages=num_logical_pages)
  per_row = lambda shape: pl.BlockSpec((None,) + shape,
                                       lambda s, h, b: (b,) + (0,) * len(shape))
  per_row_head = pl.BlockSpec((None, None, rows, head_dim),
                              lambda s, h, b: (b, h, 0, 0))
  kv_spec = pl.BlockSpec((None, num_pages * page_size, head_dim),
                         lambda s, h, b: (h, 0, 0))
  acc, m, l = pl.pallas_call(
      kernel,
      grid=(kv_splits, num_kv_heads, batch),
      in_specs=[
          common.whole_array_spec((batch,)),  # num_items
          per_row((num_logical_pages, 2)),  # items
          per_row((rows,)),  # row_pos
          per_row_head,  # q_rot
          per_row_head,  # q_rot_half
          common.whole_array_spec((NUM_TURN_CHUNKS, head_dim)),
          per_row((num_logical_pages,)),  # page_table
          per_row((num_logical_pages,)),  # page_pos
          per_row((num_logical_pages,)),  # page_len
          per_row((num_logical_pages,)),  # page_shift
          kv_spec,
          kv_spec,
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, rows, head_dim),
                       lambda s, h, b: (b, h, s, 0, 0)),
          pl.BlockSpec((None, None, None, rows), lambda s, h, b: (b, h, s, 0)),
          pl.BlockSpec((None, None, None, rows), lambda s, h, b: (b, h, s, 0)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct((batch, num_kv_heads, kv_splits, rows,
                                head_dim), jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, kv_splits, rows),
                               jnp.float32),
          jax.ShapeDtypeStruct((batch, num_kv_heads, kv_splits, rows),
                               jnp.float32),
      ],
      compiler_params=common.compiler_params(block_sizes),
      interpret=interpret,
      name="lazy_decode",
  )(num_items, items, row_pos, q_rot, q_rot_half, chunks, page_table,
    page_pos, page_len, page_shift, common.flat_pages(k_pages),
    common.flat_pages(v_pages))

  out = combine_splits(acc[:, :, :, :group], m[..., :group], l[..., :group])
  return out.reshape(batch, 1, num_heads, head_dim).astype(q.dtype)
