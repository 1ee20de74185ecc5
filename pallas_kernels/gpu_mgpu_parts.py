"""The compute warpgroups' pieces the Mosaic GPU (Hopper) prefill and
decode kernels share: query rotation by -shift, key positions, the V
fix-up of invalid slots, the online softmax (base 2); `Ops` gives the
interpreter plain jnp stand-ins for what it has no layouts for.  The
producer warpgroup's K/V ring is gpu_mgpu_producer.py.  The kernels:
gpu_prefill_mgpu_kernel.py, gpu_decode_mgpu_kernel.py; design:
docs/kernels.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_prefill_mgpu_plan import (INT32_MAX, Q15_ONE,
                                                  RecordLayout)
from pallas_kernels.rope import cos_sin_from_chunks

# Registers per thread (setmaxnreg) of the compute warpgroups (the
# producer's: gpu_mgpu_producer.PRODUCER_REGISTERS).
COMPUTE_REGISTERS = 232


class Ops:
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
      plgpu.wgmma(acc_ref, q_ref, k_ref.transpose((1, 0)))
      if between is not None:
        between()  # runs while the wgmma is in flight
      return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

  def qk_halves(self, q_lo, q_hi, k_ref, shape, between=None):
    """S = Q K^T in f32 with Q's column halves in registers (16-bit
    [64, H/2] each): two wgmmas over the halves of H."""
    half = q_lo.shape[1]
    if self.interpret:
      if between is not None:
        between()
      k = k_ref[...]
      dims = (((1,), (1,)), ((), ()))
      return (lax.dot_general(q_lo, k[:, :half], dims,
                              preferred_element_type=jnp.float32) +
              lax.dot_general(q_hi, k[:, half:], dims,
                              preferred_element_type=jnp.float32))

    def body(acc_ref):
      for part, start in ((q_lo, 0), (q_hi, half)):
        plgpu.wgmma(acc_ref, part,
                    k_ref.at[:, pl.ds(start, half)].transpose((1, 0)))
      if between is not None:
        between()
      return acc_ref[...]
    return pl.run_scoped(body, plgpu.ACC(shape, jnp.float32))

  def pv(self, acc, p, v_ref, between=None):
    """acc + P V; `between()` runs while the wgmma is in flight."""
    def run(carry):
      if between is not None:
        between()
      return carry
    return self.pv_carry(acc, p, v_ref, (), run)[0]

  def pv_carry(self, acc, p, v_ref, carry, between):
    """(acc + P V, *between(carry)): `between` maps register values (a
    tuple) to new ones of the same shapes while the wgmma is in flight."""
    if self.interpret:
      out = acc + lax.dot_general(p, v_ref[...], (((1,), (0,)), ((), ())),
                                  preferred_element_type=jnp.float32)
      return (out, *between(tuple(carry)))

    def body(refs):
      acc_ref, *carry_refs = refs
      plgpu.wgmma(acc_ref, p, v_ref)
      new = between(tuple(r[...] for r in carry_refs))
      for ref, value in zip(carry_refs, new):
        ref[...] = value
    return pl.run_state(body)((plgpu.ACC.init(acc), *carry))

  def optimization_barrier(self, xs):
    return xs if self.interpret else lax.optimization_barrier(xs)


def select_per_page(page, values):
  """values[page] for a small static list of scalars (a select chain)."""
  out = values[0]
  for j in range(1, len(values)):
    out = jnp.where(page == j, values[j], out)
  return out


def page_fields(rec, offset, pages_per_block):
  return [rec[offset + j] for j in range(pages_per_block)]


# The compute warpgroups' steps.
def _cos_sin_at(ops, cs_smem, slot):
  """The cos and sin rows cs_smem[slot] (f32 [H/2] each, one value per
  column of the WGMMA layout)."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  return (ops.cast(cs_smem[slot, 0], col_layout),
          ops.cast(cs_smem[slot, 1], col_layout))


def record_cos_sin(ops, rec, offset: int, half: int):
  """The cos and sin (f32 [H/2] each, per column) a step record carries
  from `offset` on as int32 bits (RecordLayout.cos_sin); rec: the record's
  shared-memory slot."""
  col_layout = plgpu.Layout.WGMMA.reduce(0)
  row = lambda start: lax.bitcast_convert_type(
      ops.cast(rec[pl.ds(start, half)], col_layout), jnp.float32)
  return row(offset), row(offset + half)


def _rotated_halves(src, cos, sin, half, math_dtype=jnp.float32):
  """(lo, hi) in `math_dtype`: the column halves of R(-shift) src [64, H]
  (f32 or 16-bit), shift's cos and sin [H/2] (f32) given per column, and
  every operation in `math_dtype` (f32, or packed 16-bit arithmetic)."""
  lo = src.at[:, pl.ds(0, half)][...].astype(math_dtype)
  hi = src.at[:, pl.ds(half, half)][...].astype(math_dtype)
  cos = lax.broadcast_in_dim(cos.astype(math_dtype), (WG_ROWS, half), [1])
  sin = lax.broadcast_in_dim(sin.astype(math_dtype), (WG_ROWS, half), [1])
  return lo * cos + hi * sin, hi * cos - lo * sin


def rotate_query(ops, src, dst, cs_smem, slot, half, dtype, cos_sin=None):
  """dst = R(-shift) src in `dtype` (64 rows: the wgmma A operand), with the
  step's cos / sin in cs_smem[slot] (or given: `cos_sin`, per column); src
  f32 or 16-bit."""
  cos, sin = cos_sin or _cos_sin_at(ops, cs_smem, slot)
  lo, hi = _rotated_halves(src, cos, sin, half)
  dst.at[:, pl.ds(0, half)][...] = lo.astype(dtype)
  dst.at[:, pl.ds(half, half)][...] = hi.astype(dtype)
  plgpu.commit_smem()  # generic-proxy writes -> visible to wgmma


def rope_rows_from_table(q_ref, table_ref, scale, half):
  """q_ref [64, H] (16-bit: the raw query rows) = R(q_pos) q * scale, in
  place.  table_ref [64, H], 16-bit, holds int16 bits: each row's cos | sin
  in Q15 (`gpu_prefill_mgpu_plan.query_cos_sin_table`; zero on padding
  rows, which so come out zero).  scale: f32 scalar."""
  unit = scale * jnp.float32(1.0 / Q15_ONE)
  q15 = lambda x: lax.bitcast_convert_type(x, jnp.int16).astype(
      jnp.float32) * unit
  cos = q15(table_ref.at[:, pl.ds(0, half)][...])
  sin = q15(table_ref.at[:, pl.ds(half, half)][...])
  lo = q_ref.at[:, pl.ds(0, half)][...].astype(jnp.float32)
  hi = q_ref.at[:, pl.ds(half, half)][...].astype(jnp.float32)
  # R(a) [x1, x2] = [x1 cos a - x2 sin a, x2 cos a + x1 sin a].
  q_ref.at[:, pl.ds(0, half)][...] = (lo * cos - hi * sin).astype(q_ref.dtype)
  q_ref.at[:, pl.ds(half, half)][...] = (hi * cos + lo * sin).astype(
      q_ref.dtype)
  plgpu.commit_smem()


def shift_cos_sin(shift, chunk_rows):
  """cos and sin (f32 [H/2] each, per column) of a scalar int32 shift,
  computed in the kernel with the exact range reduction of
  `rope.cos_sin_from_chunks` from `chunk_rows` (the turn chunks' first
  H/2 columns, int32 rows per column).  Mosaic GPU lowers round, not
  floor; the interpreter runs the same."""
  return cos_sin_from_chunks(shift, chunk_rows, nearest=jnp.round)


def rotated_query_halves(ops, src, cs_smem, slot, half, dtype, cos_sin=None,
                         in_16bit=False):
  """(lo, hi): the column halves of R(-shift) src in `dtype`, in registers
  (WGMMA layout: the A operands of `Ops.qk_halves`), with the step's cos /
  sin in cs_smem[slot] (or given: `cos_sin`, per column); src f32 or
  16-bit.  `in_16bit`: computed in packed `dtype` arithmetic instead of
  f32 (MgpuBlockSizes.segment_rotation_16bit)."""
  cos, sin = cos_sin or _cos_sin_at(ops, cs_smem, slot)
  lo, hi = _rotated_halves(src, cos, sin, half,
                           dtype if in_16bit else jnp.float32)
  return (ops.cast(lo.astype(dtype), plgpu.Layout.WGMMA),
          ops.cast(hi.astype(dtype), plgpu.Layout.WGMMA))


def key_positions(ops, rec, layout: RecordLayout, pages_per_block: int,
                  page_size: int, block_kv: int):
  """Key position of each of a step's columns (one value per column),
  INT32_MAX where the slot is invalid."""
  col = ops.iota((block_kv,), 0, plgpu.Layout.WGMMA.reduce(0))
  page = lax.div(col, jnp.int32(page_size))
  slot_in_page = col - page * page_size
  lim = select_per_page(page,
                         page_fields(rec, layout.lim, pages_per_block))
  pos = select_per_page(page,
                         page_fields(rec, layout.pos, pages_per_block))
  return jnp.where(slot_in_page < lim, pos + slot_in_page, INT32_MAX)


def zero_invalid_v_rows(ops, src, dst, rec, layout: RecordLayout,
                        pages_per_block: int, page_size: int, block_kv: int,
                        head_dim: int, dtype, convert=lambda x: x):
  """dst = convert(src) with the V rows of invalid slots zeroed: TMA copies
  whole pages, and a NaN there would survive p = 0 in P V (src and dst may
  be the same ring slot)."""
  row_layout = plgpu.Layout.WGMMA.reduce(1)
  for r0 in range(0, block_kv, WG_ROWS):
    kv_rows = ops.iota((WG_ROWS,), 0, row_layout) + r0
    page = lax.div(kv_rows, jnp.int32(page_size))
    slot_in_page = kv_rows - page * page_size
    lim = select_per_page(page,
                           page_fields(rec, layout.lim, pages_per_block))
    ok = lax.broadcast_in_dim(lim - slot_in_page, (WG_ROWS, head_dim),
                              [0]) > 0
    values = convert(src.at[pl.ds(r0, WG_ROWS)][...])
    dst.at[pl.ds(r0, WG_ROWS)][...] = jnp.where(ok, values,
                                                jnp.zeros((), dtype))
  plgpu.commit_smem()


def softmax_start(ops, head_dim: int):
  """(acc, m, l) of an online softmax over 64 rows, before any key."""
  m = ops.cast(jnp.full((WG_ROWS,), common.NEG_INIT, jnp.float32),
               plgpu.Layout.WGMMA.reduce(1))
  l = ops.cast(jnp.full((WG_ROWS,), 0.0, jnp.float32),
               plgpu.Layout.WGMMA.reduce(1))
  acc = ops.cast(jnp.full((WG_ROWS, head_dim), 0.0, jnp.float32),
                 plgpu.Layout.WGMMA)
  return acc, m, l


def softmax_update(acc, m, l, s, acc_factor=None):
  """One online-softmax step (base 2) over scores s [64, block_kv]:
  (acc rescaled, new max, new sum, p).  `acc_factor` (a scalar) also
  multiplies acc: a change of the units acc is kept in."""
  m_new = jnp.maximum(m, s.max(axis=1))
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s - lax.broadcast_in_dim(m_new, s.shape, [0]))
  acc_alpha = alpha if acc_factor is None else alpha * acc_factor
  acc = acc * lax.broadcast_in_dim(acc_alpha, acc.shape, [0])
  l = l * alpha + p.sum(axis=1)
  return acc, m_new, l, p


def interpreter_params():
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
