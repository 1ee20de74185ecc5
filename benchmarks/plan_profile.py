"""Device time of the Mosaic kernels' per-batch plans (XLA metadata work).

The decode plan at B64 / ctx 8192 (segment steps, and one step per block:
`MgpuDecodeBlockSizes.steps_by_block`, with and without its cos / sin,
`rope_in_kernel`, and with the records read by the kernel,
`fields_in_kernel`) and the prefill plan at the 512-token chunk (B 4, 8K
context; the XLA plan and, on the GPU, the plan in one Mosaic GPU launch,
`gpu_prefill_plan_kernel`), on the kernel benchmark's page layout
(benchmarks/kernel_cases.py): each is jitted with its outputs summed (so
no output is dead code), timed chained, then profiled, and its ops listed
by device time.  A plan call is too short to time by the wall clock alone
(dispatch dominates), so the profile's per-op sum is the figure to read.

  python -m benchmarks.plan_profile --trace-dir /tmp/plans [--top 25]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.comm_profile import op_breakdown
from benchmarks.kernel_cases import (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS,
                                     PAGE_SIZE, ROPE, page_metadata)
from benchmarks.kernel_timing import time_per_call
from pallas_kernels.gpu_block_sizes import MgpuBlockSizes
from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_decode_mgpu import plan_decode
from pallas_kernels.gpu_prefill_mgpu import plan_prefill
from pallas_kernels.gpu_prefill_plan_kernel import (plan_kernel_unsupported,
                                                    plan_prefill_kernel)


def _summed(plan_fn):
  return lambda *args: sum(jnp.sum(x.astype(jnp.float32))
                           for x in jax.tree.leaves(plan_fn(*args)))


def _perturb(args, zero):
  table, pos, shift, length, q_pos = args
  return table, pos, shift, length + (zero > 1e30).astype(jnp.int32), q_pos


def profile_plan(name, plan_fn, args, trace_dir: str, top: int,
                 calls: int = 3) -> dict:
  """Chained time per call and the profiled device time of `calls` calls."""
  fn = _summed(plan_fn)
  chained = time_per_call(fn, [args], _perturb)
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  directory = f"{trace_dir}/{name}"
  with jax.profiler.trace(directory):
    for _ in range(calls):
      jax.block_until_ready(jitted(*args))
  ops = op_breakdown(directory, top=top)
  return dict(name=name, chained_us=chained * 1e6,
              device_us=ops["busy_s"] * 1e6 / calls,
              ops_per_call=ops["ops"] / calls,
              top_ops=[[n, s * 1e6 / calls, c // calls]
                       for n, s, c in ops["by_op"]])


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--trace-dir", default="/tmp/plan_profile")
  p.add_argument("--top", type=int, default=25)
  p.add_argument("--decode-batch", type=int, default=64)
  p.add_argument("--context", type=int, default=8192,
                 help="tokens of context, a multiple of 512 (documents)")
  p.add_argument("--prefill-batch", type=int, default=4)
  p.add_argument("--chunk", type=int, default=512,
                 help="prefill chunk tokens, a multiple of 16 (pages)")
  args = p.parse_args(argv)
  if args.context % 512 or args.chunk % PAGE_SIZE or min(
      args.decode_batch, args.prefill_batch, args.context, args.chunk) < 1:
    p.error("--context must be a positive multiple of 512, --chunk of 16, "
            "and the batches positive")
  rng = np.random.default_rng(0)
  rows = []
  batch, context = args.decode_batch, args.context
  table, pos, shift, length = page_metadata(rng, batch, context, 0)
  q_pos = jnp.full((batch, 1), context - 1, jnp.int32)
  for suffix, sizes in (
      ("_segments", MgpuDecodeBlockSizes()),
      ("_blocks", MgpuDecodeBlockSizes(steps_by_block=True)),
      ("_blocks_rope", MgpuDecodeBlockSizes(steps_by_block=True,
                                            rope_in_kernel=True)),
      ("_fields", MgpuDecodeBlockSizes(steps_by_block=True,
                                       rope_in_kernel=True,
                                       fields_in_kernel=True))):
    rows.append(profile_plan(
        f"decode_B{batch}_ctx{context}{suffix}",
        functools.partial(plan_decode, rope=ROPE, head_dim=HEAD_DIM,
                          page_size=PAGE_SIZE, num_pages=table.size,
                          block_sizes=sizes),
        (table, pos, shift, length, q_pos), args.trace_dir, args.top))
  batch, q_len = args.prefill_batch, args.chunk
  table, pos, shift, length = page_metadata(rng, batch, context, q_len)
  q_pos = jnp.broadcast_to(context + jnp.arange(q_len, dtype=jnp.int32),
                           (batch, q_len))
  plans = [("", plan_prefill)]
  # The plan kernel runs on the GPU, at the shapes it takes.
  if jax.default_backend() == "gpu" and plan_kernel_unsupported(
      num_logical_pages=table.shape[1], q_len=q_len, head_dim=HEAD_DIM,
      block_sizes=MgpuBlockSizes()) is None:
    plans.append(("_kernel", plan_prefill_kernel))
  for suffix, plan_fn in plans:
    rows.append(profile_plan(
        f"prefill_B{batch}_chunk{q_len}{suffix}",
        functools.partial(plan_fn, rope=ROPE,
                          group=NUM_HEADS // NUM_KV_HEADS, head_dim=HEAD_DIM,
                          num_pages=table.size, page_size=PAGE_SIZE),
        (table, pos, shift, length, q_pos), args.trace_dir, args.top))
  _print(rows)
  return rows


def _print(rows):
  for row in rows:
    print(f"{row['name']}: {row['device_us']:.1f} us of device time in "
          f"{row['ops_per_call']:.0f} ops (chained {row['chained_us']:.1f} "
          f"us per call)")
    for name, us, count in row["top_ops"]:
      print(f"  {us:8.2f} us x{count} {name[:90]}")


if __name__ == "__main__":
  main()
