"""Pieces of the Mosaic GPU prefill kernel's block steps
(`MgpuBlockSizes.steps_by_block`; compute warpgroups).

A step is a whole KV block (`gpu_prefill_block_records`).  The query is
held in registers rotated to the shift of the block's last live page, so
consecutive blocks of one document share one rotation, made while the step
before's P V runs.  Pages of another shift in the block (a document that
ends inside it) are masked out of that pass and taken by one more pass
each: rotate, Q K^T, online-softmax update, P V, on the K and V already in
the ring slot.

Design: docs/kernels.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_mgpu_parts import (
    key_positions, page_fields, rotated_query_halves, select_per_page,
    shift_cos_sin, softmax_update)
from pallas_kernels.gpu_prefill_block_records import PrefillBlockLayout
from pallas_kernels.gpu_prefill_mgpu_plan import INT32_MAX


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


def query_halves_at(ops, q_store, shift, chunks_smem, dtype):
  """R(-shift) q (q_store: [64, H] 16-bit) as the two register halves of
  Q K^T's A operand, the cos / sin computed here from RoPE's turn chunks
  (chunks_smem: int32 [6, H/2]; rows read per rotation, since six rows
  held through the step loop would take registers the loop needs)."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  rows = [ops.cast(chunks_smem[r], col_layout)
          for r in range(chunks_smem.shape[0])]
  half = q_store.shape[1] // 2
  return rotated_query_halves(ops, q_store, None, None, half, dtype,
                              shift_cos_sin(shift, rows))


def other_shift_passes(ops, acc, m, l, *, rec, layout: PrefillBlockLayout,
                       k_slot, v_slot, q_store, chunks_smem, row_pos,
                       page_size: int, dtype):
  """(acc, m, l) after one pass for each shift of the block's live pages
  other than its last live page's (the main pass's); V must be in v_slot,
  its invalid rows zeroed."""
  ppb = layout.pages_per_block
  main_shift = rec[layout.last_shift]
  shape = (WG_ROWS, k_slot.shape[0])

  def one_page(j, carry):
    shift = rec[layout.shift + j]
    # Page j opens a pass if it is live, not at the main shift, and no
    # live page before it in the block has its shift.
    opens = (rec[layout.lim + j] > 0) & (shift != main_shift)
    for k in range(ppb - 1):
      opens = opens & ~((k < j) & (rec[layout.lim + k] > 0)
                        & (rec[layout.shift + k] == shift))

    def one_pass(carry):
      acc, m, l = carry
      q_lo, q_hi = query_halves_at(ops, q_store, shift, chunks_smem, dtype)
      s = ops.qk_halves(q_lo, q_hi, k_slot, shape)
      s = masked_scores(ops, s, rec, layout, shift, row_pos,
                        page_size=page_size)
      acc, m, l, p = softmax_update(acc, m, l, s)
      return ops.pv(acc, p.astype(dtype), v_slot), m, l

    return lax.cond(opens, one_pass, lambda carry: carry, carry)

  return lax.fori_loop(0, ppb, one_page, (acc, m, l))
