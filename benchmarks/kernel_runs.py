"""The measured sections of the kernel benchmark (benchmarks/kernels.py):
the result rows and time budget, the measurement of one row or one
alternated pair of rows, the choice of the fastest tuned variant, the decode
and prefill runs, and the single compile run of --compile-once."""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_cases import (
    HEAD_DIM, JAX_PAGED_SETTINGS, NUM_HEADS, NUM_KV_HEADS, PAGE_SIZE,
    SM_SCALE, decode_inputs, decode_planned, decode_planned_sets,
    decode_shape_name, dense_decode, dense_from_pages, fp8_sets, jax_paged,
    lazy_fn, page_metadata, prefill_plan, prefill_planned,
    prefill_planned_perturb, random_array, visible_pairs)
from benchmarks.kernel_timing import (perturb_lazy, perturb_paged,
                                      perturb_positions, perturb_query,
                                      time_pair, time_per_call)
from benchmarks.kernel_variants import MOSAIC_CANDIDATES
from pallas_kernels.gpu_decode import lazy_decode_gpu
from pallas_kernels.gpu_decode_mgpu import lazy_decode_mgpu
from pallas_kernels.gpu_prefill import lazy_prefill_gpu
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes, lazy_prefill_mgpu


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
