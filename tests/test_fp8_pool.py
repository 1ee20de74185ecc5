"""Writes into a float8 pool (models/quantized_pool.py): scales per (head,
page), pages filled a few tokens at a time."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.cache_config import CacheConfig
from lazyattn_jax.cache_state import init_cache_state
from models.quantized_pool import QuantizedPool, write_quantized_rows
from pallas_kernels.kv_quant import FP8_DTYPE

PAGE, HEADS, DIM, PAGES = 8, 2, 16, 4
# One e4m3 rounding: within half an ulp of a 3-bit mantissa, 2^-4 relative.
ROUNDING = 2.0**-4

_write = jax.jit(write_quantized_rows, static_argnames="page_size")


def _empty():
  return (jnp.zeros((HEADS, PAGES * PAGE, DIM), FP8_DTYPE),
          jnp.zeros((HEADS, PAGES), jnp.float32))


def _read(pages, scales):
  """Dequantized rows [K, num_rows, H] in float64."""
  rows = np.asarray(pages.astype(jnp.float32), np.float64)
  return rows * np.repeat(np.asarray(scales, np.float64), PAGE, axis=1)[
      ..., None]


def _assert_close(got, want):
  # Relative to each element, with an absolute floor for values that drop
  # into e4m3's subnormal range (below 2^-6 of the scale, step 2^-9).
  scale = np.max(np.abs(want))
  np.testing.assert_array_less(np.abs(got - want),
                               ROUNDING * np.abs(want) + scale * 2.0**-9)


def test_decode_appends_grow_the_scale_without_clipping_earlier_tokens():
  """Tokens written one per step, each larger than the last: a scale fixed
  at the first write would clip every later token (here by up to 1000x)."""
  rng = np.random.default_rng(0)
  pages, scales = _empty()
  page = 2
  written = []
  for slot in range(PAGE):
    token = rng.standard_normal((HEADS, 1, DIM)) * 10.0 ** (slot * 3 / 7)
    written.append(token[:, 0])
    pages, scales = _write(pages, scales, jnp.asarray([page * PAGE + slot]),
                           jnp.asarray(token, jnp.float32), page_size=PAGE)
    got = _read(pages, scales)[:, page * PAGE:page * PAGE + slot + 1]
    _assert_close(got, np.stack(written, axis=1))
  # The page's scale is the power-of-two ceiling of its largest |value|/448.
  amax = np.max(np.abs(np.stack(written, 1)), axis=(1, 2))
  want = 2.0 ** np.ceil(np.log2(amax / 448.0))
  np.testing.assert_array_equal(np.asarray(scales[:, page]), want)
  assert np.all(np.asarray(scales[:, [0, 1, 3]]) == 0), "other pages untouched"


def test_a_prefill_chunk_that_continues_a_page_keeps_its_first_part():
  rng = np.random.default_rng(1)
  pages, scales = _empty()
  first = rng.standard_normal((HEADS, 3, DIM)) * 0.01
  second = rng.standard_normal((HEADS, 9, DIM)) * 50.0  # crosses a page end
  pages, scales = _write(pages, scales, jnp.arange(3) + PAGE,
                         jnp.asarray(first, jnp.float32), page_size=PAGE)
  pages, scales = _write(pages, scales, jnp.arange(3, 12) + PAGE,
                         jnp.asarray(second, jnp.float32), page_size=PAGE)
  got = _read(pages, scales)[:, PAGE:PAGE + 12]
  want = np.concatenate([first, second], axis=1)
  # The first part now sits at a scale 5000x too large for it: what it
  # keeps is what quantizing the whole page at once would keep.
  _assert_close(got, want)
  assert np.abs(got[:, :3]).max() > 0, "small tokens must not all vanish"


def test_writing_slot_zero_restarts_a_reused_page():
  """A page freed and handed to a new document starts from its own scale,
  not the old owner's (which would cost the new values their precision)."""
  rng = np.random.default_rng(2)
  pages, scales = _empty()
  big = rng.standard_normal((HEADS, PAGE, DIM)) * 1e4
  small = rng.standard_normal((HEADS, 5, DIM)) * 1e-3
  rows = jnp.arange(PAGE) + 3 * PAGE
  pages, scales = _write(pages, scales, rows, jnp.asarray(big, jnp.float32),
                         page_size=PAGE)
  pages, scales = _write(pages, scales, rows[:5],
                         jnp.asarray(small, jnp.float32), page_size=PAGE)
  assert np.all(np.asarray(scales[:, 3]) < 1e-3 / 100)
  _assert_close(_read(pages, scales)[:, 3 * PAGE:3 * PAGE + 5], small)


def test_dropped_rows_write_nothing():
  pages, scales = _empty()
  values = jnp.ones((HEADS, 3, DIM), jnp.float32)
  pages, scales = _write(pages, scales, jnp.asarray([-1, PAGES * PAGE, 9]),
                         values, page_size=PAGE)
  read = _read(pages, scales)
  assert np.count_nonzero(read) == HEADS * DIM  # row 9 only
  assert np.all(read[:, 9] == 1.0)


def test_cache_config_float8_pool_and_its_bytes():
  kw = dict(num_pages=10, page_size=PAGE, num_layers=3, num_kv_heads=HEADS,
            head_dim=DIM, max_pages_per_doc=4)
  fp8 = CacheConfig(dtype="float8_e4m3fn", **kw)
  bf16 = CacheConfig(dtype=jnp.bfloat16, **kw)
  assert fp8.quantized and not bf16.quantized
  state = init_cache_state(fp8)
  assert isinstance(state.k, QuantizedPool)
  assert state.k.pages.dtype == FP8_DTYPE
  assert state.k.scales.shape == (HEADS, 3, 10)
  assert fp8.pool_bytes == state.k.nbytes + state.v.nbytes
  assert bf16.pool_bytes == init_cache_state(bf16).k.nbytes * 2
  # Half of bf16's bytes plus one float32 per page, head and layer.
  assert fp8.bytes_per_page == bf16.bytes_per_page // 2 + 2 * 4 * HEADS * 3
  with pytest.raises(ValueError, match="the only 8-bit pool is "
                     "float8_e4m3fn, got float8_e5m2"):
    CacheConfig(dtype="float8_e5m2", **kw)


@pytest.mark.gpu
def test_layer_scan_writes_scales_in_place_on_gpu():
  """A layer scan's float8 writes update the carried scales in place: XLA
  GPU copied the whole scales array twice per layer and pool when the read
  of the old scales was not ordered before their scatter (0.6 ms of a
  12 ms decode step on the H200).  The CPU backend copies scatter operands
  regardless, so this runs on a GPU only."""
  layers, pages_per_layer, rows = 4, 64, 8

  def scan(pages, scales, rows_, values):
    def body(carry, layer):
      return write_quantized_rows(*carry, rows_ + layer * pages_per_layer *
                                  PAGE, values, PAGE), None
    return jax.lax.scan(body, (pages, scales), jnp.arange(layers))[0]

  pages = jax.ShapeDtypeStruct((HEADS, layers * pages_per_layer * PAGE, DIM),
                               FP8_DTYPE)
  scales = jax.ShapeDtypeStruct((HEADS, layers * pages_per_layer),
                                jnp.float32)
  hlo = jax.jit(scan, donate_argnums=(0, 1)).lower(
      pages, scales, jax.ShapeDtypeStruct((rows,), jnp.int32),
      jax.ShapeDtypeStruct((HEADS, rows, DIM), jnp.float32)).compile(
      ).as_text()
  whole = f"f32[{HEADS},{layers * pages_per_layer}]"
  copies = [line for line in hlo.splitlines()
            if " copy(" in line and line.split("=")[1].strip().startswith(
                whole)]
  assert not copies, "\n".join(copies)


def _writes(rng, steps=6):
  """Rows and values of a few writes: page restarts, growing scales,
  continued pages and dropped rows (-1 and past the end)."""
  for step in range(steps):
    rows = rng.choice(PAGES * PAGE, 5, replace=False).astype(np.int32)
    rows[0] = -1 if step % 2 else PAGES * PAGE
    values = rng.standard_normal((HEADS, 5, DIM)) * 10.0 ** (step / 2)
    yield jnp.asarray(rows), jnp.asarray(values, jnp.float32)


def test_pages_written_as_bits_match_float8_pages_bit_for_bit():
  """uint8 bit patterns in, the same bits out as float8 pages (the form
  the layer scan carries on CPU, whose XLA has no float8 scatter)."""
  pages, scales = _empty()
  bits = jax.lax.bitcast_convert_type(pages, jnp.uint8)
  bit_scales = scales
  for rows, values in _writes(np.random.default_rng(3)):
    pages, scales = _write(pages, scales, rows, values, page_size=PAGE)
    bits, bit_scales = _write(bits, bit_scales, rows, values, page_size=PAGE)
    assert bits.dtype == jnp.uint8
    np.testing.assert_array_equal(
        np.asarray(bits), np.asarray(jax.lax.bitcast_convert_type(
            pages, jnp.uint8)))
    np.testing.assert_array_equal(np.asarray(bit_scales), np.asarray(scales))

