"""Tile sizes of the GPU lazy attention kernels.

`GpuBlockSizes` (tiles and Triton launch parameters of the Triton decode and
prefill kernels) is what a caller, or benchmarks/kernels.py, passes as
`block_sizes=`; `block_sizes_for` picks one when none is given: the tuned
table below first, then the defaults.  `MgpuBlockSizes` are the tiles of the
Mosaic GPU (Hopper) prefill kernel, `MgpuDecodeBlockSizes` those of the
Mosaic GPU decode kernel.  How the tuned values were found:
docs/kernels.md.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.rope import NUM_TURN_CHUNKS
from pallas_kernels.sizes import ceil_div

# The Triton decode aims for about four waves of programs on a 132-SM Hopper
# part when it picks kv_splits itself: enough programs in flight to cover HBM
# latency.  (The Mosaic decode fills the SMs once: mgpu_decode_kv_splits.)
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


def _ring_bytes(stages: int, block_kv: int, head_dim: int,
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
          + _ring_bytes(block_sizes.num_stages, block_sizes.block_kv,
                        head_dim, quantized))


# --------------------------------------------------------------------------
# Mosaic GPU (Hopper) decode


@dataclasses.dataclass(frozen=True)
class MgpuDecodeBlockSizes:
  """Tiles of the Mosaic GPU decode kernel (gpu_decode_mgpu*.py).

  Attributes:
    block_kv: keys per step (whole pages): 64 or 128.
    num_stages: depth of the K/V shared-memory ring (>= 2).
    kv_splits: CTAs that share one (batch row, kv head), each streaming an
      even share of the row's steps; None picks from the shape
      (`mgpu_decode_kv_splits`).
    mask_fast_path: skip the score mask on steps that need none.
    persistent: launch at most one CTA per SM (`num_ctas`), each streaming
      several (batch row, kv head, split) work items through one K/V ring,
      the next item's query prefetched; else one CTA per work item.
      `gpu_decode_mgpu.default_decode_block_sizes` turns it on for float8
      pools only: on 16-bit pools it measured no faster (and with
      `steps_by_block` at 128-key steps and H 128 it does not fit).
    num_ctas: CTAs of the persistent grid; None takes the local GPU's SM
      count (`gpu_sm_count`).
    float8_operand: the 16-bit wgmma operand dtype of float8 pools' steps
      (the rotated query, the widened K and V tiles, P): "float16" (Hopper
      widens e4m3 pairs to f16 in one instruction) or "query" (q's dtype;
      e4m3 -> bf16 goes through f32).  Both are exact for the e4m3 values;
      f16 keeps more of the query's and P's mantissa, and its range holds
      any scaled query and P times a V scale up to 65504.
    steps_by_block: one step per KV block, whatever shifts its pages carry
      (the kernel rotates the query for each run of one shift inside the
      block and takes that run's columns from its own Q K^T), so the plan
      is a reshape of the page metadata, not a flattening into segment
      steps (`gpu_decode_block_plan.py`).  16-bit pages only.
    rope_in_kernel: with `steps_by_block`, the kernel computes each
      shift's cos / sin itself (the exact range reduction of
      `rope.cos_sin_from_chunks`, then the GPU's sin / cos), so the plan
      writes and the producer copies none.  The two together are the
      default for 16-bit pools (`gpu_decode_mgpu.default_decode_block_sizes`).
    fields_in_kernel: with `rope_in_kernel`, the producer copies each step's
      page fields (id, position, slots, shift) from the caller's page
      metadata and the kernel applies liveness itself, so the plan is only
      each row's step count (`gpu_decode_page_fields.py`): one XLA launch
      before the kernel instead of three on a whole call.  Not the default:
      per layer (the model's call, its plan made once a step) it was
      slower on the H200 (docs/kernels.md).
    copy_contiguous_blocks: as `MgpuBlockSizes.copy_contiguous_blocks`.
    plan_in_kernel: with `rope_in_kernel` (not `fields_in_kernel`),
      `plan_decode` makes the block plan in one Mosaic GPU launch
      (`gpu_decode_plan_kernel`, the same arrays bit for bit) instead of
      about ten XLA launches, where that kernel takes the shape.
    dependent_launch: as `MgpuBlockSizes.dependent_launch`: the decode
      kernel waits for the kernel before it before its first global read,
      so jax >= 0.11 launches it with programmatic dependent launch; the
      plan kernel lets it launch at its start.
  """

  # 128-key steps and two stages (all that fits beside the float32 query
  # and output tiles at H 128): 64-key steps with four stages measured no
  # faster on the H200 (benchmarks/RESULTS.md).
  block_kv: int = 128
  num_stages: int = 2
  kv_splits: int | None = None
  mask_fast_path: bool = True
  persistent: bool = False
  num_ctas: int | None = None
  float8_operand: str = "float16"
  steps_by_block: bool = False
  rope_in_kernel: bool = False
  fields_in_kernel: bool = False
  copy_contiguous_blocks: bool = True
  plan_in_kernel: bool = False
  dependent_launch: bool = False

  def __post_init__(self):
    if self.rope_in_kernel and not self.steps_by_block:
      raise ValueError("rope_in_kernel needs steps_by_block=True")
    if self.fields_in_kernel and not self.rope_in_kernel:
      raise ValueError("fields_in_kernel needs rope_in_kernel=True")
    if self.float8_operand not in ("float16", "query"):
      raise ValueError(f"float8_operand must be 'float16' or 'query', got "
                       f"{self.float8_operand!r}")
    if self.num_ctas is not None and self.num_ctas < 1:
      raise ValueError(f"num_ctas must be >= 1, got {self.num_ctas}")
    if self.block_kv not in (64, 128):
      raise ValueError(f"block_kv must be 64 or 128, got {self.block_kv}")
    if self.num_stages < 2:
      raise ValueError(f"num_stages must be >= 2, got {self.num_stages}")
    if self.kv_splits is not None and self.kv_splits < 1:
      raise ValueError(f"kv_splits must be >= 1, got {self.kv_splits}")


def mgpu_decode_smem_bytes(block_sizes: MgpuDecodeBlockSizes,
                           head_dim: int, quantized: bool = False,
                           page_size: int = 8) -> int:
  """Shared memory of one decode CTA (buffers only): the f32 query tile
  (reused for the output; two when persistent), its 16-bit rotated copy,
  the K/V ring (1-byte elements for float8 pages, plus a 16-bit K and V
  tile they are widened into), records, cos/sin (twice as deep for float8;
  one row per page of a step with `steps_by_block`, pages of `page_size`),
  the RoPE turn chunks, the m / l rows and (`steps_by_block`) a block's
  f32 scores."""
  q_store = WG_ROWS * head_dim * 4 * (2 if block_sizes.persistent else 1)
  q_16 = WG_ROWS * head_dim * 2
  # steps_by_block: cos / sin of every page of a step, not of one segment.
  pages = (block_sizes.block_kv // page_size if block_sizes.steps_by_block
           else 1)
  if block_sizes.rope_in_kernel:  # a one-row placeholder per stage
    pages = 1
  cos_sin_pages = block_sizes.num_stages * (pages - 1) * head_dim * 4
  turn_chunks = NUM_TURN_CHUNKS * head_dim // 2 * 4
  scores = (WG_ROWS * block_sizes.block_kv * 4 if block_sizes.steps_by_block
            else 0)
  # fields_in_kernel: a record slot holds four 128-byte field chunks, not
  # one 128-byte record.
  fields = (2 * block_sizes.num_stages * 3 * 128
            if block_sizes.fields_in_kernel else 0)
  return (q_store + q_16 + cos_sin_pages + turn_chunks + 2 * WG_ROWS * 4
          + scores + fields
          + _ring_bytes(block_sizes.num_stages, block_sizes.block_kv,
                        head_dim, quantized))


def mgpu_decode_kv_splits(block_sizes: MgpuDecodeBlockSizes, *, batch: int,
                          num_kv_heads: int, max_steps: int) -> int:
  """kv_splits for the Mosaic decode: as given, else as many as fill the
  SMs once (one CTA fits an SM), each with at least MIN_BLOCKS_PER_SPLIT
  steps of the longest possible row.  Unlike the Triton decode's four
  waves: measured per layer on the H200, one split beat two and three at
  B32 and B64, two beat one, four and nine at B8 (docs/kernels.md)."""
  if block_sizes.kv_splits is not None:
    return block_sizes.kv_splits
  wanted = gpu_sm_count() // (batch * num_kv_heads)
  return max(1, min(wanted, max_steps // MIN_BLOCKS_PER_SPLIT))


# H100 and H200 (SXM) have 132 SMs: the persistent grid's size where no GPU
# is attached (export, the interpreter).
HOPPER_SM_COUNT = 132


def gpu_sm_count() -> int:
  """SMs of the first local GPU (its `core_count`), else HOPPER_SM_COUNT."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:  # no GPU backend in this process
    return HOPPER_SM_COUNT
  return getattr(devices[0], "core_count", None) or HOPPER_SM_COUNT


def mgpu_decode_num_ctas(block_sizes: MgpuDecodeBlockSizes,
                         num_items: int) -> int:
  """CTAs of the Mosaic decode grid for `num_items` (batch row, kv head,
  split) work items: one per item, or with `persistent` at most num_ctas
  (the SM count by default)."""
  if not block_sizes.persistent:
    return num_items
  return max(1, min(num_items, block_sizes.num_ctas or gpu_sm_count()))


def mgpu_decode_work_item(j, cta, *, num_ctas: int, num_kv_heads: int,
                          num_splits: int, n_steps_ref):
  """In the Mosaic decode kernel: (batch, head, split, first step, steps)
  of this CTA's j-th work item: items w = cta + j * num_ctas, in (batch,
  kv head, split) order.  A split takes an even share of its row's steps
  (rows differ in length, so the share is per row); steps are in page
  order."""
  w = cta + j * num_ctas
  per_batch = num_kv_heads * num_splits
  batch = lax.div(w, jnp.int32(per_batch))
  rest = w - batch * per_batch
  head = lax.div(rest, jnp.int32(num_splits))
  split = rest - head * num_splits
  total = n_steps_ref[batch]
  per_split = lax.div(total + (num_splits - 1), jnp.int32(num_splits))
  first = jnp.minimum(split * per_split, total)
  return batch, head, split, first, jnp.minimum(per_split, total - first)
