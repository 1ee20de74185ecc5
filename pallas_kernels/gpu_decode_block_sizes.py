"""Tiles of the Mosaic GPU (Hopper) decode kernel, and how its work maps
onto CTAs: `MgpuDecodeBlockSizes`, its shared memory, its KV splits and its
grid's work items.  How the values were chosen: docs/kernels.md, 'GPU
decode, Mosaic GPU'.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.gpu_block_sizes import (MIN_BLOCKS_PER_SPLIT, WG_ROWS,
                                            ring_bytes)
from pallas_kernels.gpu_mgpu_lanes import LANES
from pallas_kernels.rope import NUM_TURN_CHUNKS

@dataclasses.dataclass(frozen=True)
class MgpuDecodeBlockSizes:
  """Tiles of the Mosaic GPU decode kernel (gpu_decode_mgpu*.py).

  Attributes:
    block_kv: keys per step (whole pages): 64 or 128.
    num_stages: depth of the K/V shared-memory ring (>= 2).
    kv_splits: CTAs that share one (batch row, kv head), each streaming an
      even share of the row's steps; None picks from the shape
      (`mgpu_decode_kv_splits`).
    mask_fast_path: skip the score mask on steps that need none.
    persistent: launch at most one CTA per SM (`num_ctas`), each streaming
      several (batch row, kv head, split) work items through one K/V ring,
      the next item's query prefetched; else one CTA per work item.
      `gpu_decode_mgpu.default_decode_block_sizes` turns it on for float8
      pools only: on 16-bit pools it measured no faster (and with
      `steps_by_block` at 128-key steps and H 128 it does not fit).
    num_ctas: CTAs of the persistent grid; None takes the local GPU's SM
      count (`gpu_sm_count`).
    float8_operand: the 16-bit wgmma operand dtype of float8 pools' steps
      (the rotated query, the widened K and V tiles, P): "float16" (Hopper
      widens e4m3 pairs to f16 in one instruction) or "query" (q's dtype;
      e4m3 -> bf16 goes through f32).  Both are exact for the e4m3 values;
      f16 keeps more of the query's and P's mantissa, and its range holds
      any scaled query and P times a V scale up to 65504.
    steps_by_block: one step per KV block, whatever shifts its pages carry
      (the kernel rotates the query for each run of one shift inside the
      block and takes that run's columns from its own Q K^T), so the plan
      is a reshape of the page metadata, not a flattening into segment
      steps (`gpu_decode_block_plan.py`).  16-bit pages only.
    rope_in_kernel: with `steps_by_block`, the kernel computes each
      shift's cos / sin itself (the exact range reduction of
      `rope.cos_sin_from_chunks`, then the GPU's sin / cos), so the plan
      writes and the producer copies none.  The two together are the
      default for 16-bit pools (`gpu_decode_mgpu.default_decode_block_sizes`).
    fields_in_kernel: with `rope_in_kernel`, the producer copies each step's
      page fields (id, position, slots, shift) from the caller's page
      metadata and the kernel applies liveness itself, so the plan is only
      each row's step count (`gpu_decode_page_fields.py`): one XLA launch
      before the kernel instead of three on a whole call.  Not the default:
      per layer (the model's call, its plan made once a step) it was
      slower on the H200 (docs/kernels.md).
    copy_contiguous_blocks: as `MgpuBlockSizes.copy_contiguous_blocks`.
    l2_prefetch: as `MgpuBlockSizes.l2_prefetch`.
    plan_in_kernel: with `rope_in_kernel` (not `fields_in_kernel`),
      `plan_decode` makes the block plan in one Mosaic GPU launch
      (`gpu_decode_plan_kernel`, the same arrays bit for bit) instead of
      about ten XLA launches, where that kernel takes the shape.  None (the
      default): on the GPU, and not when interpreting, where the
      interpreted kernel is slow; True / False force it.
    rotate_ahead: with `rope_in_kernel` (not `fields_in_kernel`), the
      query rotation a block's first page needs is done before the
      block's K copy is waited for, from that page's shift read from the
      plan in global memory a step earlier, so it overlaps the copy; else
      after the wait, before the block's Q K^T, where it delays the K
      slot's release.  The same result, bit for bit; on the H200 no
      faster (docs/kernels.md), so off by default.
    dependent_launch: as `MgpuBlockSizes.dependent_launch`: the decode
      kernel waits for the kernel before it before its first global read,
      so jax >= 0.11 launches it with programmatic dependent launch; the
      plan kernel lets it launch at its start.
    compact_cos_sin: with `rope_in_kernel`, a rotation's H cos and sin
      values are computed one a thread (laid out over the warpgroup's 128
      threads) and read back from shared memory, instead of each thread
      computing the 16 columns it holds in the WGMMA layout (every column
      in 32 threads).  The same values, in float32 with the same range
      reduction; it takes work off the compute warpgroup at each shift.
      Faster on the H200 on shuffled pages (docs/kernels.md); on in
      `default_decode_block_sizes` for 16-bit pools.
  """

  # 128-key steps and two stages (all that fits beside the float32 query
  # and output tiles at H 128): 64-key steps with four stages measured no
  # faster on the H200 (benchmarks/RESULTS.md).
  block_kv: int = 128
  num_stages: int = 2
  kv_splits: int | None = None
  mask_fast_path: bool = True
  persistent: bool = False
  num_ctas: int | None = None
  float8_operand: str = "float16"
  steps_by_block: bool = False
  rope_in_kernel: bool = False
  fields_in_kernel: bool = False
  copy_contiguous_blocks: bool = True
  l2_prefetch: bool = False
  plan_in_kernel: bool | None = None
  rotate_ahead: bool = False
  dependent_launch: bool = False
  compact_cos_sin: bool = False

  def __post_init__(self):
    if self.rope_in_kernel and not self.steps_by_block:
      raise ValueError("rope_in_kernel needs steps_by_block=True")
    if self.fields_in_kernel and not self.rope_in_kernel:
      raise ValueError("fields_in_kernel needs rope_in_kernel=True")
    if self.rotate_ahead and (not self.rope_in_kernel
                              or self.fields_in_kernel):
      raise ValueError("rotate_ahead needs rope_in_kernel=True and "
                       "fields_in_kernel=False")
    if self.compact_cos_sin and not self.rope_in_kernel:
      raise ValueError("compact_cos_sin needs rope_in_kernel=True")
    if self.float8_operand not in ("float16", "query"):
      raise ValueError(f"float8_operand must be 'float16' or 'query', got "
                       f"{self.float8_operand!r}")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"num_ctas must be >= 1, got {self.num_ctas}")
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
    if self.kv_splits is not None and self.kv_splits < 1:
      raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")


def shift_cos_sin_shape(head_dim: int) -> tuple[int, int]:
  """`compact_cos_sin`: one rotation's cos / sin, one value a thread, as
  rows of H/2: cos in the even rows, sin in the odd (two rows at H 128,
  four at H 64)."""
  half = head_dim // 2
  return (LANES // half, half)


def mgpu_decode_smem_bytes(block_sizes: MgpuDecodeBlockSizes,
                           head_dim: int, quantized: bool = False,
                           page_size: int = 8) -> int:
  """Shared memory of one decode CTA (buffers only): the f32 query tile
  (reused for the output; two when persistent), its 16-bit rotated copy,
  the K/V ring (1-byte elements for float8 pages, plus a 16-bit K and V
  tile they are widened into), records, cos/sin (twice as deep for float8;
  one row per page of a step with `steps_by_block`, pages of `page_size`),
  the RoPE turn chunks, the m / l rows and (`steps_by_block`) a block's
  f32 scores."""
  q_store = WG_ROWS * head_dim * 4 * (2 if block_sizes.persistent else 1)
  q_16 = WG_ROWS * head_dim * 2
  # steps_by_block: cos / sin of every page of a step, not of one segment.
  pages = (block_sizes.block_kv // page_size if block_sizes.steps_by_block
           else 1)
  if block_sizes.rope_in_kernel:  # a one-row placeholder per stage
    pages = 1
  cos_sin_pages = block_sizes.num_stages * (pages - 1) * head_dim * 4
  turn_chunks = NUM_TURN_CHUNKS * head_dim // 2 * 4
  if block_sizes.compact_cos_sin:  # the chunks repeated over the rows of
    # shift_cos_sin_shape, and one rotation's cos / sin
    turn_chunks = (NUM_TURN_CHUNKS + 1) * LANES * 4
  scores = (WG_ROWS * block_sizes.block_kv * 4 if block_sizes.steps_by_block
            else 0)
  # fields_in_kernel: a record slot holds four 128-byte field chunks, not
  # one 128-byte record.
  fields = (2 * block_sizes.num_stages * 3 * 128
            if block_sizes.fields_in_kernel else 0)
  return (q_store + q_16 + cos_sin_pages + turn_chunks + 2 * WG_ROWS * 4
          + scores + fields
          + ring_bytes(block_sizes.num_stages, block_sizes.block_kv,
                        head_dim, quantized))


def mgpu_decode_kv_splits(block_sizes: MgpuDecodeBlockSizes, *, batch: int,
                          num_kv_heads: int, max_steps: int) -> int:
  """kv_splits for the Mosaic decode: as given, else as many as fill the
  SMs once (one CTA fits an SM), each with at least MIN_BLOCKS_PER_SPLIT
  steps of the longest possible row.  Unlike the Triton decode's four
  waves: measured per layer on the H200, one split beat two and three at
  B32 and B64, two beat one, four and nine at B8 (docs/kernels.md)."""
  if block_sizes.kv_splits is not None:
    return block_sizes.kv_splits
  wanted = gpu_sm_count() // (batch * num_kv_heads)
  return max(1, min(wanted, max_steps // MIN_BLOCKS_PER_SPLIT))


# H100 and H200 (SXM) have 132 SMs: the persistent grid's size where no GPU
# is attached (export, the interpreter).
HOPPER_SM_COUNT = 132


def gpu_sm_count() -> int:
  """SMs of the first local GPU (its `core_count`), else HOPPER_SM_COUNT."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:  # no GPU backend in this process
    return HOPPER_SM_COUNT
  return getattr(devices[0], "core_count", None) or HOPPER_SM_COUNT


def mgpu_decode_num_ctas(block_sizes: MgpuDecodeBlockSizes,
                         num_items: int) -> int:
  """CTAs of the Mosaic decode grid for `num_items` (batch row, kv head,
  split) work items: one per item, or with `persistent` at most num_ctas
  (the SM count by default)."""
  if not block_sizes.persistent:
    return num_items
  return max(1, min(num_items, block_sizes.num_ctas or gpu_sm_count()))


def mgpu_decode_work_item(j, cta, *, num_ctas: int, num_kv_heads: int,
                          num_splits: int, n_steps_ref):
  """In the Mosaic decode kernel: (batch, head, split, first step, steps)
  of this CTA's j-th work item: items w = cta + j * num_ctas, in (batch,
  kv head, split) order.  A split takes an even share of its row's steps
  (rows differ in length, so the share is per row); steps are in page
  order."""
  w = cta + j * num_ctas
  per_batch = num_kv_heads * num_splits
  batch = lax.div(w, jnp.int32(per_batch))
  rest = w - batch * per_batch
  head = lax.div(rest, jnp.int32(num_splits))
  split = rest - head * num_splits
  total = n_steps_ref[batch]
  per_split = lax.div(total + (num_splits - 1), jnp.int32(num_splits))
  first = jnp.minimum(split * per_split, total)
  return batch, head, split, first, jnp.minimum(per_split, total - first)
