"""The compute warpgroups' loop of the Mosaic GPU prefill with one step per
KV block (`MgpuBlockSizes.steps_by_block`).

The producer loads whole KV blocks (`gpu_prefill_block_records`).  A block
takes one pass per distinct shift of its live pages: rotate the query to
that shift (if it is not there already), Q K^T, mask to that shift's pages
(and to causality, and valid slots), online-softmax update, P V, all on
the K and V already in the ring slot, which the last pass frees.  A block
inside one document is one pass.  The query lives in registers; the next
pass's rotation runs while this pass's P V wgmma is in flight, with the
cos / sin from the record where the next shift is its block's last live
page's (a document starting), else computed from RoPE's turn chunks (a
document wholly inside a block, or a CTA's first block).

The loop is one uniform body whatever the pass: a pass of another shift
as a branch inside a block step cost 4% of the kernel even where no block
took it (benchmarks/RESULTS.md).

Design: docs/kernels.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_mgpu_parts import (
    key_positions, page_fields, record_cos_sin, rotated_query_halves,
    select_per_page, shift_cos_sin, softmax_update)
from pallas_kernels.gpu_prefill_block_records import PrefillBlockLayout
from pallas_kernels.gpu_prefill_mgpu_plan import INT32_MAX, INT32_MIN


def key_positions_at_shift(ops, rec, layout: PrefillBlockLayout, shift, *,
                           page_size: int, block_kv: int):
  """Key position of each column of the block (one value per column),
  INT32_MAX where the slot is invalid or its page has another shift."""
  ppb = layout.pages_per_block
  key_pos = key_positions(ops, rec, layout, ppb, page_size, block_kv)
  col = ops.iota((block_kv,), 0, plgpu.Layout.WGMMA.reduce(0))
  page_shift = select_per_page(lax.div(col, jnp.int32(page_size)),
                               page_fields(rec, layout.shift, ppb))
  return jnp.where(page_shift == shift, key_pos, INT32_MAX)


def masked_scores(ops, s, rec, layout: PrefillBlockLayout, shift, row_pos, *,
                  page_size: int):
  """s with -inf where a key is invalid, of another shift, or later than
  the row (row_pos: int32 [64], one value per row)."""
  key_pos = key_positions_at_shift(ops, rec, layout, shift,
                                   page_size=page_size, block_kv=s.shape[1])
  key_pos = lax.broadcast_in_dim(key_pos, s.shape, [1])
  visible = key_pos <= lax.broadcast_in_dim(row_pos, s.shape, [0])
  return jnp.where(visible, s, -jnp.inf)


def chunk_cos_sin(ops, shift, chunks_smem):
  """cos and sin of a shift (f32 [H/2] each, per column) computed from
  RoPE's turn chunks (chunks_smem: int32 [6, H/2]; rows read per call,
  since six rows held through the loop would take registers it needs)."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  rows = [ops.cast(chunks_smem[r], col_layout)
          for r in range(chunks_smem.shape[0])]
  return shift_cos_sin(shift, rows)


def block_pass_loop(ops, acc, m, l, *, n_steps, rings, q_store, chunks_smem,
                    row_pos, oldest_row, layout: PrefillBlockLayout,
                    page_size: int, dtype, schedule, use_sched: bool,
                    sched_bar, fixup_v):
  """(acc, m, l) after every pass of the CTA's n_steps blocks.

  rings: (k_smem, v_smem, rec_smem, k_bars, v_bars, k_free, v_free), the
  producer's ring (records twice as deep as K / V); q_store: R(q_pos) q
  [64, H] in `dtype`; row_pos: int32 [64] per row; oldest_row: the token
  block's oldest q_pos; schedule / use_sched / sched_bar: the two compute
  warpgroups' ping-pong; fixup_v(slot, rec): zeroes a slot's invalid V
  rows.
  """
  k_smem, v_smem, rec_smem, k_bars, v_bars, k_free, v_free = rings
  stages, block_kv = k_smem.shape[0], k_smem.shape[1]
  half = q_store.shape[1] // 2
  rec_at = lambda j: rec_smem.at[lax.rem(j, 2 * stages)]

  def halves_for(j, k, halves, rotated):
    """Pass k of block j's query halves (j < n_steps; waits for the block's
    K and record first at k = 0), rotated from q_store unless `rotated`
    is its shift already; past the last block, `halves`."""
    live = j < n_steps

    @pl.when(live & (k == 0))
    def _():
      plgpu.barrier_wait(k_bars.at[lax.rem(j, stages)])

    rec = rec_at(j)
    target = rec[layout.pass_shift + k]

    def turn():
      cos_sin = lax.cond(
          target == rec[layout.last_shift],
          lambda: record_cos_sin(ops, rec, layout.cos_sin, half),
          lambda: chunk_cos_sin(ops, target, chunks_smem))
      return rotated_query_halves(ops, q_store, None, None, half, dtype,
                                  cos_sin)

    return lax.cond(live & (target != rotated), turn, lambda: tuple(halves))

  def shift_of(j, k, rotated):
    """The shift pass k of block j rotates to (read after `halves_for`
    waited for its record); past the last block, `rotated`."""
    return jnp.where(j < n_steps, rec_at(j)[layout.pass_shift + k], rotated)

  def body(carry):
    acc, m, l, q_lo, q_hi, shift, j, k = carry
    slot = lax.rem(j, stages)
    rec = rec_at(j)
    passes = rec[layout.passes]
    first, last = k == 0, k == passes - 1
    s = ops.qk_halves(q_lo, q_hi, k_smem.at[slot], (WG_ROWS, block_kv),
                      schedule)
    pl.when(last)(lambda: plgpu.barrier_arrive(k_free.at[slot]))
    fixup = rec[layout.fixup] != 0
    needs_mask = (fixup | (passes > 1)
                  | (rec[layout.max_pos] > oldest_row))
    s = lax.cond(needs_mask,
                 lambda s: masked_scores(ops, s, rec, layout, shift, row_pos,
                                         page_size=page_size),
                 lambda s: s, s)
    acc, m_new, l, p = softmax_update(acc, m, l, s)
    p16 = p.astype(dtype)
    acc, l, m_new, p16 = ops.optimization_barrier((acc, l, m_new, p16))
    if use_sched:
      plgpu.barrier_arrive(sched_bar)  # softmax done

    @pl.when(first)
    def _():
      plgpu.barrier_wait(v_bars.at[slot])
      pl.when(fixup)(lambda: fixup_v(slot, rec))

    if use_sched:
      plgpu.barrier_wait(sched_bar)  # tensor cores free
    next_j = jnp.where(last, j + 1, j)
    next_k = jnp.where(last, 0, k + 1)
    acc, q_lo, q_hi = ops.pv_carry(
        acc, p16, v_smem.at[slot], (q_lo, q_hi),
        lambda halves: halves_for(next_j, next_k, halves, shift))
    pl.when(last)(lambda: plgpu.barrier_arrive(v_free.at[slot]))
    return (acc, m_new, l, q_lo, q_hi, shift_of(next_j, next_k, shift),
            next_j, next_k)

  zero = ops.cast(jnp.zeros((WG_ROWS, half), dtype), plgpu.Layout.WGMMA)
  start, no_shift = jnp.int32(0), jnp.int32(INT32_MIN)
  halves = halves_for(start, start, (zero, zero), no_shift)
  carry = (acc, m, l, *halves, shift_of(start, start, no_shift), start,
           start)
  acc, m, l, *_ = lax.while_loop(lambda c: c[6] < n_steps, body, carry)
  return acc, m, l
