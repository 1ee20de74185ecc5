"""Lazy (deferred-RoPE) paged attention, prefill (T > 1), Pallas / Mosaic TPU.

Prefill is compute bound: the figure of merit is MXU FLOP/s.
  - One program per (batch row b, KV head k, query tile).  A tile holds
    `bq` query tokens times the G query heads of KV head k (rows t * G + g),
    so one fetch of a KV block feeds G heads' worth of matmul rows.
  - Flash attention over KV blocks with the online-softmax state (m, l, acc)
    in VMEM scratch; K/V pages are DMA'd page by page from HBM, double
    buffered, so the next block's DMAs overlap this block's matmuls.
  - Causal skipping: the wrapper bounds each tile's KV blocks by the last page
    that the tile's largest q_pos can see; pages inside a block that no row
    of the tile sees are not fetched.  The per-slot mask keeps every order
    of pages correct.
  - Rotation: the wrapper forms R(q_pos) q * sm_scale once per row; per
    distinct shift s of a block the kernel applies one cos/sin row (R(-s))
    to the whole tile, cached across blocks while s does not change.
    bfloat16 inputs go to the MXU as bf16 with f32 accumulation; float32 uses
    full precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import tpu_common as tc
from pallas_kernels.lazy_attention import contract_shapes
from pallas_kernels.rope import RopeConfig, rotated_query
from pallas_kernels.sizes import round_up
from pallas_kernels.tpu_block_sizes import TpuPrefillBlockSizes
from pallas_kernels.tpu_page_metadata import (build_page_metadata,
                                              call_in_batch_chunks,
                                              gather_page_scales,
                                              query_limits,
                                              visible_block_counts)


@tc.takes_page_refs
def _prefill_kernel(
    # Scalar prefetch (SMEM).
    tile_blocks_ref,  # [B * nT] KV blocks holding any key the tile sees
    tile_q_max_ref,  # [B * nT] largest query limit of the tile
    page_refs: tc.PageRefs,  # page metadata (tpu_page_metadata)
    # Inputs.
    chunks_ref,  # [6, H] int32 RoPE turn chunks
    q_ref,  # [R, H] f32, R(q_pos) q * sm_scale, rows t * G + g
    q_half_ref,  # [R, H] f32, rotate_half of q_ref
    q_limit_ref,  # [R, 1] int32, q_pos of the row or NO_QUERY
    k_hbm,  # [K, num_pages, P, H] in HBM
    v_hbm,
    # Output.
    o_ref,  # [R, H] in q.dtype
    # Scratch.
    k_buf,  # [2, 1, ppb, P, H]
    v_buf,
    sems,  # DMA semaphores [2 (K, V), 2 slots]
    m_ref,  # [R, STAT_LANES] f32 running max
    l_ref,  # [R, STAT_LANES] f32 running sum
    acc_ref,  # [R, H] f32 unnormalised output
    q_shifted_ref,  # [R, H] compute dtype: R(q_pos - s) q for s cached
    cached_shift_ref,  # SMEM [1]: the shift q_shifted_ref was rotated by
    *,
    pages_per_row: int,
    precision,
):
  b = pl.program_id(0)
  head = pl.program_id(1)
  tile = pl.program_id(2)
  num_tiles = pl.num_programs(2)
  _, _, pages_per_block, page_size, _ = k_buf.shape
  blocks_per_row = pages_per_row // pages_per_block
  first_page_of_row = b * pages_per_row
  num_blocks = tile_blocks_ref[b * num_tiles + tile]
  q_max = tile_q_max_ref[b * num_tiles + tile]

  tc.reset_accumulators(acc_ref, m_ref, l_ref, cached_shift_ref)

  def block_pages(block):
    return tc.read_block_pages(page_refs,
                               first_page_of_row + block * pages_per_block,
                               pages_per_block, q_max)

  fetcher = tc.KvBlockFetcher(k_hbm, v_hbm, k_buf, v_buf, sems,
                              head_start=head)

  def rotate_queries(shift):
    cos, sin = tc.shift_cos_sin(chunks_ref, shift)
    return tc.rotate_by_minus_shift(q_ref[...], q_half_ref[...], cos, sin)

  def compute_block(block, slot, pages):
    first_page = first_page_of_row + block * pages_per_block
    slot_pos, slot_shift_index = tc.block_columns(pages, page_size)
    keep = slot_pos <= q_limit_ref[...]  # [1, S] vs [R, 1] -> [R, S]
    num_shifts = page_refs.block_num_shifts[b * blocks_per_row + block]
    first_shift = page_refs.block_shifts[first_page]

    tc.ensure_shifted_queries(q_shifted_ref, cached_shift_ref, first_shift,
                              rotate_queries)

    k = tc.load_block_rows(k_buf, slot, 0, q_shifted_ref.dtype)
    scores = tc.dot_q_kt(q_shifted_ref[...], k, precision)

    def other_shift(d, scores):
      # Rare: a block that spans a document boundary.
      q_d = rotate_queries(page_refs.block_shifts[first_page + d])
      return jnp.where(slot_shift_index == d,
                       tc.dot_q_kt(q_d.astype(k.dtype), k, precision), scores)

    scores = lax.fori_loop(1, num_shifts, other_shift, scores)
    v_scale = None
    if page_refs.k_scales is not None:  # float8 pages
      num_kv_heads = pl.num_programs(1)
      scores = scores * tc.scale_columns(page_refs.k_scales, pages,
                                         first_page, page_size, num_kv_heads,
                                         head)
      v_scale = tc.scale_columns(page_refs.v_scales, pages, first_page,
                                 page_size, num_kv_heads, head)
    v = tc.load_block_rows(v_buf, slot, 0, q_shifted_ref.dtype)
    tc.online_softmax_update(scores, keep, v, m_ref, l_ref, acc_ref,
                             precision=precision, v_scale=v_scale)

  fetcher.stream(block_pages, 0, num_blocks, compute_block)

  l = l_ref[...][:, :1]
  out = acc_ref[...] / jnp.where(l > 0, l, 1.0)
  o_ref[...] = jnp.where(l > 0, out, 0.0).astype(o_ref.dtype)


def _query_tokens_per_tile(block_sizes: TpuPrefillBlockSizes, q_len: int,
                           group: int, dtype) -> int:
  # Tile rows (tokens x G) must fill whole native tiles of the output dtype.
  align = tc.sublane_rows(dtype)
  tokens = min(block_sizes.q_tokens_per_block,
               max(align, block_sizes.max_q_rows // group))
  tokens = max(align, tokens // align * align)
  return min(tokens, round_up(q_len, align))


def lazy_prefill_tpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                     page_len, q_pos, *, rope: RopeConfig, sm_scale,
                     interpret,
                     block_sizes: TpuPrefillBlockSizes | None = None,
                     k_scales=None, v_scales=None):
  """Prefill (T > 1) of `pallas_kernels.lazy_attention` on TPU.

  Arguments, `interpret` and result as for `tpu_decode.lazy_decode_tpu`;
  `block_sizes` is a `TpuPrefillBlockSizes` (defaults when None); float8
  pages as in `lazy_decode_tpu`.
  """
  block_sizes = block_sizes or TpuPrefillBlockSizes()
  tc.check_page_size(k_pages.shape[2])
  shapes = contract_shapes(q, k_pages, page_table)
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads, group = shapes.num_kv_heads, shapes.group
  dtype, precision = tc.compute_dtype(q.dtype)
  ppb = tc.pages_per_block(shapes, k_pages.dtype, block_sizes,
                           all_kv_heads=False)
  tile_tokens = _query_tokens_per_tile(block_sizes, q_len, group, q.dtype)
  q_len_padded = round_up(q_len, tile_tokens)
  num_tiles = q_len_padded // tile_tokens
  tile_rows = tile_tokens * group

  meta = build_page_metadata(page_table, page_pos, page_shift, page_len,
                             num_physical_pages=shapes.num_pages,
                             pages_per_block=ppb)
  # float8 pages: their scales ride in SMEM with the page metadata.
  quantized = k_scales is not None
  page_scales = gather_page_scales(k_scales, v_scales, meta)
  q_pos = jnp.pad(q_pos, ((0, 0), (0, q_len_padded - q_len)),
                  constant_values=-1)
  q_limit = query_limits(q_pos)
  tile_q_max = jnp.max(q_limit.reshape(batch, num_tiles, tile_tokens), -1)
  tile_blocks = visible_block_counts(meta, tile_q_max, ppb)

  q = jnp.pad(q, ((0, 0), (0, q_len_padded - q_len), (0, 0), (0, 0)))
  q_rot, q_rot_half = rotated_query(q, q_pos, rope, sm_scale)

  def group_rows(x):  # [B, Tp, N, H] -> [B, K, Tp * G, H], rows t * G + g
    x = x.reshape(batch, q_len_padded, num_kv_heads, group, head_dim)
    return jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(
        batch, num_kv_heads, q_len_padded * group, head_dim)

  q_rot, q_rot_half = group_rows(q_rot), group_rows(q_rot_half)
  row_limit = jnp.repeat(q_limit, group, axis=1)[..., None]  # [B, Tp*G, 1]
  chunks = tc.rope_chunks(rope, head_dim)

  tile_spec = pl.BlockSpec((None, None, tile_rows, head_dim),
                           lambda b, h, t, *_: (b, h, t, 0))
  kernel = functools.partial(_prefill_kernel,
                             pages_per_row=meta.pages_per_row,
                             precision=precision, quantized=quantized)

  def call(scalars, operands):  # operands: q_rot, q_rot_half, row_limit
    rows = operands[0].shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(rows, num_kv_heads, num_tiles),
        in_specs=[
            pl.BlockSpec(chunks.shape, lambda b, h, t, *_: (0, 0)),
            tile_spec,
            tile_spec,
            pl.BlockSpec((None, tile_rows, 1), lambda b, h, t, *_: (b, t, 0)),
            *tc.kv_pool_specs(),
        ],
        out_specs=tile_spec,
        scratch_shapes=[
            *tc.kv_buffer_scratch(k_pages, v_pages, ppb, all_kv_heads=False),
            pltpu.VMEM((tile_rows, tc.STAT_LANES), jnp.float32),
            pltpu.VMEM((tile_rows, tc.STAT_LANES), jnp.float32),
            pltpu.VMEM((tile_rows, head_dim), jnp.float32),
            *tc.shifted_query_scratch((tile_rows, head_dim), dtype),
        ],
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(operands[0].shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel")),
        interpret=tc.interpret_params(interpret),
    )(*scalars, chunks, *operands, k_pages, v_pages)
    return (out,)

  (out,) = call_in_batch_chunks(
      call, meta, [tile_blocks, tile_q_max], [q_rot, q_rot_half, row_limit],
      max_metadata_bytes=block_sizes.max_metadata_bytes,
      page_scales=page_scales)
  out = out.reshape(batch, num_kv_heads, q_len_padded, group, head_dim)
  out = jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(
      batch, q_len_padded, num_heads, head_dim)
  return out[:, :q_len]
