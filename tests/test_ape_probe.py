"""Read-time logit changes in the dense reference, and the APE probe's
arrays (benchmarks/ape_probe.py)."""

import math

import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.ape_probe import ape_arrays, parse_settings
from models.dense_reference import causal_mask, dense_attention
from pallas_kernels.rope import RopeConfig


def _qkv(seed=0, batch=2, length=12, heads=4, kv_heads=2, head_dim=8):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((batch, length, heads, head_dim)),
                  jnp.float32)
  k, v = (jnp.asarray(rng.standard_normal((batch, length, kv_heads,
                                           head_dim)), jnp.float32)
          for _ in range(2))
  positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), (batch, 1))
  return q, k, v, positions


def test_identity_scale_and_zero_bias_change_nothing():
  q, k, v, positions = _qkv()
  mask = causal_mask(2, 12)
  plain = dense_attention(q, k, v, positions, mask, RopeConfig(), jnp.float32)
  ones = jnp.ones((2, 12, 12), jnp.float32)
  same = dense_attention(q, k, v, positions, mask, RopeConfig(), jnp.float32,
                         logit_scale=ones, logit_bias=0 * ones)
  np.testing.assert_array_equal(np.asarray(plain), np.asarray(same))


def test_a_very_negative_bias_removes_keys_like_the_mask():
  q, k, v, positions = _qkv(1)
  mask = np.asarray(causal_mask(2, 12))
  bias = np.zeros((2, 12, 12), np.float32)
  bias[:, 6:, 1:4] = -1e9  # rows 6.. do not read keys 1..3
  masked = mask.copy()
  masked[:, 6:, 1:4] = False
  by_bias = dense_attention(q, k, v, positions, jnp.asarray(mask),
                            RopeConfig(), jnp.float32,
                            logit_bias=jnp.asarray(bias))
  by_mask = dense_attention(q, k, v, positions, jnp.asarray(masked),
                            RopeConfig(), jnp.float32)
  np.testing.assert_allclose(np.asarray(by_bias), np.asarray(by_mask),
                             atol=1e-6)


def test_temperature_sharpens_the_scaled_rows_only():
  q, k, v, positions = _qkv(2)
  mask = causal_mask(2, 12)
  scale = np.ones((2, 12, 12), np.float32)
  scale[:, 8:, :] = 2.0
  plain = np.asarray(dense_attention(q, k, v, positions, mask, RopeConfig(),
                                     jnp.float32))
  sharp = np.asarray(dense_attention(q, k, v, positions, mask, RopeConfig(),
                                     jnp.float32,
                                     logit_scale=jnp.asarray(scale)))
  np.testing.assert_array_equal(plain[:, :8], sharp[:, :8])
  assert np.abs(plain[:, 8:] - sharp[:, 8:]).max() > 1e-3


def test_ape_arrays_touch_query_rows_reading_documents_only():
  student = dict(tokens=np.zeros((1, 10), np.int32))
  scale, bias = ape_arrays(student, (2, 7), temperature=0.8, scale=0.5)
  assert scale.shape == bias.shape == (1, 10, 10)
  pair = np.zeros((10, 10), bool)
  pair[7:, 2:7] = True
  np.testing.assert_allclose(scale[0][pair], 1 / 0.8)
  np.testing.assert_allclose(bias[0][pair], math.log(0.5))
  assert (scale[0][~pair] == 1).all() and (bias[0][~pair] == 0).all()


def test_settings_parse_and_refuse_non_positive_values():
  assert parse_settings("1:1,0.9,0.8:0.7") == [(1.0, 1.0), (0.9, 1.0),
                                                (0.8, 0.7)]
  with pytest.raises(ValueError, match="must be > 0"):
    parse_settings("0:1")
  with pytest.raises(ValueError, match="must be > 0"):
    parse_settings("0.9:-1")
