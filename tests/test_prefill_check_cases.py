"""The Mosaic prefill check's parity cases and benchmark inputs build on
CPU (the check itself runs on a GPU only)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_cases import PAGE_SIZE
from benchmarks.mgpu_prefill_cases import VARIANTS, build_inputs
from benchmarks.mgpu_prefill_parity import _parity_cases
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes


def test_parity_cases_build():
  cases = _parity_cases()
  assert len({name for name, *_ in cases}) == len(cases) == 4
  for name, make, rope, sizes in cases:
    lazy = make()
    assert lazy.q.shape[0] == 3 and lazy.q.dtype == jnp.bfloat16, name
    assert sizes is None or isinstance(sizes, MgpuBlockSizes)
  assert VARIANTS["k128w2s2-qreg-csrec-sched"] == MgpuBlockSizes()


def test_benchmark_inputs_match_their_pages():
  (q, k_pages, v_pages, table, pos, shift, length, q_pos, k_dense,
   v_dense) = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0),
                           batch=2, q_len=32, context=1024,
                           layout="documents")
  assert q.shape[:2] == (2, 32) and k_dense.shape[1] == table.shape[1] * (
      PAGE_SIZE)
  # Row 1's third page in the dense K is its table's page in the pool.
  page = int(table[1, 2])
  np.testing.assert_array_equal(
      np.asarray(k_dense[1, 2 * PAGE_SIZE:3 * PAGE_SIZE, 0]),
      np.asarray(k_pages[0, page]))
  np.testing.assert_array_equal(np.asarray(q_pos[0]), 1024 + np.arange(32))
