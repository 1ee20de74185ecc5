"""Lazy (deferred-RoPE) paged prefill on Hopper: Pallas, Mosaic GPU lowering.

Same contract and result as `gpu_prefill.lazy_prefill_gpu` (the Triton
kernel), for 16-bit queries with pools in their dtype or float8 (e4m3, with
per-page scales) on H100/H200: TMA copies of whole KV pages into a
shared-memory ring and wgmma for both matmuls, FlashAttention-3 style.  This
module is the entry point: it checks the inputs, makes the per-batch plan
(`gpu_prefill_mgpu_plan`), leaves the query's rotation to the kernel (the
default for a 16-bit query: MgpuBlockSizes.rotates_query_in_kernel) or
makes the rotated query, and runs the kernel (`gpu_prefill_mgpu_kernel`).
`interpret=True` runs the kernel in jax's Mosaic GPU interpreter on CPU.

Design: docs/kernels.md.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import MgpuBlockSizes, smem_bytes
from pallas_kernels.gpu_prefill_mgpu_kernel import mgpu_prefill_kernel
from pallas_kernels.gpu_prefill_mgpu_plan import (PrefillPlan, RecordLayout,
                                                  padded_query_len,
                                                  plan_prefill, step_records)
from pallas_kernels.gpu_prefill_plan_kernel import (plan_kernel_unsupported,
                                                    plan_prefill_kernel)
from pallas_kernels.gpu_mgpu_lanes import wants_plan_kernel
from pallas_kernels.kv_quant import check_kv_scales, is_quantized
from pallas_kernels.lazy_attention import check_lazy_attention_shapes
from pallas_kernels.rope import RopeConfig, rotated_query

# The plan, the kernel and the tiles stay importable from here.
__all__ = [
    "MgpuBlockSizes",
    "PrefillPlan",
    "RecordLayout",
    "lazy_prefill_mgpu",
    "lazy_prefill_mgpu_planned",
    "mgpu_prefill_kernel",
    "mosaic_prefill_supported",
    "padded_query_len",
    "plan_prefill",
    "query_operand",
    "rotated_query_tokens",
    "smem_bytes",
    "step_records",
    "choose_prefill_plan",
]

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
SUPPORTED_HEAD_DIMS = (64, 128)
# Shared memory we allow ourselves (H100/H200: 227 KB per block opt-in).
_SMEM_LIMIT = 227 * 1024


def tile_refusal(kernel: str, head_dim: int, page_size: int,
                 block_kv: int) -> str | None:
  """Why a Mosaic GPU kernel (prefill or decode) cannot tile this head dim
  and page size into its `block_kv`-key steps, or None."""
  if head_dim not in SUPPORTED_HEAD_DIMS:
    return (f"{kernel} needs q head dim in {SUPPORTED_HEAD_DIMS}, "
            f"got {head_dim}")
  if page_size % 8 or block_kv % page_size:
    return (f"{kernel} needs a k_pages page_size that is a multiple "
            f"of 8 and divides block_kv={block_kv}, got {page_size}")
  return None


def _unsupported(q_dtype, k_dtype, head_dim: int, page_size: int,
                 block_sizes: MgpuBlockSizes) -> str | None:
  """Why this kernel cannot take these inputs, or None if it can."""
  if jnp.dtype(q_dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    return f"lazy_prefill_mgpu needs q dtype bfloat16 or float16, got {q_dtype}"
  quantized = is_quantized(k_dtype)
  if not quantized and jnp.dtype(k_dtype) != jnp.dtype(q_dtype):
    return (f"k_pages dtype {k_dtype} must equal q dtype {q_dtype} or be "
            f"float8_e4m3fn")
  if quantized and block_sizes.query_in_f32:
    return ("lazy_prefill_mgpu on float8 pages needs 16-bit query storage "
            "(MgpuBlockSizes(query_in_f32=False))")
  reason = tile_refusal("lazy_prefill_mgpu", head_dim, page_size,
                        block_sizes.block_kv)
  if reason is not None:
    return reason
  need = smem_bytes(block_sizes, head_dim, quantized)
  if need > _SMEM_LIMIT - 4096:
    return (f"block_sizes {block_sizes} need {need} bytes of shared memory "
            f"(limit {_SMEM_LIMIT - 4096}); use fewer stages")
  return None


def mosaic_prefill_supported(q_dtype, kv_dtype, head_dim: int,
                             page_size: int) -> bool:
  """Whether the default MgpuBlockSizes handle a query of `q_dtype` on pools
  of `kv_dtype` (q's dtype, or float8_e4m3fn)."""
  return _unsupported(q_dtype, kv_dtype, head_dim, page_size,
                      MgpuBlockSizes()) is None


def _check_inputs(q, k_pages, page_size, block_sizes):
  reason = _unsupported(q.dtype, k_pages.dtype, q.shape[-1], page_size,
                        block_sizes)
  if reason is not None:
    raise ValueError(reason)


def choose_prefill_plan(page_table, page_pos, page_shift, page_len, q_pos,
                        *, block_sizes: MgpuBlockSizes,
                        interpret: bool = False, **plan_args) -> PrefillPlan:
  """The prefill plan of `lazy_prefill_mgpu` and of a model's forward pass
  (`plan_lazy_attention`): one Mosaic GPU launch
  (`plan_prefill_kernel`) where `block_sizes.plan_in_kernel` asks for it
  (by default on the GPU, not when interpreting) and that kernel takes the
  shape, else the XLA plan (`plan_prefill`); the same arrays either way.
  `plan_args`: plan_prefill's keywords."""
  use_kernel = wants_plan_kernel(block_sizes.plan_in_kernel, interpret) and (
      plan_kernel_unsupported(
          num_logical_pages=page_table.shape[1], q_len=q_pos.shape[1],
          head_dim=plan_args["head_dim"], block_sizes=block_sizes) is None)
  if use_kernel:
    return plan_prefill_kernel(page_table, page_pos, page_shift, page_len,
                               q_pos, block_sizes=block_sizes,
                               interpret=interpret, **plan_args)
  return plan_prefill(page_table, page_pos, page_shift, page_len, q_pos,
                      block_sizes=block_sizes, **plan_args)


def lazy_prefill_mgpu(q, k_pages, v_pages, page_table, page_pos, page_shift,
                      page_len, q_pos, *, rope: RopeConfig, sm_scale,
                      block_sizes: MgpuBlockSizes | None = None,
                      interpret: bool = False, k_scales=None, v_scales=None):
  """Prefill (T >= 1) of the lazy attention contract, Mosaic GPU (Hopper).

  Same arguments and result as `pallas_kernels.lazy_attention` (and
  `gpu_prefill.lazy_prefill_gpu`); `sm_scale` is a float or f32 scalar
  array; float8_e4m3fn pools take `k_scales`, `v_scales`.  `block_sizes`
  picks tiles (MgpuBlockSizes); `interpret=True` runs the kernel in the
  Mosaic GPU interpreter on CPU (slow; tests only).  Raises ValueError,
  naming the argument, for shapes it does not support.
  """
  check_lazy_attention_shapes(q, k_pages, v_pages, page_table, page_pos,
                              page_shift, page_len, q_pos, k_scales, v_scales)
  if not isinstance(rope, RopeConfig):
    raise ValueError(f"rope must be a RopeConfig, got {type(rope).__name__}")
  block_sizes = block_sizes or MgpuBlockSizes()
  _check_inputs(q, k_pages, k_pages.shape[2], block_sizes)
  plan = choose_prefill_plan(
      page_table, page_pos, page_shift, page_len, q_pos, rope=rope,
      group=q.shape[2] // k_pages.shape[0], head_dim=q.shape[-1],
      num_pages=k_pages.shape[1], page_size=k_pages.shape[2],
      block_sizes=block_sizes, interpret=interpret)
  return lazy_prefill_mgpu_planned(q, k_pages, v_pages, q_pos, plan,
                                   rope=rope, sm_scale=sm_scale,
                                   block_sizes=block_sizes,
                                   interpret=interpret, k_scales=k_scales,
                                   v_scales=v_scales)


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


def query_operand(q, q_pos, rope: RopeConfig, sm_scale, padded_len,
                  block_sizes: MgpuBlockSizes):
  """[B, T_pad, N, H]: the query `mgpu_prefill_kernel` takes with these
  block sizes: the raw query padded to `padded_len` tokens where the kernel
  rotates it itself (`rotates_query_in_kernel`), else
  `rotated_query_tokens`."""
  if block_sizes.rotates_query_in_kernel:
    return jnp.pad(q, ((0, 0), (0, padded_len - q.shape[1]), (0, 0), (0, 0)))
  return rotated_query_tokens(q, q_pos, rope, sm_scale, padded_len,
                              block_sizes.query_in_f32)


def lazy_prefill_mgpu_planned(q, k_pages, v_pages, q_pos, plan: PrefillPlan,
                              *, rope: RopeConfig, sm_scale, page_offset=0,
                              block_sizes: MgpuBlockSizes | None = None,
                              interpret: bool = False, k_scales=None,
                              v_scales=None):
  """The per-layer part of `lazy_prefill_mgpu`: query rotation + kernel
  (where `block_sizes.rotates_query_in_kernel`, the kernel alone: it
  rotates the query from the plan's table).

  `plan` must come from `plan_prefill` with the same metadata, q_pos, shapes
  and block_sizes.  `page_offset` (int or int32 scalar array) is added to
  every physical page id of the plan: layer l of a model whose layers share
  one [K, L * pages, P, H] array passes l * pages and reuses one plan.
  """
  block_sizes = block_sizes or MgpuBlockSizes()
  _check_inputs(q, k_pages, k_pages.shape[2], block_sizes)
  check_kv_scales(k_pages, v_pages, k_scales, v_scales, q.dtype)
  batch, q_len, num_heads, _ = q.shape
  t_pad = plan.row_pos.shape[1]
  group = num_heads // k_pages.shape[0]
  if (plan.row_pos.shape[0] != batch or t_pad != padded_query_len(
      q_len, group, block_sizes.num_compute_wgs)):
    raise ValueError(f"plan was made for {plan.row_pos.shape[0]} rows of "
                     f"{t_pad} padded tokens; q has {batch} rows of {q_len}")
  q_in = query_operand(q, q_pos, rope, sm_scale, t_pad, block_sizes)
  out = mgpu_prefill_kernel(q_in, k_pages, v_pages, plan, page_offset,
                            out_dtype=q.dtype, block_sizes=block_sizes,
                            interpret=interpret, k_scales=k_scales,
                            v_scales=v_scales, sm_scale=sm_scale)
  return out[:, :q_len]
