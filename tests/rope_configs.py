"""The RoPE configurations the kernel tests run against: plain RoPE
(theta 10000) and Llama 3's scaled RoPE (theta 500000, factor 8, as the
Llama-3.x models ship it)."""

from __future__ import annotations

from pallas_kernels import RopeConfig

PLAIN = RopeConfig(theta=10000.0)
LLAMA3 = RopeConfig(theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position=8192)
