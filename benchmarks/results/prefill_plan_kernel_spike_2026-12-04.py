"""Feasibility spike (2026-12-04, not library code): a plan-like Pallas
Mosaic GPU kernel at the prefill plan's grid (B 4 x 68 KV blocks), each CTA
one block.  It TMA-copies a row's page shifts and liveness (256 pages) into
shared memory, counts segment starts before its block with masked
reductions over a WG_STRIDED array, computes a 64-frequency cos / sin in
the kernel, and writes one 160-word record to a row of the output that
the count picks (a dynamic-row shared-to-global copy).  The work is
plan-like, not the plan.  Timed as links of a device loop, each link the
kernel and one reduction, against links of one tiny XLA op and the same
reduction.

Run on the GPU machine: PYTHONPATH=. V=<variant> python
benchmarks/results/prefill_plan_kernel_spike_2026-12-04.py, where V is
"nooff,noscalar", "nooff" or "noscalar".  "nooff" reads the previous
page's shift from the same aligned copy (wrong counts, timing only),
not from a copy at offset 1; "noscalar" leaves out the 32 scalar
stores of the record's header.  On CPU the kernel runs in the
interpreter (two links).  benchmarks/RESULTS.md, "A plan kernel in
Mosaic GPU: a feasibility spike".
"""
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_mgpu_parts import interpreter_params

CPU = jax.default_backend() == "cpu"

M, PPB, W = 256, 8, 160
NB = M // PPB
INTERPRET = CPU

def body(shift_ref, live_ref, out_ref, sh, prev_sh, lv, rec, bar):
  b = jax.lax.axis_index("b"); blk = jax.lax.axis_index("blk")
  V = os.environ.get("V", "")
  plgpu.copy_gmem_to_smem(shift_ref.at[b, pl.ds(0 if "nooff" in V else 1, M)], sh, bar)
  plgpu.copy_gmem_to_smem(shift_ref.at[b, pl.ds(0, M)], prev_sh, bar)
  plgpu.copy_gmem_to_smem(live_ref.at[b], lv, bar)
  plgpu.barrier_wait(bar)
  lay = plgpu.Layout.WG_STRIDED((M,), vec_size=2)
  cast = (lambda x: x) if INTERPRET else (lambda x: plgpu.layout_cast(x, lay))
  page = cast(jax.lax.broadcasted_iota(jnp.int32, (M,), 0))
  s, p, l = cast(sh[...]), cast(prev_sh[...]), cast(lv[...])
  starts = jnp.where((l != 0) & (s != p), 1, 0)
  before = jnp.sum(jnp.where(page < blk * PPB, starts, 0))
  # one candidate: header scalars, then cos/sin of its shift
  shift = sh[jnp.minimum(blk * PPB, M - 1)]
  if "noscalar" not in V:
    for j in range(32):
      rec[j] = before + j
  f = jax.lax.broadcasted_iota(jnp.int32, (128,), 0)
  if not INTERPRET:
    f = plgpu.layout_cast(f, plgpu.Layout.WG_STRIDED((128,), vec_size=1))
  ang = (shift * (f % 64)).astype(jnp.float32) * jnp.float32(1e-3)
  cs = jnp.where(f < 64, jnp.cos(ang), jnp.sin(ang))
  rec[pl.ds(32, 128)] = jax.lax.bitcast_convert_type(cs, jnp.int32)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(rec, out_ref.at[b, before])
  plgpu.wait_smem_to_gmem(0)

B, NB = 4, 68
kern = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, 612, W), jnp.int32),
    scratch_types=[plgpu.SMEM((M,), jnp.int32)] * 3 + [plgpu.SMEM((W,), jnp.int32),
                   plgpu.Barrier(num_arrivals=3)], grid=(B, NB), grid_names=("b", "blk"), **({"interpret": interpreter_params()} if CPU else {}))
shift = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (B, M + 4)), jnp.int32)
live = jnp.ones((B, M), jnp.int32)

def chain(f, n=2 if CPU else 200):
  def run(shift):
    def body(i, s):
      out = f(s)
      return s + (jnp.max(out[:, 0, 0]) > 2**30).astype(jnp.int32)
    return jax.lax.fori_loop(0, n, body, shift)
  g = jax.jit(run)
  jax.block_until_ready(g(shift))
  best = 1e9
  for _ in range(5):
    t = time.perf_counter(); jax.block_until_ready(g(shift)); best = min(best, time.perf_counter() - t)
  return best / n * 1e6

tiny = lambda s: (s + 1)[:, None, :]
print("spike plan kernel + its reduce: %.1f us a link" % chain(lambda s: kern(s, live)))
print("tiny XLA op + its reduce:       %.1f us a link" % chain(tiny))
