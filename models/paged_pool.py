"""The paged K/V pool as a forward pass carries, writes and reads it.

Shared by `models.llama.Llama.__call__` (one batch of rows of equal T) and
`models.mixed_batch.mixed_forward` (decode rows and prefill-chunk rows in one
pass).  `PoolAccess` holds what one call knows about the pool's layout and
turns it into the layer scan's carry, flat token-row write indices, row
scatters and the kernel's page views.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from models.quantized_pool import QuantizedPool, write_quantized_rows
from pallas_kernels.lazy_attention import lazy_attention
from pallas_kernels.rope import apply_rope


@dataclasses.dataclass(frozen=True)
class PoolAccess:
  """Static layout of one call's pools (K and V share it).

  Attributes:
    num_kv_heads, num_layers, num_pages, page_size, head_dim: the pool
      [K, L, num_pages, P, H].
    pool_dtype: the pages' dtype.
    quantized: the pools are float8 `QuantizedPool`s.
    carried: dtype of the scan's carry (uint16 for 16-bit pools and uint8
      for float8 pages with `pool_as_bits` or on CPU, else `pool_dtype`).
  """
  num_kv_heads: int
  num_layers: int
  num_pages: int
  page_size: int
  head_dim: int
  pool_dtype: object
  quantized: bool
  carried: object

  @classmethod
  def of(cls, k_cache, *, pool_as_bits: bool = False) -> "PoolAccess":
    """The access of a pool [K, L, num_pages, P, H] (array or
    QuantizedPool).  pool_as_bits: 16-bit float pools travel as their
    uint16 bit patterns, float8 pages as uint8.  XLA may widen a 16-bit
    float scatter to float32 (on CPU it does: four pool-sized temporaries
    per step), and XLA CPU has no float8 scatter (it converts the whole
    pool to float16 and back around each write); an integer row scatter
    does neither, at the price of bitcasts XLA may or may not fold.  So
    on CPU pools travel as bits whatever `pool_as_bits`.  "On CPU" is
    JAX's default backend when the step is traced: a step exported for
    CUDA from a CPU host carries bits too (the same values; the GPU's own
    trace carries the pool's dtype unless `pool_as_bits`)."""
    num_kv_heads, num_layers, num_pages, page_size, head_dim = k_cache.shape
    pool_dtype = k_cache.dtype
    quantized = isinstance(k_cache, QuantizedPool)
    as_bits = pool_as_bits or jax.default_backend() == "cpu"
    bits = {1: jnp.uint8, 2: jnp.uint16}.get(jnp.dtype(pool_dtype).itemsize)
    carried = bits if as_bits and bits is not None else pool_dtype
    return cls(num_kv_heads, num_layers, num_pages, page_size, head_dim,
               pool_dtype, quantized, carried)

  @property
  def all_pages(self) -> int:
    return self.num_layers * self.num_pages

  @property
  def all_rows(self) -> int:
    """Token rows of the carried pool; a write to this row is dropped."""
    return self.all_pages * self.page_size

  def _to_carry(self, x):
    if self.carried == self.pool_dtype:  # no op in the program at all
      return x
    return jax.lax.bitcast_convert_type(x, self.carried)

  def _to_pool(self, x):
    if self.carried == self.pool_dtype:
      return x
    return jax.lax.bitcast_convert_type(x, self.pool_dtype)

  def to_rows(self, pool):
    """The scan's carry: each pool as [K, L*N*P, H] token rows, so a step's
    writes are a plain row scatter (one index per token).  A scatter into
    [K, L*N, P, H] by (page, slot) gave XLA GPU room to pick another layout
    for the carried pool and copy it around the kernel call."""
    row_shape = (self.num_kv_heads, self.all_rows, self.head_dim)
    if self.quantized:
      return (self._to_carry(pool.pages.reshape(row_shape)),
              pool.scales.reshape(self.num_kv_heads, self.all_pages))
    return self._to_carry(pool.reshape(row_shape))

  def from_rows(self, rows, like):
    """Inverse of `to_rows`, shaped like the pool `like`."""
    if self.quantized:
      return QuantizedPool(pages=self._to_pool(rows[0]).reshape(like.shape),
                           scales=rows[1].reshape(like.scales.shape))
    return self._to_pool(rows).reshape(like.shape)

  def writable(self, write_page, write_slot):
    """Which writes land in the pool: inside [0, num_pages) x [0, P)."""
    return ((write_page >= 0) & (write_page < self.num_pages) &
            (write_slot >= 0) & (write_slot < self.page_size))

  def write_rows(self, writable, write_page, write_slot, offset):
    """Flat carried-row index of each write (any shape, flattened) into the
    layer at page `offset`; writes not `writable` go to `all_rows`, which
    the scatter drops.  Explicitly: a scatter would wrap negative indices,
    and an out-of-range page would land in another layer's pages."""
    return jnp.where(writable,
                     (write_page + offset) * self.page_size + write_slot,
                     self.all_rows).reshape(-1)

  def write(self, pool, new_rows, rows):
    """Scatters token rows [K, R, H] into the carried pool at `rows` [R]."""
    if self.quantized:  # pool: (float8 rows, scales [K, L*N])
      return write_quantized_rows(*pool, rows, new_rows, self.page_size)
    return pool.at[:, rows].set(self._to_carry(new_rows.astype(
        self.pool_dtype)), mode="drop")

  def page_view(self, pool, kv_heads: int):
    """The kernel's [K, L*N, P, H] pages (and scales [K, L*N], or None)."""
    pages = (kv_heads, self.all_pages, self.page_size, self.head_dim)
    if self.quantized:
      return self._to_pool(pool[0]).reshape(pages), pool[1]
    return self._to_pool(pool).reshape(pages), None

  def write_kv(self, k, v, key_pos, k_pool, v_pool, rows, rope):
    """Writes one layer's new keys (rotated at `key_pos`) and values.

    k, v: [B, T, K, H] (this device's KV heads); key_pos: int32 [B, T];
    rows: [B*T] from `write_rows`.  Returns the carried (k_pool, v_pool).
    """
    kv_heads = k.shape[2]
    # Float pools store the keys in their dtype; float8 pools quantize
    # the rotated float32 keys directly (one rounding, not two).
    k_rot = apply_rope(k, key_pos, rope)
    if not self.quantized:
      k_rot = k_rot.astype(self.pool_dtype)
    # [B, T, K, H] -> [K, B*T, H], one row per written token.
    k_rows = jnp.moveaxis(k_rot, 2, 0).reshape(kv_heads, -1, self.head_dim)
    v_rows = jnp.moveaxis(v, 2, 0).reshape(kv_heads, -1, self.head_dim)
    return self.write(k_pool, k_rows, rows), self.write(v_pool, v_rows, rows)

  def attend(self, q, k_pool, v_pool, inputs, offset, plan, *, rope, impl):
    """`lazy_attention` of q [B, T, N, H] over the carried pools' layer at
    page `offset`, with `inputs`' page metadata; returns [B, T, N, H]."""
    kv_heads = k_pool[0].shape[0] if self.quantized else k_pool.shape[0]
    k_pages, k_scales = self.page_view(k_pool, kv_heads)
    v_pages, v_scales = self.page_view(v_pool, kv_heads)
    return lazy_attention(q, k_pages, v_pages, inputs.page_table,
                          inputs.page_pos, inputs.page_shift, inputs.page_len,
                          inputs.q_pos, rope=rope, impl=impl,
                          page_offset=offset, plan=plan, k_scales=k_scales,
                          v_scales=v_scales)
