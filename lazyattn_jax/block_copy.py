"""Block-Attention's materialized copy: re-rotate cached document pages.

The `block` baseline keeps each document encoded once from position 0, like
`lazy`, but at use it writes a fresh copy of the document's keys rotated to the
position of use (R(S_d) k) plus a copy of its values into newly allocated
pages, then attends with shift 0.  This is the cost that `lazy` avoids.
"""

from __future__ import annotations

import jax.numpy as jnp

from models.quantized_pool import QuantizedPool
from pallas_kernels.kv_quant import power_of_two_scale, quantize
from pallas_kernels.rope import RopeConfig, apply_rope


def rerotate_pages(k_cache, v_cache, src_pages, dst_pages, shifts,
                   rope: RopeConfig, tensor_parallel=None):
  """Copies pages src -> dst in every layer, rotating keys by `shifts`.

  Args:
    k_cache, v_cache: [K, L, num_pages, page_size, H] pools (any layout
      with pages on axis 2), arrays or float8 `QuantizedPool`s: values are
      copied with their scales; keys are dequantized, rotated and quantized
      again at the scale of the rotated page (rotation moves values between
      the two halves of the head dim, so the old scale may not hold them).
    src_pages, dst_pages: int32[n]; a dst outside [0, num_pages) is dropped
      (padding entries).
    shifts: int32[n] rotation of each copied page (the document's logical
      start position S_d).
    rope: the model's RoPE.
    tensor_parallel: a `models.sharding.TensorParallel` when the pools are
      split over KV heads: each device then copies its own heads' pages
      (shard_map), nothing crosses devices.
  Returns:
    (k_cache, v_cache) with the copies written.
  """
  if tensor_parallel is not None:
    copy = tensor_parallel.pools_per_device(
        lambda k, v, src, dst, shift: rerotate_pages(k, v, src, dst, shift,
                                                     rope))
    return copy(k_cache, v_cache, src_pages, dst_pages, shifts)
  if isinstance(k_cache, QuantizedPool):
    return _rerotate_quantized(k_cache, v_cache, src_pages, dst_pages, shifts,
                               rope)
  keys = jnp.moveaxis(k_cache[:, :, src_pages], 2, 0)  # [n, K, L, P, H]
  keys = apply_rope(keys, shifts, rope).astype(k_cache.dtype)
  values = v_cache[:, :, src_pages]  # [K, L, n, P, H]
  k_cache = k_cache.at[:, :, dst_pages].set(jnp.moveaxis(keys, 0, 2),
                                            mode="drop")
  v_cache = v_cache.at[:, :, dst_pages].set(values, mode="drop")
  return k_cache, v_cache


def _rerotate_quantized(k_cache: QuantizedPool, v_cache: QuantizedPool,
                        src_pages, dst_pages, shifts, rope: RopeConfig):
  """`rerotate_pages` on float8 pools (see there)."""
  pages = k_cache.pages[:, :, src_pages].astype(jnp.float32)  # [K,L,n,P,H]
  keys = pages * k_cache.scales[:, :, src_pages][..., None, None]
  keys = jnp.moveaxis(apply_rope(jnp.moveaxis(keys, 2, 0), shifts, rope), 0,
                      2)
  # Padding slots past a document's end may hold anything; a NaN there
  # must not decide the page's scale (it is never read).
  magnitude = jnp.where(jnp.isnan(keys), 0.0, jnp.abs(keys))
  scales = power_of_two_scale(jnp.max(magnitude, axis=(3, 4)))  # [K, L, n]
  k_cache = QuantizedPool(
      pages=k_cache.pages.at[:, :, dst_pages].set(
          quantize(keys, scales[..., None, None]), mode="drop"),
      scales=k_cache.scales.at[:, :, dst_pages].set(scales, mode="drop"))
  v_cache = QuantizedPool(
      pages=v_cache.pages.at[:, :, dst_pages].set(
          v_cache.pages[:, :, src_pages], mode="drop"),
      scales=v_cache.scales.at[:, :, dst_pages].set(
          v_cache.scales[:, :, src_pages], mode="drop"))
  return k_cache, v_cache
