"""Float8 (e4m3) pages in the Mosaic GPU decode: widening and scales.

wgmma takes 16-bit operands, so a float8 K or V tile is widened in shared
memory before the compute warpgroup reads it.  A converter warpgroup
(`convert_kv_ring`) does the widening between the producer's float8 ring
and one 16-bit K tile and one 16-bit V tile: it widens the next step's K
while the compute warpgroup runs this step's softmax and P V, and the next
V while it runs the next Q K^T.  Measured on the H200, widening inside the
compute warpgroup took a quarter of the float8 decode's time and the scale
loads at their use a sixth (benchmarks/RESULTS.md); the compute warpgroup
now reads each step's scales one step ahead (`load_page_scales`).

The per-page scales stay out of the 16-bit tiles: K's multiply the score
columns, V's the P columns, relative to the largest V scale the work item
has seen (`step_scales`), so P times a scale never leaves f16's range.

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_mgpu_parts import select_per_page, zero_invalid_v_rows

# Registers per thread (setmaxnreg) of the converter warpgroup: with the
# compute warpgroup's 232 and the producer's 40, three warpgroups fit the
# SM's 64K registers (128 x (232 + 40 + 160) <= 65536).
CONVERTER_REGISTERS = 160


def float8_registers(num_compute_wgs: int) -> tuple[int, int, int]:
  """(compute, producer, converter) registers per thread with float8 pages:
  one compute warpgroup as above; two (the prefill's ping-pong) leave
  2 x 216 + 24 + 56 = 512 x 128 threads, the SM's 64K (the converter's
  64-row pieces may spill at 56: not measured yet)."""
  if num_compute_wgs == 1:
    return 232, 40, CONVERTER_REGISTERS
  return 216, 24, 56


def to_operand(x, dtype):
  """Values of a float8 or 16-bit tile as `dtype` (16-bit).  Hopper converts
  e4m3 to f16 in hardware (exact: e4m3 fits f16); f16 -> bf16 goes through
  f32 (also exact: 4 mantissa bits), as Mosaic GPU has no direct cast."""
  if x.dtype == jnp.dtype(dtype):
    return x
  if x.dtype == jnp.dtype(jnp.float8_e4m3fn):
    x = x.astype(jnp.float16)
  if x.dtype != jnp.dtype(dtype):
    x = x.astype(jnp.float32).astype(dtype)
  return x


def widen(src, dst, block_kv: int, dtype):
  """dst = src as `dtype`: a float8 ring slot into a 16-bit wgmma operand,
  in 64-row pieces (the layout Mosaic GPU loads them in) to bound the
  registers it takes."""
  for r0 in range(0, block_kv, WG_ROWS):
    dst.at[pl.ds(r0, WG_ROWS)][...] = to_operand(
        src.at[pl.ds(r0, WG_ROWS)][...], dtype)
  plgpu.commit_smem()  # generic-proxy writes -> visible to wgmma


def convert_kv_ring(n_steps, ring_step, k_smem, v_smem, rec_smem, k16, v16,
                    k_bars, v_bars, k_free, v_free, k16_ready, v16_ready,
                    k16_free, v16_free, *, ops, layout, pages_per_block: int,
                    page_size: int, stages: int, dtype):
  """The converter warpgroup's steps of one work item.

  Step i waits for ring slot (ring_step + i) % stages, widens its K pages
  into k16 once the compute warpgroup has released the previous K
  (k16_free), signals k16_ready and frees the slot's K; then the same for
  V, zeroing the V rows of invalid slots on steps that need it (TMA copies
  whole pages, and NaN there would survive p = 0).  k16_free and v16_free
  complete when every compute warpgroup has released the tile.  Returns
  ring_step + n_steps.
  """
  block_kv, head_dim = k16.shape

  def step(i, _):
    ring = ring_step + i
    slot = lax.rem(ring, stages)
    rec = rec_smem.at[lax.rem(ring, 2 * stages)]
    plgpu.barrier_wait(k_bars.at[slot])
    pl.when(ring > 0)(lambda: plgpu.barrier_wait(k16_free))
    widen(k_smem.at[slot], k16, block_kv, dtype)
    plgpu.barrier_arrive(k16_ready)
    plgpu.barrier_arrive(k_free.at[slot])
    plgpu.barrier_wait(v_bars.at[slot])
    pl.when(ring > 0)(lambda: plgpu.barrier_wait(v16_free))
    fixup = rec[layout.fixup] != 0
    pl.when(fixup)(lambda: zero_invalid_v_rows(
        ops, v_smem.at[slot], v16, rec, layout, pages_per_block, page_size,
        block_kv, head_dim, dtype, convert=lambda x: to_operand(x, dtype)))
    pl.when(jnp.logical_not(fixup))(
        lambda: widen(v_smem.at[slot], v16, block_kv, dtype))
    plgpu.barrier_arrive(v16_ready)
    plgpu.barrier_arrive(v_free.at[slot])
    return ()

  lax.fori_loop(0, n_steps, step, ())
  return ring_step + n_steps


def convert_work_items(num_items, item_steps, k_smem, v_smem, rec_smem, k16,
                       v16, k_bars, v_bars, k_free, v_free, k16_ready,
                       v16_ready, k16_free, v16_free, *, registers: int,
                       interpret: bool, **ring):
  """The converter warpgroup of a CTA that runs `num_items` work items
  through one ring (`item_steps(j)` steps each): its registers, each item's
  `convert_kv_ring` (with the keyword arguments `ring`), then the drain."""
  if not interpret:
    plgpu.set_max_registers(registers, action="decrease")

  def one_item(j, ring_step):
    return convert_kv_ring(
        item_steps(j), ring_step, k_smem, v_smem, rec_smem, k16, v16, k_bars,
        v_bars, k_free, v_free, k16_ready, v16_ready, k16_free, v16_free,
        **ring)

  ring_steps = lax.fori_loop(0, num_items, one_item, jnp.int32(0))
  drain_converted(ring_steps, k16_free, v16_free)


def drain_converted(ring_steps, k16_free, v16_free):
  """Observe the compute warpgroup's last releases of the 16-bit tiles (the
  interpreter checks that every barrier phase is seen by its waiter)."""
  @pl.when(ring_steps > 0)
  def _():
    plgpu.barrier_wait(k16_free)
    plgpu.barrier_wait(v16_free)


def load_page_scales(rec_ref, ks_ref, vs_ref, batch, head, row, page_offset,
                     *, layout, pages_per_block: int):
  """(K scales, V scales) of plan record `row`'s pages, lists of f32
  scalars, read from global memory (the record too: its ring slot may not
  have arrived yet).  Rows past the plan's end are clamped; padding records
  hold page 0, so any row is safe to read."""
  row = jnp.minimum(row, jnp.int32(rec_ref.shape[1] - 1))
  phys = [rec_ref[batch, row, layout.phys + j] + page_offset
          for j in range(pages_per_block)]
  return [ks_ref[head, x] for x in phys], [vs_ref[head, x] for x in phys]


def _used_pages_only(rec, values, layout):
  """0 for the pages the step does not read (an unused page's scale may be
  NaN, and 0 * NaN would leak)."""
  return [jnp.where(rec[layout.lim + j] > 0, x, jnp.float32(0.0))
          for j, x in enumerate(values)]


def _column_scales(ops, values, block_kv: int, page_size: int):
  """One value per key column: its page's entry of `values`."""
  col = ops.iota((block_kv,), 0, plgpu.Layout.WGMMA.reduce(0))
  return select_per_page(lax.div(col, jnp.int32(page_size)), values)


def step_scales(ops, rec, unit, k_scales, v_scales, *, layout, block_kv: int,
                page_size: int):
  """The scales of one compute step: (K scale per score column, V scale per
  P column relative to the new unit, acc factor, new unit).

  acc is kept in units of the largest V scale seen (`unit`, 0 before any),
  so P times a V scale relative to it is at most P (never past f16's range,
  and below its normal range only for pages far smaller than the item's
  largest); the acc factor moves acc to the new unit.  Scales are powers of
  two: the ratios are exact.
  """
  v_pages = _used_pages_only(rec, v_scales, layout)
  new_unit = functools.reduce(jnp.maximum, v_pages, unit)
  inverse = jnp.where(new_unit > 0, 1.0 / new_unit, 0.0)
  acc_factor = jnp.where(new_unit > 0, unit * inverse, 1.0)
  k_cols = _column_scales(ops, _used_pages_only(rec, k_scales, layout),
                          block_kv, page_size)
  v_cols = _column_scales(ops, [x * inverse for x in v_pages], block_kv,
                          page_size)
  return k_cols, v_cols, acc_factor, new_unit


def float8_scratch(block_kv: int, head_dim: int, dtype, transforms,
                   num_compute_wgs: int):
  """The scratch the float8 path adds at the end of a kernel's: the 16-bit
  K and V tiles, their ready barriers (the converter arrives) and their
  free barriers (every compute warpgroup arrives)."""
  tile = plgpu.SMEM((block_kv, head_dim), dtype, transforms=transforms)
  return ([tile] * 2 + [plgpu.Barrier(num_arrivals=1)] * 2
          + [plgpu.Barrier(num_arrivals=num_compute_wgs)] * 2)


def ring_transforms(head_dim: int):
  """Tiling and swizzle of a float8 ring slot (one row of 1-byte elements
  per swizzle span)."""
  swizzle = min(128, head_dim)
  return (plgpu.TilingTransform((8, swizzle)),
          plgpu.SwizzleTransform(swizzle))
