"""The Mosaic GPU (Hopper) lazy decode kernel: kernel body and builder.

A work item is one (batch row, kv head, KV split); a CTA runs one item,
or on a persistent grid (`MgpuDecodeBlockSizes.persistent`) several through
one K/V ring.  The G query heads of the kv head are the first G rows of one
64-row wgmma tile (GQA: every KV byte is
read once for the group; the other rows are zero).  A producer warpgroup
TMA-copies each step's KV pages, its step record and its segment's cos/sin
into a ring of shared-memory slots; one compute warpgroup rotates the query
tile by -shift at a segment's first step (or its split's first step), and
runs the online softmax (base 2) with wgmma.  Float8 pages (e4m3) are
widened by a third, converter warpgroup from the ring into a 16-bit K / V
tile (the wgmma operands, f16 by default:
`MgpuDecodeBlockSizes.float8_operand`), their per-page scales applied per
score column (K) and per P column (V) (gpu_mgpu_float8.py).  With
`MgpuDecodeBlockSizes.steps_by_block` a step is a whole KV block whatever
its pages' shifts: the query is rotated per run of one shift in it, and
each run's columns come from its own Q K^T (`rope_in_kernel`: the cos /
sin computed here, not read from the plan; gpu_decode_block_scores.py).
Each CTA writes its unnormalised partial state (acc, m, l); XLA merges the
splits (`masked_softmax.merge_splits`).  The inputs come from
`gpu_decode_mgpu.plan_decode` and `gpu_decode_mgpu.decode_query_tile`.

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_decode_block_sizes import (MgpuDecodeBlockSizes,
                                                   mgpu_decode_num_ctas,
                                                   mgpu_decode_work_item,
                                                   shift_cos_sin_shape)
# The warpgroups' registers per thread (setmaxnreg) as in prefill.
from pallas_kernels.gpu_mgpu_float8 import (
    CONVERTER_REGISTERS, convert_work_items, load_page_scales, step_scales)
from pallas_kernels.gpu_mgpu_parts import (
    COMPUTE_REGISTERS, Ops, interpreter_params, key_positions, rotate_query,
    softmax_start, softmax_update, zero_invalid_v_rows)
from pallas_kernels.gpu_mgpu_producer import (PRODUCER_REGISTERS,
                                              drain_kv_ring, produce_kv_ring)
from pallas_kernels.gpu_decode_block_plan import (BlockRecordLayout,
                                                   block_flags)
from pallas_kernels.gpu_decode_block_scores import (block_scores,
                                                    rotate_ahead)
from pallas_kernels.gpu_decode_mgpu_scratch import decode_scratch
from pallas_kernels.gpu_decode_page_fields import (
    PageFieldsLayout, PageFieldsRecord, check_fields, producer_calls)
from pallas_kernels.gpu_prefill_mgpu_plan import INT32_MIN, RecordLayout
from pallas_kernels.rope import NUM_TURN_CHUNKS, RopeConfig
from pallas_kernels.sizes import round_up


def out_rows(group: int) -> int:
  """Rows of the partial output per (split, kv head): G rounded up to the
  8-row tile of the shared-memory layout the output is copied from."""
  return round_up(group, 8)


def _kernel(
    # Plan (per batch, the same for every layer; see DecodePlan).
    n_steps_ref,  # int32 [B]: steps of each row
    rec_ref,  # int32 [B, steps, record width]; fields_in_kernel: the page
    #           table [B, M'] (M' whole chunks of FIELD_CHUNK pages)
    cs_ref,  # f32 [B, M, 2, H/2]: cos / sin of each segment's shift
    q_pos_ref,  # int32 [B]: q_pos, PADDING_ROW for padding rows
    page_offset_ref,  # int32 [1]: added to every physical page id
    chunks_ref,  # int32 [6, H/2]: RoPE turn chunks (rope_in_kernel;
    #              compact_cos_sin: [6, R, H/2], shift_cos_sin_shape)
    # Operands.
    q_ref,  # f32 [B, K, 64, H]: R(q_pos) q * sm_scale * log2(e), G rows
    k_ref,  # [K, pages * P, H], 16-bit or float8_e4m3fn
    v_ref,  # [K, pages * P, H]
    ks_ref,  # f32 [K, pages]: K scale of each page (float8; else unused)
    vs_ref,  # f32 [K, pages]: V scale of each page
    # fields_in_kernel: the other page fields, int32 [B, M'] (else unused).
    pos_ref, len_ref, shift_ref,
    # Outputs (partial states of each split).
    acc_ref,  # f32 [B, S, K, Gp, H]
    ml_ref,  # f32 [B, S, K, 2, 64]: running max m and sum l of each row
    # Scratch; at the end, float8: the 16-bit K and V tiles and their four
    # barriers: ready (converter -> compute) and free (compute -> converter);
    # steps_by_block: the block's f32 scores [64, block_kv].
    q_smem, q16_smem, k_smem, v_smem, rec_smem, cs_smem, ml_smem,
    chunks_smem, q_bars, k_bars, v_bars, k_free, v_free, chunks_bar,
    *tail_scratch,
    cfg: MgpuDecodeBlockSizes,
    page_size: int, num_splits: int, num_items: int, num_ctas: int,
    rows: int, layout: RecordLayout, dtype, interpret: bool):
  ops = Ops(interpret)
  stages, block_kv = cfg.num_stages, cfg.block_kv
  ppb = block_kv // page_size
  head_dim = q_ref.shape[-1]
  half = head_dim // 2
  by_block = cfg.steps_by_block  # one step per block (BlockRecordLayout)
  # (16-bit pages only, so the scores never follow float8 scratch)
  s_smem = tail_scratch[0] if by_block else None
  float8_scratch = () if by_block else tail_scratch
  quantized = bool(float8_scratch)  # dtype: the 16-bit wgmma operand dtype
  # With float8 the converter frees a K slot before the compute warpgroup
  # has used its cos/sin: their ring is twice as deep, as the records'.
  cs_stages = cs_smem.shape[0]
  # compact_cos_sin: one rotation's cos / sin, written by the compute
  # warpgroup
  compact_cs = cs_smem.at[0] if cfg.compact_cos_sin else None
  if cfg.dependent_launch and not interpret:  # before any global read
    plgpu.griddepcontrol_wait()
  page_offset = page_offset_ref[0]
  query_buffers = q_smem.shape[0]  # 2: the next item's query prefetched
  cta = lax.axis_index("cta")
  wg = lax.axis_index("wg")
  # This CTA's work items (one each unless the grid is persistent).
  my_items = lax.div(jnp.int32(num_items - 1 + num_ctas) - cta,
                     jnp.int32(num_ctas))
  item = functools.partial(mgpu_decode_work_item, cta=cta, num_ctas=num_ctas,
                           num_kv_heads=q_ref.shape[1],
                           num_splits=num_splits, n_steps_ref=n_steps_ref)
  fields = cfg.fields_in_kernel  # PageFieldsLayout: records read here
  if quantized:
    k16_smem, v16_smem, k16_ready, v16_ready, k16_free, v16_free = (
        float8_scratch)

  @pl.when(wg == 0)
  def _compute():
    if not interpret:
      plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")

    def fetch_query(j, buf):
      batch, head, _, _, _ = item(j)
      plgpu.copy_gmem_to_smem(q_ref.at[batch, head], q_smem.at[buf],
                              q_bars.at[buf])

    def mask_scores(s, rec, q_pos):
      # Every row is the same token: one comparison with q_pos.
      key_pos = key_positions(ops, rec, layout, ppb, page_size, block_kv)
      visible = lax.broadcast_in_dim(key_pos <= q_pos, s.shape, [1])
      return jnp.where(visible, s, -jnp.inf)

    def fixup_v(slot, rec):
      zero_invalid_v_rows(ops, v_smem.at[slot], v_smem.at[slot], rec,
                          layout, ppb, page_size, block_kv, head_dim, dtype)

    def load_scales(batch, head, row):
      return load_page_scales(rec_ref, ks_ref, vs_ref, batch, head, row,
                              page_offset, layout=layout,
                              pages_per_block=ppb)

    if cfg.rope_in_kernel:  # the turn chunks, once per CTA
      plgpu.copy_gmem_to_smem(chunks_ref, chunks_smem, chunks_bar.at[0])
      plgpu.barrier_wait(chunks_bar.at[0])

    def one_item(j, ring_step):
      batch, head, split, first, n_steps = item(j)
      buf = lax.rem(j, query_buffers)
      q_tile = q_smem.at[buf]
      plgpu.barrier_wait(q_bars.at[buf])
      if query_buffers > 1:  # the other buffer's output has been read
        pl.when(j + 1 < my_items)(lambda: fetch_query(j + 1, 1 - buf))
      q_pos = q_pos_ref[batch]

      def first_page(row):  # rotate_ahead: (shift, valid slots), from HBM
        row = jnp.minimum(row, rec_ref.shape[1] - 1)  # past the last step
        return rec_ref[batch, row, layout.shift], rec_ref[batch, row,
                                                          layout.lim]

      def step(i, carry):
        # float8 pools: [acc's V-scale unit, this step's K and V scales];
        # steps_by_block: [the shift the query tile is rotated by, and
        # with rotate_ahead this step's first page's shift and slots]
        acc, m, l, *carried = carry
        ring = ring_step + i
        slot = lax.rem(ring, stages)
        if cfg.rotate_ahead:  # before the wait; the next page read early
          rotated = rotate_ahead(ops, carried[1:], carried[0], q_tile,
                                 q16_smem=q16_smem, chunks_smem=chunks_smem,
                                 dtype=dtype, cos_sin_smem=compact_cs)
          carried = (rotated, *first_page(first + i + 1))
        # The record ring is twice as deep as the K/V ring: the record is
        # read after the K slot is released (mask, V fix-up); see the
        # prefill.
        rec = rec_smem.at[lax.rem(ring, 2 * stages)]
        # float8: the converter waited for the slot (record and cos/sin
        # included) before it widened K.
        plgpu.barrier_wait(k16_ready if quantized else k_bars.at[slot])
        if fields:  # the step's fields in its chunk, liveness applied
          rec = PageFieldsRecord(rec, first + i, q_pos, layout)
        if not by_block:
          # A split may start inside a segment: rotate at its first step too.
          pl.when((rec[layout.new_seg] != 0) | (i == 0))(
              lambda: rotate_query(ops, q_tile, q16_smem, cs_smem,
                                   lax.rem(ring, cs_stages), half, dtype))
        acc_factor = None
        if by_block:
          s, rotated = block_scores(
              ops, rec, k_smem.at[slot], q_tile, carried[0], q16_smem=q16_smem,
              cs_smem=cs_smem.at[lax.rem(ring, cs_stages)],
              chunks_smem=chunks_smem, s_smem=s_smem, layout=layout,
              page_size=page_size, rope_in_kernel=cfg.rope_in_kernel,
              dtype=dtype, rotated_ahead=cfg.rotate_ahead,
              compact_cos_sin=cfg.compact_cos_sin)
          plgpu.barrier_arrive(k_free.at[slot])
          carried = (rotated, *carried[1:])
        elif quantized:
          next_scales = load_scales(batch, head, first + i + 1)
          k_cols, v_cols, acc_factor, unit = step_scales(
              ops, rec, *carried, layout=layout, block_kv=block_kv,
              page_size=page_size)
          s = ops.qk(q16_smem, k16_smem, (WG_ROWS, block_kv))
          plgpu.barrier_arrive(k16_free)
          s = s * lax.broadcast_in_dim(k_cols, s.shape, [1])
          carried = (unit, *next_scales)
        else:
          s = ops.qk(q16_smem, k_smem.at[slot], (WG_ROWS, block_kv))
          plgpu.barrier_arrive(k_free.at[slot])
        if by_block:
          fixup, max_pos = block_flags(rec, layout, page_size)
        else:
          fixup, max_pos = rec[layout.fixup] != 0, rec[layout.max_pos]
        if cfg.mask_fast_path:
          needs_mask = fixup | (max_pos > q_pos)
          s = lax.cond(needs_mask, lambda s: mask_scores(s, rec, q_pos),
                       lambda s: s, s)
        else:
          s = mask_scores(s, rec, q_pos)
        acc, m_new, l, p = softmax_update(acc, m, l, s, acc_factor)
        if quantized:  # V scales per P column; l keeps the unscaled p
          p = p * lax.broadcast_in_dim(v_cols, p.shape, [1])
        p16 = p.astype(dtype)
        acc, l, m_new, p16 = ops.optimization_barrier((acc, l, m_new, p16))
        if quantized:  # the converter zeroed invalid V rows as it widened
          plgpu.barrier_wait(v16_ready)
          acc = ops.pv(acc, p16, v16_smem)
          plgpu.barrier_arrive(v16_free)
        else:
          plgpu.barrier_wait(v_bars.at[slot])
          pl.when(fixup)(lambda: fixup_v(slot, rec))
          acc = ops.pv(acc, p16, v_smem.at[slot])
          plgpu.barrier_arrive(v_free.at[slot])
        return acc, m_new, l, *carried

      if quantized:
        carried = (jnp.float32(0.0), *load_scales(batch, head, first))
      elif by_block:  # no rotation yet: the first live page rotates
        carried = (jnp.int32(INT32_MIN),
                   *(first_page(first) if cfg.rotate_ahead else ()))
      else:
        carried = ()
      acc, m, l, *carried = lax.fori_loop(
          0, n_steps, step, (*softmax_start(ops, head_dim), *carried))
      if quantized:  # back from units of the largest V scale
        acc = acc * carried[0]
      # The item's f32 query tile is dead now: it stages the partial output.
      q_tile[...] = acc
      ml_smem[0] = m
      ml_smem[1] = l
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(q_tile.at[pl.ds(0, rows)],
                              acc_ref.at[batch, split, head])
      plgpu.copy_smem_to_gmem(ml_smem, ml_ref.at[batch, split, head])
      # Both buffers are rewritten by the next items (query, m / l).
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      return ring_step + n_steps

    fetch_query(0, 0)
    lax.fori_loop(0, my_items, one_item, jnp.int32(0))
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == 1)
  def _produce():
    if not interpret:
      plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

    field_calls = producer_calls(
        (rec_ref, pos_ref, len_ref, shift_ref), layout=layout,
        page_offset=page_offset, num_pages=k_ref.shape[1] // page_size,
    ) if fields else {}  # the records come from the page metadata itself

    def one_item(j, ring_step):
      batch, head, _, first, n_steps = item(j)
      return produce_kv_ring(
          n_steps, batch, head, page_offset_ref, rec_ref, k_ref, v_ref,
          cs_ref, rec_smem, k_smem, v_smem, cs_smem, k_bars, v_bars, k_free,
          v_free, layout=layout, pages_per_block=ppb, page_size=page_size,
          stages=stages, interpret=interpret, first_record=first,
          ring_step=ring_step, drain=False, set_registers=False,
          cs_stages=cs_stages,
          cs_rows=0 if cfg.rope_in_kernel else ppb if by_block else None,
          copy_contiguous_blocks=cfg.copy_contiguous_blocks,
          l2_prefetch=cfg.l2_prefetch, **field_calls)

    ring_steps = lax.fori_loop(0, my_items, one_item, jnp.int32(0))
    drain_kv_ring(ring_steps, k_free, v_free, stages=stages)

  if quantized:
    pl.when(wg == 2)(lambda: convert_work_items(
        my_items, lambda j: item(j)[4], k_smem, v_smem, rec_smem, k16_smem,
        v16_smem, k_bars, v_bars, k_free, v_free, k16_ready, v16_ready,
        k16_free, v16_free, registers=CONVERTER_REGISTERS,
        interpret=interpret, ops=ops, layout=layout, pages_per_block=ppb,
        page_size=page_size, stages=stages, dtype=dtype))


def mgpu_decode_kernel(q_tile, k_pages, v_pages, n_steps, records, cos_sin,
                       q_pos, page_offset=0, *, group: int, num_splits: int,
                       compute_dtype, rope: RopeConfig | None = None,
                       k_scales=None, v_scales=None,
                       block_sizes: MgpuDecodeBlockSizes | None = None,
                       interpret: bool = False):
  """The kernel alone.

  Args:
    q_tile: f32 [B, K, 64, H] from `gpu_decode_mgpu.decode_query_tile`.
    k_pages, v_pages: [K, num_pages, P, H], 16-bit (compute_dtype), or
      float8_e4m3fn with f32 k_scales, v_scales [K, num_pages].
    n_steps, records, cos_sin, q_pos: the DecodePlan fields (records: the
      four page fields with `block_sizes.fields_in_kernel`).
    page_offset: int32 scalar added to every physical page id.
    group: G = N / K (rows of q_tile that are real heads).
    num_splits: S, CTAs per (batch row, kv head).
    compute_dtype: q's 16-bit dtype: the wgmma operands (with float8 pages,
      `block_sizes.float8_operand` may pick float16 instead).
    rope: the RoPE whose cos / sin the kernel computes
      (`block_sizes.rope_in_kernel`; else unused).

  Returns:
    (acc f32 [B, S, K, Gp, H], ml f32 [B, S, K, 2, 64]) with Gp =
    out_rows(G): unnormalised partial outputs, running max and sum (base 2).
  """
  block_sizes = block_sizes or MgpuDecodeBlockSizes()
  batch, num_kv_heads, _, head_dim = q_tile.shape
  page_size = k_pages.shape[2]
  block_kv = block_sizes.block_kv
  ppb = block_kv // page_size
  fields = block_sizes.fields_in_kernel
  layout = (PageFieldsLayout if fields else BlockRecordLayout
            if block_sizes.steps_by_block else RecordLayout)(ppb)
  if fields:  # records: the four page fields
    records, other_fields = check_fields(records)
  else:
    other_fields = [jnp.zeros((1, 1), jnp.int32)] * 3  # unused
    if records.shape[-1] != layout.width:
      raise ValueError(f"records width {records.shape[-1]} must be "
                       f"{layout.width} for block_kv {block_kv} and page "
                       f"size {page_size}")
  rows = out_rows(group)
  num_items = batch * num_kv_heads * num_splits
  num_ctas = mgpu_decode_num_ctas(block_sizes, num_items)
  query_buffers = 2 if num_ctas < num_items else 1
  page_offset = jnp.reshape(jnp.asarray(page_offset, jnp.int32), (1,))
  quantized = k_scales is not None
  dtype = jnp.dtype(compute_dtype)
  if quantized and block_sizes.float8_operand == "float16":
    dtype = jnp.dtype(jnp.float16)
  if not quantized:  # unused operands, one f32 each
    k_scales = v_scales = jnp.zeros((1, 1), jnp.float32)
  half = head_dim // 2
  if block_sizes.rope_in_kernel:
    if rope is None:
      raise ValueError("rope_in_kernel needs the rope")
    chunks = rope.turn_chunks(head_dim)[:, :half]  # (its halves repeat)
    if block_sizes.compact_cos_sin:  # each column in every row
      chunks = np.repeat(chunks[:, None, :],
                         shift_cos_sin_shape(head_dim)[0], axis=1)
    chunks = jnp.asarray(chunks)
  else:  # unused
    chunks = jnp.zeros((NUM_TURN_CHUNKS, half), jnp.int32)
  scratch = decode_scratch(block_sizes, head_dim=head_dim,
                           page_size=page_size, kv_dtype=k_pages.dtype,
                           dtype=dtype, record_width=layout.width,
                           query_buffers=query_buffers,
                           chunks_shape=chunks.shape, quantized=quantized)
  kernel = functools.partial(_kernel, cfg=block_sizes, page_size=page_size,
                             num_splits=num_splits, num_items=num_items,
                             num_ctas=num_ctas, rows=rows, layout=layout,
                             dtype=dtype, interpret=interpret)
  extra = {}
  if interpret:
    extra["interpret"] = interpreter_params()
  out_shape = (
      jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, rows, head_dim),
                           jnp.float32),
      jax.ShapeDtypeStruct((batch, num_splits, num_kv_heads, 2, WG_ROWS),
                           jnp.float32),
  )
  return plgpu.kernel(
      kernel,
      out_type=out_shape,
      scratch_types=scratch,
      grid=(num_ctas,),
      grid_names=("cta",),
      num_threads=3 if quantized else 2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **extra,
  )(n_steps, records, cos_sin, q_pos, page_offset, chunks, q_tile,
    common.flat_pages(k_pages), common.flat_pages(v_pages), k_scales,
    v_scales, *other_fields)
