"""The check behind RESULTS.md, "The prefill plan in one Mosaic GPU launch"
(2026-12-04; not library code, no test imports it).  On the GPU: the plan
kernel (gpu_prefill_plan_kernel) against the XLA plan, array for array,
on the H200 check's inputs (both page layouts) and on random layouts
(tests/test_mgpu_plan_records.random_metadata), then each plan timed as
links of a device loop (each link the plan and one reduction of its
n_steps into the next q_pos).  On CPU the kernel runs in the interpreter
at smaller shapes.  From the repository root:
  PYTHONPATH=. python benchmarks/results/prefill_plan_kernel_check_2026-12-04.py
tests/test_prefill_plan_kernel.py holds the same comparisons as tests;
benchmarks.plan_profile profiles both plans' device time.
"""
import sys, time
import numpy as np, jax, jax.numpy as jnp
from pallas_kernels.gpu_block_sizes import MgpuBlockSizes
from pallas_kernels.gpu_prefill_mgpu_plan import plan_prefill
from pallas_kernels.gpu_prefill_plan_kernel import plan_prefill_kernel
from benchmarks.mgpu_prefill_cases import build_inputs
from benchmarks.mgpu_prefill_check import ROPE
from tests.rope_configs import LLAMA3
from tests.test_mgpu_plan_records import random_metadata
CPU = jax.default_backend() == "cpu"
def compare(tag, args, kw):
  ref = jax.jit(lambda *a: plan_prefill(*a, **kw))(*args)
  got = jax.jit(lambda *a: plan_prefill_kernel(*a, interpret=CPU, **kw))(*args)
  ok = True
  for name in ref._fields:
    a, b = np.asarray(getattr(ref, name)), np.asarray(getattr(got, name))
    if a.shape != b.shape or not np.array_equal(a, b):
      ok = False
      print(tag, name, a.shape, b.shape)
      if a.shape == b.shape:
        bad = np.argwhere(a != b)
        print("  diffs", len(bad), bad[:4].tolist(), [(a[tuple(i)], b[tuple(i)]) for i in bad[:4]])
        if name == "records":
          fa = jax.lax.bitcast_convert_type(jnp.asarray(a[..., 32:]), jnp.float32)
          fb = jax.lax.bitcast_convert_type(jnp.asarray(b[..., 32:]), jnp.float32)
          print("  cos/sin max abs diff", float(jnp.max(jnp.abs(fa - fb))), "header equal", np.array_equal(a[..., :32], b[..., :32]))
        if name == "query_cos_sin":
          print("  max int16 diff", int(np.max(np.abs(a.astype(np.int32) - b.astype(np.int32)))))
  print(tag, "EQUAL" if ok else "DIFFERENT", "steps", int(np.asarray(ref.n_steps).max()), flush=True)
  return ref, got
kwb = dict(rope=ROPE, group=4, head_dim=128, page_size=16, block_sizes=MgpuBlockSizes())
for layout in ("documents", "pages"):
  lazy = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0), batch=4, q_len=512 if not CPU else 128, context=8192 if not CPU else 2048, layout=layout)[:8]
  q, k_pages, v_pages, table, pos, shift, length, q_pos = lazy
  args = (table, pos, shift, length, q_pos)
  kw = dict(kwb, num_pages=k_pages.shape[1])
  compare("bench-" + layout, args, kw)
  if not CPU:
    def chain(f, n=200):
      def run(q_pos):
        def body(i, qp):
          plan = f(table, pos, shift, length, qp)
          return qp + (plan.n_steps[0, 0] > 2**30).astype(jnp.int32)
        return jax.lax.fori_loop(0, n, body, q_pos)
      g = jax.jit(run); jax.block_until_ready(g(q_pos))
      best = 1e9
      for _ in range(7):
        t = time.perf_counter(); jax.block_until_ready(g(q_pos)); best = min(best, time.perf_counter() - t)
      return best / n * 1e6
    print(layout, "plan chain link us: xla %.1f  kernel %.1f" % (chain(lambda *a: plan_prefill(*a, **kw)), chain(lambda *a: plan_prefill_kernel(*a, **kw))), flush=True)
for s in range(4 if not CPU else 2):
  rng = np.random.default_rng(100 + s)
  M = int(rng.choice([129, 150, 263, 544])); T = int(rng.choice([128, 130, 257, 512])); B = int(rng.integers(1, 5))
  table, pos, shift, length, live = random_metadata(rng, B, M)
  pos = pos * 4; length = np.where(live, rng.integers(1, 17, (B, M)), 0).astype(np.int32)
  shift = (shift * int(rng.choice([1, 977, 65537]))).astype(np.int32)
  q_pos = (int(rng.integers(0, M * 16)) + np.arange(T))[None].repeat(B, 0).astype(np.int32)
  sizes = MgpuBlockSizes(block_kv=int(rng.choice([64, 128])), num_compute_wgs=int(rng.choice([1, 2])))
  kw = dict(rope=LLAMA3 if s % 2 else ROPE, group=int(rng.choice([1, 2, 4, 8])), head_dim=128, num_pages=B * M, page_size=16, block_sizes=sizes)
  compare(f"random{s}", [jnp.asarray(a) for a in (table, pos, shift, length, q_pos)], kw)
