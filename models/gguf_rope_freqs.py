"""Llama-3 RoPE scaling from llama.cpp's `rope_freqs.weight` tensor.

convert_hf_to_gguf writes Llama-3 frequency scaling not as metadata but as a
tensor of per-frequency divisors.  This model wants the scaling parameters
(`models.config.Llama3RopeScaling`), so they are fitted back from the tensor
and the fit is checked against it.
"""

from __future__ import annotations

import numpy as np

from models.config import Llama3RopeScaling, LlamaConfig
from models.errors import ModelFormatError

__all__ = ["llama3_scaling_from_rope_freqs"]


def llama3_scaling_from_rope_freqs(freq_divisors: np.ndarray, head_dim: int,
                                   theta: float, original_max_position: int,
                                   path: str) -> Llama3RopeScaling | None:
  """Recovers Llama-3 scaling parameters from llama.cpp's rope_freqs tensor.

  The Llama-3 rule only depends on original_max_position / low_freq_factor
  and original_max_position / high_freq_factor, so original_max_position is
  fixed (from metadata or 8192) and the two factors are fitted to the
  smoothly interpolated frequencies (or take Llama-3's 1 and 4 when fewer
  than two frequencies are interpolated); the result is then verified
  against the tensor.
  """
  divisors = np.asarray(freq_divisors, np.float64).reshape(-1)
  if divisors.shape != (head_dim // 2,):
    raise ModelFormatError(f"{path}: rope_freqs.weight has {divisors.size} "
                           f"entries, expected head_dim / 2 = {head_dim // 2}")
  factor = float(divisors.max())
  if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
    return None
  base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2.0 * np.pi / base
  tol = 1e-5 * factor
  smoothed = (divisors > 1.0 + tol) & (divisors < factor - tol)
  low, high = 1.0, 4.0
  if factor > 1.0 and smoothed.sum() >= 2:
    # 1/divisor = (1 - s)/factor + s  =>  s; and s (high - low) + low = orig/wl.
    s = (1.0 / divisors[smoothed] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a = np.stack([1.0 - s, s], axis=1)
    (low, high), *_ = np.linalg.lstsq(
        a, original_max_position / wavelen[smoothed], rcond=None)
  try:
    scaling = Llama3RopeScaling(
        factor=factor, low_freq_factor=float(low),
        high_freq_factor=float(high),
        original_max_position=int(original_max_position))
    config = LlamaConfig(vocab_size=1, hidden_size=head_dim, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=head_dim,
                         intermediate_size=1, rope_theta=theta,
                         rope_scaling=scaling)
    fitted = config.rope.inv_frequencies(head_dim)
  except ValueError as e:
    raise ModelFormatError(f"{path}: rope_freqs.weight is not Llama-3 RoPE "
                           f"scaling ({e})") from e
  if not np.allclose(fitted, base / divisors, rtol=1e-5, atol=0):
    raise ModelFormatError(f"{path}: rope_freqs.weight does not match Llama-3 "
                           "RoPE scaling; this frequency scaling is not "
                           "supported")
  return scaling
