"""Lazy (deferred-RoPE) paged decode on Hopper: Pallas, Mosaic GPU lowering.

Same contract and result as `gpu_decode.lazy_decode_gpu` (the Triton
kernel) for T == 1 with 16-bit queries and 16-bit or float8 (e4m3, with
per-page scales) pools on H100/H200: TMA copies of whole KV
pages into a shared-memory ring, wgmma for both matmuls, the KV of a row
split over CTAs (flash-decoding) and merged in XLA.  This module is the entry
point: input checks (`mosaic_decode_unsupported`), the per-batch plan
(`plan_decode`: one step per KV block for 16-bit pools, the prefill's
segment step records with T == 1 for float8 pools), the query tile, the
kernel (`gpu_decode_mgpu_kernel`) and the merge.  `interpret=True` runs the
kernel in jax's Mosaic GPU interpreter on CPU.

Design: docs/kernels.md, 'GPU decode, Mosaic GPU'.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_decode_block_sizes import (MgpuDecodeBlockSizes,
                                                   mgpu_decode_kv_splits,
                                                   mgpu_decode_smem_bytes)
from pallas_kernels.gpu_decode_block_plan import block_records
from pallas_kernels.gpu_decode_mgpu_kernel import mgpu_decode_kernel
from pallas_kernels.gpu_decode_page_fields import plan_fields
from pallas_kernels.gpu_decode_plan_kernel import (
    decode_plan_kernel_unsupported, plan_decode_kernel)
from pallas_kernels.gpu_mgpu_lanes import wants_plan_kernel
from pallas_kernels.gpu_prefill_mgpu import SUPPORTED_DTYPES, tile_refusal
from pallas_kernels.gpu_prefill_mgpu_plan import (segment_cos_sin,
                                                  step_records)
from pallas_kernels.kv_quant import check_kv_scales, is_quantized
from pallas_kernels.lazy_attention import check_lazy_attention_shapes
from pallas_kernels.masked_softmax import merge_splits
from pallas_kernels.rope import RopeConfig, rotated_query
from pallas_kernels.sizes import ceil_div

# Shared memory we allow ourselves (H100/H200: 227 KB per block opt-in),
# less a margin for barriers and alignment.
_SMEM_LIMIT = 227 * 1024 - 4096


def default_decode_block_sizes(kv_dtype) -> MgpuDecodeBlockSizes:
  """The decode tiles for pools of `kv_dtype`.

  16-bit pools: one CTA per work item (no faster persistent), one step per
  KV block with the RoPE cos / sin computed in the kernel, so the plan is
  the page metadata reshaped (8.8 us of device time at B 64 / 8K context on
  the H200, against 37 us for segment steps; the kernel as fast), a
  rotation's cos / sin computed one value a thread (`compact_cos_sin`:
  faster on shuffled pages).
  Float8 pools: segment steps on the persistent grid (faster there per
  layer: their steps are compute-bound, and a CTA's next item overlaps its
  drain).  The plan depends on the choice: plan with the same block sizes
  (`plan_decode`'s default for the same `kv_dtype`).  Measurements:
  benchmarks/RESULTS.md."""
  if is_quantized(kv_dtype):
    return MgpuDecodeBlockSizes(persistent=True)
  return MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True,
                              compact_cos_sin=True)


def mosaic_decode_unsupported(q_shape, q_dtype, k_shape, k_dtype,
                              block_sizes: MgpuDecodeBlockSizes | None = None
                              ) -> str | None:
  """Why the Mosaic decode kernel cannot take these inputs, or None.

  q_shape [B, T, N, H], k_shape [K, num_pages, P, H].
  """
  block_sizes = block_sizes or default_decode_block_sizes(k_dtype)
  q_len, num_heads, head_dim = q_shape[1], q_shape[2], q_shape[3]
  num_kv_heads, page_size = k_shape[0], k_shape[2]
  if q_len != 1:
    return f"lazy_decode_mgpu needs one query token (T == 1), got T={q_len}"
  if jnp.dtype(q_dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    return f"lazy_decode_mgpu needs q dtype bfloat16 or float16, got {q_dtype}"
  if (not is_quantized(k_dtype)
      and jnp.dtype(k_dtype) != jnp.dtype(q_dtype)):
    return (f"k_pages dtype {k_dtype} must equal q dtype {q_dtype} or be "
            f"float8_e4m3fn")
  reason = tile_refusal("lazy_decode_mgpu", head_dim, page_size,
                        block_sizes.block_kv)
  if reason is not None:
    return reason
  if block_sizes.steps_by_block and is_quantized(k_dtype):
    return ("lazy_decode_mgpu with steps_by_block needs 16-bit pages, got "
            f"{k_dtype}")
  if num_heads // num_kv_heads > WG_ROWS:
    return (f"lazy_decode_mgpu needs at most {WG_ROWS} query heads per kv "
            f"head, got {num_heads // num_kv_heads}")
  need = mgpu_decode_smem_bytes(block_sizes, head_dim,
                                quantized=is_quantized(k_dtype),
                                page_size=page_size)
  if need > _SMEM_LIMIT:
    return (f"block_sizes {block_sizes} need {need} bytes of shared memory "
            f"(limit {_SMEM_LIMIT}); use fewer stages or block_kv 64")
  return None


class DecodePlan(NamedTuple):
  """Per-batch metadata of the decode kernel (XLA, or one Mosaic GPU launch
  with plan_in_kernel), the same for every layer
  (made once per decode step by `plan_decode`)."""

  n_steps: jax.Array  # int32 [B]: KV steps of each row
  records: jax.Array  # int32 [B, steps, width]: step records (prefill's);
  #                    fields_in_kernel: a tuple, the page table, positions,
  #                    slots and shifts, each int32 [B, M'] (M' whole chunks)
  cos_sin: jax.Array  # f32 [B, M, 2, H / 2]: per-segment cos / sin (per
  #                    page, M rounded up to whole blocks, steps_by_block)
  q_pos: jax.Array  # int32 [B]: q_pos, PADDING_ROW for padding rows


def _no_cos_sin(rows, num_pages: int):
  """The [B, M, 2, 0] cos / sin of a plan whose kernel computes its own
  (B from `rows`' leading axis)."""
  return jnp.zeros((rows.shape[0], num_pages, 2, 0), jnp.float32)


def plan_decode(page_table, page_pos, page_shift, page_len, q_pos, *,
                rope: RopeConfig, head_dim: int, num_pages: int,
                page_size: int,
                block_sizes: MgpuDecodeBlockSizes | None = None,
                kv_dtype=jnp.bfloat16, interpret: bool = False) -> DecodePlan:
  """Step records of each row's live pages (page_len > 0, page_pos <=
  q_pos; none for a padding row), in page order, one segment (one shift) per
  step, and the cos / sin of each segment's shift (exact).  With
  `block_sizes.steps_by_block`: one step per block of pages, and the cos /
  sin of each page's shift (`gpu_decode_block_plan.block_records`); none
  with `block_sizes.rope_in_kernel` (a [B, M, 2, 0] placeholder).  With
  `block_sizes.fields_in_kernel` the records are the page fields themselves
  and only the step counts are computed (`gpu_decode_page_fields`).  With
  `block_sizes.plan_in_kernel` (by default on the GPU, not when
  interpreting) the block plan comes from one Mosaic GPU launch where that
  kernel takes the shape (`gpu_decode_plan_kernel`; run in the interpreter
  with `interpret` and plan_in_kernel=True), the same arrays.  block_sizes
  defaults to `default_decode_block_sizes(kv_dtype)`, the pools' dtype."""
  block_sizes = block_sizes or default_decode_block_sizes(kv_dtype)
  num_logical = page_table.shape[1]
  use_kernel = wants_plan_kernel(block_sizes.plan_in_kernel, interpret) and (
      decode_plan_kernel_unsupported(
          num_logical_pages=num_logical, page_size=page_size,
          block_sizes=block_sizes) is None)
  if use_kernel:
    n_steps, records, kernel_q_pos = plan_decode_kernel(
        page_table, page_pos, page_shift, page_len, q_pos,
        num_pages=num_pages, page_size=page_size, block_sizes=block_sizes,
        interpret=interpret)
    return DecodePlan(n_steps, records, _no_cos_sin(q_pos, num_logical),
                      kernel_q_pos)
  row = q_pos[:, 0]
  live = (page_len > 0) & (page_pos <= row[:, None]) & (row[:, None] >= 0)
  kernel_q_pos = jnp.where(row >= 0, row, common.PADDING_ROW)
  if block_sizes.fields_in_kernel:  # the kernel reads the fields and
    # applies liveness: only the step counts here; no cos / sin
    n_steps, fields = plan_fields(
        page_table, page_pos, page_shift, page_len, live,
        pages_per_block=block_sizes.block_kv // page_size)
    return DecodePlan(n_steps, fields, _no_cos_sin(row, fields[0].shape[1]),
                      kernel_q_pos)
  make = block_records if block_sizes.steps_by_block else step_records
  records, num_steps, *_, shift = make(
      page_table, page_pos, page_shift, page_len, live, num_pages=num_pages,
      page_size=page_size, pages_per_block=block_sizes.block_kv // page_size)
  if block_sizes.rope_in_kernel:  # computed in the kernel: none here
    cos_sin = _no_cos_sin(shift, shift.shape[1])
  else:
    cos_sin = segment_cos_sin(shift, rope, head_dim)
  return DecodePlan(num_steps.astype(jnp.int32), records, cos_sin,
                    kernel_q_pos)


def decode_query_tile(q, q_pos, rope: RopeConfig, sm_scale,
                      num_kv_heads: int):
  """f32 [B, K, 64, H]: R(q_pos) q * sm_scale * log2(e) of the one token of
  q [B, 1, N, H]; rows 0..G-1 of kv head k are its G query heads (the wgmma
  M is 64 rows), the rows below and padding rows (q_pos -1) are zero."""
  scale = jnp.asarray(sm_scale, jnp.float32) * jnp.float32(common.LOG2_E)
  q_rot, _ = rotated_query(q, q_pos, rope, scale)
  batch, _, num_heads, head_dim = q.shape
  group = num_heads // num_kv_heads
  tile = q_rot.reshape(batch, num_kv_heads, group, head_dim)
  return jnp.pad(tile, ((0, 0), (0, 0), (0, WG_ROWS - group), (0, 0)))


def lazy_decode_mgpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                     page_len, q_pos, *, rope: RopeConfig, sm_scale,
                     block_sizes: MgpuDecodeBlockSizes | None = None,
                     interpret: bool = False, k_scales=None, v_scales=None):
  """Decode (T == 1) of the lazy attention contract, Mosaic GPU (Hopper).

  Same arguments and result as `pallas_kernels.lazy_attention` (and
  `gpu_decode.lazy_decode_gpu`) for 16-bit queries, with pools in q's dtype
  or float8_e4m3fn with `k_scales`, `v_scales`; `sm_scale` is a float or f32
  scalar array.  `interpret=True` runs the kernel in the Mosaic GPU
  interpreter on CPU (slow; tests only).  Raises ValueError, naming the
  argument, for inputs it does not support (`mosaic_decode_unsupported`).
  """
  check_lazy_attention_shapes(q, k_pages, v_pages, page_table, page_pos,
                              page_shift, page_len, q_pos, k_scales, v_scales)
  if not isinstance(rope, RopeConfig):
    raise ValueError(f"rope must be a RopeConfig, got {type(rope).__name__}")
  block_sizes = block_sizes or default_decode_block_sizes(k_pages.dtype)
  reason = mosaic_decode_unsupported(q.shape, q.dtype, k_pages.shape,
                                     k_pages.dtype, block_sizes)
  if reason is not None:
    raise ValueError(reason)
  plan = plan_decode(page_table, page_pos, page_shift, page_len, q_pos,
                     rope=rope, head_dim=q.shape[-1],
                     num_pages=k_pages.shape[1], page_size=k_pages.shape[2],
                     block_sizes=block_sizes, interpret=interpret)
  return lazy_decode_mgpu_planned(q, k_pages, v_pages, q_pos, plan,
                                  rope=rope, sm_scale=sm_scale,
                                  block_sizes=block_sizes,
                                  interpret=interpret, k_scales=k_scales,
                                  v_scales=v_scales)


def lazy_decode_mgpu_planned(q, k_pages, v_pages, q_pos, plan: DecodePlan,
                             *, rope: RopeConfig, sm_scale, page_offset=0,
                             block_sizes: MgpuDecodeBlockSizes | None = None,
                             interpret: bool = False, k_scales=None,
                             v_scales=None):
  """The per-layer part of `lazy_decode_mgpu`: query tile, kernel, merge.

  `plan` must come from `plan_decode` with the same metadata, q_pos, shapes
  and block_sizes; `page_offset` (int or int32 scalar) is added to every
  physical page id of the plan (layers at offsets of one page array).
  """
  block_sizes = block_sizes or default_decode_block_sizes(k_pages.dtype)
  reason = mosaic_decode_unsupported(q.shape, q.dtype, k_pages.shape,
                                     k_pages.dtype, block_sizes)
  if reason is not None:
    raise ValueError(reason)
  check_kv_scales(k_pages, v_pages, k_scales, v_scales, q.dtype)
  batch, _, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  if plan.n_steps.shape != (batch,):
    raise ValueError(f"plan was made for {plan.n_steps.shape[0]} rows; q "
                     f"has {batch}")
  num_logical = plan.cos_sin.shape[1]
  ppb = block_sizes.block_kv // page_size
  # A block plan has one record per ppb cos/sin rows, a segment plan more;
  # a page-fields plan holds the fields themselves.
  fields = isinstance(plan.records, (tuple, list))
  made = dict(steps_by_block=fields or (
                  plan.records.shape[1] * ppb == num_logical),
              rope_in_kernel=plan.cos_sin.shape[-1] == 0,
              fields_in_kernel=fields)
  for name, value in made.items():
    if value != getattr(block_sizes, name):
      raise ValueError(f"plan was made with {name}={value}, block_sizes "
                       f"have {name}={not value}: make the plan with the "
                       f"same block_sizes")
  splits = mgpu_decode_kv_splits(
      block_sizes, batch=batch, num_kv_heads=num_kv_heads,
      max_steps=ceil_div(num_logical, ppb))
  q_tile = decode_query_tile(q, q_pos, rope, sm_scale, num_kv_heads)
  acc, ml = mgpu_decode_kernel(
      q_tile, k_pages, v_pages, plan.n_steps, plan.records, plan.cos_sin,
      plan.q_pos, page_offset, group=group, num_splits=splits, rope=rope,
      compute_dtype=q.dtype, k_scales=k_scales, v_scales=v_scales,
      block_sizes=block_sizes, interpret=interpret)
  # acc [B, S, K, Gp, H], ml [B, S, K, 2, 64]: keep the G real rows.
  acc = acc[:, :, :, :group]
  m, l = ml[:, :, :, 0, :group], ml[:, :, :, 1, :group]
  out = merge_splits(acc, m, l, axis=1, exp=jnp.exp2)  # [B, K, G, H]
  return out.reshape(batch, 1, num_heads, head_dim).astype(q.dtype)
