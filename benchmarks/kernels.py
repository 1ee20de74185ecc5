"""GPU kernel benchmark: lazy decode and prefill against their baselines.

Run on a GPU machine from the repository root:
  python -m benchmarks.kernels [--json results.json] [--quick]

Everything is measured side by side in one run and printed as one table,
last.  What is measured (issue 2):

Decode, bf16, Hq/Hkv 32/8, H 128, page 16, documents of 512 tokens (so the
shift changes every 32 pages), B in {8, 32, 64}, context in {4096, 8192}:
  lazy        lazy_decode_gpu with the real per-document shifts;
  lazy-shift0 the same kernel and block sizes with every shift 0;
  lazy-fp8[v], lazy-mosaic-fp8[default] (with --fp8)
              both kernels on float8 e4m3 pools (TB/s of the float8
              bytes), real shifts and shift 0 in alternation;
  lazy-mosaic[v], lazy-mosaic-shift0[v]
              the Mosaic GPU (Hopper) decode kernel (lazy_decode_mgpu, what
              lazy_attention(impl="gpu") runs on Hopper) with each of
              MOSAIC_DECODE_VARIANTS, real shifts and shift 0 timed in
              alternation like the Triton pair;
  lazy-mosaic per-layer, lazy-mosaic-shift0 per-layer
              the default Mosaic decode with its per-batch plan made once
              outside the timed call (as the model does for all layers);
  jax-paged   jax.experimental.pallas.ops.gpu.paged_attention on the same
              pool, read as pre-rotated keys (its default settings);
  xla-dense   a dense XLA decode over contiguous pre-rotated K/V.
TB/s counts the K and V bytes a decode step needs: B * context * Hkv * H *
2 (K and V) * 2 bytes, read once.

Prefill, bf16, same heads: a chunk of 128 or 512 query tokens against 8192
tokens of context held in 16 documents of 512 (each at its own shift) plus
the chunk's own pages; and a causal document prefill of 2048 tokens against
its own pages (shift 0).  The baseline is cuDNN flash attention
(jax.nn.dot_product_attention(implementation="cudnn")) on the equivalent
dense, pre-rotated inputs: for the chunk, K/V of context + chunk with no mask
(cuDNN's causal mask is aligned to the top-left corner, which is not the
chunk's mask; the chunk's own triangle is 1% or 3% of the pairs, so cuDNN does
that much extra work); for the document, is_causal=True.  FLOPs are counted
the same way for both: 4 * H * Hq per visible (query, key) pair, pairs
counted from the lazy inputs' causal mask.  Lazy prefill rows: the Triton
kernel ("lazy[...]"), the Mosaic GPU kernel that lazy_attention(impl="gpu")
runs on Hopper ("lazy-mosaic", default tiles, and "lazy-mosaic[...]" for the
MOSAIC_CANDIDATES tiles), each also "per-layer": the per-batch plan made
once outside the timed call, as the model does for all its layers.

Block sizes: a few variants of each kernel run at tuning shapes ("tune:"
rows); the fastest (geometric mean) is the one measured everywhere and judged
by the bars.  Lazy decode with real shifts and with shift 0 are timed in
alternation (seven rounds, medians), so that drift cannot fake or hide a few
percent between them.

Timing: each measured function runs in a jitted step that calls it several
times in a chain (every call's query, and the lazy path's q_pos, depend on the
previous output through a zero-valued scalar, so XLA can neither merge calls
nor hoist the lazy path's per-call metadata work out of the chain; the Mosaic
prefill's q_pos alone, since it rotates the raw query in its kernel and q + 0
would be a pass of its own before it), cycling
over enough independent input sets that one cycle reads several times the
60 MB L2.  Steps are dispatched back to back, then synchronised; the reported
time is the median over repeats of (elapsed / calls).  The lazy times include
everything the public API does per call: query rotation, work lists, the
kernel and (decode) the split combine.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_cases import (
    HEAD_DIM, JAX_PAGED_SETTINGS, NUM_HEADS, NUM_KV_HEADS, PAGE_LAYOUTS,
    PAGE_SIZE,
    SM_SCALE, decode_inputs, decode_planned, decode_planned_sets,
    decode_shape_name, dense_decode, dense_from_pages, fp8_sets, jax_paged,
    lazy_fn, page_metadata, prefill_plan, prefill_planned,
    prefill_planned_perturb, random_array, visible_pairs)
from benchmarks.kernel_timing import (perturb_lazy, perturb_paged,
                                      perturb_positions, perturb_query,
                                      time_pair, time_per_call)
from benchmarks.kernels_report import report
from pallas_kernels.gpu_block_sizes import GpuBlockSizes
from pallas_kernels.gpu_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_decode import lazy_decode_gpu
from pallas_kernels.gpu_decode_mgpu import lazy_decode_mgpu
from pallas_kernels.gpu_prefill import lazy_prefill_gpu
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes, lazy_prefill_mgpu

DECODE_SHAPES = [(8, 4096), (8, 8192), (32, 4096), (32, 8192), (64, 4096),
                 (64, 8192)]
# Every variant runs at these shapes; the one with the lowest geometric-mean
# time there runs at the others and is the one the bars judge.
DECODE_TUNING_SHAPES = [(8, 4096), (64, 8192)]
PREFILL_TUNING_SHAPE = "chunk512"
# (batch, query tokens, context tokens held in documents)
PREFILL_SHAPES = [("chunk128", 8, 128, 8192), ("chunk512", 4, 512, 8192),
                  ("doc2048", 4, 2048, 0)]

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
# Triton kernel (the default is the first; --mosaic-variants picks some).
MOSAIC_DECODE_VARIANTS = {
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
    "k128s2-blocks-rope": MgpuDecodeBlockSizes(steps_by_block=True,
                                               rope_in_kernel=True),
    # The default with one TMA copy per page even where a block's pages are
    # consecutive in the pool (--page-layout documents).
    "k128s2-blocks-rope-pagecopy": MgpuDecodeBlockSizes(
        steps_by_block=True, rope_in_kernel=True,
        copy_contiguous_blocks=False),
    # The default with the records read by the kernel from the page
    # metadata: the plan is the step counts only.
    "k128s2-blocks-rope-fields": MgpuDecodeBlockSizes(
        steps_by_block=True, rope_in_kernel=True, fields_in_kernel=True),
    # The default form at 64-key steps: a deeper ring in the same bytes,
    # one CTA per item or persistent (128-key persistent steps do not fit).
    "k64s4-blocks-rope": MgpuDecodeBlockSizes(
        block_kv=64, num_stages=4, steps_by_block=True, rope_in_kernel=True),
    "k64s3-blocks-rope-persistent": MgpuDecodeBlockSizes(
        block_kv=64, num_stages=3, steps_by_block=True, rope_in_kernel=True,
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


@dataclasses.dataclass
class Result:
  section: str  # "decode" or "prefill"
  shape: str
  method: str
  seconds: float | None
  bytes: float = 0.0  # KV bytes needed (decode)
  flops: float = 0.0  # useful FLOPs (prefill)
  note: str = ""

  @property
  def tb_per_s(self):
    return self.bytes / self.seconds / 1e12 if self.seconds else None

  @property
  def tflop_per_s(self):
    return self.flops / self.seconds / 1e12 if self.seconds else None


# --------------------------------------------------------------------------
# Timing


# --------------------------------------------------------------------------
# Inputs


# --------------------------------------------------------------------------
# Baselines


# --------------------------------------------------------------------------
# Sections


class Budget:

  def __init__(self, seconds):
    self.deadline = time.perf_counter() + seconds

  def left(self):
    return self.deadline - time.perf_counter()


def _measure(results, section, shape, method, fn, sets, perturb, *, nbytes=0,
             flops=0, note="", budget=None, log=print):
  if budget is not None and budget.left() < 0:
    results.append(Result(section, shape, method, None, nbytes, flops,
                          "skipped: time budget"))
    return results[-1]
  try:
    seconds = time_per_call(fn, sets, perturb)
    result = Result(section, shape, method, seconds, nbytes, flops, note)
  except Exception as e:  # keep going: report the failure in the table
    msg = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    log(f"  FAILED {method}: {msg}")
    traceback.print_exc(file=sys.stdout)
    result = Result(section, shape, method, None, nbytes, flops,
                    "failed: " + msg)
  results.append(result)
  if result.seconds:
    rate = (f"{result.tb_per_s:.2f} TB/s" if nbytes else
            f"{result.tflop_per_s:.1f} TFLOP/s")
    log(f"  {shape:>14s} {method:<24s} {result.seconds * 1e3:8.3f} ms "
        f"{rate}", flush=True)
  return result


def _time_lazy_pair(results, shape, kv_bytes, kernel, sizes, lazy_sets,
                    shift0_sets, names):
  """Times `kernel` with real shifts and with shift 0 in alternation and
  records both rows under `names` (real, shift0)."""
  fn = lazy_fn(kernel, sizes)
  try:
    lazy_s, shift0_s = time_pair(fn, lazy_sets, fn, shift0_sets,
                                 perturb_lazy)
    pair = list(zip(names, (lazy_s, shift0_s)))
  except Exception as e:  # keep going: report the failure in the table
    pair = [(names[0], None)]
    print(f"  FAILED {names[0]} pair: {type(e).__name__}: {e}", flush=True)
    traceback.print_exc(file=sys.stdout)
  for method, seconds in pair:
    results.append(Result("decode", shape, method, seconds, kv_bytes,
                          note="timed in alternation"))
    if seconds:
      print(f"  {shape:>14s} {method:<24s} {seconds * 1e3:8.3f} ms "
            f"{kv_bytes / seconds / 1e12:.2f} TB/s", flush=True)


def _time_planned_pair(results, shape, kv_bytes, sizes, lazy_sets,
                       shift0_sets, method):
  """The Mosaic decode's per-layer part (plan made once, outside), real
  shifts against shift 0 in alternation; rows `method` and its shift-0
  twin (float8 sets carry their scales)."""
  try:
    planned, planned0 = (decode_planned_sets(lazy_sets, sizes),
                         decode_planned_sets(shift0_sets, sizes))
    layer = functools.partial(decode_planned, block_sizes=sizes)
    layer_s, layer0_s = time_pair(layer, planned, layer, planned0,
                                  perturb_query)
  except Exception as e:  # keep going: report the failure in the table
    print(f"  FAILED {method}: {type(e).__name__}: {e}", flush=True)
    return
  shift0 = method.replace(" per-layer[", "-shift0 per-layer[")
  for name, seconds in ((method, layer_s), (shift0, layer0_s)):
    results.append(Result("decode", shape, name, seconds, kv_bytes,
                          note="plan made once, outside"))
    print(f"  {shape:>14s} {name:<40s} {seconds * 1e3:8.3f} ms "
          f"{kv_bytes / seconds / 1e12:.2f} TB/s", flush=True)


def _geomean_best(results, section, names, shapes, prefix="lazy"):
  """Variant name with the lowest geometric-mean time over `shapes`."""
  best = None
  for name in names:
    times = [r.seconds for r in results if r.section == section
             and r.method == f"{prefix}[{name}]" and r.shape in shapes
             and r.seconds]
    if len(times) != len(shapes):
      continue
    score = math.exp(sum(math.log(t) for t in times) / len(times))
    if best is None or score < best[1]:
      best = (name, score)
  return best[0] if best else None



def run_decode(results, variants, shapes, tuning_shapes, budget,
               mosaic_variants=None, fp8=False, baselines=True,
               layout="pages"):
  """Measures every decode row; returns the chosen variant name (or None).

  Pass 1, at the tuning shapes: every variant ("tune:" rows).  The variant
  with the lowest geometric-mean time there is chosen.  Pass 2, at every
  shape: the chosen variant with real shifts and with every shift 0, timed in
  alternation (the 1.05x bar compares these two), then each Mosaic GPU
  decode variant the same way, with `fp8` both kernels on float8 pools
  (TB/s of the float8 bytes), then (with `baselines`) JAX's paged attention
  and dense XLA.  An empty `variants` skips the Triton rows.  `layout`
  places the pages in the pool (kernel_cases.PAGE_LAYOUTS).
  """
  mosaic_variants = mosaic_variants or {}
  print("# decode", flush=True)
  key = jax.random.PRNGKey(0)
  rng = np.random.default_rng(0)
  tuning = [s for s in shapes if s in tuning_shapes]
  for batch, context in tuning:
    shape = decode_shape_name(batch, context)
    key, kv_bytes, _, _, lazy_sets, _ = decode_inputs(key, rng, batch,
                                                       context, layout)
    for name, sizes in variants.items():
      _measure(results, "decode", shape, f"tune:lazy[{name}]",
               lazy_fn(lazy_decode_gpu, sizes), lazy_sets, perturb_lazy,
               nbytes=kv_bytes, budget=budget)
    del lazy_sets
  chosen = _geomean_best(results, "decode", variants,
                         [decode_shape_name(*s) for s in tuning],
                         prefix="tune:lazy")
  print(f"  chosen decode variant: {chosen}", flush=True)
  for batch, context in shapes:
    shape = decode_shape_name(batch, context)
    key, kv_bytes, sets, table, lazy_sets, shift0_sets = decode_inputs(
        key, rng, batch, context, layout)
    if chosen:
      _time_lazy_pair(results, shape, kv_bytes, lazy_decode_gpu,
                      variants[chosen], lazy_sets, shift0_sets,
                      (f"lazy[{chosen}]", f"lazy-shift0[{chosen}]"))
    for name, sizes in mosaic_variants.items():
      _time_lazy_pair(results, shape, kv_bytes, lazy_decode_mgpu, sizes,
                      lazy_sets, shift0_sets,
                      (f"lazy-mosaic[{name}]", f"lazy-mosaic-shift0[{name}]"))
    for name, sizes in mosaic_variants.items():  # the per-layer part alone
      _time_planned_pair(results, shape, kv_bytes, sizes, lazy_sets,
                         shift0_sets, f"lazy-mosaic per-layer[{name}]")
    if fp8:  # float8 pools: half the KV bytes; Triton and each Mosaic variant
      fp8_lazy, fp8_shift0 = fp8_sets(lazy_sets), fp8_sets(shift0_sets)
      if chosen:
        _time_lazy_pair(results, shape, kv_bytes // 2, lazy_decode_gpu,
                        variants[chosen], fp8_lazy, fp8_shift0,
                        (f"lazy-fp8[{chosen}]", f"lazy-fp8-shift0[{chosen}]"))
      for name, sizes in (mosaic_variants or {"default": None}).items():
        _time_lazy_pair(results, shape, kv_bytes // 2, lazy_decode_mgpu,
                        sizes, fp8_lazy, fp8_shift0,
                        (f"lazy-mosaic-fp8[{name}]",
                         f"lazy-mosaic-fp8-shift0[{name}]"))
        _time_planned_pair(results, shape, kv_bytes // 2, sizes, fp8_lazy,
                           fp8_shift0, f"lazy-mosaic-fp8 per-layer[{name}]")
      del fp8_lazy, fp8_shift0
    if not baselines:
      del sets, lazy_sets, shift0_sets
      continue
    lengths = jnp.full((batch,), context, jnp.int32)
    paged_sets = [(q[:, 0], k, v, table, lengths) for q, k, v in sets]
    for name, settings in JAX_PAGED_SETTINGS.items():
      _measure(results, "decode", shape, f"jax-paged[{name}]",
               jax_paged(settings), paged_sets, perturb_paged,
               nbytes=kv_bytes)
    dense_sets = [(q[:, 0], dense_from_pages(k, table),
                   dense_from_pages(v, table)) for q, k, v in sets]
    _measure(results, "decode", shape, "xla-dense", dense_decode, dense_sets,
             perturb_query, nbytes=kv_bytes)
    del sets, lazy_sets, shift0_sets, paged_sets, dense_sets
  return chosen


def run_prefill(results, variants, shapes, tuning_shape, budget, fp8=False,
                layout="pages"):
  """Measures every prefill row; returns the chosen variant name (or None).

  The tuning shape runs first with every variant ("tune:" rows); the fastest
  there is chosen and runs at every shape, beside cuDNN.  With `fp8`, the
  Triton and Mosaic GPU kernels on float8 pools too (whole call; the Mosaic
  one with two and one compute warpgroups).  `layout` places the pages in
  the pool (kernel_cases.PAGE_LAYOUTS).
  """
  print("# prefill", flush=True)
  key = jax.random.PRNGKey(1)
  rng = np.random.default_rng(1)
  ordered = ([s for s in shapes if s[0] == tuning_shape]
             + [s for s in shapes if s[0] != tuning_shape])
  chosen = None
  for shape, batch, q_len, context in ordered:
    table, pos, shift, length = page_metadata(rng, batch, context, q_len,
                                              layout)
    num_pages = table.size
    pool_shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
    key, kq, kk, kv = jax.random.split(key, 4)
    q = random_array(kq, (batch, q_len, NUM_HEADS, HEAD_DIM))
    k_pages, v_pages = random_array(kk, pool_shape), random_array(kv, pool_shape)
    q_pos = jnp.broadcast_to(context + jnp.arange(q_len, dtype=jnp.int32),
                             (batch, q_len))
    flops = 4.0 * HEAD_DIM * NUM_HEADS * visible_pairs(q_pos, pos, length)
    lazy_sets = [(q, k_pages, v_pages, table, pos, shift, length, q_pos)]
    if shape == tuning_shape:
      for name, sizes in variants.items():
        _measure(results, "prefill", shape, f"tune:lazy[{name}]",
                 lazy_fn(lazy_prefill_gpu, sizes), lazy_sets, perturb_lazy,
                 flops=flops, budget=budget)
      chosen = _geomean_best(results, "prefill", variants, [tuning_shape],
                             prefix="tune:lazy")
      print(f"  chosen prefill variant: {chosen}", flush=True)
    if chosen:
      _measure(results, "prefill", shape, f"lazy[{chosen}]",
               lazy_fn(lazy_prefill_gpu, variants[chosen]), lazy_sets,
               perturb_lazy, flops=flops)
    # The Hopper kernel (what lazy_attention(impl="gpu") runs for bf16):
    # the whole call, and the per-layer part with the per-batch plan made
    # once (as a model's layers share it).
    for suffix, sizes in [("", None)] + [
        (f"[{name}]", sizes) for name, sizes in MOSAIC_CANDIDATES.items()]:
      # q_pos perturbed, not q: the kernel rotates the raw query itself
      # (kernel_timing.perturb_positions).
      _measure(results, "prefill", shape, "lazy-mosaic" + suffix,
               lazy_fn(lazy_prefill_mgpu, sizes), lazy_sets,
               perturb_positions, flops=flops)
      plan = tuple(jax.jit(functools.partial(prefill_plan, block_sizes=sizes))(
          *lazy_sets[0]))
      _measure(results, "prefill", shape, "lazy-mosaic per-layer" + suffix,
               functools.partial(prefill_planned, block_sizes=sizes),
               [(q, k_pages, v_pages, q_pos, plan)],
               prefill_planned_perturb(sizes), flops=flops,
               note="plan made once per batch")
    if fp8:  # float8 pools: the Triton kernel (non-Hopper GPUs) against
      # the Mosaic kernel (lazy_attention's on Hopper), whole call
      fp8_lazy = fp8_sets(lazy_sets)
      for method, kernel, sizes in (
          (f"lazy-fp8[{chosen or 'triton-default'}]", lazy_prefill_gpu,
           variants.get(chosen)),
          ("lazy-mosaic-fp8", lazy_prefill_mgpu, None),
          ("lazy-mosaic-fp8[one-wg]", lazy_prefill_mgpu,
           MgpuBlockSizes(num_compute_wgs=1))):
        _measure(results, "prefill", shape, method, lazy_fn(kernel, sizes),
                 fp8_lazy, perturb_positions if kernel is lazy_prefill_mgpu
                 else perturb_lazy, flops=flops)
      del fp8_lazy
    k_dense = dense_from_pages(k_pages, table)
    v_dense = dense_from_pages(v_pages, table)
    causal = context == 0

    def cudnn(q, k, v, causal=causal):
      return jax.nn.dot_product_attention(q, k, v, scale=SM_SCALE,
                                          is_causal=causal,
                                          implementation="cudnn")
    note = "causal" if causal else "no mask over context+chunk"
    _measure(results, "prefill", shape, "cudnn", cudnn,
             [(q, k_dense, v_dense)], perturb_query, flops=flops, note=note)
    del lazy_sets, k_dense, v_dense, k_pages, v_pages
  return chosen


# --------------------------------------------------------------------------
# Report


def compile_once():
  rng = np.random.default_rng(2)
  key = jax.random.PRNGKey(2)
  for kernel, batch, q_len, context in ((lazy_decode_gpu, 8, 1, 4096),
                                        (lazy_prefill_gpu, 4, 512, 8192)):
    own = 0 if q_len == 1 else q_len
    table, pos, shift, length = page_metadata(rng, batch, context, own)
    pool_shape = (NUM_KV_HEADS, table.size, PAGE_SIZE, HEAD_DIM)
    key, kq, kk, kv = jax.random.split(key, 4)
    q = random_array(kq, (batch, q_len, NUM_HEADS, HEAD_DIM))
    q_pos = jnp.broadcast_to(
        (context - 1 if q_len == 1 else context)
        + jnp.arange(q_len, dtype=jnp.int32), (batch, q_len))
    out = jax.jit(lazy_fn(kernel, None))(q, random_array(kk, pool_shape),
                                          random_array(kv, pool_shape), table, pos,
                                          shift, length, q_pos)
    print(kernel.__name__, "ok, finite:",
          bool(jnp.all(jnp.isfinite(out.astype(jnp.float32)))), flush=True)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write all results to this file")
  parser.add_argument("--quick", action="store_true",
                      help="two decode shapes, one prefill shape, 2 variants")
  parser.add_argument("--time-budget", type=float, default=480.0,
                      help="seconds after which remaining lazy variants are "
                      "skipped (baselines still run)")
  parser.add_argument("--decode-only", action="store_true",
                      help="only the decode section (Triton, Mosaic GPU "
                      "and the baselines)")
  parser.add_argument("--no-mosaic-decode", action="store_true",
                      help="skip the Mosaic GPU decode rows")
  parser.add_argument("--decode-shapes", default="",
                      help="comma-separated BxCONTEXT decode shapes, e.g. "
                      "64x8192 (default: DECODE_SHAPES)")
  parser.add_argument("--mosaic-variants", default="",
                      help="comma-separated MOSAIC_DECODE_VARIANTS names to "
                      "time (default: all)")
  parser.add_argument("--no-triton-decode", action="store_true",
                      help="skip the Triton decode rows (tuning included)")
  parser.add_argument("--no-baselines", action="store_true",
                      help="skip JAX's paged attention and dense XLA decode")
  parser.add_argument("--fp8", action="store_true",
                      help="also time decode and prefill (Triton and Mosaic "
                      "GPU) on float8 e4m3 pools")
  parser.add_argument("--prefill-only", action="store_true",
                      help="only the prefill section")
  parser.add_argument("--prefill-shapes", default="",
                      help="comma-separated PREFILL_SHAPES names, e.g. "
                      "chunk512 (default: all)")
  parser.add_argument("--no-triton-prefill", action="store_true",
                      help="skip the Triton prefill tuning and rows (its "
                      "float8 row then takes the default tiles)")
  parser.add_argument("--page-layout", choices=PAGE_LAYOUTS,
                      default="pages",
                      help="where each row's pages lie in the pool: every "
                      "page shuffled (default), or each document's pages "
                      "consecutive and the documents shuffled")
  parser.add_argument("--compile-once", action="store_true",
                      help="only run lazy decode (B8/ctx4096) and prefill "
                      "(chunk512) once with the default block sizes, e.g. "
                      "under XLA_FLAGS=--xla_dump_to=DIR to read the PTX")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("benchmarks.kernels needs a GPU (jax.default_backend() "
                     f"is {jax.default_backend()!r})")
  decode_shapes, prefill_shapes = DECODE_SHAPES, PREFILL_SHAPES
  decode_variants, prefill_variants = DECODE_VARIANTS, PREFILL_VARIANTS
  if args.quick:
    decode_shapes = DECODE_TUNING_SHAPES
    prefill_shapes = [s for s in PREFILL_SHAPES if s[0] == PREFILL_TUNING_SHAPE]
    decode_variants = dict(list(DECODE_VARIANTS.items())[:2])
    prefill_variants = dict(list(PREFILL_VARIANTS.items())[:2])
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"page layout: {args.page_layout}", flush=True)
  if args.compile_once:
    compile_once()
    return
  budget = Budget(args.time_budget)
  results: list[Result] = []
  mosaic_decode = {} if args.no_mosaic_decode else MOSAIC_DECODE_VARIANTS
  if args.decode_shapes:
    try:
      decode_shapes = [(int(b), int(c)) for b, c in (
          shape.split("x") for shape in args.decode_shapes.split(","))]
    except ValueError:
      parser.error(f"--decode-shapes takes BxCONTEXT,..., e.g. 64x8192; got "
                   f"{args.decode_shapes!r}")
  if args.mosaic_variants:
    names = args.mosaic_variants.split(",")
    unknown = set(names) - set(mosaic_decode)
    if unknown:
      parser.error(f"unknown --mosaic-variants {sorted(unknown)}; known: "
                   f"{sorted(MOSAIC_DECODE_VARIANTS)}")
    mosaic_decode = {name: mosaic_decode[name] for name in names}
  if args.quick:
    mosaic_decode = dict(list(mosaic_decode.items())[:1])
  if args.no_triton_decode:
    decode_variants = {}
  if args.no_triton_prefill:
    prefill_variants = {}
  if args.prefill_shapes:
    names = args.prefill_shapes.split(",")
    unknown = set(names) - {s[0] for s in PREFILL_SHAPES}
    if unknown:
      parser.error(f"unknown --prefill-shapes {sorted(unknown)}; known: "
                   f"{[s[0] for s in PREFILL_SHAPES]}")
    prefill_shapes = [s for s in prefill_shapes if s[0] in names]
  decode_variant = prefill_variant = None
  if args.prefill_only:
    decode_shapes = []
  else:
    decode_variant = run_decode(results, decode_variants, decode_shapes,
                                DECODE_TUNING_SHAPES, budget, mosaic_decode,
                                fp8=args.fp8,
                                baselines=not args.no_baselines,
                                layout=args.page_layout)
  if args.decode_only:
    prefill_shapes = []
  else:
    prefill_variant = run_prefill(results, prefill_variants, prefill_shapes,
                                  PREFILL_TUNING_SHAPE, budget, fp8=args.fp8,
                                  layout=args.page_layout)
  report(results, decode_shapes, prefill_shapes, decode_variant,
         prefill_variant, mosaic_candidates=tuple(MOSAIC_CANDIDATES))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({
          "device": jax.devices()[0].device_kind,
          "jax": jax.__version__,
          "page_layout": args.page_layout,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "decode_variant": decode_variant,
          "decode_block_sizes": (dataclasses.asdict(
              decode_variants[decode_variant]) if decode_variant else None),
          "prefill_variant": prefill_variant,
          "prefill_block_sizes": (dataclasses.asdict(
              prefill_variants[prefill_variant]) if prefill_variant else None),
          "results": [dataclasses.asdict(r) for r in results],
      }, f, indent=1)


if __name__ == "__main__":
  main()
