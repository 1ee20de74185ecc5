"""The Mosaic GPU (Hopper) lazy prefill kernel: kernel body and builder.

One CTA per (tile of query units, kv head, batch row).  A producer
warpgroup TMA-copies each step's KV pages, its step record and its segment's
cos/sin (or a record that carries them: cos_sin_in_records) into a ring of
shared-memory slots; one or two compute warpgroups each take 64 query rows
of one query head (with a 16-bit query, the raw rows, which each rotates
first by their positions from the plan's Q15 cos / sin table:
MgpuBlockSizes.rotates_query_in_kernel), rotate them by -shift for a
segment's first step while the step before's P V wgmma runs (into
registers, the A operand of Q K^T, in packed 16-bit arithmetic by default:
segment_rotation_16bit; or into shared memory with `query_in_registers=False`
and float8), and run the online softmax (base 2) with wgmma, the two
warpgroups in ping-pong.
Float8 pages (e4m3): a converter warpgroup widens each step's K and V into
one 16-bit K and V tile the compute warpgroups share, as in the decode
(gpu_mgpu_float8.py; per-page scales per score and P column).  The
inputs come from `gpu_prefill_mgpu_plan.plan_prefill` (and, where the
kernel does not rotate the query itself,
`gpu_prefill_mgpu.rotated_query_tokens`).

Design: docs/kernels.md.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import WG_ROWS, MgpuBlockSizes
from pallas_kernels.gpu_mgpu_float8 import (
    convert_kv_ring, drain_converted, float8_registers, float8_scratch,
    load_page_scales, ring_transforms, step_scales)
from pallas_kernels.gpu_mgpu_parts import (
    COMPUTE_REGISTERS, Ops, interpreter_params, key_positions,
    record_cos_sin, rope_rows_from_table, rotate_query, rotated_query_halves,
    softmax_start, softmax_update, zero_invalid_v_rows)
from pallas_kernels.gpu_mgpu_producer import produce_kv_ring
from pallas_kernels.gpu_prefill_mgpu_plan import (PrefillPlan, RecordLayout,
                                                  check_plan_fits)


def _kernel(
    # Plan (per batch, the same for every layer; see PrefillPlan).
    n_steps_ref,  # int32 [B, tiles]
    min_row_ref,  # int32 [B, token blocks]
    rec_ref,  # int32 [B, steps, record width]
    cs_ref,  # f32 [B, M, 2, H/2]
    row_pos_ref,  # int32 [B, T_pad]
    page_offset_ref,  # int32 [1]: added to every physical page id
    table_ref,  # [B, T_pad, H] 16-bit: each row's Q15 cos | sin as int16
    #            bits (rotates_query_in_kernel; else unused)
    scale_ref,  # f32 [1]: sm_scale * log2(e) (rotates_query_in_kernel)
    # Operands.
    q_ref,  # [B, T_pad, N, H]: R(q_pos) q * sm_scale * log2(e), f32 or
    #        q's 16-bit dtype (MgpuBlockSizes.query_in_f32); with
    #        rotates_query_in_kernel the raw 16-bit query
    k_ref,  # [K, pages * P, H] in the pool's dtype (16-bit or float8)
    v_ref,  # [K, pages * P, H]
    ks_ref,  # f32 [K, pages]: K scale of each page (float8; else unused)
    vs_ref,  # f32 [K, pages]: V scale of each page
    # Output.
    o_ref,  # [B, T_pad, N, H]
    # Scratch (float8: the 16-bit K and V tiles and their ready and free
    # barriers at the end).
    q_store_smem, q16_smem, k_smem, v_smem, rec_smem, cs_smem, rp_smem, q_bars,
    k_bars, v_bars, k_free, v_free, sched_bar, *float8_scratch,
    cfg: MgpuBlockSizes, page_size: int, group: int, layout: RecordLayout,
    dtype, interpret: bool):
  ops = Ops(interpret)
  nwg, stages, block_kv = cfg.num_compute_wgs, cfg.num_stages, cfg.block_kv
  ppb = block_kv // page_size
  head_dim = q_ref.shape[-1]
  half = head_dim // 2
  quantized = bool(float8_scratch)  # dtype: the 16-bit wgmma operand dtype
  if quantized:
    k16, v16, k16_ready, v16_ready, k16_free, v16_free = float8_scratch
    compute_regs, producer_regs, converter_regs = float8_registers(nwg)
  else:
    compute_regs, producer_regs = COMPUTE_REGISTERS, None
  cs_stages = cs_smem.shape[0]  # twice as deep with float8 (the decode's)
  if cfg.dependent_launch and not interpret:  # before any global read
    plgpu.griddepcontrol_wait()
  page_offset = page_offset_ref[0]
  tile = lax.axis_index("tile")
  head = lax.axis_index("head")
  batch = lax.axis_index("batch")
  wg = lax.axis_index("wg")
  n_steps = n_steps_ref[batch, tile]
  use_sched = nwg == 2 and cfg.schedule_barrier
  # The rotated query's halves ride in the loop carry (registers) instead
  # of q16_smem, rotated while the step before's P V wgmma runs.
  regs_query = cfg.query_in_registers and not float8_scratch
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per row

  def schedule():
    if use_sched:
      plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(sched_bar)

  @pl.when(wg < nwg)
  def _compute():
    if not interpret:
      plgpu.set_max_registers(compute_regs, action="increase")
    unit = tile * nwg + wg
    token_block = lax.div(unit, jnp.int32(group))
    query_head = head * group + (unit - token_block * group)
    tokens = pl.ds(token_block * WG_ROWS, WG_ROWS)
    q_store = q_store_smem.at[wg]  # R(q_pos) q, f32 or 16-bit
    q16 = q16_smem.at[wg]
    plgpu.copy_gmem_to_smem(q_ref.at[batch, tokens, query_head], q_store,
                            q_bars.at[wg])
    plgpu.copy_gmem_to_smem(row_pos_ref.at[batch, tokens], rp_smem.at[wg],
                            q_bars.at[wg])
    if cfg.rotates_query_in_kernel:  # the table into q16, free until step 0
      plgpu.copy_gmem_to_smem(table_ref.at[batch, tokens], q16, q_bars.at[wg])
    plgpu.barrier_wait(q_bars.at[wg])
    if cfg.rotates_query_in_kernel:  # R(q_pos) q * scale, in place
      rope_rows_from_table(q_store, q16, scale_ref[0], half)
    row_pos = ops.cast(rp_smem[wg], row_layout)
    oldest_row = min_row_ref[batch, token_block]

    def step_cos_sin(j):
      """Step j's segment cos / sin from its record (cos_sin_in_records;
      the record ring outlives the cos/sin ring), else None: the ring's."""
      if not cfg.cos_sin_in_records:
        return None
      return record_cos_sin(ops, rec_smem.at[lax.rem(j, 2 * stages)],
                            layout.cos_sin, half)

    def rotate(j):
      rotate_query(ops, q_store, q16, cs_smem, lax.rem(j, cs_stages), half,
                   dtype, step_cos_sin(j))

    def load_scales(row):
      # The CTA's steps are the plan rows 0..n_steps - 1 of its batch row.
      return load_page_scales(rec_ref, ks_ref, vs_ref, batch, head, row,
                              page_offset, layout=layout,
                              pages_per_block=ppb)

    def mask_scores(s, rec):
      key_pos = key_positions(ops, rec, layout, ppb, page_size, block_kv)
      key_pos = lax.broadcast_in_dim(key_pos, s.shape, [1])
      visible = key_pos <= lax.broadcast_in_dim(row_pos, s.shape, [0])
      return jnp.where(visible, s, -jnp.inf)

    def fixup_v(slot, rec):
      zero_invalid_v_rows(ops, v_smem.at[slot], v_smem.at[slot], rec, layout,
                          ppb, page_size, block_kv, head_dim, dtype)

    acc, m, l = softmax_start(ops, head_dim)

    def next_step_ready(j):
      """Waits for step j's K (with its record and cos/sin) and, where j
      starts a segment, rotates the query for it.  Step j - 1 calls this
      while its P V wgmma runs, so the rotation is off the tensor cores'
      path: step j - 1's Q K^T is done with q16 by then."""
      @pl.when(j < n_steps)
      def _():
        # float8: the converter waited for the slot (record and cos/sin
        # included) before it widened K.
        plgpu.barrier_wait(k16_ready if quantized
                           else k_bars.at[lax.rem(j, stages)])
        if not regs_query:
          rec = rec_smem.at[lax.rem(j, 2 * stages)]
          pl.when(rec[layout.new_seg] != 0)(lambda: rotate(j))

    def halves_ready(j, halves):
      """Waits for step j's K; returns its rotated query halves (regs_query):
      rotated from q_store where j starts a segment, else `halves`.  Step
      j - 1 calls this while its P V wgmma runs, the halves leaving that
      wgmma's scope with the accumulator."""
      next_step_ready(j)
      starts = (j < n_steps) & (
          rec_smem[lax.rem(j, 2 * stages), layout.new_seg] != 0)
      return lax.cond(
          starts,
          lambda: rotated_query_halves(ops, q_store, cs_smem,
                                       lax.rem(j, cs_stages), half, dtype,
                                       step_cos_sin(j),
                                       cfg.segment_rotation_16bit),
          lambda: tuple(halves))

    if not regs_query:
      next_step_ready(jnp.int32(0))
    if use_sched:
      pl.when(wg == 1)(schedule)

    def step(i, carry):
      # float8 pools: [acc's V-scale unit, this step's K and V scales];
      # regs_query: [the rotated query's two halves]
      acc, m, l, *carried = carry
      slot = lax.rem(i, stages)
      # The record ring is twice as deep as the K/V ring: the record is read
      # after the K slot is released (masks, V fix-up), and the producer
      # rewrites record slot r only after both warpgroups released the K of
      # step i - stages, i.e. after they finished step i - 2 * stages.
      rec = rec_smem.at[lax.rem(i, 2 * stages)]
      acc_factor = None
      if quantized:
        next_scales = load_scales(i + 1)
        k_cols, v_cols, acc_factor, unit = step_scales(
            ops, rec, *carried, layout=layout, block_kv=block_kv,
            page_size=page_size)
        s = ops.qk(q16, k16, (WG_ROWS, block_kv), schedule)
        plgpu.barrier_arrive(k16_free)
        s = s * lax.broadcast_in_dim(k_cols, s.shape, [1])
        carried = (unit, *next_scales)
      elif regs_query:  # rotated during the step before's P V
        s = ops.qk_halves(*carried, k_smem.at[slot], (WG_ROWS, block_kv),
                          schedule)
        plgpu.barrier_arrive(k_free.at[slot])
      else:
        s = ops.qk(q16, k_smem.at[slot], (WG_ROWS, block_kv), schedule)
        plgpu.barrier_arrive(k_free.at[slot])
      fixup = rec[layout.fixup] != 0
      if cfg.mask_fast_path:
        needs_mask = fixup | (rec[layout.max_pos] > oldest_row)
        s = lax.cond(needs_mask, lambda s: mask_scores(s, rec), lambda s: s,
                     s)
      else:
        s = mask_scores(s, rec)
      acc, m_new, l, p = softmax_update(acc, m, l, s, acc_factor)
      if quantized:  # V scales per P column; l keeps the unscaled p
        p = p * lax.broadcast_in_dim(v_cols, p.shape, [1])
      p16 = p.astype(dtype)
      acc, l, m_new, p16 = ops.optimization_barrier((acc, l, m_new, p16))
      if use_sched:
        plgpu.barrier_arrive(sched_bar)  # softmax done
      if quantized:  # the converter zeroed invalid V rows as it widened
        plgpu.barrier_wait(v16_ready)
      else:
        plgpu.barrier_wait(v_bars.at[slot])
        pl.when(fixup)(lambda: fixup_v(slot, rec))
      if use_sched:
        plgpu.barrier_wait(sched_bar)  # tensor cores free
      if regs_query:
        acc, *carried = ops.pv_carry(
            acc, p16, v_smem.at[slot], carried,
            lambda halves: halves_ready(i + 1, halves))
      else:
        acc = ops.pv(acc, p16, v16 if quantized else v_smem.at[slot],
                     lambda: next_step_ready(i + 1))
      plgpu.barrier_arrive(v16_free if quantized else v_free.at[slot])
      return acc, m_new, l, *carried

    if quantized:
      carried = (jnp.float32(0.0), *load_scales(jnp.int32(0)))
    elif regs_query:  # every CTA's first step starts a segment
      zero = ops.cast(jnp.zeros((WG_ROWS, half), dtype), plgpu.Layout.WGMMA)
      carried = halves_ready(jnp.int32(0), (zero, zero))
    else:
      carried = ()
    acc, m, l, *carried = lax.fori_loop(0, n_steps, step,
                                        (acc, m, l, *carried))
    if use_sched:
      pl.when(wg == 0)(schedule)
    seen = l > 0
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    if quantized:  # back from units of the largest V scale
      inv_l = inv_l * carried[0]
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    # float8: the operands are f16; q's dtype stages the output (q_store,
    # dead after the last rotation; mgpu_prefill_kernel checks its dtype).
    out_smem = q_store if quantized else q16
    out_smem[...] = out.astype(out_smem.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, o_ref.at[batch, tokens, query_head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == nwg)
  def _produce():
    if quantized and not interpret:
      plgpu.set_max_registers(producer_regs, action="decrease")
    produce_kv_ring(
        n_steps, batch, head, page_offset_ref, rec_ref, k_ref, v_ref, cs_ref,
        rec_smem, k_smem, v_smem, cs_smem, k_bars, v_bars, k_free, v_free,
        layout=layout, pages_per_block=ppb, page_size=page_size,
        stages=stages, interpret=interpret, set_registers=not quantized,
        cs_stages=cs_stages, cs_rows=0 if cfg.cos_sin_in_records else None,
        copy_contiguous_blocks=cfg.copy_contiguous_blocks,
        l2_prefetch=cfg.l2_prefetch)

  if quantized:
    @pl.when(wg == nwg + 1)
    def _convert():
      if not interpret:
        plgpu.set_max_registers(converter_regs, action="decrease")
      ring_steps = convert_kv_ring(
          n_steps, jnp.int32(0), k_smem, v_smem, rec_smem, k16, v16, k_bars,
          v_bars, k_free, v_free, k16_ready, v16_ready, k16_free, v16_free,
          ops=ops, layout=layout, pages_per_block=ppb, page_size=page_size,
          stages=stages, dtype=dtype)
      drain_converted(ring_steps, k16_free, v16_free)


def mgpu_prefill_kernel(q_rot, k_pages, v_pages, plan: PrefillPlan,
                        page_offset=0, *, out_dtype,
                        block_sizes: MgpuBlockSizes | None = None,
                        interpret: bool = False, k_scales=None,
                        v_scales=None, sm_scale=None):
  """The kernel alone: q_rot from `rotated_query_tokens`, plan from
  `plan_prefill`; float8_e4m3fn pages take f32 k_scales, v_scales [K,
  num_pages] (f16 wgmma operands, 16-bit query storage only).  With
  `block_sizes.rotates_query_in_kernel`, q_rot is the raw 16-bit query padded
  to T_pad, the plan must be made with those block sizes (its query cos /
  sin table) and `sm_scale` (float or f32 scalar) is required.  Returns
  out_dtype [B, T_pad, N, H]."""
  block_sizes = block_sizes or MgpuBlockSizes()
  quantized = k_scales is not None
  if quantized and block_sizes.query_in_f32:
    raise ValueError("float8 pages need 16-bit query storage "
                     "(MgpuBlockSizes(query_in_f32=False))")
  want = jnp.float32 if block_sizes.query_in_f32 else out_dtype
  if q_rot.dtype != jnp.dtype(want):
    raise ValueError(f"q_rot dtype {q_rot.dtype} must be {jnp.dtype(want)} "
                     f"for query_in_f32={block_sizes.query_in_f32}")
  batch, t_pad, num_heads, head_dim = q_rot.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  nwg, stages = block_sizes.num_compute_wgs, block_sizes.num_stages
  block_kv = block_sizes.block_kv
  ppb = block_kv // page_size
  in_records = block_sizes.cos_sin_in_records
  layout = RecordLayout(ppb, cos_sin_dim=head_dim if in_records else 0)
  num_tiles = check_plan_fits(plan, layout, block_sizes, t_pad=t_pad,
                              group=group, head_dim=head_dim)
  if block_sizes.rotates_query_in_kernel:
    if sm_scale is None:
      raise ValueError("a kernel that rotates the query needs sm_scale")
    scale = jnp.reshape(jnp.asarray(sm_scale, jnp.float32)
                        * jnp.float32(common.LOG2_E), (1,))
  else:  # unused operands
    scale = jnp.zeros((1,), jnp.float32)
  page_offset = jnp.reshape(jnp.asarray(page_offset, jnp.int32), (1,))

  # The wgmma operands: the pool's 16-bit dtype, f16 for float8 pages.
  dtype = jnp.dtype(jnp.float16) if quantized else k_pages.dtype
  # The query table is copied into q16: its int16 bits in q16's dtype.
  table = (lax.bitcast_convert_type(plan.query_cos_sin, dtype)
           if block_sizes.rotates_query_in_kernel
           else jnp.zeros((1, 1, 1), dtype))
  if not quantized:  # unused operands, one f32 each
    k_scales = v_scales = jnp.zeros((1, 1), jnp.float32)
  swizzle = min(128, head_dim)  # bytes of one half row of 16-bit elements
  tiled16 = (plgpu.TilingTransform((8, swizzle // 2)),
             plgpu.SwizzleTransform(swizzle))
  tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  ring = ring_transforms(head_dim) if quantized else tiled16
  # float8: the converter alone frees the ring's slots; the compute
  # warpgroups free the 16-bit tiles.
  slot_users = 1 if quantized else nwg
  scratch = [
      plgpu.SMEM((nwg, WG_ROWS, head_dim), q_rot.dtype,
                 transforms=tiled32 if block_sizes.query_in_f32 else tiled16),
      plgpu.SMEM((nwg, WG_ROWS, head_dim), dtype, transforms=tiled16),
      plgpu.SMEM((stages, block_kv, head_dim), k_pages.dtype,
                 transforms=ring),
      plgpu.SMEM((stages, block_kv, head_dim), k_pages.dtype,
                 transforms=ring),
      plgpu.SMEM((2 * stages, layout.width), jnp.int32),
      # The cos/sin ring (one unused slot when the records carry them).
      plgpu.SMEM((1 if in_records else (2 if quantized else 1) * stages, 2,
                  head_dim // 2), jnp.float32),
      plgpu.SMEM((nwg, WG_ROWS), jnp.int32),
      # q, row_pos (and the query's cos / sin table)
      plgpu.Barrier(num_arrivals=2 + block_sizes.rotates_query_in_kernel,
                    num_barriers=nwg),
      # K pages, record (and cos/sin)
      plgpu.Barrier(num_arrivals=ppb + (1 if in_records else 2),
                    num_barriers=stages),
      plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),  # V pages
      plgpu.Barrier(num_arrivals=slot_users, num_barriers=stages),  # K free
      plgpu.Barrier(num_arrivals=slot_users, num_barriers=stages),  # V free
      plgpu.Barrier(num_arrivals=nwg),  # schedule (ping-pong)
  ]
  if quantized:  # 16-bit K and V tiles; ready (1) and free (nwg) barriers
    scratch += float8_scratch(block_kv, head_dim, dtype, tiled16, nwg)
  kernel = functools.partial(_kernel, cfg=block_sizes, page_size=page_size,
                             group=group, layout=layout, dtype=dtype,
                             interpret=interpret)
  extra = {}
  if interpret:
    extra["interpret"] = interpreter_params()
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((batch, t_pad, num_heads, head_dim),
                                    out_dtype),
      scratch_types=scratch,
      # The last axis is CUDA's x, launched fastest: a (batch row, kv head)'s
      # CTAs run side by side and share its K/V in L2.
      grid=(batch, num_kv_heads, num_tiles),
      grid_names=("batch", "head", "tile"),
      num_threads=nwg + (2 if quantized else 1),
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **extra,
  )(plan.n_steps, plan.min_row, plan.records, plan.cos_sin, plan.row_pos,
    page_offset, table, scale, q_rot, common.flat_pages(k_pages),
    common.flat_pages(v_pages), k_scales, v_scales)
