"""How the layer loop carries a pool (models/paged_pool.py): 16-bit pools
as uint16 bit patterns and float8 pages as uint8 with `pool_as_bits`, and
always on CPU, whose XLA widened a bfloat16 row scatter to float32 and
turned a float8 one into float16 conversions of the whole pool."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.paged_pool import PoolAccess
from models.quantized_pool import QuantizedPool
from pallas_kernels.kv_quant import FP8_DTYPE

HEADS, LAYERS, PAGES, PAGE, DIM = 2, 2, 32, 8, 16


def _pool():
  rng = np.random.default_rng(0)
  return jnp.asarray(rng.standard_normal((HEADS, LAYERS, PAGES, PAGE, DIM)),
                     jnp.bfloat16)


def _write_layer(access):
  def write(pool, rows, values):
    carry = access.to_rows(pool)
    return access.from_rows(access.write(carry, values, rows), pool)
  return jax.jit(write)


def test_bits_carry_writes_the_same_bits_as_the_plain_carry():
  """Rows written through the uint16 carry, dropped rows included, leave
  the pool bit for bit as the bfloat16 carry does."""
  pool = _pool()
  access = PoolAccess.of(pool, pool_as_bits=True)
  assert access.carried == jnp.uint16
  plain = dataclasses.replace(access, carried=access.pool_dtype)
  rows = jnp.asarray([3, 70, access.all_rows, 511, -1 + access.all_rows],
                     jnp.int32)
  values = jnp.asarray(np.random.default_rng(1).standard_normal(
      (HEADS, 5, DIM)), jnp.float32)
  got = _write_layer(access)(pool, rows, values)
  want = _write_layer(plain)(pool, rows, values)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(
      np.asarray(jax.lax.bitcast_convert_type(got, jnp.uint16)),
      np.asarray(jax.lax.bitcast_convert_type(want, jnp.uint16)))
  assert not np.array_equal(np.asarray(got, np.float32),
                            np.asarray(pool, np.float32))


def _compiled_write(access, pool):
  return _write_layer(access).lower(
      pool, jnp.zeros((4,), jnp.int32),
      jnp.zeros((HEADS, 4, DIM), jnp.float32)).compile().as_text()


def test_cpu_carries_16_bit_pools_as_bits_and_widens_no_whole_pool():
  """On CPU the pool travels as uint16 whatever pool_as_bits (a bfloat16
  generate at 2,048 pages took 57 s, 4 s so): the compiled write holds no
  float32 array of the pool's size."""
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's choice")
  pool = _pool()
  access = PoolAccess.of(pool)
  assert access.carried == jnp.uint16
  hlo = _compiled_write(access, pool)
  assert f"f32[{HEADS},{LAYERS * PAGES * PAGE},{DIM}]" not in hlo


def test_cpu_carries_float8_pages_as_bits_and_converts_no_whole_pool():
  """On CPU float8 pages travel as uint8 whatever pool_as_bits: a float8
  scatter there converted the whole pool to float16 and back around every
  write (decode 50x slower at 2,048 pages).  The compiled write holds no
  float16 array of the pool's size."""
  if jax.default_backend() != "cpu":
    pytest.skip("the CPU backend's choice")
  pool = QuantizedPool(
      pages=jnp.zeros((HEADS, LAYERS, PAGES, PAGE, DIM), FP8_DTYPE),
      scales=jnp.zeros((HEADS, LAYERS, PAGES), jnp.float32))
  access = PoolAccess.of(pool)
  assert access.carried == jnp.uint8
  hlo = _compiled_write(access, pool)
  assert f"f16[{HEADS},{LAYERS * PAGES * PAGE},{DIM}]" not in hlo


def test_float32_pools_travel_as_they_are():
  pool = _pool().astype(jnp.float32)
  assert PoolAccess.of(pool, pool_as_bits=True).carried == jnp.float32
