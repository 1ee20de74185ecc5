"""Shared memory and barriers of the Mosaic GPU decode kernel
(gpu_decode_mgpu_kernel.py), in the order its body takes them.  Their
bytes are `gpu_decode_block_sizes.mgpu_decode_smem_bytes`, which must
agree with this list."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_block_sizes import WG_ROWS
from pallas_kernels.gpu_decode_block_sizes import (MgpuDecodeBlockSizes,
                                                   shift_cos_sin_shape)
from pallas_kernels.gpu_mgpu_float8 import float8_scratch, ring_transforms


def decode_scratch(block_sizes: MgpuDecodeBlockSizes, *, head_dim: int,
                   page_size: int, kv_dtype, dtype, record_width: int,
                   query_buffers: int, chunks_shape, quantized: bool):
  """The decode kernel's scratch types: the f32 query tiles (and partial
  output), the rotated 16-bit query (`dtype`), the K / V ring (`kv_dtype`),
  records of `record_width` int32, cos / sin (`compact_cos_sin`: the
  rotation's; else from the plan, or an unused placeholder), m / l, the
  RoPE turn chunks (`chunks_shape`), their barriers, then (float8) the
  widened K / V tiles or (steps_by_block) a block's f32 scores."""
  stages, block_kv = block_sizes.num_stages, block_sizes.block_kv
  ppb = block_kv // page_size
  fields = block_sizes.fields_in_kernel
  swizzle = min(128, head_dim)  # bytes of one half row of 16-bit elements
  tiled16 = (plgpu.TilingTransform((8, swizzle // 2)),
             plgpu.SwizzleTransform(swizzle))
  ring = ring_transforms(head_dim) if quantized else tiled16
  tiled32 = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128))
  # cos/sin rows per ring slot: a segment's, a block's pages', or (rope
  # computed in the kernel) an unused placeholder.
  cs_pages = ((1,) if block_sizes.rope_in_kernel else
              (ppb,) if block_sizes.steps_by_block else ())
  cos_sin_shape = ((2 if quantized else 1) * stages, *cs_pages, 2,
                   head_dim // 2)
  if block_sizes.compact_cos_sin:  # one rotation's, written by the kernel
    cos_sin_shape = (1, *shift_cos_sin_shape(head_dim))
  scratch = [
      plgpu.SMEM((query_buffers, WG_ROWS, head_dim), jnp.float32,
                 transforms=tiled32),
      plgpu.SMEM((WG_ROWS, head_dim), dtype, transforms=tiled16),
      plgpu.SMEM((stages, block_kv, head_dim), kv_dtype, transforms=ring),
      plgpu.SMEM((stages, block_kv, head_dim), kv_dtype, transforms=ring),
      plgpu.SMEM((2 * stages, record_width), jnp.int32),
      plgpu.SMEM(cos_sin_shape, jnp.float32),
      plgpu.SMEM((2, WG_ROWS), jnp.float32),
      plgpu.SMEM(chunks_shape, jnp.int32),
      plgpu.Barrier(num_arrivals=1, num_barriers=query_buffers),  # queries
      # K pages, record (four field chunks) and (unless rope_in_kernel)
      # cos/sin
      plgpu.Barrier(num_arrivals=ppb + (4 if fields else 1)
                    + (not block_sizes.rope_in_kernel), num_barriers=stages),
      plgpu.Barrier(num_arrivals=ppb, num_barriers=stages),  # V pages
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # K slot free
      plgpu.Barrier(num_arrivals=1, num_barriers=stages),  # V slot free
      plgpu.Barrier(num_arrivals=1, num_barriers=1),  # turn chunks
  ]
  if quantized:  # 16-bit K and V tiles; ready and free barriers of each
    scratch += float8_scratch(block_kv, head_dim, dtype, tiled16, 1)
  if block_sizes.steps_by_block:  # a block's scores while the query is
    # rotated again
    scratch.append(plgpu.SMEM((WG_ROWS, block_kv), jnp.float32,
                              transforms=tiled32))
  return scratch
