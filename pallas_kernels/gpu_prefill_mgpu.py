"""Lazy (deferred-RoPE) paged prefill on Hopper: Pallas, Mosaic GPU lowering.

Same contract and result as `pallas_kernels.gpu_prefill.lazy_prefill_gpu`
(the Triton kernel); this one is written for H100/H200 tensor cores: TMA
copies of whole KV pages into a multi-stage shared-memory ring and wgmma for
both matmuls, FlashAttention-3 style (warp specialisation: a producer
warpgroup and two compute warpgroups).  Why: the Triton kernel spends its time on
per-element gather addressing (integer ALU, 255 registers, 12.5 % occupancy)
and leaves the tensor cores mostly idle.  Here the gather happens at page
granularity in the TMA unit and no per-element address is ever computed.

Layout of the work:

- Queries stay in their [B, T, N, H] layout: XLA only rotates them,
  R(q_pos) q computed in f32 with sm_scale * log2(e) folded in
  (`rope.rotated_query`) and stored in q's dtype by default, and the kernel
  TMA-copies a (64 tokens, one query head) box straight out of that array;
  the output is written back the same way into [B, T, N, H].  No relayout
  of q or of the output.
- Work units of one (batch row, kv head) are u = token_block * G + g: 64
  tokens of query head g of the group.  One compute warpgroup takes one
  unit (one wgmma M of 64 rows); a CTA takes `num_compute_wgs` consecutive
  units, so with G even both warpgroups see the same 64 tokens (two heads
  of the group) and the CTA streams the kv head's pages once for both.
  Grid (units / num_compute_wgs, K, B).  T is padded to whole token blocks
  (and one more block when the unit count would not split evenly).
- XLA (metadata only, outside the kernel) flattens the batch row's work into
  a list of *steps*: one step = one KV block of `block_kv / page_size`
  logical pages of one segment (a run of live pages with one shift,
  `gpu_prefill.prefill_segments`).  Per step a 128-byte-multiple int32
  record holds the physical page ids, page_pos, the number of valid slots
  `lim` of each page (0 for a page outside the segment, dead, or past M),
  the segment index, a new-segment flag, a "needs fix-up" flag (some lim <
  page_size) and the largest valid key position.  Per CTA, `n_steps` counts
  the steps that hold a page the tile can see (causal skipping:
  `gpu_prefill.tile_page_ends`); steps are in page order, so it is a prefix.
- The cos/sin vectors of each segment's shift (f32 [2, H/2]) are computed in
  XLA with `rope.cos_sin_from_chunks` (exact range reduction), once per
  segment, not per row.
- Producer warpgroup: per step, TMA-copies each page (page_size rows) of K
  and V into the ring slot, plus the step record and the segment's cos/sin
  (they ride on the K barrier).  It reads the page ids with scalar GMEM
  loads.  One barrier arrival per copy (barrier arrival counts say so).
  The record ring is twice as deep as the K/V ring, because the compute
  warpgroups still read the record (masks, V fix-up) after they released
  the step's K slot (a race the Mosaic GPU interpreter caught).
- Compute warpgroups, per step: wait K; at a segment's first step rotate the
  warpgroup's query tile by -shift (tile in SMEM -> f32 registers, one
  cos/sin column vector broadcast over rows -> bf16 tile in SMEM, the wgmma
  A operand); S = Q K^T (wgmma); mask if needed; online softmax in base 2;
  wait V; O += P V (wgmma, accumulator in registers).  Keys are never
  rotated.  Optionally (`schedule_barrier`) the two warpgroups ping-pong
  on a schedule barrier as in jax's `attention_mgpu.py`.

Masking and NaN safety (pages hold NaN in unused pages / padding slots):
- S: a step needs a mask iff some page of its block is not fully valid
  (fix-up flag) or its newest key is newer than the warpgroup's oldest row.
  Only then (lax.cond) the scores go through `where(visible, s, -inf)`,
  `visible` built from a per-column key position (a column vector, INT_MAX
  for invalid slots) compared with the per-row position: a select, so a NaN
  score of an invalid column is dropped, never multiplied.
- V: p = 0 does not protect the P V product from a NaN row of V (0 * NaN =
  NaN), and TMA copies whole pages.  So on a fix-up step each compute
  warpgroup rewrites the V block in shared memory with `where(row valid, v,
  0)` before its P V wgmma (then fences).  Both warpgroups do this for the
  same slot: they write identical values (valid rows unchanged, invalid rows
  0), so the overlap is benign, and each fences its own writes before its
  own wgmma.  Fix-up steps are rare: a document's last, partial page, a
  dead page, or a block that straddles a segment boundary.  Steps where
  every page is full and live take the fast path (no mask, no fix-up).
- Init of the running max is finite (NEG_INIT), so a row that has seen only
  masked columns keeps p = 0 and l = 0; such rows and padding rows (q_pos =
  -1, zero query, never visible) return exactly 0.

Simplifications (documented, deliberate):
- dtype bf16 or f16 only (wgmma operands); head dim 64 or 128; page_size a
  multiple of 8 (TMA into an (8, x)-tiled SMEM tile) dividing block_kv.
- cos/sin per segment come from XLA (exact, as the contract asks), the step
  list too; both are small (B * steps * 128 bytes, B * M * 4 * H bytes).
- Both compute warpgroups of a CTA run all of the CTA's steps (the causal
  skip is per CTA tile, not per warpgroup); the mask handles the rest.
- The query tile R(q_pos) q is kept in SMEM in q's 16-bit dtype by default
  (16 KB per warpgroup) and rotated by -shift in f32 registers, so it is
  rounded twice (by XLA, then per segment) where an f32 copy would round
  once; measured parity is unchanged at the bf16 tolerance.  With 128-key
  steps, two warpgroups and 2 stages the CTA uses about 196 KB of shared
  memory; `query_in_f32=True` (32 KB per warpgroup) needs 64-key steps.
- `page_offset` (an int32 scalar input, not part of the plan) is added to
  every physical page id by the producer, so a model whose layers live in
  one page array at per-layer offsets can make one plan for all layers.

`interpret=True` runs the kernel in the (experimental, jax >= 0.10) Mosaic
GPU interpreter on CPU: layouts are dropped and the two matmuls become
jnp dots on the same SMEM tiles; everything else (ring, barriers, TMA
copies, step records, rotation, masks, fix-ups) is the same code.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_prefill import prefill_segments, tile_page_ends
from pallas_kernels.lazy_attention import check_lazy_attention_shapes
from pallas_kernels.rope import (RopeConfig, cos_sin_from_chunks,
                                 rotated_query)
from pallas_kernels.sizes import ceil_div, round_up

# Rows per compute warpgroup: the M of one wgmma.
WG_ROWS = 64
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
# Registers per thread (setmaxnreg) of compute / producer warpgroups.
_PRODUCER_REGISTERS = 40
_COMPUTE_REGISTERS = 232
# Shared memory we allow ourselves (H100/H200: 227 KB per block opt-in).
_SMEM_LIMIT = 227 * 1024


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
  """Tiles of the Mosaic GPU prefill kernel.

  Attributes:
    block_kv: keys per step (whole pages): 64 or 128.
    num_compute_wgs: compute warpgroups per CTA (64 query rows each), 1 or 2.
    num_stages: depth of the K/V shared-memory ring (>= 2).
    schedule_barrier: ping-pong the two compute warpgroups (FA3 style).
    mask_fast_path: skip the score mask on steps that need none.
    query_in_f32: keep R(q_pos) q in float32 (one rounding to 16 bits per
      segment).  False keeps it in q's 16-bit dtype (two roundings, half the
      shared memory: room for block_kv 128 with two warpgroups).
  """

  # Defaults: 128-key steps, two compute warpgroups, two stages, 16-bit
  # query storage.  On the H200 (jax 0.11.2, 2026-11-29, whole call at the
  # 512-token chunk): 0.666-0.672 ms against 0.736-0.743 ms for the previous
  # default (64-key steps, f32 query), in two scripts' side-by-side runs
  # (benchmarks/RESULTS.md section 1).  128-key steps with two warpgroups
  # only fit in shared memory with the 16-bit query.  Two stages beat three
  # at 64-key steps in all four pairs measured that day.
  block_kv: int = 128
  num_compute_wgs: int = 2
  num_stages: int = 2
  # Off by default: the ping-pong barrier cost 5 % with 64-key steps; with
  # 128-key steps it gained 1-2 % in two runs (0.658 vs 0.672 and 0.674 ms),
  # but the GPU test suite has not run with it (benchmarks/kernel_notes.md).
  schedule_barrier: bool = False
  mask_fast_path: bool = True
  query_in_f32: bool = False

  def __post_init__(self):
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
    if self.num_compute_wgs not in (1, 2):
      raise ValueError(
          f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")


def smem_bytes(block_sizes: MgpuBlockSizes, head_dim: int) -> int:
  """Shared memory of one CTA (buffers only; barriers are a few bytes)."""
  wgs, stages = block_sizes.num_compute_wgs, block_sizes.num_stages
  q_store = wgs * WG_ROWS * head_dim * (4 if block_sizes.query_in_f32 else 2)
  q_16 = wgs * WG_ROWS * head_dim * 2
  kv = stages * 2 * block_sizes.block_kv * head_dim * 2
  small = stages * (2 * 256 + 2 * head_dim * 4) + wgs * WG_ROWS * 4
  return q_store + q_16 + kv + small


# --------------------------------------------------------------------------
# Step records (XLA, metadata only)


@dataclasses.dataclass(frozen=True)
class RecordLayout:
  """Field offsets of one int32 step record."""

  pages_per_block: int

  @property
  def phys(self):
    return 0

  @property
  def pos(self):
    return self.pages_per_block

  @property
  def lim(self):
    return 2 * self.pages_per_block

  @property
  def seg(self):
    return 3 * self.pages_per_block

  @property
  def new_seg(self):
    return self.seg + 1

  @property
  def fixup(self):
    return self.seg + 2

  @property
  def max_pos(self):
    return self.seg + 3

  @property
  def width(self):
    # A multiple of 32 int32 (128 bytes): the TMA copy's byte count must
    # split evenly over the 128 threads that arrive on the barrier.
    return round_up(self.seg + 4, 32)


def max_steps(num_logical_pages: int, pages_per_block: int) -> int:
  """Static bound on the steps of one batch row.

  Steps = sum over segments of the blocks its page range touches <= the
  number of blocks + (segments - 1) <= cdiv(M, ppb) + M - 1.
  """
  return ceil_div(num_logical_pages, pages_per_block) + num_logical_pages


def step_records(page_table, page_pos, page_shift, page_len, live, *,
                 num_pages, page_size, pages_per_block):
  """Flattens each batch row's work into KV steps (see module docstring).

  Returns:
    records: int32 [B, S_max, RecordLayout.width];
    num_steps: int32 [B];
    step_first_page: int32 [B, S_max], first page of each step that belongs
      to its segment (INT32_MAX past the row's steps), nondecreasing;
    shift: int32 [B, M], shift of segment j (entries past the count unused).
  """
  batch, num_logical = page_table.shape
  ppb = pages_per_block
  layout = RecordLayout(ppb)
  segments, segment_of_page = prefill_segments(page_shift, live)
  first, end, shift = segments[..., 0], segments[..., 1], segments[..., 2]
  num_segments = segment_of_page[:, -1] + 1  # [B]
  seg_ids = jnp.arange(num_logical, dtype=jnp.int32)[None, :]
  seg_valid = seg_ids < num_segments[:, None]
  first_block = first // ppb
  end_block = ceil_div(end, ppb)
  count = jnp.where(seg_valid, end_block - first_block, 0)
  cum = common.prefix_sum(count.astype(jnp.int32))
  start = cum - count
  num_steps = cum[:, -1]
  s_max = max_steps(num_logical, ppb)
  steps = jnp.arange(s_max, dtype=jnp.int32)
  sorted_start = jnp.where(seg_valid, start, INT32_MAX)
  # compare_all: one [B, S, M] comparison and a sum.  The default binary
  # search is a while loop, and on the GPU each of its iterations is a
  # separate launch: it made this wrapper 0.23 ms at the benchmark shape,
  # a third of the whole call (H200, benchmarks/kernel_notes.md).
  seg = jax.vmap(lambda a: jnp.searchsorted(a, steps, side="right",
                                            method="compare_all"))(
      sorted_start).astype(jnp.int32) - 1
  seg = jnp.clip(seg, 0, num_logical - 1)  # [B, S]
  step_valid = steps[None, :] < num_steps[:, None]
  take = lambda a: jnp.take_along_axis(a, seg, axis=1)
  seg_first, seg_end, seg_start = take(first), take(end), take(start)
  block = take(first_block) + steps[None, :] - seg_start
  page = block[..., None] * ppb + jnp.arange(ppb, dtype=jnp.int32)
  page_c = jnp.clip(page, 0, num_logical - 1).reshape(batch, -1)
  gather = lambda a: jnp.take_along_axis(a, page_c, axis=1).reshape(
      page.shape)
  in_segment = ((page >= seg_first[..., None]) & (page < seg_end[..., None])
                & (page < num_logical) & step_valid[..., None])
  lim = jnp.where(in_segment & gather(live), gather(page_len), 0)
  phys = jnp.clip(gather(page_table), 0, num_pages - 1)
  pos = gather(page_pos)
  new_seg = step_valid & (steps[None, :] == seg_start)
  fixup = jnp.any(lim < page_size, axis=-1)
  max_pos = jnp.max(jnp.where(lim > 0, pos + lim - 1, INT32_MIN), axis=-1)
  step_first = jnp.where(step_valid, jnp.maximum(block * ppb, seg_first),
                         INT32_MAX)
  i32 = lambda x: x.astype(jnp.int32)
  fields = [phys, pos, lim, i32(seg)[..., None], i32(new_seg)[..., None],
            i32(fixup)[..., None], max_pos[..., None]]
  records = jnp.concatenate(fields, axis=-1)
  records = jnp.pad(records, ((0, 0), (0, 0),
                              (0, layout.width - records.shape[-1])))
  records = jnp.where(step_valid[..., None], records, 0)
  return records, num_steps, step_first, shift


def segment_cos_sin(shift, rope: RopeConfig, head_dim: int):
  """f32 [B, M, 2, H/2]: cos and sin of each segment's shift (exact)."""
  half = head_dim // 2
  chunks = jnp.asarray(rope.turn_chunks(head_dim)[:, :half])
  cos, sin = cos_sin_from_chunks(shift[..., None], chunks)
  return jnp.stack([cos, sin], axis=2)


# --------------------------------------------------------------------------
# Kernel


class _Ops:
  """Layout-dependent pieces; the interpreter has no layouts and no wgmma
  transposes, so it takes plain jnp equivalents."""

  def __init__(self, interpret: bool):
    self.interpret = interpret

  def cast(self, x, layout):
    return x if self.interpret else plgpu.layout_cast(x, layout)

  def iota(self, shape, dim, layout):
    if self.interpret:
      return lax.broadcasted_iota(jnp.int32, shape, dim)
    return plgpu.broadcasted_iota(jnp.int32, shape, dim, layout=layout)

  def qk(self, q_ref, k_ref, shape, between=None):
    """S = Q K^T in f32 (K rows are keys)."""
    if self.interpret:
      if between is not None:
        between()
      return lax.dot_general(q_ref[...], k_ref[...], (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)

    def body(acc_ref):
      plgpu.wgmma(acc_ref, q_ref, plgpu.transpose_ref(k_ref, (1, 0)))
      if between is not None:
        between()  # runs while the wgmma is in flight
      return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

  def pv(self, acc, p, v_ref):
    """acc + P V."""
    if self.interpret:
      return acc + lax.dot_general(p, v_ref[...], (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

    def body(acc_ref):
      plgpu.wgmma(acc_ref, p, v_ref)
    return pl.run_state(body)(plgpu.ACC.init(acc))

  def optimization_barrier(self, xs):
    return xs if self.interpret else lax.optimization_barrier(xs)


def _select_per_page(page, values):
  """values[page] for a small static list of scalars (a select chain)."""
  out = values[0]
  for j in range(1, len(values)):
    out = jnp.where(page == j, values[j], out)
  return out


def _kernel(
    # Plan (per batch, the same for every layer; see PrefillPlan).
    n_steps_ref,  # int32 [B, tiles]
    min_row_ref,  # int32 [B, token blocks]
    rec_ref,  # int32 [B, steps, record width]
    cs_ref,  # f32 [B, M, 2, H/2]
    row_pos_ref,  # int32 [B, T_pad]
    page_offset_ref,  # int32 [1]: added to every physical page id
    # Operands.
    q_ref,  # [B, T_pad, N, H]: R(q_pos) q * sm_scale * log2(e), f32 or
    #        q's 16-bit dtype (MgpuBlockSizes.query_in_f32)
    k_ref,  # [K, pages * P, H] in the pool's dtype
    v_ref,  # [K, pages * P, H]
    # Output.
    o_ref,  # [B, T_pad, N, H]
    # Scratch.
    q_store_smem, q16_smem, k_smem, v_smem, rec_smem, cs_smem, rp_smem, q_bars,
    k_bars, v_bars, k_free, v_free, sched_bar, *, cfg: MgpuBlockSizes,
    page_size: int, group: int, layout: RecordLayout, interpret: bool):
  ops = _Ops(interpret)
  nwg, stages, block_kv = cfg.num_compute_wgs, cfg.num_stages, cfg.block_kv
  ppb = block_kv // page_size
  head_dim = q_ref.shape[-1]
  half = head_dim // 2
  dtype = k_ref.dtype
  tile = lax.axis_index("tile")
  head = lax.axis_index("head")
  batch = lax.axis_index("batch")
  wg = lax.axis_index("wg")
  n_steps = n_steps_ref[batch, tile]
  use_sched = nwg == 2 and cfg.schedule_barrier
  wgmma_layout = plgpu.Layout.WGMMA
  row_layout = plgpu.Layout.WGMMA.reduce(1)  # one value per row
  col_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per column

  def schedule():
    if use_sched:
      plgpu.barrier_arrive(sched_bar)
      plgpu.barrier_wait(sched_bar)

  @pl.when(wg < nwg)
  def _compute():
    if not interpret:
      plgpu.set_max_registers(_COMPUTE_REGISTERS, action="increase")
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
    plgpu.barrier_wait(q_bars.at[wg])
    row_pos = ops.cast(rp_smem[wg], row_layout)
    oldest_row = min_row_ref[batch, token_block]

    def rotate(slot):
      """q16 = R(-shift) q in `dtype`; cos/sin of the step's segment."""
      lo = q_store.at[:, pl.ds(0, half)][...].astype(jnp.float32)
      hi = q_store.at[:, pl.ds(half, half)][...].astype(jnp.float32)
      cos = ops.cast(cs_smem[slot, 0], col_layout)
      sin = ops.cast(cs_smem[slot, 1], col_layout)
      cos = lax.broadcast_in_dim(cos, (WG_ROWS, half), [1])
      sin = lax.broadcast_in_dim(sin, (WG_ROWS, half), [1])
      q16.at[:, pl.ds(0, half)][...] = (lo * cos + hi * sin).astype(dtype)
      q16.at[:, pl.ds(half, half)][...] = (hi * cos - lo * sin).astype(dtype)
      plgpu.commit_smem()  # generic-proxy writes -> visible to wgmma

    def page_fields(rec, offset):
      return [rec[offset + j] for j in range(ppb)]

    def mask_scores(s, rec):
      # Key position of each column, INT32_MAX where the slot is invalid.
      col = ops.iota((block_kv,), 0, col_layout)
      page = lax.div(col, jnp.int32(page_size))
      slot_in_page = col - page * page_size
      lim = _select_per_page(page, page_fields(rec, layout.lim))
      pos = _select_per_page(page, page_fields(rec, layout.pos))
      key_pos = jnp.where(slot_in_page < lim, pos + slot_in_page, INT32_MAX)
      key_pos = lax.broadcast_in_dim(key_pos, s.shape, [1])
      visible = key_pos <= lax.broadcast_in_dim(row_pos, s.shape, [0])
      return jnp.where(visible, s, -jnp.inf)

    def fixup_v(slot, rec):
      # Zero the V rows of invalid slots (NaN there would survive p = 0).
      for r0 in range(0, block_kv, WG_ROWS):
        rows = ops.iota((WG_ROWS,), 0, row_layout) + r0
        page = lax.div(rows, jnp.int32(page_size))
        slot_in_page = rows - page * page_size
        lim = _select_per_page(page, page_fields(rec, layout.lim))
        ok = lax.broadcast_in_dim(lim - slot_in_page, (WG_ROWS, head_dim),
                                  [0]) > 0
        ref = v_smem.at[slot, pl.ds(r0, WG_ROWS)]
        ref[...] = jnp.where(ok, ref[...], jnp.zeros((), dtype))
      plgpu.commit_smem()

    m = ops.cast(jnp.full((WG_ROWS,), common.NEG_INIT, jnp.float32),
                 row_layout)
    l = ops.cast(jnp.full((WG_ROWS,), 0.0, jnp.float32), row_layout)
    acc = ops.cast(jnp.full((WG_ROWS, head_dim), 0.0, jnp.float32),
                   wgmma_layout)
    if use_sched:
      pl.when(wg == 1)(schedule)

    def step(i, carry):
      acc, m, l = carry
      slot = lax.rem(i, stages)
      # The record ring is twice as deep as the K/V ring: the record is read
      # after the K slot is released (masks, V fix-up), and the producer
      # rewrites record slot r only after both warpgroups released the K of
      # step i - stages, i.e. after they finished step i - 2 * stages.
      rec = rec_smem.at[lax.rem(i, 2 * stages)]
      plgpu.barrier_wait(k_bars.at[slot])
      pl.when(rec[layout.new_seg] != 0)(lambda: rotate(slot))
      s = ops.qk(q16, k_smem.at[slot], (WG_ROWS, block_kv), schedule)
      plgpu.barrier_arrive(k_free.at[slot])
      fixup = rec[layout.fixup] != 0
      if cfg.mask_fast_path:
        needs_mask = fixup | (rec[layout.max_pos] > oldest_row)
        s = lax.cond(needs_mask, lambda s: mask_scores(s, rec), lambda s: s,
                     s)
      else:
        s = mask_scores(s, rec)
      m_new = jnp.maximum(m, s.max(axis=1))
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
      acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
      l = l * alpha + p.sum(axis=1)
      p16 = p.astype(dtype)
      acc, l, m_new, p16 = ops.optimization_barrier((acc, l, m_new, p16))
      if use_sched:
        plgpu.barrier_arrive(sched_bar)  # softmax done
      plgpu.barrier_wait(v_bars.at[slot])
      pl.when(fixup)(lambda: fixup_v(slot, rec))
      if use_sched:
        plgpu.barrier_wait(sched_bar)  # tensor cores free
      acc = ops.pv(acc, p16, v_smem.at[slot])
      plgpu.barrier_arrive(v_free.at[slot])
      return acc, m_new, l

    acc, m, l = lax.fori_loop(0, n_steps, step, (acc, m, l))
    if use_sched:
      pl.when(wg == 0)(schedule)
    seen = l > 0
    inv_l = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
    out = acc * lax.broadcast_in_dim(inv_l, acc.shape, [0])
    q16[...] = out.astype(dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(q16, o_ref.at[batch, tokens, query_head])
    plgpu.wait_smem_to_gmem(0)

  @pl.when(wg == nwg)
  def _produce():
    if not interpret:
      plgpu.set_max_registers(_PRODUCER_REGISTERS, action="decrease")

    page_offset = page_offset_ref[0]

    def step(i, _):
      slot = lax.rem(i, stages)
      # Scalar reads first: their latency overlaps the wait for the slot.
      phys = [rec_ref[batch, i, layout.phys + j] + page_offset
              for j in range(ppb)]
      seg = rec_ref[batch, i, layout.seg]

      def copy_pages(pages_ref, ring, barrier):
        # One TMA copy per page: the block's pages are not contiguous.
        for j in range(ppb):
          plgpu.copy_gmem_to_smem(
              pages_ref.at[head, pl.ds(phys[j] * page_size, page_size)],
              ring.at[slot, pl.ds(j * page_size, page_size)], barrier)

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(k_free.at[slot])
      copy_pages(k_ref, k_smem, k_bars.at[slot])
      plgpu.copy_gmem_to_smem(rec_ref.at[batch, i],
                              rec_smem.at[lax.rem(i, 2 * stages)],
                              k_bars.at[slot])
      plgpu.copy_gmem_to_smem(cs_ref.at[batch, seg], cs_smem.at[slot],
                              k_bars.at[slot])

      @pl.when(i >= stages)
      def _():
        plgpu.barrier_wait(v_free.at[slot])
      copy_pages(v_ref, v_smem, v_bars.at[slot])
      return ()

    lax.fori_loop(0, n_steps, step, ())

    # Drain: observe the last releases of every slot, so each barrier phase
    # is seen by its waiter (the interpreter checks this; on the GPU it only
    # makes the producer wait for the consumers, having nothing left to do).
    def drain(i, _):
      slot = lax.rem(i, stages)
      plgpu.barrier_wait(k_free.at[slot])
      plgpu.barrier_wait(v_free.at[slot])
      return ()

    lax.fori_loop(jnp.maximum(n_steps - stages, 0), n_steps, drain, ())


def _interpreter_params():
  """jax's experimental Mosaic GPU interpreter (a private API, jax >= 0.10)."""
  try:
    from jax._src.pallas.mosaic_gpu.interpret.params import (  # pylint: disable=g-import-not-at-top
        InterpretGPUParams)
  except ImportError as e:
    # The installed jax lacks a module this feature needs: an ImportError,
    # with the module named, for the caller to catch or read.
    raise ImportError(
        "interpret=True needs jax's Mosaic GPU interpreter "
        "(jax._src.pallas.mosaic_gpu.interpret), which this jax "
        f"{jax.__version__} does not have") from e
  return InterpretGPUParams()


def _unsupported(q_dtype, k_dtype, head_dim: int, page_size: int,
                 block_sizes: MgpuBlockSizes) -> str | None:
  """Why this kernel cannot take these inputs, or None if it can."""
  if jnp.dtype(q_dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    return f"lazy_prefill_mgpu needs q dtype bfloat16 or float16, got {q_dtype}"
  if jnp.dtype(k_dtype) != jnp.dtype(q_dtype):
    return f"k_pages dtype {k_dtype} must equal q dtype {q_dtype}"
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (f"lazy_prefill_mgpu needs q head dim in {SUPPORTED_HEAD_DIMS}, "
            f"got {head_dim}")
  if page_size % 8 or block_sizes.block_kv % page_size:
    return (f"lazy_prefill_mgpu needs a k_pages page_size that is a multiple "
            f"of 8 and divides block_kv={block_sizes.block_kv}, got "
            f"{page_size}")
  need = smem_bytes(block_sizes, head_dim)
  if need > _SMEM_LIMIT - 4096:
    return (f"block_sizes {block_sizes} need {need} bytes of shared memory "
            f"(limit {_SMEM_LIMIT - 4096}); use fewer stages")
  return None


def mosaic_prefill_supported(dtype, head_dim: int, page_size: int) -> bool:
  """Whether the default MgpuBlockSizes handle these inputs."""
  return _unsupported(dtype, dtype, head_dim, page_size,
                      MgpuBlockSizes()) is None


def _check_inputs(q, k_pages, page_size, block_sizes):
  reason = _unsupported(q.dtype, k_pages.dtype, q.shape[-1], page_size,
                        block_sizes)
  if reason is not None:
    raise ValueError(reason)


class PrefillPlan(NamedTuple):
  """Per-batch metadata of the kernel (XLA), the same for every layer.

  Computed by `plan_prefill` from the page metadata and q_pos only, so a
  model can compute it once per forward pass and hand it to every layer's
  `lazy_prefill_mgpu_planned` (as FlashInfer's plan/run split does); layers
  that sit at different offsets of one page array pass `page_offset`.
  """

  n_steps: jax.Array  # int32 [B, tiles]: steps each CTA runs
  min_row: jax.Array  # int32 [B, T_pad / 64]: oldest q_pos of a token block
  records: jax.Array  # int32 [B, steps, width]: step records
  cos_sin: jax.Array  # f32 [B, M, 2, H / 2]: per-segment cos / sin
  row_pos: jax.Array  # int32 [B, T_pad]: q_pos, PADDING_ROW for padding


def padded_query_len(q_len: int, group: int, num_compute_wgs: int) -> int:
  """Tokens the kernel works on: whole 64-token blocks, and as many blocks
  that the (block, query head) units split evenly over the CTAs."""
  blocks = ceil_div(q_len, WG_ROWS)
  while (blocks * group) % num_compute_wgs:
    blocks += 1
  return blocks * WG_ROWS


def plan_prefill(page_table, page_pos, page_shift, page_len, q_pos, *, rope,
                 group, head_dim, num_pages, page_size,
                 block_sizes: MgpuBlockSizes | None = None) -> PrefillPlan:
  """The layer-independent XLA work before the kernel (see PrefillPlan).

  `num_pages` is the number of pages one layer's page ids index (the plan's
  physical ids are clipped to it; `page_offset` is added in the kernel).
  """
  block_sizes = block_sizes or MgpuBlockSizes()
  batch, q_len = q_pos.shape
  nwg = block_sizes.num_compute_wgs
  ppb = block_sizes.block_kv // page_size
  t_pad = padded_query_len(q_len, group, nwg)
  row_pos = jnp.where(q_pos >= 0, q_pos, common.PADDING_ROW)
  row_pos = jnp.pad(row_pos, ((0, 0), (0, t_pad - q_len)),
                    constant_values=common.PADDING_ROW)
  newest = jnp.max(q_pos, axis=1)
  live = ((page_len > 0) & (page_pos <= newest[:, None])
          & (newest[:, None] >= 0))
  records, num_steps, step_first, shift = step_records(
      page_table, page_pos, page_shift, page_len, live, num_pages=num_pages,
      page_size=page_size, pages_per_block=ppb)
  # Steps are in page order: a token block's steps are those starting before
  # the last page it can see.
  block_end = tile_page_ends(row_pos, page_pos, live, WG_ROWS)  # [B, TB]
  block_steps = jnp.sum(step_first[:, None, :] < block_end[:, :, None],
                        axis=-1).astype(jnp.int32)
  block_steps = jnp.minimum(block_steps, num_steps[:, None])
  # A CTA runs the steps of the newest token block among its units.
  num_tiles = t_pad // WG_ROWS * group // nwg
  unit_block = (np.arange(num_tiles * nwg) // group).reshape(num_tiles, nwg)
  n_steps = jnp.max(block_steps[:, unit_block], axis=-1)
  min_row = jnp.min(row_pos.reshape(batch, t_pad // WG_ROWS, WG_ROWS),
                    axis=-1)
  cos_sin = segment_cos_sin(shift, rope, head_dim)
  return PrefillPlan(n_steps, min_row, records, cos_sin, row_pos)


def lazy_prefill_mgpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                      page_len, q_pos, *, rope: RopeConfig, sm_scale,
                      block_sizes: MgpuBlockSizes | None = None,
                      interpret: bool = False):
  """Prefill (T >= 1) of the lazy attention contract, Mosaic GPU (Hopper).

  Same arguments and result as `pallas_kernels.lazy_attention` (and
  `gpu_prefill.lazy_prefill_gpu`); `sm_scale` is a float or f32 scalar
  array.  `block_sizes` picks tiles (MgpuBlockSizes); `interpret=True` runs
  the kernel in the Mosaic GPU interpreter on CPU (slow; tests only).
  Raises ValueError, naming the argument, for shapes it does not support.
  """
  check_lazy_attention_shapes(q, k_pages, v_pages, page_table, page_pos,
                              page_shift, page_len, q_pos)
  if not isinstance(rope, RopeConfig):
    raise ValueError(f"rope must be a RopeConfig, got {type(rope).__name__}")
  block_sizes = block_sizes or MgpuBlockSizes()
  _check_inputs(q, k_pages, k_pages.shape[2], block_sizes)
  plan = plan_prefill(page_table, page_pos, page_shift, page_len, q_pos,
                      rope=rope, group=q.shape[2] // k_pages.shape[0],
                      head_dim=q.shape[-1], num_pages=k_pages.shape[1],
                      page_size=k_pages.shape[2], block_sizes=block_sizes)
  return lazy_prefill_mgpu_planned(q, k_pages, v_pages, q_pos, plan,
                                   rope=rope, sm_scale=sm_scale,
                                   block_sizes=block_sizes,
                                   interpret=interpret)


def rotated_query_tokens(q, q_pos, rope: RopeConfig, sm_scale, padded_len,
                         in_f32: bool = True):
  """[B, T_pad, N, H]: R(q_pos) q * sm_scale * log2(e), the kernel's query
  operand (zero on padding rows and past T); float32, or q's dtype where
  `in_f32` is False (MgpuBlockSizes.query_in_f32)."""
  scale = jnp.asarray(sm_scale, jnp.float32) * jnp.float32(common.LOG2_E)
  q_rot, _ = rotated_query(q, q_pos, rope, scale)
  if not in_f32:
    q_rot = q_rot.astype(q.dtype)
  return jnp.pad(q_rot, ((0, 0), (0, padded_len - q.shape[1]), (0, 0),
                         (0, 0)))


def lazy_prefill_mgpu_planned(q, k_pages, v_pages, q_pos, plan: PrefillPlan,
                              *, rope: RopeConfig, sm_scale, page_offset=0,
                              block_sizes: MgpuBlockSizes | None = None,
                              interpret: bool = False):
  """The per-layer part of `lazy_prefill_mgpu`: query rotation + kernel.

  `plan` must come from `plan_prefill` with the same metadata, q_pos, shapes
  and block_sizes.  `page_offset` (int or int32 scalar array) is added to
  every physical page id of the plan: layer l of a model whose layers share
  one [K, L * pages, P, H] array passes l * pages and reuses one plan.
  """
  block_sizes = block_sizes or MgpuBlockSizes()
  _check_inputs(q, k_pages, k_pages.shape[2], block_sizes)
  batch, q_len, num_heads, _ = q.shape
  t_pad = plan.row_pos.shape[1]
  group = num_heads // k_pages.shape[0]
  if (plan.row_pos.shape[0] != batch or t_pad != padded_query_len(
      q_len, group, block_sizes.num_compute_wgs)):
    raise ValueError(f"plan was made for {plan.row_pos.shape[0]} rows of "
                     f"{t_pad} padded tokens; q has {batch} rows of {q_len}")
  q_rot = rotated_query_tokens(q, q_pos, rope, sm_scale, t_pad,
                               block_sizes.query_in_f32)
  out = mgpu_prefill_kernel(q_rot, k_pages, v_pages, plan, page_offset,
                            out_dtype=q.dtype, block_sizes=block_sizes,
                            interpret=interpret)
  return out[:, :q_len]


def mgpu_prefill_kernel(q_rot, k_pages, v_pages, plan: PrefillPlan,
                        page_offset=0, *, out_dtype,
                        block_sizes: MgpuBlockSizes | None = None,
                        interpret: bool = False):
  """The kernel alone: q_rot from `rotated_query_tokens`, plan from
  `plan_prefill`.  Returns out_dtype [B, T_pad, N, H]."""
  block_sizes = block_sizes or MgpuBlockSizes()
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
  layout = RecordLayout(ppb)
  num_tiles = plan.n_steps.shape[1]
  if num_tiles * nwg != t_pad // WG_ROWS * group:
    raise ValueError(f"plan has {num_tiles} tiles; q_rot with T_pad {t_pad} "
                     f"and group {group} needs {t_pad // WG_ROWS * group} "
                     f"units over {nwg} warpgroups")
  page_offset = jnp.reshape(jnp.asarray(page_offset, jnp.int32), (1,))

  dtype = k_pages.dtype
  swizzle = min(128, head_dim)  # bytes of one half row of 16-bit elements
  tiled16 = (plgpu.TilingTransform((8, swizzle // 2)),
             plgpu.SwizzleTransform(swizzle))
  tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  scratch = [
      plgpu.SMEM((nwg, WG_ROWS, head_dim), q_rot.dtype,
                 transforms=tiled32 if block_sizes.query_in_f32 else tiled16),
      plgpu.SMEM((nwg, WG_ROWS, head_dim), dtype, transforms=tiled16),
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tiled16),
      plgpu.SMEM((stages, block_kv, head_dim), dtype, transforms=tiled16),
      plgpu.SMEM((2 * stages, layout.width), jnp.int32),
      plgpu.SMEM((stages, 2, head_dim // 2), jnp.float32),
      plgpu.SMEM((nwg, WG_ROWS), jnp.int32),
      plgpu.Barrier(num_arrivals=2, num_barriers=nwg),  # q + row_pos
      plgpu.Barrier(num_arrivals=ppb + 2, num_barriers=stages),  # K+rec+cs
      plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),  # V pages
      plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),  # K slot free
      plgpu.Barrier(num_arrivals=nwg, num_barriers=stages),  # V slot free
      plgpu.Barrier(num_arrivals=nwg),  # schedule (ping-pong)
  ]
  kernel = functools.partial(_kernel, cfg=block_sizes, page_size=page_size,
                             group=group, layout=layout, interpret=interpret)
  extra = {}
  if interpret:
    extra["interpret"] = _interpreter_params()
  return plgpu.kernel(
      kernel,
      out_type=jax.ShapeDtypeStruct((batch, t_pad, num_heads, head_dim),
                                    out_dtype),
      scratch_types=scratch,
      grid=(num_tiles, num_kv_heads, batch),
      grid_names=("tile", "head", "batch"),
      num_threads=nwg + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
      **extra,
  )(plan.n_steps, plan.min_row, plan.records, plan.cos_sin, plan.row_pos,
    page_offset, q_rot, common.flat_pages(k_pages), common.flat_pages(v_pages))
