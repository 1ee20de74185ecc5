"""Rotary position embedding (RoPE) with exact range reduction.

The kernels need cos/sin of `position * inv_freq` for integer positions up to
about 2^23.  A float32 product `position * inv_freq` loses the phase long before
that (its ulp near 2^20 radians is 0.125), so the phase is computed in *turns*
with integer arithmetic instead:

  turns_per_position[f] = inv_freq[f] / 2pi  (float64, computed once on host)
  = sum_j chunk[j, f] * 2^-(8 (j + 1))        (six 8-bit chunks, 48 bits)

  frac(n * turns) = frac(sum_j n * chunk[j] * 2^-(8 (j + 1)))

For j < 3 the fractional contribution is an exact int32 product masked to
8 (j + 1) bits; the three low chunks add at most 2^-1 turns and are summed in
float32.  Every step uses int32 multiply/and and float32 add/floor, which lower
the same way on XLA, Triton and Mosaic TPU, so the same function runs inside the
kernels and in the references.  The phase error is below 1e-7 turns for
|n| < 2^23 (measured against float64 in tests/test_rope.py).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

# |n * chunk| must stay inside int32: chunk < 2^8, so |n| < 2^23.
MAX_ROPE_POSITION = 1 << 23
NUM_TURN_CHUNKS = 6
_TWO_PI = 2.0 * math.pi


@dataclasses.dataclass(frozen=True)
class RopeConfig:
  """RoPE frequencies in the HF / GPT-NeoX `rotate_half` convention.

  Attributes:
    theta: base of the geometric frequency ladder (`rope_theta`).
    factor: Llama-3 frequency scaling factor; `None` means plain RoPE.
    low_freq_factor: Llama-3 `low_freq_factor`.
    high_freq_factor: Llama-3 `high_freq_factor`.
    original_max_position: Llama-3 `original_max_position_embeddings`.
  """

  theta: float = 10000.0
  factor: float | None = None
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position: int = 8192

  def __post_init__(self):
    if not self.theta > 1.0:
      raise ValueError(f"RopeConfig.theta must be > 1, got {self.theta}")
    if self.factor is not None:
      if not self.factor >= 1.0:
        raise ValueError(f"RopeConfig.factor must be >= 1, got {self.factor}")
      if not self.high_freq_factor > self.low_freq_factor > 0:
        raise ValueError(
            "RopeConfig needs high_freq_factor > low_freq_factor > 0, got"
            f" {self.high_freq_factor} and {self.low_freq_factor}")
      if self.original_max_position <= 0:
        raise ValueError("RopeConfig.original_max_position must be positive")

  def inv_frequencies(self, head_dim: int) -> np.ndarray:
    """float64[head_dim // 2] angular frequency per rotation pair."""
    if head_dim % 2:
      raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (self.theta ** exponents)
    if self.factor is None:
      return inv_freq
    # Llama-3: leave short wavelengths, divide long ones by `factor`, and
    # interpolate smoothly in between.
    low_freq_wavelen = self.original_max_position / self.low_freq_factor
    high_freq_wavelen = self.original_max_position / self.high_freq_factor
    wavelen = _TWO_PI / inv_freq
    smooth = ((self.original_max_position / wavelen - self.low_freq_factor) /
              (self.high_freq_factor - self.low_freq_factor))
    smoothed = (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
    return np.where(
        wavelen < high_freq_wavelen, inv_freq,
        np.where(wavelen > low_freq_wavelen, inv_freq / self.factor, smoothed))

  def turn_chunks(self, head_dim: int) -> np.ndarray:
    """int32[NUM_TURN_CHUNKS, head_dim]: 8-bit chunks of turns per position.

    Columns are duplicated across the two halves of the head dimension, so the
    cos/sin vectors come out already laid out for `rotate_half`.
    """
    turns = self.inv_frequencies(head_dim) / _TWO_PI  # in (0, 1/2pi]
    chunks = np.empty((NUM_TURN_CHUNKS, head_dim // 2), np.int64)
    rest = turns.copy()
    for j in range(NUM_TURN_CHUNKS):
      rest = rest * 256.0
      chunks[j] = np.floor(rest)
      rest -= chunks[j]
    return np.concatenate([chunks, chunks], axis=1).astype(np.int32)


def cos_sin_from_chunks(positions, chunks, nearest=None):
  """cos and sin of `positions * inv_freq`, float32, exact range reduction.

  Args:
    positions: int32 array, broadcastable against one row of `chunks`
      (typically shape [..., 1]); |positions| < MAX_ROPE_POSITION.
    chunks: int32[NUM_TURN_CHUNKS, D] from `RopeConfig.turn_chunks`, or a
      sequence of NUM_TURN_CHUNKS int32 rows of shape [D] (kernels pass rows
      loaded from a ref).
    nearest: the nearest integer to each float of an array (default
      floor(x + 0.5); a kernel without floor passes its own rounding: ties
      only move an angle of exactly +-pi to the other sign).

  Returns:
    (cos, sin), each float32 with the broadcast shape [..., D].
  """
  c = [chunks[j] for j in range(NUM_TURN_CHUNKS)]
  n = positions
  # Exact part: fractional turns of the three high chunks, in units of 2^-24.
  # Two's-complement wrap-around keeps the masks right for negative n.
  k0 = (n * c[0]) & 0xFF
  k1 = (n * c[1]) & 0xFFFF
  k2 = (n * c[2]) & 0xFFFFFF
  exact = (k0 * 65536 + k1 * 256 + k2) & 0xFFFFFF
  turns = (exact.astype(jnp.float32) * (2.0 ** -24)
           + (n * c[3]).astype(jnp.float32) * (2.0 ** -32)
           + (n * c[4]).astype(jnp.float32) * (2.0 ** -40)
           + (n * c[5]).astype(jnp.float32) * (2.0 ** -48))
  if nearest is None:
    nearest = lambda x: jnp.floor(x + 0.5)
  turns = turns - nearest(turns)  # now in [-1/2, 1/2]
  angle = turns * jnp.float32(_TWO_PI)
  return jnp.cos(angle), jnp.sin(angle)


def rotate_half(x):
  """[x1, x2] -> [-x2, x1] along the last axis (HF / NeoX convention)."""
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def apply_rope(x, positions, rope: RopeConfig):
  """Rotates `x` [..., D] by `positions` [...] (int32), in float32.

  Positions broadcast against x's leading axes with the head axis implied:
  x [B, T, N, D] takes positions [B, T].  Returns float32.
  """
  head_dim = x.shape[-1]
  chunks = jnp.asarray(rope.turn_chunks(head_dim))
  pos = jnp.asarray(positions, jnp.int32)
  pos = pos.reshape(pos.shape + (1,) * (x.ndim - pos.ndim))
  cos, sin = cos_sin_from_chunks(pos, chunks)
  x = x.astype(jnp.float32)
  return x * cos + rotate_half(x) * sin


def rotated_query(q, q_pos, rope: RopeConfig, sm_scale):
  """The per-row half of the deferred rotation, done once outside the kernels.

  Returns (q_rot, q_rot_half), float32 [B, T, N, H]:
    q_rot = R(q_pos) q * sm_scale,  q_rot_half = rotate_half(q_rot).
  A kernel then forms R(q_pos - s) q = q_rot * cos(s) - q_rot_half * sin(s)
  (the rotation by -s) with one cos/sin vector per distinct shift s.  Padding
  rows (q_pos < 0) are zeroed so they cannot carry NaN into a kernel.
  """
  q_pos = jnp.asarray(q_pos, jnp.int32)
  q_rot = apply_rope(q, jnp.maximum(q_pos, 0), rope) * jnp.asarray(
      sm_scale, jnp.float32)
  q_rot = jnp.where((q_pos >= 0)[:, :, None, None], q_rot, 0.0)
  return q_rot, rotate_half(q_rot)
