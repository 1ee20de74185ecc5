"""Pieces shared by the GPU (Pallas, Triton lowering) decode and prefill kernels.

Both kernels stream the paged KV of one batch row and one kv head in blocks of
`pages_per_block` logical pages and run an online (flash) softmax over them.
What they share:

- the tiles of a call (`kv_tiles`): block sizes, whole pages per KV step;
- the rotation of query rows by -s for a page shift s with one cos/sin
  vector for all rows (`rotate_row_halves`);
- the gather of one block of KV: per-column page metadata, the physical rows,
  and masked loads that never touch an invalid slot (`load_kv_block`);
- one online-softmax step in base 2 (`softmax_step`), written so that padding
  slots holding NaN and rows that see nothing can never produce NaN;
- host-side (XLA) helpers that build the grouped query-row layout.

Scores are kept in base-2 units: log2(e) is folded into the query scale, so
the kernels call exp2 directly.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gpu_block_sizes import GpuBlockSizes, block_sizes_for
from pallas_kernels.lazy_attention import ContractShapes
from pallas_kernels.rope import NUM_TURN_CHUNKS, RopeConfig, cos_sin_from_chunks
from pallas_kernels.rope import rotated_query
from pallas_kernels.sizes import next_power_of_two, round_up

LOG2_E = math.log2(math.e)
# Running-max start value: finite, so a row that has seen only masked (-inf)
# scores keeps exp2(-inf - NEG_INIT) = 0 and exp2(NEG_INIT - NEG_INIT) = 1.
NEG_INIT = -1e30
# Position given to a key column that no query row may see.
NEVER_VISIBLE = 2**31 - 1
# Query position of a padding row: below every key position.
PADDING_ROW = -(2**31)


def check_power_of_2_head_dim(head_dim: int) -> None:
  if head_dim < 16 or head_dim & (head_dim - 1):
    raise ValueError(
        "the gpu kernels need a power-of-two head dim >= 16 (Triton tiles), "
        f"got q head dim {head_dim}; use impl='xla' for this shape")


class KvTiles(NamedTuple):
  """How a GPU kernel call steps through the KV of a row."""

  block_sizes: GpuBlockSizes  # as given, else `block_sizes_for`'s pick
  pages_per_block: int  # whole logical pages per step (at least one)
  block_k: int  # columns per step: pages_per_block * page_size, padded


def kv_tiles(kernel: str, shapes: ContractShapes, dtype,
             block_sizes: GpuBlockSizes | None, *,
             power_of_two_pages: bool = False) -> KvTiles:
  """Checks the head dim and picks the tiles of one call.

  Columns are padded to a power of two for the Triton tiles;
  `power_of_two_pages` also rounds the pages per step down to a power of two.
  """
  check_power_of_2_head_dim(shapes.head_dim)
  if block_sizes is None:
    block_sizes = block_sizes_for(kernel, dtype=dtype,
                                  head_dim=shapes.head_dim,
                                  group=shapes.group,
                                  page_size=shapes.page_size)
  pages_per_block = max(1, block_sizes.block_kv // shapes.page_size)
  if power_of_two_pages:
    pages_per_block = 1 << (pages_per_block.bit_length() - 1)
  return KvTiles(block_sizes, pages_per_block,
                 next_power_of_two(pages_per_block * shapes.page_size))


def dot_precision(dtype):
  """Full f32 for float32 inputs (Triton's default would be tf32)."""
  if jnp.dtype(dtype) == jnp.float32:
    return lax.Precision.HIGHEST
  return None


def compiler_params(block_sizes):
  return plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                              num_stages=block_sizes.num_stages)


def whole_array_spec(shape):
  """BlockSpec handing every program the whole (small, metadata) array."""
  return pl.BlockSpec(tuple(shape), lambda *_: (0,) * len(shape))


def load_chunk_rows(chunks_ref, columns=None):
  """The NUM_TURN_CHUNKS int32 rows of rope.turn_chunks, from a ref (all H
  columns, or the first `columns`)."""
  columns = chunks_ref.shape[1] if columns is None else columns
  return [chunks_ref[j, pl.ds(0, columns)] for j in range(NUM_TURN_CHUNKS)]


def rotate_row_halves(q_lo, q_hi, shift, chunk_rows_lo, dtype):
  """R(-shift) applied to rows given as their two head-dim halves.

  With x = [x1, x2] and rotate_half(x) = [-x2, x1]:
  R(-s) x = x cos(s) - rotate_half(x) sin(s) = [x1 c + x2 s, x2 c - x1 s].
  q_lo, q_hi: f32 [R, H/2]; shift: int32 scalar; chunk_rows_lo: the first
  H/2 columns of the turn chunks (the halves share frequencies).  Returns the
  two halves of the rotated rows in `dtype`.
  """
  cos, sin = cos_sin_from_chunks(shift, chunk_rows_lo)  # each f32 [H/2]
  cos, sin = cos[None, :], sin[None, :]
  return ((q_lo * cos + q_hi * sin).astype(dtype),
          (q_hi * cos - q_lo * sin).astype(dtype))


def load_kv_block(k_ref, v_ref, page_table_ref, page_pos_ref, page_len_ref,
                  block, *, pages_per_block, page_size, block_k, num_pages,
                  num_logical_pages, column_filter, key_parts=1,
                  scale_refs=None):
  """Gathers one block of logical pages of one batch row and kv head.

  Args:
    k_ref, v_ref: [num_pages * page_size, H] refs (one kv head, pages
      flattened into rows).
    page_table_ref, page_pos_ref, page_len_ref: [M] refs of one batch row.
    block: int32 scalar, index of the block of `pages_per_block` pages.
    column_filter: fn(page, position) -> bool [block_k], an extra condition
      on each column given its logical page index and logical position (shift
      match, segment range, causal bound, ...).
    key_parts: K comes back as this many column slices [block_k, H / parts]
      (the prefill scores each half of the head dim with its own dot).
    scale_refs: (k_scale_ref, v_scale_ref), [num_pages] refs of one kv head,
      for float8 pages; None otherwise.

  Returns:
    (k_parts, v, position, scales): a tuple of K slices and v [block_k, H],
    zero in every column that is not a valid slot passing `column_filter`
    (those are never loaded, so NaN in unused pages or padding slots cannot
    leak); `position` int32 [block_k], the logical position of each column or
    NEVER_VISIBLE; `scales` None, or (k_scale, v_scale) f32 [block_k], each
    column's page scale (0 in columns that are not loaded).  K and V stay in
    the pool's dtype: float8 tiles are widened by the caller
    (`block_scores`, `softmax_step`) and scaled per column.
  """
  cols = lax.broadcasted_iota(jnp.int32, (block_k,), 0)
  page_in_block = lax.div(cols, page_size)
  slot = lax.rem(cols, page_size)
  page = block * pages_per_block + page_in_block
  in_range = (page_in_block < pages_per_block) & (page < num_logical_pages)
  page = jnp.minimum(page, num_logical_pages - 1)  # keep the gathers in bounds
  page_len = page_len_ref[page]
  page_pos = page_pos_ref[page]
  physical = jnp.clip(page_table_ref[page], 0, num_pages - 1)
  position = page_pos + slot
  ok = in_range & (slot < page_len) & column_filter(page, position)
  # Both index arrays broadcast to [block_k, H] (array-only indexing is what
  # both the Triton lowering and the interpreter support for a gather).
  rows = (physical * page_size + slot)[:, None]
  head_dim = k_ref.shape[-1]
  part = head_dim // key_parts
  lanes = lax.broadcasted_iota(jnp.int32, (1, part), 1)
  k_parts = tuple(
      plgpu.load(k_ref.at[rows, lanes + j * part], mask=ok[:, None],
                 other=0.0) for j in range(key_parts))
  lanes = lax.broadcasted_iota(jnp.int32, (1, head_dim), 1)
  v = plgpu.load(v_ref.at[rows, lanes], mask=ok[:, None], other=0.0)
  scales = None
  if scale_refs is not None:
    scales = tuple(plgpu.load(ref.at[physical], mask=ok, other=0.0)
                   for ref in scale_refs)
  return k_parts, v, jnp.where(ok, position, NEVER_VISIBLE), scales


def block_scores(q_parts, k_parts, k_scale=None):
  """sum_j q_parts[j] @ k_parts[j]^T, f32 [R, block_k] (base-2 scores).

  float8 K parts are widened to the query's dtype (exact) and the scores
  scaled by `k_scale` f32 [block_k], each column's page scale: the same
  numbers as scoring against dequantized keys, since scales are powers of
  two (kv_quant.py), for a multiply per score instead of per key element.
  """
  dtype = q_parts[0].dtype
  if q_parts[0].shape[-1] < 16 and jnp.dtype(dtype).itemsize == 2:
    # Triton's 16-bit dot needs an inner size of 16: the halves of a head
    # dim under 32 are scored in float32, whose dot takes 8 (in 16 bits
    # the H 16 prefill returned wrong scores, with no error).
    dtype = jnp.float32
  precision = dot_precision(dtype)
  scores = None
  for q_j, k_j in zip(q_parts, k_parts):
    s_j = lax.dot_general(q_j.astype(dtype), k_j.astype(dtype),
                          (((1,), (1,)), ((), ())),
                          precision=precision,
                          preferred_element_type=jnp.float32)
    scores = s_j if scores is None else scores + s_j
  if k_scale is not None:
    scores = scores * k_scale[None, :]
  return scores


def softmax_step(carry, scores, v, visible, v_scale=None, dtype=None):
  """One online-softmax step over a KV block, scores in base 2.

  carry: (acc f32 [R, H], m f32 [R], l f32 [R]); scores f32 [R, block_k];
  v [block_k, H] in the KV dtype; visible bool [R, block_k].  float8 V:
  `v_scale` f32 [block_k] (page scale per column) and `dtype`, the compute
  dtype V is widened to; P's columns are scaled instead of V's rows, each
  row relative to its largest product (the row's unit, applied to the f32
  result), so small scales cannot sink a float16 P below its range.
  """
  acc, m_prev, l_prev = carry
  dtype = v.dtype if dtype is None else dtype
  precision = dot_precision(dtype)
  scores = jnp.where(visible, scores, -jnp.inf)
  m_next = jnp.maximum(m_prev, jnp.max(scores, axis=1))
  alpha = jnp.exp2(m_prev - m_next)
  p = jnp.exp2(scores - m_next[:, None])
  l_next = l_prev * alpha + jnp.sum(p, axis=1)
  unit = None
  if v_scale is not None:
    p = p * v_scale[None, :]
    unit = jnp.max(p, axis=1)
    unit = jnp.where(unit > 0, unit, 1.0)
    p = p / unit[:, None]
  pv = lax.dot_general(p.astype(dtype), v.astype(dtype),
                       (((1,), (0,)), ((), ())), precision=precision,
                       preferred_element_type=jnp.float32)
  if unit is not None:
    pv = pv * unit[:, None]
  return acc * alpha[:, None] + pv, m_next, l_next


def softmax_init(rows: int, head_dim: int):
  return (jnp.zeros((rows, head_dim), jnp.float32),
          jnp.full((rows,), NEG_INIT, jnp.float32),
          jnp.zeros((rows,), jnp.float32))


def grouped_query_rows(q, q_pos, rope: RopeConfig, sm_scale, num_kv_heads,
                       rows_multiple):
  """Rotated queries laid out as rows of one kv head (XLA, outside kernels).

  Row r of kv head k is token t = r // G, query head n = k * G + r % G, so a
  program that takes consecutive rows shares one stream of KV among the G
  heads of a group.

  Returns:
    q_rot: f32 [B, K, R_pad, H], R(q_pos) q with sm_scale * log2(e) folded
      in (zero for padding rows);
    row_pos: int32 [B, R_pad], q_pos of each row, PADDING_ROW for padding
      rows (q_pos < 0 or past T * G).
  """
  batch, q_len, num_heads, head_dim = q.shape
  group = num_heads // num_kv_heads
  num_rows = q_len * group
  padded_rows = round_up(num_rows, rows_multiple)
  scale = jnp.asarray(sm_scale, jnp.float32) * jnp.float32(LOG2_E)
  q_rot, _ = rotated_query(q, q_pos, rope, scale)

  def to_rows(x):  # [B, T, N, H] -> [B, K, T*G, H], padded
    x = x.reshape(batch, q_len, num_kv_heads, group, head_dim)
    x = jnp.transpose(x, (0, 2, 1, 3, 4)).reshape(
        batch, num_kv_heads, num_rows, head_dim)
    return jnp.pad(x, ((0, 0), (0, 0), (0, padded_rows - num_rows), (0, 0)))

  return to_rows(q_rot), grouped_row_positions(q_pos, group, rows_multiple)


def grouped_row_positions(q_pos, group, rows_multiple):
  """int32 [B, R_pad]: q_pos of each grouped query row (see
  grouped_query_rows), PADDING_ROW for padding rows."""
  batch, q_len = q_pos.shape
  num_rows = q_len * group
  padded_rows = round_up(num_rows, rows_multiple)
  row_pos = jnp.where(q_pos >= 0, q_pos, PADDING_ROW)
  row_pos = jnp.repeat(row_pos, group, axis=1)
  return jnp.pad(row_pos, ((0, 0), (0, padded_rows - num_rows)),
                 constant_values=PADDING_ROW)


def fold_last_axis(op, x):
  """op (pairwise, e.g. jnp.maximum) folded over the short last axis of x
  (a KV block's pages), unrolled into elementwise ops: XLA fuses them into
  their users, where a reduction would be a launch of its own, and the
  plans are launch bound (docs/kernels.md)."""
  out = x[..., 0]
  for i in range(1, x.shape[-1]):
    out = op(out, x[..., i])
  return out


def prefix_sum(x, block: int = 32):
  """Inclusive prefix sum over the last axis of an integer [..., M] array.

  Written as masked reductions, which XLA fuses into a few kernels, because
  jnp.cumsum lowers on GPU to a tree of reduce-window ops, several launches
  each, and the XLA work before the kernels is launch bound
  (docs/kernels.md).  Rows of up to `block` take one [..., M, M] reduction;
  longer rows are cut into blocks of `block`, summed within each block and
  then over the block totals, so the work grows as M * block instead of M^2
  (a row of 512 pages in a decode batch of 64).
  """
  m = x.shape[-1]
  if m <= block:
    return _quadratic_prefix_sum(x)
  num_blocks = -(-m // block)
  pad = [(0, 0)] * (x.ndim - 1) + [(0, num_blocks * block - m)]
  blocks = jnp.pad(x, pad).reshape(*x.shape[:-1], num_blocks, block)
  within = _quadratic_prefix_sum(blocks)
  before = _quadratic_prefix_sum(within[..., -1]) - within[..., -1]
  out = within + before[..., None]
  return out.reshape(*x.shape[:-1], num_blocks * block)[..., :m]


def _quadratic_prefix_sum(x):
  m = x.shape[-1]
  row = lax.broadcasted_iota(jnp.int32, (m, m), 0)
  col = lax.broadcasted_iota(jnp.int32, (m, m), 1)
  return jnp.sum(jnp.where(col <= row, x[..., None, :], 0), axis=-1,
                 dtype=x.dtype)


def rows_to_heads(out, q_len, group):
  """[B, K, R_pad, H] kernel rows back to [B, T, N, H]."""
  batch, num_kv_heads, _, head_dim = out.shape
  out = out[:, :, :q_len * group].reshape(batch, num_kv_heads, q_len, group,
                                          head_dim)
  return jnp.transpose(out, (0, 2, 1, 3, 4)).reshape(
      batch, q_len, num_kv_heads * group, head_dim)


def scale_specs(k_scales, index_map):
  """in_specs of float8 page scales (K and V, each [K, num_pages]; one kv
  head's row per program, picked by index_map), or none without them."""
  if k_scales is None:
    return []
  spec = pl.BlockSpec((None, k_scales.shape[1]), index_map)
  return [spec, spec]


def flat_pages(pages):
  """[K, P, page_size, H] -> [K, P * page_size, H] (free, contiguous)."""
  num_kv_heads, num_pages, page_size, head_dim = pages.shape
  return pages.reshape(num_kv_heads, num_pages * page_size, head_dim)
