"""The device timeline behind RESULTS.md, "The plan kernel's roles on CTAs of
their own, and programmatic dependent launch" (2026-12-04; not library
code, no test imports it).  On the GPU: the check's whole prefill call at
the 512-token chunk (B 4, 8K context), per variant of
benchmarks/mgpu_prefill_cases.VARIANTS, jitted and profiled over six calls
in a row; prints each call's span (first op's start to last op's end) and
the last call's ops with their start, duration and the gap before each.
From the repository root:
  PYTHONPATH=. python benchmarks/results/prefill_call_timeline_2026-12-04.py \
      documents|pages [variant,variant,...]
"""
import sys
import jax, numpy as np
from benchmarks.comm_profile import _op_events, read_trace
from benchmarks.mgpu_prefill_cases import VARIANTS, build_inputs
from benchmarks.mgpu_prefill_check import whole_call
DEFAULT = "k128w2s2-qreg-csrec-sched"
layout = sys.argv[1] if len(sys.argv) > 1 else "documents"
names = (sys.argv[2].split(",") if len(sys.argv) > 2 else
         [DEFAULT, DEFAULT + "-plank", DEFAULT + "-plank-pdl", DEFAULT + "-pdl"])
args = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0), batch=4,
                    q_len=512, context=8192, layout=layout)[:8]
CALLS = 6
for name in names:
  fn = jax.jit(lambda *a, s=VARIANTS[name]: whole_call(*a, sizes=s))
  jax.block_until_ready(fn(*args)); jax.block_until_ready(fn(*args))
  trace = f"/tmp/prefill_call_timeline/{layout}/{name}"
  with jax.profiler.trace(trace):
    for _ in range(CALLS):
      out = fn(*args)
    jax.block_until_ready(out)
  _, ops = _op_events(read_trace(trace), 0)
  ops = sorted(ops, key=lambda e: float(e["ts"]))
  per = len(ops) // CALLS
  print(f"== {layout} {name}: {len(ops)} ops, {per} a call")
  spans = []
  for c in range(CALLS):
    call = ops[c * per:(c + 1) * per]
    start = float(call[0]["ts"])
    spans.append(max(float(e["ts"]) + float(e["dur"]) for e in call) - start)
  print("  span per call us:", [round(s, 1) for s in spans],
        f"median of calls 2-{CALLS}: {np.median(spans[1:]):.1f}")
  call = ops[-per:]
  start = prev_end = float(call[0]["ts"])
  for e in call:
    ts, dur = float(e["ts"]), float(e["dur"])
    print(f"  {ts - start:8.1f} +{dur:7.1f} gap {ts - prev_end:6.1f}  "
          f"{e['name'][:70]}")
    prev_end = ts + dur
