"""A float8 (e4m3) KV pool with per-(head, page) scales, and its writes.

`QuantizedPool` holds one pool (K or V): float8_e4m3fn pages
[K, L, num_pages, P, H] and float32 scales [K, L, num_pages], one per KV
head and page (pallas_kernels/kv_quant.py: a slot reads as fp8 * scale;
scales are powers of two).  It is a pytree, so it travels through jit,
donation, scans and shard_map (split on axis 0 like the pages) as one value.

Pages are written a few tokens at a time: a document page in one prefill,
but a request's private page one decode token per step, and a chunked
prefill may stop mid-page.  A scale fixed by the first write would clip a
later, larger token.  Instead a page's scale is the power-of-two ceiling of
the largest |value| written to it since its slot 0 was last written:

- a write to slot 0 starts the page: its old contents are dead (pages fill
  in slot order), so its scale restarts from this step's tokens;
- a write that raises a page's scale re-scales the slots already there by
  old / new scale, a power of two 2^-k, which is exact for every value that
  stays in e4m3's normal range (the smallest lose low bits, as they would
  had the page been quantized at the larger scale in one go).

So the stored page always equals quantizing, at the page's current scale,
what was written, up to those bottom bits; no token is ever clipped.  The
price: each written row re-reads and re-writes its page's P slots (K x P x
H bytes per token and pool), small next to a decode step's KV read but P
times the write traffic of a long prefill.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import (FP8_DTYPE, is_quantized,
                                     power_of_two_scale, quantize)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedPool:
  """One float8 K or V pool and its scales (see the module docstring)."""

  pages: jax.Array  # float8_e4m3fn [K, L, num_pages, P, H]
  scales: jax.Array  # float32 [K, L, num_pages]

  @property
  def shape(self) -> tuple[int, ...]:
    """The pages' shape, [K, L, num_pages, P, H]."""
    return self.pages.shape

  @property
  def ndim(self) -> int:
    return self.pages.ndim

  @property
  def dtype(self):
    """The pages' dtype, float8_e4m3fn."""
    return self.pages.dtype

  @property
  def nbytes(self) -> int:
    """Bytes of pages and scales."""
    return self.pages.nbytes + self.scales.nbytes

  def replace(self, **changes) -> "QuantizedPool":
    return dataclasses.replace(self, **changes)

  def is_deleted(self) -> bool:
    """Whether a buffer is gone (donated into a step, or deleted)."""
    return self.pages.is_deleted() or self.scales.is_deleted()

  def delete(self):
    """Frees both buffers now (as `jax.Array.delete`)."""
    for buffer in (self.pages, self.scales):
      if not buffer.is_deleted():
        buffer.delete()


def zeros_pool(shape, dtype, device=None):
  """An all-zero pool of `shape` [K, L, num_pages, P, H]: a plain array, or
  a `QuantizedPool` (zero pages, zero scales) for float8_e4m3fn."""
  if not is_quantized(dtype):
    return jnp.zeros(shape, dtype, device=device)
  return QuantizedPool(pages=jnp.zeros(shape, FP8_DTYPE, device=device),
                       scales=jnp.zeros(shape[:3], jnp.float32,
                                        device=device))


def check_quantized_pool(pool, name: str):
  """Raises ValueError unless `pool` is a QuantizedPool whose scales are
  float32 [K, L, num_pages] matching its float8 pages."""
  if not isinstance(pool, QuantizedPool):
    raise ValueError(f"{name} must be a QuantizedPool (float8 pages and "
                     f"scales), got {type(pool).__name__}")
  if pool.pages.dtype != FP8_DTYPE:
    raise ValueError(f"{name}.pages must be float8_e4m3fn, got "
                     f"{pool.pages.dtype}")
  if pool.scales.dtype != jnp.float32 or (
      tuple(pool.scales.shape) != tuple(pool.pages.shape[:3])):
    raise ValueError(f"{name}.scales must be float32 [K, L, num_pages] = "
                     f"{tuple(pool.pages.shape[:3])}, got "
                     f"{pool.scales.dtype} {tuple(pool.scales.shape)}")


def write_quantized_rows(pages, scales, rows, values, page_size: int):
  """Writes token rows into a float8 pool viewed as rows, keeping scales.

  Args:
    pages: float8 [K, num_rows, H], the pool as token rows (page-major:
      row = page * page_size + slot), or its uint8 bit patterns (returned
      so too: XLA CPU has no float8 scatter, and around each one converts
      the whole pool to float16 and back).
    scales: f32 [K, num_rows / page_size], one per head and page.
    rows: int32 [R] destination rows; outside [0, num_rows) is dropped.
    values: [K, R, H] the rows' new values (any float dtype).
    page_size: slots per page.

  Returns:
    (pages, scales) with the rows written, as the module docstring says.
  """
  num_rows = pages.shape[1]
  num_pages = scales.shape[1]
  valid = (rows >= 0) & (rows < num_rows)
  page = jnp.where(valid, rows // page_size, num_pages)  # num_pages: dropped
  safe_page = jnp.minimum(page, num_pages - 1)
  values = values.astype(jnp.float32)
  need = power_of_two_scale(jnp.max(jnp.abs(values), axis=-1))  # [K, R]

  starts = jnp.where(valid & (rows % page_size == 0), page, num_pages)
  kept = scales.at[:, starts].set(0.0, mode="drop")
  # old [K, R]: 0 on a page this step starts.  The barrier orders its read
  # before the scatter that updates `kept` in place; without it XLA GPU
  # copied the whole scales array (all layers) twice per layer and pool.
  old, kept = jax.lax.optimization_barrier((kept[:, safe_page], kept))
  new_scales = kept.at[:, page].max(need, mode="drop")
  new = new_scales[:, safe_page]

  # Re-scale the slots already in each written row's page.  Rows of one
  # page compute the same values, so duplicate scatter indices agree.
  slots = jnp.arange(page_size, dtype=jnp.int32)
  page_rows = safe_page[:, None] * page_size + slots[None, :]  # [R, P]
  kv_heads, num_written = need.shape
  as_bits = pages.dtype == jnp.uint8
  def stored(x):  # float8 values as the pool holds them
    return jax.lax.bitcast_convert_type(x, jnp.uint8) if as_bits else x
  earlier = pages[:, page_rows.reshape(-1)]
  if as_bits:
    earlier = jax.lax.bitcast_convert_type(earlier, FP8_DTYPE)
  earlier = earlier.astype(jnp.float32).reshape(
      kv_heads, num_written, page_size, -1)
  factor = jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)
  factor = factor[:, :, None, None]
  # `where`, not a product: a restarted page's dead slots may hold NaN.
  rescaled = jnp.where(factor > 0, earlier * factor, 0.0).astype(FP8_DTYPE)
  targets = jnp.where(valid[:, None], page_rows, num_rows).reshape(-1)
  pages = pages.at[:, targets].set(stored(
      rescaled.reshape(kv_heads, num_written * page_size, -1)), mode="drop")
  pages = pages.at[:, jnp.where(valid, rows, num_rows)].set(
      stored(quantize(values, new[:, :, None])), mode="drop")
  return pages, new_scales
