"""One launch each of the Mosaic GPU lazy prefill kernel and JAX's dense
Mosaic GPU attention, at the 512-token chunk, for Nsight Compute.

The plan and the rotated query are made first; each kernel then runs twice
(a warm-up launch and the one to profile), in the order lazy, dense, lazy,
dense, so skipping the first two Mosaic launches profiles one of each:

  ncu --target-processes all -k regex:mosaic --launch-skip 2 \\
      --launch-count 2 --section SpeedOfLight --section WarpStateStats \\
      python -m benchmarks.ncu_prefill [--page-layout documents]

(ncu without --target-processes all crashed on the H200 machine.)
"""

from __future__ import annotations

import argparse
import functools

import jax
import numpy as np

from benchmarks.kernel_cases import PAGE_LAYOUTS
from benchmarks.mgpu_prefill_cases import build_inputs
from benchmarks.mgpu_prefill_check import (jax_mgpu_dense,
                                           jax_mgpu_dense_inputs,
                                           kernel_alone, kernel_inputs)
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--page-layout", default="documents",
                      choices=PAGE_LAYOUTS)
  args = parser.parse_args(argv)
  inputs = build_inputs(jax.random.PRNGKey(1), np.random.default_rng(1),
                        batch=4, q_len=512, context=8192,
                        layout=args.page_layout)
  lazy_args, (k_dense, v_dense) = inputs[:8], inputs[8:]
  sizes = MgpuBlockSizes()
  q_rot, plan = kernel_inputs(lazy_args, sizes)
  lazy = jax.jit(functools.partial(kernel_alone, sizes=sizes))
  dense = jax.jit(functools.partial(jax_mgpu_dense, cfg=(64, 128, 2)))
  lazy_in = (q_rot, lazy_args[1], lazy_args[2], tuple(plan))
  dense_in = jax_mgpu_dense_inputs(lazy_args[0], k_dense, v_dense)
  for _ in range(2):
    jax.block_until_ready(lazy(*lazy_in))
    jax.block_until_ready(dense(*dense_in))
  print("ran the lazy and the dense kernel twice each")


if __name__ == "__main__":
  main()
