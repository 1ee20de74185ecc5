"""Shapes and block-size variants timed by the kernel benchmark
(benchmarks/kernels.py): the decode and prefill shapes, the tuning shapes
where every Triton variant runs, and the Triton and Mosaic GPU tiles."""

from __future__ import annotations

from pallas_kernels.gpu_block_sizes import GpuBlockSizes
from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes

DECODE_SHAPES = [(8, 4096), (8, 8192), (32, 4096), (32, 8192), (64, 4096),
                 (64, 8192)]
# Every variant runs at these shapes; the one with the lowest geometric-mean
# time there runs at the others and is the one the bars judge.
DECODE_TUNING_SHAPES = [(8, 4096), (64, 8192)]
PREFILL_TUNING_SHAPE = "chunk512"
# (batch, query tokens, context tokens held in documents)
PREFILL_SHAPES = [("chunk128", 8, 128, 8192), ("chunk512", 4, 512, 8192),
                  ("doc2048", 4, 2048, 0)]

def _blocks_rope(**fields):
  """One step per block, the RoPE in the kernel, with `fields`: the 16-bit
  default's form (`gpu_decode_mgpu.default_decode_block_sizes`) before it
  took `compact_cos_sin` (2026-12-05), so the names keep their meaning in
  earlier results; `k128s2-blocks-rope-compactcs` is today's default."""
  return MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True,
                              **fields)


DECODE_VARIANTS = {
    "d128w4s2": GpuBlockSizes(block_kv=128, num_warps=4, num_stages=2),
    "d128w4s3": GpuBlockSizes(block_kv=128, num_warps=4, num_stages=3),
    "d128w8s2": GpuBlockSizes(block_kv=128, num_warps=8, num_stages=2),
}


def _prefill_tiles(block_q, block_kv, warps, stages):
  return GpuBlockSizes(block_q=block_q, block_kv=block_kv, num_warps=warps,
                       num_stages=stages)


PREFILL_VARIANTS = {
    "q64k64w4s3": _prefill_tiles(64, 64, 4, 3),
    "q64k128w4s2": _prefill_tiles(64, 128, 4, 2),
    "q64k64w8s3": _prefill_tiles(64, 64, 8, 3),
    "q128k64w8s2": _prefill_tiles(128, 64, 8, 2),
    "q128k64w8s3": _prefill_tiles(128, 64, 8, 3),
    "q128k128w8s2": _prefill_tiles(128, 128, 8, 2),
}

# Mosaic GPU decode tiles, each timed at every decode shape beside the
# Triton kernel (--mosaic-variants picks some; --quick times the first).
MOSAIC_DECODE_VARIANTS = {
    # What lazy_attention runs: default_decode_block_sizes for the pool's
    # dtype (for 16-bit pools the tiles of k128s2-blocks-rope-compactcs).
    "default": None,
    "k128s2": MgpuDecodeBlockSizes(),
    "k64s4": MgpuDecodeBlockSizes(block_kv=64, num_stages=4),
    "k128s2-nofast": MgpuDecodeBlockSizes(mask_fast_path=False),
    # Fixed split counts, against the default rule (fill the SMs once).
    "k128s2-split1": MgpuDecodeBlockSizes(kv_splits=1),
    "k128s2-split2": MgpuDecodeBlockSizes(kv_splits=2),
    "k128s2-split4": MgpuDecodeBlockSizes(kv_splits=4),
    # One CTA per SM, each streaming its work items through one ring (the
    # next item's query prefetched): no per-CTA start and drain.
    "k128s2-persistent": MgpuDecodeBlockSizes(persistent=True),
    # float8 pools widened to q's dtype (bf16: e4m3 -> f32 -> bf16) instead
    # of f16 (one conversion); the same as k128s2 for 16-bit pools.
    "k128s2-fp8query": MgpuDecodeBlockSizes(float8_operand="query"),
    # Three ring stages: fits only with float8 pools (1-byte ring slots).
    "k128s3": MgpuDecodeBlockSizes(num_stages=3),
    # One step per block, the query rotated per run of one shift inside it:
    # a plan of reshapes instead of segment steps (16-bit pools only).
    "k128s2-blocks": MgpuDecodeBlockSizes(steps_by_block=True),
    # The same with each shift's cos / sin computed in the kernel.
    "k128s2-blocks-rope": _blocks_rope(),
    # The default with one TMA copy per page even where a block's pages are
    # consecutive in the pool (--page-layout documents).
    "k128s2-blocks-rope-pagecopy": _blocks_rope(copy_contiguous_blocks=False),
    # The default with the records read by the kernel from the page
    # metadata: the plan is the step counts only.
    "k128s2-blocks-rope-fields": _blocks_rope(fields_in_kernel=True),
    # The default (its plan in one Mosaic GPU launch, gpu_decode_plan_kernel,
    # since 2026-12-04) with the XLA plan instead: the default before.
    "k128s2-blocks-rope-xlaplan": _blocks_rope(plan_in_kernel=False),
    # The plan kernel forced (on the GPU the default), and with the decode
    # kernel launched while that plan runs (programmatic dependent launch);
    # dependent launch after the XLA plan.
    "k128s2-blocks-rope-plank": _blocks_rope(plan_in_kernel=True),
    "k128s2-blocks-rope-plank-pdl": _blocks_rope(plan_in_kernel=True,
                                                 dependent_launch=True),
    "k128s2-blocks-rope-pdl": _blocks_rope(plan_in_kernel=False,
                                           dependent_launch=True),
    # The default with a block's first rotation done before its K copy is
    # waited for (MgpuDecodeBlockSizes.rotate_ahead).
    "k128s2-blocks-rope-ahead": _blocks_rope(rotate_ahead=True),
    # The default with each step's K and V pages prefetched into L2 before
    # the producer waits for the step's slot (MgpuDecodeBlockSizes.
    # l2_prefetch); and with rotate_ahead too.
    "k128s2-blocks-rope-l2pf": _blocks_rope(l2_prefetch=True),
    "k128s2-blocks-rope-ahead-l2pf": _blocks_rope(rotate_ahead=True,
                                                  l2_prefetch=True),
    # With a rotation's cos / sin computed one value a thread
    # (MgpuDecodeBlockSizes.compact_cos_sin): the 16-bit default since
    # 2026-12-05; and with rotate_ahead too.
    "k128s2-blocks-rope-compactcs": _blocks_rope(compact_cos_sin=True),
    "k128s2-blocks-rope-compactcs-ahead": _blocks_rope(compact_cos_sin=True,
                                                       rotate_ahead=True),
    # The default form at 64-key steps: a deeper ring in the same bytes,
    # one CTA per item or persistent (128-key persistent steps do not fit).
    "k64s4-blocks-rope": _blocks_rope(block_kv=64, num_stages=4),
    "k64s3-blocks-rope-persistent": _blocks_rope(block_kv=64, num_stages=3,
                                                 persistent=True),
}

# Mosaic GPU prefill tiles timed beside the default (MgpuBlockSizes(): 128-key
# steps, 16-bit query storage, ping-pong): an earlier default (64-key steps,
# f32 query) and the default without the ping-pong (docs/kernels.md).
MOSAIC_CANDIDATES = {
    "k64w2s2-f32": MgpuBlockSizes(block_kv=64, num_compute_wgs=2,
                                  num_stages=2, query_in_f32=True),
    "k128w2s2-nosched": MgpuBlockSizes(schedule_barrier=False),
    # One TMA copy per page even where a block's pages are consecutive.
    "k128w2s2-pagecopy": MgpuBlockSizes(copy_contiguous_blocks=False),
}
