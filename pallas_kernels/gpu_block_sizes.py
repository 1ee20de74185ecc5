"""Tile sizes of the GPU lazy attention kernels.

`GpuBlockSizes` (tiles and Triton launch parameters of the Triton decode and
prefill kernels) is what a caller, or benchmarks/kernels.py, passes as
`block_sizes=`; `block_sizes_for` picks one when none is given: the tuned
table below first, then the defaults.  `MgpuBlockSizes` are the tiles of the
Mosaic GPU (Hopper) prefill kernel; the Mosaic GPU decode kernel's are in
gpu_decode_block_sizes.py.  How the tuned values were found:
docs/kernels.md.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels.sizes import ceil_div

# The Triton decode aims for about four waves of programs on a 132-SM Hopper
# part when it picks kv_splits itself: enough programs in flight to cover HBM
# latency.  (The Mosaic decode fills the SMs once:
# gpu_decode_block_sizes.mgpu_decode_kv_splits.)
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

# The fastest variants of benchmarks/kernels.py on an H200 (docs/kernels.md).
# Key: (kernel, dtype name, head dim H, group G = N / K, page size).
TUNED: dict[tuple[str, str, int, int, int], GpuBlockSizes] = {
    # Llama-3-8B-like decode: 128-key steps; 8 warps were half as fast.
    ("decode", "bfloat16", 128, 4, 16): GpuBlockSizes(
        block_kv=128, num_warps=4, num_stages=3),
    # 512-token chunk against 8K context: as fast as 128-row tiles (the
    # kernel is register bound either way) with fewer warps.
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


# --------------------------------------------------------------------------
# Mosaic GPU (Hopper) prefill

# Query rows of one compute warpgroup: the M of one wgmma.
WG_ROWS = 64


@dataclasses.dataclass(frozen=True)
class MgpuBlockSizes:
  """Tiles of the Mosaic GPU prefill kernel.

  Attributes:
    block_kv: keys per step (whole pages): 64 or 128.
    num_compute_wgs: compute warpgroups per CTA (64 query rows each), 1 or 2.
    num_stages: depth of the K/V shared-memory ring (>= 2).
    schedule_barrier: ping-pong the two compute warpgroups (FA3 style).
    mask_fast_path: skip the score mask on steps that need none.
    query_in_f32: keep R(q_pos) q in float32 (one rounding to 16 bits per
      segment).  False keeps it in q's 16-bit dtype (two roundings, half the
      shared memory: room for block_kv 128 with two warpgroups).
    query_in_registers: keep each segment's rotated query in registers as
      the A operand of Q K^T (two wgmmas over the halves of H) instead of
      writing it to shared memory and fencing, rotated (like the shared
      memory tile) while the step before's P V wgmma runs; 1-3% faster on
      the H200 (docs/kernels.md).  Float8 pages keep it in shared memory
      (their compute warpgroups' registers are spoken for).
    cos_sin_in_records: each step record carries its segment's cos / sin
      (the plan appends them), so the producer makes one copy fewer a step
      (no separate cos / sin copy); 1-4% faster kernel, 1-2% faster whole
      call on the H200 (docs/kernels.md).
    copy_contiguous_blocks: a step whose pages are consecutive in the pool
      (a document's pages as the cache allocates them) is one TMA copy per
      K and V block instead of one per page
      (`gpu_mgpu_producer.produce_kv_ring`).
    l2_prefetch: the producer prefetches each step's K and V pages into L2
      before it waits for the step's ring slot, so their HBM reads start a
      step earlier (`produce_kv_ring`).  Opt-in: on the H200 it was 6%
      slower for prefill and 10% for decode (docs/kernels.md).
    query_rope_in_kernel: each compute warpgroup rotates its raw query rows
      by their positions, R(q_pos) q * scale, once at its start, from a
      table of their cos | sin the plan makes (`PrefillPlan.query_cos_sin`),
      instead of an XLA pass over q before the kernel
      (`rotated_query_tokens`).  On the H200 the call per layer is about
      2% faster, the whole call up to 1.6% on a document's consecutive
      pages and level on shuffled ones (docs/kernels.md).  None (the
      default): in the kernel wherever the query is stored in 16 bits
      (`rotates_query_in_kernel`); True needs 16-bit query storage.
    segment_rotation_16bit: rotate the query by -shift at each segment's
      start in packed arithmetic of the 16-bit operand dtype (cos / sin
      and each product rounded to it, as a 16-bit model's own RoPE
      computes) instead of f32 arithmetic rounded once; a third of the
      rotation's cost, about 1% of the kernel on the H200, for an output
      error 1.1-1.3x the f32 form's (docs/kernels.md).  Applies where
      the rotated query rides in registers (query_in_registers, 16-bit
      pages); the shared-memory form rotates in f32.
    plan_in_kernel: `lazy_prefill_mgpu` makes its plan in one Mosaic GPU
      launch (`gpu_prefill_plan_kernel`, the same arrays bit for bit)
      instead of about ten XLA fusions, where that kernel supports the
      shape (`plan_kernel_unsupported`; elsewhere the XLA plan).  None
      (the default): on the GPU, not when interpreting (the interpreted
      kernel is slow); True: also interpreted; False: never.
    dependent_launch: the attention kernel waits for the kernel before it
      (griddepcontrol.wait) before its first global read, so jax >= 0.11
      launches it with programmatic dependent launch: its launch and set-up
      overlap the plan's end; the plan kernel lets it launch at its start.
      With both, the whole call is faster on the H200 (docs/kernels.md).
  """

  # Defaults: the fastest tiles in the H200 benchmarks (docs/kernels.md).
  # 128-key steps with two warpgroups fit in shared memory only beside a
  # 16-bit query; a third stage did not pay.
  block_kv: int = 128
  num_compute_wgs: int = 2
  num_stages: int = 2
  # The ping-pong pays once the query rotation runs under the P V wgmma
  # (docs/kernels.md).
  schedule_barrier: bool = True
  mask_fast_path: bool = True
  query_in_f32: bool = False
  query_in_registers: bool = True
  cos_sin_in_records: bool = True
  copy_contiguous_blocks: bool = True
  l2_prefetch: bool = False
  query_rope_in_kernel: bool | None = None
  segment_rotation_16bit: bool = True
  plan_in_kernel: bool | None = None
  dependent_launch: bool = True

  def __post_init__(self):
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
    if self.num_compute_wgs not in (1, 2):
      raise ValueError(
          f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
    if self.query_rope_in_kernel and self.query_in_f32:
      raise ValueError("query_rope_in_kernel needs 16-bit query storage "
                       "(query_in_f32=False)")

  @property
  def rotates_query_in_kernel(self) -> bool:
    """Whether the kernel rotates the raw query (query_rope_in_kernel, or
    by default wherever the query is stored in 16 bits)."""
    if self.query_rope_in_kernel is None:
      return not self.query_in_f32
    return self.query_rope_in_kernel


def ring_bytes(stages: int, block_kv: int, head_dim: int,
                quantized: bool) -> int:
  """The producer's rings, shared by the prefill and decode kernels: K/V
  (1-byte elements for float8 pages, plus the 16-bit K and V tiles they are
  widened into), step records and cos/sin (twice as deep for float8)."""
  kv = stages * 2 * block_kv * head_dim * (1 if quantized else 2)
  small = stages * (2 * 256 + 2 * head_dim * 4)
  if quantized:
    kv += 2 * block_kv * head_dim * 2
    small += stages * head_dim * 4
  return kv + small


def smem_bytes(block_sizes: MgpuBlockSizes, head_dim: int,
               quantized: bool = False) -> int:
  """Shared memory of one CTA (buffers only; barriers are a few bytes).
  Float8 pages: a ring of 1-byte elements, a 16-bit K and V tile, and a
  cos/sin ring twice as deep."""
  wgs = block_sizes.num_compute_wgs
  q_store = wgs * WG_ROWS * head_dim * (4 if block_sizes.query_in_f32 else 2)
  q_16 = wgs * WG_ROWS * head_dim * 2
  # Records that carry cos / sin: H f32 more in each of 2 * stages slots.
  records = (2 * block_sizes.num_stages * head_dim * 4
             if block_sizes.cos_sin_in_records else 0)
  return (q_store + q_16 + wgs * WG_ROWS * 4 + records
          + ring_bytes(block_sizes.num_stages, block_sizes.block_kv,
                        head_dim, quantized))
