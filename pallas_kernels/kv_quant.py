"""float8 (e4m3) KV pages: the scale rule, quantize / dequantize, checks.

A quantized pool stores keys and values as `jnp.float8_e4m3fn` with one
float32 scale per (KV head, page) for K and another for V: a slot holds
`x / scale` rounded to e4m3, and reads back as `fp8 * scale`.

Scales are powers of two, `2^ceil(log2(amax / 448))` over the page's written
slots of that head (448 is e4m3fn's largest finite value).  A power of two
costs at most one e4m3 exponent of range (the 3-bit mantissa keeps the same
relative precision across exponents) and buys two exact operations:
- dequantization `fp8 * scale` is exact in bf16, f16 (within its range) and
  f32, so a kernel that dequantizes in registers computes exactly what a
  kernel given the dequantized pages computes;
- re-scaling a page whose scale grows (a later write with a larger value,
  models/quantized_pool.py) multiplies its stored values by 2^-k, exact
  except where a value drops into e4m3's subnormal range.

A scale of 0 marks a page (head) with nothing but zeros written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def is_quantized(dtype) -> bool:
  """Whether pages of `dtype` are float8 pages that need scales."""
  return jnp.dtype(dtype) == FP8_DTYPE


def power_of_two_scale(amax):
  """float32 scale 2^ceil(log2(amax / FP8_MAX)), 0 where amax is 0.

  `amax / scale <= FP8_MAX` always holds, so quantizing never saturates.
  The scale is at least float32's smallest normal number: below it
  `amax / FP8_MAX` may be flushed to 0 (XLA on CPU does), which gave a
  scale of 1, and a page's scale never shrinks.  An infinite amax is not
  a case this rule serves (it gives a scale of 1).
  """
  amax = jnp.asarray(amax, jnp.float32)
  quotient = jnp.maximum(amax / FP8_MAX, jnp.finfo(jnp.float32).tiny)
  mantissa, exponent = jnp.frexp(quotient)  # mantissa in [0.5, 1)
  # An exact power of two (mantissa 0.5) is its own ceiling.
  exponent = jnp.where(mantissa == 0.5, exponent - 1, exponent)
  scale = jnp.ldexp(jnp.ones_like(amax), exponent)
  return jnp.where(amax > 0, scale, 0.0)


def quantize(x, scale):
  """x / scale as float8_e4m3fn (0 where scale is 0); scale broadcasts."""
  x = jnp.asarray(x, jnp.float32)
  scale = jnp.asarray(scale, jnp.float32)
  safe = jnp.where(scale > 0, scale, 1.0)
  # The clip only catches float32 rounding at the boundary (amax/448 is
  # rounded before its ceiling power of two is taken): it never moves a
  # value by more than an ulp of FP8_MAX.
  y = jnp.clip(x / safe, -FP8_MAX, FP8_MAX)
  return jnp.where(scale > 0, y, 0.0).astype(FP8_DTYPE)


def quantize_pages(pages):
  """Quantizes float pages [K, N, P, H] with one scale per (head, page).

  Returns (float8 pages [K, N, P, H], float32 scales [K, N]).  NaN slots
  (unused, in tests) are ignored by the scale and stay NaN.
  """
  pages = jnp.asarray(pages, jnp.float32)
  magnitude = jnp.where(jnp.isnan(pages), 0.0, jnp.abs(pages))
  scales = power_of_two_scale(jnp.max(magnitude, axis=(2, 3)))
  return quantize(pages, scales[:, :, None, None]), scales


def dequantize_pages(pages, scales, dtype=jnp.float32):
  """float8 pages [K, N, P, H] and scales [K, N] -> pages in `dtype`."""
  return (pages.astype(jnp.float32) *
          scales[:, :, None, None]).astype(dtype)


def check_kv_scales(k_pages, v_pages, k_scales, v_scales, q_dtype):
  """Checks the pools' dtypes against q and the scales against the pools.

  Float8 pools need float32 scales of shape [K, num_pages], one per KV head
  and page; pools in q's dtype take none.  Raises ValueError naming the
  argument.
  """
  if not is_quantized(k_pages.dtype):
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
      if scales is not None:
        raise ValueError(f"{name} is only taken with float8_e4m3fn pages; "
                         f"k_pages is {k_pages.dtype}")
    return
  if v_pages.dtype != k_pages.dtype:
    raise ValueError(f"v_pages dtype {v_pages.dtype} must equal k_pages "
                     f"dtype {k_pages.dtype}")
  expected = tuple(k_pages.shape[:2])
  for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
    if scales is None:
      raise ValueError(f"float8_e4m3fn pages need {name} (float32 [K, "
                       f"num_pages] = {expected}), got None")
    if not isinstance(scales, (jax.Array, jax.ShapeDtypeStruct)) and not (
        hasattr(scales, "shape") and hasattr(scales, "dtype")):
      raise ValueError(f"{name} must be an array, got {type(scales).__name__}")
    if tuple(scales.shape) != expected:
      raise ValueError(f"{name} shape {tuple(scales.shape)} must be [K, "
                       f"num_pages] = {expected}")
    if scales.dtype != jnp.float32:
      raise ValueError(f"{name} must be float32, got {scales.dtype}")
  del q_dtype  # any supported q dtype reads float8 pages
