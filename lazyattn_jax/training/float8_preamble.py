"""The preamble's keys and values as a float8 pool returns them, for training.

With float8 pages (`CacheConfig(kv_dtype="float8_e4m3fn")`) the learned
sink's K and V are stored like any page: keys rotated at their stored angle
(the preamble is encoded at positions 0..P-1), one power-of-two scale per
KV head and page, values rounded to e4m3.  Every document and query reads
those pages, which is where float8's cost with a sink was traced
(benchmarks/RESULTS.md, "Float8 pages").  `Float8Preamble` rounds the
preamble's rows the same way inside the dense training forward, with a
straight-through gradient, so a sink can be trained for the rounded pages
it will be served from.

Only the preamble's rows are rounded: the documents' and the query's pages
are rounded in the pool too, but the sink has no say over them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import power_of_two_scale, quantize
from pallas_kernels.rope import cos_sin_from_chunks, rotate_half


def _page_rounded(x, page, num_pages: int):
  """x [B, T, K, H] float32 through e4m3 at one scale per (batch, head,
  preamble page); rows with page < 0 come back unchanged."""
  magnitude = jnp.max(jnp.abs(x), axis=-1)  # [B, T, K]
  in_page = page[..., None] == jnp.arange(num_pages)  # [B, T, J]
  amax = jnp.max(jnp.where(in_page[:, :, None, :], magnitude[..., None], 0.0),
                 axis=1)  # [B, K, J]
  scales = power_of_two_scale(amax)
  row_scale = jnp.take_along_axis(
      scales, jnp.broadcast_to(jnp.maximum(page, 0)[:, None, :],
                               scales.shape[:2] + page.shape[1:]), axis=2)
  row_scale = jnp.swapaxes(row_scale, 1, 2)[..., None]  # [B, T, K, 1]
  rounded = quantize(x, row_scale).astype(jnp.float32) * row_scale
  return jnp.where((page >= 0)[..., None, None], rounded, x)


@dataclasses.dataclass(frozen=True)
class Float8Preamble:
  """Rounds the preamble's K/V rows as a float8 pool stores them.

  Attributes:
    page_size: tokens per pool page (the served page size); the preamble's
      pages are its rows [j * page_size, (j + 1) * page_size).
    preamble_len: P, to size the per-page scales.
  """
  page_size: int
  preamble_len: int

  def __call__(self, k, v, preamble_index, rope):
    """(k, v) [B, T, K, H] raw projections with the rows where
    `preamble_index` [B, T] >= 0 replaced by what the pool returns for them
    (the gradient passes through the rounding unchanged).  k comes back in
    float32 (attention rotates it in float32 first); v in its own dtype,
    which holds a rounded value exactly, so the other rows' attention keeps
    its precision."""
    num_pages = -(-self.preamble_len // self.page_size)
    page = jnp.where(preamble_index >= 0, preamble_index // self.page_size,
                     -1)
    v_dtype = v.dtype
    k, v = k.astype(jnp.float32), v.astype(jnp.float32)
    # Stored angle = preamble index; rotate there, round, rotate back.
    chunks = jnp.asarray(rope.turn_chunks(k.shape[-1]))
    cos, sin = cos_sin_from_chunks(
        jnp.maximum(preamble_index, 0)[..., None, None], chunks)
    stored = _page_rounded(k * cos + rotate_half(k) * sin, page, num_pages)
    is_preamble = (page >= 0)[..., None, None]
    k_read = jnp.where(is_preamble, stored * cos - rotate_half(stored) * sin,
                       k)
    v_read = _page_rounded(v, page, num_pages)
    straight = lambda x, y: x + jax.lax.stop_gradient(y - x)
    return straight(k, k_read), straight(v, v_read).astype(v_dtype)
