"""benchmarks/prefill_device_split.py's accounting on CPU: one traced chain
of a small jitted function, counted per call."""

from __future__ import annotations

import jax.numpy as jnp

from benchmarks.kernel_timing import perturb_query
from benchmarks.prefill_device_split import split


def test_split_counts_one_chain_per_call(tmp_path):
  x = jnp.ones((128, 128), jnp.float32)
  row = split("matmul", lambda a: jnp.tanh(a @ a), (x,), perturb_query,
              str(tmp_path), top=2, samples=1)
  assert row["name"] == "matmul"
  assert row["chained_us"] > 0 and row["busy_us"] > 0
  # Each call is the function plus the chain's own ops: more than one op,
  # and a few at most (not the whole chain's count).
  assert 1 < row["ops_per_call"] < 20
  assert 1 <= len(row["top_ops"]) <= 2
  busiest = row["top_ops"][0]
  assert busiest[1] <= row["busy_us"] and busiest[2] >= 1
