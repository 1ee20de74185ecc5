"""Tile sizes and Triton launch parameters of the GPU lazy attention kernels.

`GpuBlockSizes` is what a caller (or benchmarks/kernels.py) passes as
`block_sizes=`; `block_sizes_for` picks one when none is given: the tuned
table below first (measured on an H200, see benchmarks/kernel_notes.md), then
the defaults.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.sizes import ceil_div

# Decode aims for about four waves of programs on a 132-SM Hopper part when it
# picks kv_splits itself: enough programs in flight to cover HBM latency.
DECODE_TARGET_PROGRAMS = 4 * 132
# A decode split should stream at least this many KV blocks, or the partial
# results and their combine cost more than the parallelism buys.
MIN_BLOCKS_PER_SPLIT = 4


def _is_power_of_2(n: int) -> bool:
  return n > 0 and not n & (n - 1)


@dataclasses.dataclass(frozen=True)
class GpuBlockSizes:
  """Tiles of the GPU kernels.

  Attributes:
    block_q: query rows per program (prefill; rows are (token, head-in-group)
      pairs of one kv head).  Decode takes the G rows of one token, padded to
      max(16, G rounded up to a power of two), and ignores this.
    block_kv: keys per inner step, rounded down to whole pages (at least one
      page); the column tile is the next power of two.
    kv_splits: decode only: programs that share one (batch row, kv head),
      each streaming a slice of its KV; None picks from the shape.
    num_warps: Triton warps per program.
    num_stages: Triton software-pipelining depth of the inner KV loop.
  """

  block_q: int = 128
  block_kv: int = 64
  kv_splits: int | None = None
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    if not (_is_power_of_2(self.block_q) and self.block_q >= 16):
      raise ValueError(
          f"block_q must be a power of two >= 16, got {self.block_q}")
    if not (_is_power_of_2(self.block_kv) and self.block_kv >= 16):
      raise ValueError(
          f"block_kv must be a power of two >= 16, got {self.block_kv}")
    if self.kv_splits is not None and self.kv_splits < 1:
      raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")
    if not _is_power_of_2(self.num_warps):
      raise ValueError(
          f"num_warps must be a power of two, got {self.num_warps}")
    if self.num_stages < 1:
      raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


# Defaults, by kernel and by whether the operands are 4 bytes wide (float32
# tiles take twice the shared memory per pipeline stage).
DEFAULTS = {
    ("decode", 2): GpuBlockSizes(block_q=16, block_kv=128, num_warps=4,
                                 num_stages=2),
    ("decode", 4): GpuBlockSizes(block_q=16, block_kv=32, num_warps=4,
                                 num_stages=2),
    ("prefill", 2): GpuBlockSizes(block_q=64, block_kv=64, num_warps=4,
                                  num_stages=3),
    ("prefill", 4): GpuBlockSizes(block_q=32, block_kv=32, num_warps=4,
                                  num_stages=2),
}

# Tuned on an H200 (jax 0.11.2) by benchmarks/kernels.py (numbers in
# benchmarks/kernel_notes.md).  Key: (kernel, dtype name, head dim H,
# group G = N / K, page size).
TUNED: dict[tuple[str, str, int, int, int], GpuBlockSizes] = {
    # Llama-3-8B-like decode: 4.15 TB/s of KV read at B64/ctx8192 (d128w4s3;
    # two stages within 1 %, 8 warps half as fast).
    ("decode", "bfloat16", 128, 4, 16): GpuBlockSizes(
        block_kv=128, num_warps=4, num_stages=3),
    # 512-token chunk against 8K context: q64k64w4s3 (188 TFLOP/s) level with
    # the 128-row tiles; all register bound (255 registers/thread).
    ("prefill", "bfloat16", 128, 4, 16): GpuBlockSizes(
        block_q=64, block_kv=64, num_warps=4, num_stages=3),
}


def block_sizes_for(kernel: str, *, dtype, head_dim: int, group: int,
                    page_size: int) -> GpuBlockSizes:
  """Tuned block sizes for this shape if measured, else the defaults."""
  if kernel not in ("decode", "prefill"):
    raise ValueError(f"kernel must be 'decode' or 'prefill', got {kernel!r}")
  dtype = jnp.dtype(dtype)
  key = (kernel, dtype.name, head_dim, group, page_size)
  if key in TUNED:
    return TUNED[key]
  return DEFAULTS[(kernel, 4 if dtype.itemsize >= 4 else 2)]


def decode_kv_splits(block_sizes: GpuBlockSizes, *, batch: int,
                     num_kv_heads: int, num_blocks: int) -> int:
  """kv_splits for decode: as given, else enough programs to fill the GPU."""
  if block_sizes.kv_splits is not None:
    return block_sizes.kv_splits
  programs = batch * num_kv_heads
  wanted = ceil_div(DECODE_TARGET_PROGRAMS, programs)
  return max(1, min(wanted, num_blocks // MIN_BLOCKS_PER_SPLIT))
