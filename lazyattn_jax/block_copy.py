"""Block-Attention's materialized copy: re-rotate cached document pages.

The `block` baseline keeps each document encoded once from position 0, like
`lazy`, but at use it writes a fresh copy of the document's keys rotated to the
position of use (R(S_d) k) plus a copy of its values into newly allocated
pages, then attends with shift 0.  This is the cost that `lazy` avoids.
"""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.rope import RopeConfig, apply_rope


def rerotate_pages(k_cache, v_cache, src_pages, dst_pages, shifts,
                   rope: RopeConfig, tensor_parallel=None):
  """Copies pages src -> dst in every layer, rotating keys by `shifts`.

  Args:
    k_cache, v_cache: [K, L, num_pages, page_size, H] pools (any layout
      with pages on axis 2).
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
  keys = jnp.moveaxis(k_cache[:, :, src_pages], 2, 0)  # [n, K, L, P, H]
  keys = apply_rope(keys, shifts, rope).astype(k_cache.dtype)
  values = v_cache[:, :, src_pages]  # [K, L, n, P, H]
  k_cache = k_cache.at[:, :, dst_pages].set(jnp.moveaxis(keys, 0, 2),
                                            mode="drop")
  v_cache = v_cache.at[:, :, dst_pages].set(values, mode="drop")
  return k_cache, v_cache
