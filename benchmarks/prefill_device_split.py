"""Where the 512-token chunk's chained time goes, op by op on the device.

`mgpu_prefill_check` times each row as a chain of calls
(`kernel_timing.ChainTimer`); every call in the chain also pays the
harness's own ops (the perturbed input, the sum of the output).  This
traces one such chain under the profiler for cuDNN, the lazy whole call
and the lazy kernel alone, and prints per call: the chained time, the
device's busy time and span, the op count, and the busiest ops.  So the
kernels compare by their own device time, and the whole call's XLA work
(plan, rotated query) shows op by op.

  python -m benchmarks.prefill_device_split [--page-layout documents]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import jax
import numpy as np

from benchmarks.comm_profile import op_breakdown
from benchmarks.kernel_cases import PAGE_LAYOUTS
from benchmarks.kernel_timing import (SETTLE_S, ChainTimer, perturb_none,
                                      perturb_positions, perturb_query)
from benchmarks.mgpu_prefill_cases import VARIANTS, build_inputs
from benchmarks.mgpu_prefill_check import (cudnn_dense, kernel_alone,
                                           kernel_inputs, whole_call)
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes


def methods(layout: str, variants=(None,)):
  """(name, fn, args, perturb) of cuDNN, then the whole call and the kernel
  of each `mgpu_prefill_cases.VARIANTS` name in `variants` (None: the
  default block sizes); perturbed as in mgpu_prefill_check (the kernel
  alone not at all)."""
  inputs = build_inputs(jax.random.PRNGKey(1), np.random.default_rng(1),
                        batch=4, q_len=512, context=8192, layout=layout)
  lazy_args, (k_dense, v_dense) = tuple(inputs[:8]), inputs[8:]
  rows = [("cudnn", cudnn_dense, (lazy_args[0], k_dense, v_dense),
           perturb_query)]
  for variant in variants:
    sizes = MgpuBlockSizes() if variant is None else VARIANTS[variant]
    tag = "" if variant is None else f" [{variant}]"
    q_rot, plan = kernel_inputs(lazy_args, sizes)
    rows += [
        (f"whole call{tag}", functools.partial(whole_call, sizes=sizes),
         lazy_args, perturb_positions),
        (f"kernel alone{tag}", functools.partial(kernel_alone, sizes=sizes),
         (q_rot, lazy_args[1], lazy_args[2], tuple(plan)), perturb_none),
    ]
  return rows


def split(name, fn, args, perturb, trace_dir: str, top: int,
          samples: int = 5, settle_s: float = SETTLE_S) -> dict:
  """Chained seconds per call (median of `samples`, each settled for
  `settle_s` so the row runs at its own clock under the GPU's power cap,
  as in mgpu_prefill_check), then one traced chain: busy and span per
  call, ops per call and the `top` busiest ops."""
  timer = ChainTimer(fn, [args], perturb)
  chained = statistics.median(timer.sample(settle_s=settle_s)
                              for _ in range(samples))
  directory = f"{trace_dir}/{''.join(c if c.isalnum() else '_' for c in name)}"
  with jax.profiler.trace(directory):
    timer.sample()
  ops = op_breakdown(directory, top=top)
  calls = timer.steps
  return dict(name=name, chained_us=chained * 1e6,
              busy_us=ops["busy_s"] * 1e6 / calls,
              span_us=ops["span_s"] * 1e6 / calls,
              ops_per_call=ops["ops"] / calls,
              top_ops=[[op, s * 1e6 / calls, c / calls]
                       for op, s, c in ops["by_op"]])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--page-layout", default="documents",
                      choices=PAGE_LAYOUTS)
  parser.add_argument("--trace-dir", default="/tmp/prefill_device_split")
  parser.add_argument("--top", type=int, default=8)
  parser.add_argument("--variants", default="",
                      help="comma-separated mgpu_prefill_check variants to "
                           "split instead of the default block sizes")
  args = parser.parse_args(argv)
  variants = [v for v in args.variants.split(",") if v] or [None]
  unknown = sorted(set(variants) - set(VARIANTS) - {None})
  if unknown:  # before the inputs are built on the device
    parser.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
  for name, fn, fn_args, perturb in methods(args.page_layout, variants):
    row = split(name, fn, fn_args, perturb, args.trace_dir, args.top)
    print(f"== {args.page_layout} {name}: chained {row['chained_us']:.1f} "
          f"us a call; device busy {row['busy_us']:.1f} us, span "
          f"{row['span_us']:.1f} us, {row['ops_per_call']:.1f} ops a call",
          flush=True)
    for op, us, count in row["top_ops"]:
      print(f"    {us:8.2f} us x{count:.0f} {op}")


if __name__ == "__main__":
  main()
