"""Scores of one decode step that is a whole KV block (Mosaic GPU, compute
warpgroup; `MgpuDecodeBlockSizes.steps_by_block`).

A block's pages may carry several shifts (`gpu_decode_block_plan`).  The
query tile is rotated once per run of pages of one shift, and each run's
score columns come from its own Q K^T.  Where the shift changes is found on
the scalar unit; only blocks with a change inside take the slow branch,
where S waits in shared memory while the query is rotated again (S, the
accumulator and a rotation live at once would not fit in the registers:
spills, and every wgmma serialized).

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_decode_block_plan import BlockRecordLayout
from pallas_kernels.gpu_mgpu_parts import Ops, rotate_query, shift_cos_sin


def run_starts(rec, layout: BlockRecordLayout, pages_per_block: int,
               rotated):
  """Which of the block's pages start a run: page j has valid slots and a
  shift other than the one the query tile holds when it is reached.
  `rotated`: the tile's shift before the block (INT32_MIN: none yet).
  Returns (bool scalars per page, the tile's shift after the block)."""
  starts = []
  for j in range(pages_per_block):
    shift = rec[layout.shift + j]
    change = (rec[layout.lim + j] > 0) & (shift != rotated)
    starts.append(change)
    rotated = jnp.where(change, shift, rotated)
  return starts, rotated


def rotate_to_shift(ops: Ops, shift, q_tile, q16_smem, chunks_smem, dtype,
                    cos_sin_smem=None):
  """q16_smem = R(-shift) q_tile in `dtype`, the cos / sin of the scalar
  `shift` computed here from the turn chunks (`rope_in_kernel`).  The
  chunk rows are read at each rotation: rotations are rare, and six rows
  held in registers through the step loop would spill.  With
  `cos_sin_smem` (`compact_cos_sin`) the cos / sin go through it, each
  value computed by one thread (`write_shift_cos_sin`); else each thread
  computes its columns of the WGMMA layout."""
  half = q_tile.shape[-1] // 2
  col_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per column
  if cos_sin_smem is not None:
    write_shift_cos_sin(ops, shift, chunks_smem, cos_sin_smem)
    cos_sin = tuple(ops.cast(cos_sin_smem[r], col_layout) for r in (0, 1))
  else:
    chunk_rows = [ops.cast(chunks_smem[r], col_layout)
                  for r in range(chunks_smem.shape[0])]
    cos_sin = shift_cos_sin(shift, chunk_rows)
  rotate_query(ops, q_tile, q16_smem, None, None, half, dtype, cos_sin)


def write_shift_cos_sin(ops: Ops, shift, chunks_smem, cos_sin_smem):
  """cos_sin_smem (f32 [R, H/2], `shift_cos_sin_shape`) = cos of the scalar
  `shift` in its even rows, sin in its odd ones, laid out one value a
  thread of the warpgroup; chunks_smem: int32 [6, R, H/2], each column's
  turn chunks in every row.  Ends with a warpgroup barrier, so every
  thread may read any value."""
  shape = cos_sin_smem.shape
  layout = plgpu.Layout.WG_STRIDED(shape, vec_size=1)
  chunk_rows = [ops.cast(chunks_smem[r], layout)
                for r in range(chunks_smem.shape[0])]
  cos, sin = shift_cos_sin(shift, chunk_rows)
  odd = lax.rem(ops.iota(shape, 0, layout), jnp.int32(2)) == 1
  cos_sin_smem[...] = jnp.where(odd, sin, cos)
  plgpu.commit_smem()


def rotate_ahead(ops: Ops, first_page, rotated, q_tile, *, q16_smem,
                 chunks_smem, dtype, cos_sin_smem=None):
  """`MgpuDecodeBlockSizes.rotate_ahead`: before a block's K copy is waited
  for, the rotation its first page needs (`run_starts`' condition for page
  0), so it overlaps the copy instead of delaying the slot's release.
  `first_page`: that page's (shift, valid slots), read from the plan in
  global memory a step earlier.  `cos_sin_smem`: as `rotate_to_shift`.
  Returns the tile's shift after."""
  shift, valid = first_page
  change = (valid > 0) & (shift != rotated)
  pl.when(change)(lambda: rotate_to_shift(ops, shift, q_tile, q16_smem,
                                          chunks_smem, dtype, cos_sin_smem))
  return jnp.where(change, shift, rotated)


def block_scores(ops: Ops, rec, k_slot, q_tile, rotated, *,
                 q16_smem,  # [64, H] 16-bit: the rotated query (A operand)
                 cs_smem,  # f32 [ppb, 2, H/2]: this slot's pages' cos / sin
                 #           (compact_cos_sin: [R, H/2], a rotation's)
                 chunks_smem,  # int32 [6, H/2]: turn chunks (rope_in_kernel;
                 #               compact_cos_sin: [6, R, H/2])
                 s_smem,  # f32 [64, block_kv]: S while the query turns
                 layout: BlockRecordLayout, page_size: int,
                 rope_in_kernel: bool, dtype, rotated_ahead: bool = False,
                 compact_cos_sin: bool = False):
  """S (f32 [64, block_kv]) of the block in `k_slot` ([block_kv, H]) for
  the f32 query tile `q_tile` ([64, H]).  `rotated`: the shift q16_smem
  holds.  `rotated_ahead`: `rotate_ahead` has rotated it for the block's
  first page, so no rotation there is compiled.  Returns (S, the shift it
  holds after)."""
  block_kv, head_dim = k_slot.shape
  pages_per_block = block_kv // page_size
  half = head_dim // 2
  shape = (WG_ROWS, block_kv)
  col_layout = plgpu.Layout.WGMMA.reduce(0)  # one value per column
  starts, rotated = run_starts(rec, layout, pages_per_block, rotated)
  later = functools.reduce(lambda a, b: a | b, starts[1:], False)

  def rotate_to(j):
    if rope_in_kernel:
      rotate_to_shift(ops, rec[layout.shift + j], q_tile, q16_smem,
                      chunks_smem, dtype,
                      cs_smem if compact_cos_sin else None)
    else:
      rotate_query(ops, q_tile, q16_smem, cs_smem, j, half, dtype)

  def later_runs(s):
    s_smem[...] = s
    col_page = lax.div(ops.iota((block_kv,), 0, col_layout),
                       jnp.int32(page_size))
    for j in range(1, pages_per_block):
      def run_from(j=j):
        rotate_to(j)
        fresh = ops.qk(q16_smem, k_slot, shape)
        take = lax.broadcast_in_dim(col_page >= j, shape, [1])
        s_smem[...] = jnp.where(take, fresh, s_smem[...])
      pl.when(starts[j])(run_from)
    return s_smem[...]

  if not rotated_ahead:  # (after rotate_ahead, starts[0] is always False)
    pl.when(starts[0])(lambda: rotate_to(0))
  s = ops.qk(q16_smem, k_slot, shape)
  if pages_per_block > 1:
    s = lax.cond(later, later_runs, lambda s: s, s)
  return s, rotated
