"""The plan-kernel ablations behind RESULTS.md, "The plan kernel's roles on
CTAs of their own, and programmatic dependent launch" (2026-12-04; not
library code, no test imports it).  Writes a copy of
pallas_kernels/gpu_prefill_plan_kernel.py (its form at 31c503b) with roles
switched off (the output is then wrong; only the time is read), and
profiles that kernel alone at the check's chunk512 shape, twelve calls,
each after an elementwise pass over 256 MB that flushes L2.  Switches, comma
separated: empty (no body), noblock (no records), noqrows (no query rows),
nonsteps, nominrow, norcos / noqcos (zeros for the records' / query rows'
cos / sin).  From the repository root, on the GPU:
  PYTHONPATH=. python benchmarks/results/prefill_plan_ablation_2026-12-04.py \
      documents|pages [switch,switch] [rows per query CTA]
"""
import importlib.util, os, sys, tempfile
import jax, jax.numpy as jnp, numpy as np
from benchmarks.comm_profile import _op_events, read_trace
from benchmarks.kernel_cases import ROPE
from benchmarks.mgpu_prefill_cases import build_inputs
from pallas_kernels.gpu_block_sizes import MgpuBlockSizes
layout = sys.argv[1] if len(sys.argv) > 1 else "documents"
off = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else set()
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 8
source = open("pallas_kernels/gpu_prefill_plan_kernel.py").read()
ROLES = {"noblock": "(block >= 0) & (query_cta < 0)",
         "noqrows": "(query_cta >= 0) & (token_block < 0)",
         "nonsteps": "block < 0", "nominrow": "token_block >= 0"}
patches = [("ROWS_PER_QUERY_CTA = 8\n", f"ROWS_PER_QUERY_CTA = {rows}\n")]
if "empty" in off:
  patches.append(('  cta = jax.lax.axis_index("cta")\n',
                  '  cta = jax.lax.axis_index("cta")\n  return\n'))
for switch, condition in ROLES.items():
  if switch in off:
    patches.append((f"  @pl.when({condition})\n",
                    f"  @pl.when(({condition}) & False)\n"))
zeros = "(lane * 0).astype(jnp.float32)"
if "norcos" in off:
  patches.append(("cos_sin_lanes(jnp.where(shift == INT32_MIN, 0, shift))",
                  zeros))
if "noqcos" in off:
  patches.append(("cos_sin_lanes(jnp.maximum(row_pos, 0))", zeros))
for old, new in patches:
  assert source.count(old) == 1, old
  source = source.replace(old, new)
path = os.path.join(tempfile.mkdtemp(), "plan_ablated.py")
open(path, "w").write(source)
spec = importlib.util.spec_from_file_location("plan_ablated", path)
module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)
q, k, v, table, pos, shift, length, q_pos = build_inputs(
    jax.random.PRNGKey(0), np.random.default_rng(0), batch=4, q_len=512,
    context=8192, layout=layout)[:8]
plan = jax.jit(lambda *a: module.plan_prefill_kernel(
    *a, rope=ROPE, group=4, head_dim=128, num_pages=k.shape[1],
    page_size=k.shape[2], block_sizes=MgpuBlockSizes()))
flush = jax.jit(lambda x: x + 1)
big = jnp.zeros((64 << 20,), jnp.float32)
args = (table, pos, shift, length, q_pos)
jax.block_until_ready(plan(*args)); big = flush(big)
trace = tempfile.mkdtemp()
with jax.profiler.trace(trace):
  for _ in range(12):
    big = flush(big); out = plan(*args)
  jax.block_until_ready(out)
_, ops = _op_events(read_trace(trace), 0)
us = sorted(float(e["dur"]) for e in ops if "mosaic" in e["name"])
print(f"{layout} off={','.join(sorted(off)) or '-'} rows={rows}: plan kernel "
      f"us median {np.median(us):.2f} min {us[0]:.2f} max {us[-1]:.2f} "
      f"n={len(us)}")
