"""Public entry point of the lazy (deferred-RoPE) paged attention contract.

Validates shapes and dtypes at trace time, then dispatches to one of:
  "xla" - pure XLA (pallas_kernels/xla_attention.py), the CPU path;
  "gpu" - Pallas decode (T == 1) and prefill (T > 1) kernels: both run the
          Mosaic GPU (TMA + wgmma) kernels on Hopper for the 16-bit inputs
          they support, the Triton kernels otherwise;
  "tpu" - Pallas/Mosaic TPU decode and prefill kernels;
  "auto" - by jax.default_backend().
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.kv_quant import check_kv_scales, is_quantized
from pallas_kernels.rope import MAX_ROPE_POSITION, RopeConfig

IMPLS = ("auto", "xla", "gpu", "tpu")
_SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def resolve_impl(impl: str) -> str:
  """Maps "auto" to the implementation for the default backend."""
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
  if impl != "auto":
    return impl
  backend = jax.default_backend()
  if backend == "gpu":
    return "gpu"
  if backend == "tpu":
    return "tpu"
  return "xla"


class ContractShapes(NamedTuple):
  """The sizes that the contract's operands define (see `lazy_attention`)."""

  batch: int  # B
  q_len: int  # T
  num_heads: int  # N
  head_dim: int  # H
  num_kv_heads: int  # K
  group: int  # G = N / K
  num_pages: int  # physical pages of the pool
  page_size: int
  num_logical_pages: int  # M


def contract_shapes(q, k_pages, page_table) -> ContractShapes:
  """Sizes of already validated operands (`check_lazy_attention_shapes`)."""
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads, num_pages, page_size, _ = k_pages.shape
  return ContractShapes(batch=batch, q_len=q_len, num_heads=num_heads,
                        head_dim=head_dim, num_kv_heads=num_kv_heads,
                        group=num_heads // num_kv_heads, num_pages=num_pages,
                        page_size=page_size,
                        num_logical_pages=page_table.shape[1])


def check_kv_pools(k_pool, v_pool, dtype, *, names=("k_pages", "v_pages"),
                   dtype_name="q dtype"):
  """Raises ValueError, naming the pool, unless the K and V pools have one
  shape and both have `dtype` (described as `dtype_name` in the message)."""
  if v_pool.shape != k_pool.shape:
    raise ValueError(f"{names[1]} shape {v_pool.shape} must equal {names[0]} "
                     f"shape {k_pool.shape}")
  for name, pool in zip(names, (k_pool, v_pool)):
    if pool.dtype != dtype:
      raise ValueError(f"{name} dtype {pool.dtype} must equal {dtype_name} "
                       f"{dtype}")


def check_lazy_attention_shapes(q, k_pages, v_pages, page_table, page_pos,
                                page_shift, page_len, q_pos, k_scales=None,
                                v_scales=None):
  """Raises ValueError naming the offending argument; works on tracers.

  The pools are in q's dtype, or float8_e4m3fn with float32 `k_scales` and
  `v_scales` [K, num_pages] (pallas_kernels/kv_quant.py)."""
  if q.ndim != 4:
    raise ValueError(f"q must be [B, T, N, H], got shape {q.shape}")
  batch, q_len, num_heads, head_dim = q.shape
  if jnp.dtype(q.dtype) not in [jnp.dtype(d) for d in _SUPPORTED_DTYPES]:
    raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
  if k_pages.ndim != 4:
    raise ValueError(
        f"k_pages must be [K, num_pages, page_size, H], got shape {k_pages.shape}")
  if is_quantized(k_pages.dtype):
    check_kv_pools(k_pages, v_pages, k_pages.dtype,
                   dtype_name="k_pages dtype")
  else:
    check_kv_pools(k_pages, v_pages, q.dtype)
  check_kv_scales(k_pages, v_pages, k_scales, v_scales, q.dtype)
  num_kv_heads, _, _, kv_head_dim = k_pages.shape
  if kv_head_dim != head_dim:
    raise ValueError(f"k_pages head dim {kv_head_dim} must equal q head dim "
                     f"{head_dim}")
  if head_dim % 2:
    raise ValueError(f"q head dim must be even for RoPE, got {head_dim}")
  if num_heads % num_kv_heads:
    raise ValueError(f"q heads ({num_heads}) must be a multiple of k_pages "
                     f"heads ({num_kv_heads})")
  # M == 0 would leave the softmax an empty axis to reduce.
  if page_table.ndim != 2 or page_table.shape[0] != batch or not (
      page_table.shape[1]):
    raise ValueError(f"page_table must be [B={batch}, M] with M >= 1 logical "
                     f"pages, got shape {page_table.shape}")
  for name, arr in (("page_table", page_table), ("page_pos", page_pos),
                    ("page_shift", page_shift), ("page_len", page_len)):
    if arr.shape != page_table.shape:
      raise ValueError(f"{name} shape {arr.shape} must equal page_table shape "
                       f"{page_table.shape}")
    if arr.dtype != jnp.int32:
      raise ValueError(f"{name} must be int32, got {arr.dtype}")
  if q_pos.shape != (batch, q_len):
    raise ValueError(f"q_pos shape {q_pos.shape} must be [B, T] = "
                     f"{(batch, q_len)}")
  if q_pos.dtype != jnp.int32:
    raise ValueError(f"q_pos must be int32, got {q_pos.dtype}")


def check_lazy_attention_values(k_pages, page_table, page_pos, page_shift,
                                page_len, q_pos):
  """Value checks on concrete (non-traced) metadata; raises ValueError."""
  num_pages, page_size = k_pages.shape[1], k_pages.shape[2]
  page_table, page_pos, page_shift, page_len, q_pos = (
      np.asarray(a) for a in (page_table, page_pos, page_shift, page_len, q_pos))
  if page_table.size and (page_table.min() < 0 or page_table.max() >= num_pages):
    raise ValueError(f"page_table entries must lie in [0, {num_pages})")
  if page_len.size and (page_len.min() < 0 or page_len.max() > page_size):
    raise ValueError(f"page_len entries must lie in [0, {page_size}]")
  if q_pos.size and (q_pos.min() < -1):
    raise ValueError("q_pos entries must be >= 0, or -1 for padding rows")
  for name, arr in (("q_pos", q_pos), ("page_pos", page_pos),
                    ("page_shift", page_shift)):
    if arr.size and np.abs(arr).max() >= MAX_ROPE_POSITION // 2:
      raise ValueError(
          f"{name} magnitude must stay below {MAX_ROPE_POSITION // 2}")


def _mosaic_gpu_target() -> bool:
  """Whether GPU code should target Hopper (wgmma): the local GPU is compute
  capability 9.x, or there is no local GPU (lowering for export, where
  Hopper is the GPU this library tunes for)."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return True
  capability = str(getattr(devices[0], "compute_capability", ""))
  return capability.split(".")[0] == "9"


def _gpu_prefill_kernel(q, k_pages, interpret: bool) -> str:
  """"mosaic" where the Hopper prefill kernel applies, else "triton".

  Interpret mode stays on the Triton kernel (generic interpreter); the
  Mosaic kernel has its own interpreter tests.
  """
  from pallas_kernels.gpu_prefill_mgpu import mosaic_prefill_supported
  if interpret or not mosaic_prefill_supported(q.dtype, k_pages.dtype,
                                               q.shape[-1], k_pages.shape[2]):
    return "triton"
  return "mosaic" if _mosaic_gpu_target() else "triton"


def _gpu_decode_kernel(q, k_pages, interpret: bool) -> str:
  """"mosaic" where the Hopper decode kernel applies, else "triton".

  Interpret mode stays on the Triton kernel (generic interpreter); float32,
  other head dims and page sizes run Triton too
  (`gpu_decode_mgpu.mosaic_decode_unsupported` says why).
  """
  from pallas_kernels.gpu_decode_mgpu import mosaic_decode_unsupported
  if interpret or mosaic_decode_unsupported(q.shape, q.dtype, k_pages.shape,
                                            k_pages.dtype) is not None:
    return "triton"
  return "mosaic" if _mosaic_gpu_target() else "triton"


def _is_concrete(*arrays) -> bool:
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


@functools.partial(jax.jit, static_argnames=("rope", "impl", "interpret",
                                             "gpu_kernel"))
def _lazy_attention_jit(q, k_pages, v_pages, page_table, page_pos, page_shift,
                        page_len, q_pos, sm_scale, page_offset, plan, k_scales,
                        v_scales, *, rope, impl, interpret,
                        gpu_kernel="triton"):
  if plan is not None and q.shape[1] == 1:  # Mosaic GPU decode's plan
    from pallas_kernels.gpu_decode_mgpu import lazy_decode_mgpu_planned
    return lazy_decode_mgpu_planned(q, k_pages, v_pages, q_pos, plan,
                                    rope=rope, sm_scale=sm_scale,
                                    page_offset=page_offset,
                                    k_scales=k_scales, v_scales=v_scales)
  if plan is not None:  # Mosaic GPU prefill's plan
    from pallas_kernels.gpu_prefill_mgpu import lazy_prefill_mgpu_planned
    return lazy_prefill_mgpu_planned(q, k_pages, v_pages, q_pos, plan,
                                     rope=rope, sm_scale=sm_scale,
                                     page_offset=page_offset,
                                     k_scales=k_scales, v_scales=v_scales)
  page_table = page_table + page_offset
  if impl == "xla":
    from pallas_kernels.xla_attention import lazy_attention_xla
    return lazy_attention_xla(q, k_pages, v_pages, page_table, page_pos,
                              page_shift, page_len, q_pos, rope=rope,
                              sm_scale=sm_scale, k_scales=k_scales,
                              v_scales=v_scales)
  if impl == "gpu":
    if q.shape[1] == 1 and gpu_kernel == "mosaic":
      from pallas_kernels.gpu_decode_mgpu import lazy_decode_mgpu
      return lazy_decode_mgpu(q, k_pages, v_pages, page_table, page_pos,
                              page_shift, page_len, q_pos, rope=rope,
                              sm_scale=sm_scale, k_scales=k_scales,
                              v_scales=v_scales)
    if q.shape[1] == 1:
      from pallas_kernels.gpu_decode import lazy_decode_gpu as kernel
    elif gpu_kernel == "mosaic":
      from pallas_kernels.gpu_prefill_mgpu import lazy_prefill_mgpu
      return lazy_prefill_mgpu(q, k_pages, v_pages, page_table, page_pos,
                               page_shift, page_len, q_pos, rope=rope,
                               sm_scale=sm_scale, k_scales=k_scales,
                               v_scales=v_scales)
    else:
      from pallas_kernels.gpu_prefill import lazy_prefill_gpu as kernel
  else:
    if q.shape[1] == 1:
      from pallas_kernels.tpu_decode import lazy_decode_tpu as kernel
    else:
      from pallas_kernels.tpu_prefill import lazy_prefill_tpu as kernel
  return kernel(q, k_pages, v_pages, page_table, page_pos, page_shift,
                page_len, q_pos, rope=rope, sm_scale=sm_scale,
                interpret=interpret, k_scales=k_scales, v_scales=v_scales)


def _gpu_kernel(impl: str, q, k_pages, interpret: bool) -> str:
  """The GPU kernel family these inputs run: "mosaic" (Hopper) or "triton"
  ("triton" too where no GPU kernel runs)."""
  if impl != "gpu":
    return "triton"
  if q.shape[1] == 1:
    return _gpu_decode_kernel(q, k_pages, interpret)
  return _gpu_prefill_kernel(q, k_pages, interpret)


@functools.partial(jax.jit, static_argnames=("rope", "head_dim", "num_pages",
                                             "page_size", "kv_dtype"))
def _plan_decode_jit(page_table, page_pos, page_shift, page_len, q_pos, *,
                     rope, head_dim, num_pages, page_size, kv_dtype):
  from pallas_kernels.gpu_decode_mgpu import plan_decode
  return plan_decode(page_table, page_pos, page_shift, page_len, q_pos,
                     rope=rope, head_dim=head_dim, num_pages=num_pages,
                     page_size=page_size, kv_dtype=kv_dtype)


@functools.partial(jax.jit, static_argnames=("rope", "group", "head_dim",
                                             "num_pages", "page_size"))
def _plan_jit(page_table, page_pos, page_shift, page_len, q_pos, *, rope,
              group, head_dim, num_pages, page_size):
  from pallas_kernels.gpu_block_sizes import MgpuBlockSizes
  from pallas_kernels.gpu_prefill_mgpu import choose_prefill_plan
  return choose_prefill_plan(page_table, page_pos, page_shift, page_len,
                             q_pos, block_sizes=MgpuBlockSizes(), rope=rope,
                             group=group, head_dim=head_dim,
                             num_pages=num_pages, page_size=page_size)


def plan_lazy_attention(q, k_pages, page_table, page_pos, page_shift,
                        page_len, q_pos, *, rope: RopeConfig,
                        impl: str = "auto", interpret: bool = False):
  """Per-batch kernel metadata that several `lazy_attention` calls share.

  A model calls this once per forward pass and passes the result as `plan=`
  to every layer's `lazy_attention` (FlashInfer's plan/run split): the
  kernel's step lists, causal tile bounds, per-segment cos/sin and (Mosaic
  prefill) the query rows' cos/sin depend only on the page metadata and
  q_pos, not on the layer.  Layers whose pages sit
  at different offsets of one page array pass `page_offset=` there.

  Args:
    q: the query ([B, T, N, H]); only its shape and dtype are read, so a
      jax.ShapeDtypeStruct will do.
    k_pages: one layer's pool ([K, num_pages, page_size, H]), shape and dtype
      only: the plan's page ids index it.
    page_table, page_pos, page_shift, page_len, q_pos, rope, impl, interpret:
      as for `lazy_attention`.

  Returns:
    An opaque plan, or None where the kernel that `lazy_attention` picks for
    these inputs has no plan (the xla and tpu impls, the Triton kernels:
    non-Hopper GPUs, float32 pools, shapes the Mosaic GPU kernels do not
    take; B == 0 or T == 0); passing None as `plan` is always fine.
  """
  if not isinstance(rope, RopeConfig):
    raise ValueError(f"rope must be a RopeConfig, got {type(rope).__name__}")
  impl = resolve_impl(impl)
  if (_gpu_kernel(impl, q, k_pages, interpret) != "mosaic"
      or not q.shape[0] * q.shape[1]):  # no kernel runs (lazy_attention)
    return None
  num_kv_heads, num_pages, page_size, head_dim = k_pages.shape
  if q.shape[1] == 1:
    return _plan_decode_jit(page_table, page_pos, page_shift, page_len,
                            q_pos, rope=rope, head_dim=head_dim,
                            num_pages=num_pages, page_size=page_size,
                            kv_dtype=jnp.dtype(k_pages.dtype))
  return _plan_jit(page_table, page_pos, page_shift, page_len, q_pos,
                   rope=rope, group=q.shape[2] // num_kv_heads,
                   head_dim=head_dim, num_pages=num_pages,
                   page_size=page_size)


def lazy_attention(q, k_pages, v_pages, page_table, page_pos, page_shift,
                   page_len, q_pos, *, rope: RopeConfig, sm_scale=None,
                   impl: str = "auto", interpret: bool = False,
                   page_offset=None, plan=None, k_scales=None,
                   v_scales=None):
  """Paged attention with deferred RoPE (docs/design.md, 'Kernel contract').

  Score of query row (b, t, n) against slot i of logical page m:
    <R(q_pos - page_shift) q, k_pages[n // G, page_table[b, m], i]> * sm_scale
  kept where i < page_len[b, m] and page_pos[b, m] + i <= q_pos[b, t];
  softmax over kept slots.  Padding rows (q_pos == -1) and rows that see no
  key return zeros.

  Args:
    q: [B, T, N, H] raw query projections (not rotated).
    k_pages: [K, num_pages, page_size, H] keys stored rotated at their
      stored angle, in q's dtype or float8_e4m3fn; N must be a multiple of K.
    v_pages: [K, num_pages, page_size, H], k_pages' dtype.
    page_table: int32[B, M] physical page of each logical page.
    page_pos: int32[B, M] logical position of slot 0 of each logical page.
    page_shift: int32[B, M] logical position minus stored angle.
    page_len: int32[B, M] valid slots in each page, 0..page_size.
    q_pos: int32[B, T] logical position of each query row, -1 for padding.
    rope: RopeConfig (static).
    sm_scale: softmax scale (float or scalar array); default 1/sqrt(H).
    impl: "auto", "xla", "gpu" or "tpu".
    interpret: run the Pallas kernels in interpret mode (on CPU): generic
      interpret for "gpu", TPU-semantics `pltpu.InterpretParams()` for "tpu".
    page_offset: optional int32 scalar (int or array) added to every entry
      of page_table: a model whose layers share one page array passes
      layer * pages_per_layer and keeps one page_table (and one plan).
    plan: optional, from `plan_lazy_attention` with the same metadata, q_pos,
      shapes and impl (None is always accepted).
    k_scales, v_scales: float32 [K, num_pages], with float8_e4m3fn pages
      only: slot i of page p of head k reads as
      k_pages[k, p, i] * k_scales[k, p] (pallas_kernels/kv_quant.py).  The
      kernels dequantize on chip (on Hopper, in the Mosaic GPU kernels'
      converter warpgroup).

  Returns:
    [B, T, N, H] in q's dtype; with B == 0 or T == 0, that empty array from
    every impl, made without running a kernel.  M == 0 raises ValueError.
  """
  if not isinstance(rope, RopeConfig):
    raise ValueError(f"rope must be a RopeConfig, got {type(rope).__name__}")
  impl = resolve_impl(impl)
  check_lazy_attention_shapes(q, k_pages, v_pages, page_table, page_pos,
                              page_shift, page_len, q_pos, k_scales, v_scales)
  if page_offset is None:
    page_offset = 0
  if jnp.ndim(page_offset) != 0:
    raise ValueError(f"page_offset must be a scalar, got shape "
                     f"{jnp.shape(page_offset)}")
  if _is_concrete(page_table, page_pos, page_shift, page_len, q_pos,
                  page_offset):
    offset_table = np.asarray(page_table) + np.asarray(page_offset)
    check_lazy_attention_values(k_pages, offset_table, page_pos, page_shift,
                                page_len, q_pos)
  page_offset = jnp.asarray(page_offset, jnp.int32)
  gpu_kernel = _gpu_kernel(impl, q, k_pages, interpret)
  if plan is not None and gpu_kernel != "mosaic":
    raise ValueError("plan was given, but these inputs do not run the kernel "
                     "it was made for; pass the plan_lazy_attention result "
                     "for the same q, pool and impl")
  if plan is not None:
    want = "DecodePlan" if q.shape[1] == 1 else "PrefillPlan"
    if type(plan).__name__ != want:
      raise ValueError(f"plan is a {type(plan).__name__}; T={q.shape[1]} "
                       f"needs a {want} from plan_lazy_attention with this q")
  if not q.shape[0] * q.shape[1]:  # the kernels' tiling needs B, T >= 1
    return jnp.zeros(q.shape, q.dtype)
  if sm_scale is None:
    sm_scale = q.shape[-1] ** -0.5
  sm_scale = jnp.asarray(sm_scale, jnp.float32)
  return _lazy_attention_jit(q, k_pages, v_pages, page_table, page_pos,
                             page_shift, page_len, q_pos, sm_scale,
                             page_offset, plan, k_scales, v_scales,
                             rope=rope, impl=impl,
                             interpret=interpret, gpu_kernel=gpu_kernel)
