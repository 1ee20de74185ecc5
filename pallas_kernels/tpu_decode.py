"""Lazy (deferred-RoPE) paged attention, decode (T == 1), Pallas / Mosaic TPU.

Decode is memory bound: the figure of merit is KV bytes read per second.
  - One program per (batch row b, KV split); it streams the row's pages for
    all K KV heads at once (one strided DMA per page and K/V), double
    buffered, so the next block's DMAs overlap this block's compute, and the
    DMA pipeline restarts only once per row.
  - All G = N / K query heads of a KV head share one [Gp, H] query block (G
    padded to whole sublane tiles); the K heads run one after another on the
    resident KV block.
  - Only blocks up to the last page with page_pos <= q_pos are visited, and
    inside them only pages that row can see are fetched.
  - Rotation: the wrapper forms R(q_pos) q * sm_scale once; per distinct shift
    s of a block the kernel applies one cos/sin row, R(-s), cached across
    blocks while s does not change (shifts change per document, not per
    page).  Keys are never rotated.
  - A long row can be split over programs (megacore chips run them on both
    TensorCores); partial softmax states are merged in XLA afterwards.
Page metadata, per-block distinct-shift lists and per-row block counts are
scalar-prefetched into SMEM; K/V pages stay in HBM.
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
from pallas_kernels.masked_softmax import merge_splits
from pallas_kernels.rope import RopeConfig, rotated_query
from pallas_kernels.sizes import ceil_div, round_up
from pallas_kernels.tpu_block_sizes import TpuDecodeBlockSizes
from pallas_kernels.tpu_page_metadata import (build_page_metadata,
                                              call_in_batch_chunks,
                                              gather_page_scales,
                                              query_limits,
                                              visible_block_counts)


@tc.takes_page_refs
def _decode_kernel(
    # Scalar prefetch (SMEM).
    num_blocks_ref,  # [B] KV blocks holding any key the row sees
    q_limit_ref,  # [B] q_pos, or NO_QUERY for a padding row
    page_refs: tc.PageRefs,  # page metadata (tpu_page_metadata)
    # Inputs.
    chunks_ref,  # [6, H] int32 RoPE turn chunks
    q_ref,  # [K, Gp, H] f32, R(q_pos) q * sm_scale
    q_half_ref,  # [K, Gp, H] f32, rotate_half of q_ref
    k_hbm,  # [K, num_pages, P, H] in HBM
    v_hbm,
    # Outputs (resident in VMEM for the whole program: the running state).
    acc_ref,  # [K, Gp, H] f32 unnormalised output
    m_ref,  # [K, Gp, STAT_LANES] f32 running max
    l_ref,  # [K, Gp, STAT_LANES] f32 running sum
    # Scratch.
    k_buf,  # [2, K, ppb, P, H]
    v_buf,
    sems,  # DMA semaphores [2 (K, V), 2 slots]
    q_shifted_ref,  # [K, Gp, H] compute dtype: R(q_pos - s) q for s cached
    cached_shift_ref,  # SMEM [1]: the shift q_shifted_ref was rotated by
    *,
    pages_per_row: int,
    blocks_per_split: int,
    precision,
):
  b = pl.program_id(0)
  split = pl.program_id(1)
  _, num_kv_heads, pages_per_block, page_size, _ = k_buf.shape
  blocks_per_row = pages_per_row // pages_per_block
  first_page_of_row = b * pages_per_row
  q_limit = q_limit_ref[b]
  first_block = split * blocks_per_split
  end_block = jnp.minimum(num_blocks_ref[b], first_block + blocks_per_split)

  tc.reset_accumulators(acc_ref, m_ref, l_ref, cached_shift_ref)

  def block_pages(block):
    return tc.read_block_pages(page_refs,
                               first_page_of_row + block * pages_per_block,
                               pages_per_block, q_limit)

  fetcher = tc.KvBlockFetcher(k_hbm, v_hbm, k_buf, v_buf, sems, head_start=0)

  def rotate_queries(shift):
    cos, sin = tc.shift_cos_sin(chunks_ref, shift)
    return tc.rotate_by_minus_shift(q_ref[...], q_half_ref[...], cos[None],
                                    sin[None])

  def compute_block(block, slot, pages):
    first_page = first_page_of_row + block * pages_per_block
    slot_pos, slot_shift_index = tc.block_columns(pages, page_size)
    keep = slot_pos <= q_limit  # [1, S], the same for every query head
    num_shifts = page_refs.block_num_shifts[b * blocks_per_row + block]
    first_shift = page_refs.block_shifts[first_page]

    tc.ensure_shifted_queries(q_shifted_ref, cached_shift_ref, first_shift,
                              rotate_queries)

    def head_step(h, carry):
      k = tc.load_block_rows(k_buf, slot, h, q_shifted_ref.dtype)
      scores = tc.dot_q_kt(q_shifted_ref[h], k, precision)

      def other_shift(d, scores):
        # Rare: a block that spans a document boundary.
        cos, sin = tc.shift_cos_sin(chunks_ref,
                                    page_refs.block_shifts[first_page + d])
        q_d = tc.rotate_by_minus_shift(q_ref[h], q_half_ref[h], cos, sin)
        return jnp.where(slot_shift_index == d,
                         tc.dot_q_kt(q_d.astype(k.dtype), k, precision),
                         scores)

      scores = lax.fori_loop(1, num_shifts, other_shift, scores)
      v_scale = None
      if page_refs.k_scales is not None:  # float8 pages
        scores = scores * tc.scale_columns(page_refs.k_scales, pages,
                                           first_page, page_size,
                                           num_kv_heads, h)
        v_scale = tc.scale_columns(page_refs.v_scales, pages, first_page,
                                   page_size, num_kv_heads, h)
      v = tc.load_block_rows(v_buf, slot, h, q_shifted_ref.dtype)
      tc.online_softmax_update(scores, keep, v, m_ref.at[h], l_ref.at[h],
                               acc_ref.at[h], precision=precision,
                               v_scale=v_scale)
      return carry

    lax.fori_loop(0, num_kv_heads, head_step, 0)

  fetcher.stream(block_pages, first_block, end_block, compute_block)


def _num_splits(block_sizes: TpuDecodeBlockSizes, batch: int,
                blocks_per_row: int) -> int:
  if block_sizes.num_splits is not None:
    return max(1, min(block_sizes.num_splits, blocks_per_row))
  if batch >= block_sizes.max_splits:
    return 1  # the batch alone keeps every TensorCore busy
  return max(1, min(block_sizes.max_splits,
                    blocks_per_row // block_sizes.min_blocks_per_split))


def lazy_decode_tpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                    page_len, q_pos, *, rope: RopeConfig, sm_scale,
                    interpret, block_sizes: TpuDecodeBlockSizes | None =
                    None, k_scales=None, v_scales=None):
  """Decode step (T == 1) of `pallas_kernels.lazy_attention` on TPU.

  Same arguments and result as `lazy_attention` (inputs already validated),
  plus:
    interpret: True runs with `pltpu.InterpretParams()` (TPU semantics, on
      CPU); a `pltpu.InterpretParams` instance runs with those settings (for
      example race detection); False compiles the Mosaic kernel.
    block_sizes: `TpuDecodeBlockSizes`; defaults when None.
    k_scales, v_scales: f32 [K, num_pages] with float8 pages: the kernel
      widens each block to the compute dtype and scales scores and P by
      the page scales, scalar-prefetched into SMEM per (page, kv head).

  Returns:
    [B, 1, N, H] in q.dtype.
  """
  block_sizes = block_sizes or TpuDecodeBlockSizes()
  if q.shape[1] != 1:
    raise ValueError(f"lazy_decode_tpu needs q with T == 1, got shape "
                     f"{q.shape}; use lazy_prefill_tpu")
  tc.check_page_size(k_pages.shape[2])
  shapes = contract_shapes(q, k_pages, page_table)
  batch, num_heads, head_dim = shapes.batch, shapes.num_heads, shapes.head_dim
  num_kv_heads, group = shapes.num_kv_heads, shapes.group
  dtype, precision = tc.compute_dtype(q.dtype)
  group_padded = round_up(group, tc.sublane_rows(dtype))
  ppb = tc.pages_per_block(shapes, k_pages.dtype, block_sizes,
                           all_kv_heads=True)

  meta = build_page_metadata(page_table, page_pos, page_shift, page_len,
                             num_physical_pages=shapes.num_pages,
                             pages_per_block=ppb)
  # float8 pages: their scales ride in SMEM with the page metadata.
  quantized = k_scales is not None
  page_scales = gather_page_scales(k_scales, v_scales, meta)
  q_pos = q_pos[:, 0]
  q_limit = query_limits(q_pos)[:, None]  # [B, 1]
  num_blocks = visible_block_counts(meta, q_limit, ppb)  # [B, 1]
  blocks_per_row = meta.pages_per_row // ppb
  num_splits = _num_splits(block_sizes, batch, blocks_per_row)
  blocks_per_split = ceil_div(blocks_per_row, num_splits)

  q_rot, q_rot_half = rotated_query(q, q_pos[:, None], rope, sm_scale)

  def group_rows(x):  # [B, 1, N, H] -> [B, K, Gp, H]
    x = x.reshape(batch, num_kv_heads, group, head_dim)
    return jnp.pad(x, ((0, 0), (0, 0), (0, group_padded - group), (0, 0)))

  q_rot, q_rot_half = group_rows(q_rot), group_rows(q_rot_half)
  chunks = tc.rope_chunks(rope, head_dim)

  def per_row(shape):
    return pl.BlockSpec((None,) + shape, lambda b, s, *_: (b,) + (0,) * len(
        shape))

  def per_program(shape):
    return pl.BlockSpec((None, None) + shape,
                        lambda b, s, *_: (b, s) + (0,) * len(shape))

  q_block = (num_kv_heads, group_padded, head_dim)
  stat_block = (num_kv_heads, group_padded, tc.STAT_LANES)
  kernel = functools.partial(_decode_kernel,
                             pages_per_row=meta.pages_per_row,
                             blocks_per_split=blocks_per_split,
                             precision=precision, quantized=quantized)

  def call(scalars, operands):  # operands: q_rot, q_rot_half
    rows = operands[0].shape[0]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(rows, num_splits),
        in_specs=[
            pl.BlockSpec(chunks.shape, lambda b, s, *_: (0, 0)),
            per_row(q_block),
            per_row(q_block),
            *tc.kv_pool_specs(),
        ],
        out_specs=[per_program(q_block), per_program(stat_block),
                   per_program(stat_block)],
        scratch_shapes=[
            *tc.kv_buffer_scratch(k_pages, v_pages, ppb, all_kv_heads=True),
            *tc.shifted_query_scratch(q_block, dtype),
        ],
    )
    out_shape = [
        jax.ShapeDtypeStruct((rows, num_splits) + q_block, jnp.float32),
        jax.ShapeDtypeStruct((rows, num_splits) + stat_block, jnp.float32),
        jax.ShapeDtypeStruct((rows, num_splits) + stat_block, jnp.float32),
    ]
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel")),
        interpret=tc.interpret_params(interpret),
    )(*scalars, chunks, *operands, k_pages, v_pages)

  acc, m, l = call_in_batch_chunks(
      call, meta, [num_blocks, q_limit], [q_rot, q_rot_half],
      max_metadata_bytes=block_sizes.max_metadata_bytes,
      page_scales=page_scales)
  # acc [B, splits, K, Gp, H], m and l [B, splits, K, Gp] -> [B, K, Gp, H]
  out = merge_splits(acc, m[..., 0], l[..., 0], axis=1)
  out = out[:, :, :group].reshape(batch, 1, num_heads, head_dim)
  return out.astype(q.dtype)
