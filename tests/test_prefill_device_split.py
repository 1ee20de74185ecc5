"""benchmarks/prefill_device_split.py's accounting on CPU: one traced chain
of a small jitted function, counted per call."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

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


def test_every_chained_sample_settles_first(tmp_path, sample_settles):
  """The chained samples run at the row's own clock: each is settled for
  SETTLE_S, as mgpu_prefill_check's; the traced one follows them."""
  from benchmarks.kernel_timing import SETTLE_S
  settles = sample_settles
  x = jnp.ones((8, 8), jnp.float32)
  split("m", lambda a: a @ a, (x,), perturb_query, str(tmp_path), top=1,
        samples=3)
  assert SETTLE_S > 0 and settles == [SETTLE_S] * 3 + [0.0]


def test_variant_rows_are_named_after_their_variant():
  from benchmarks.prefill_device_split import methods
  names = [row[0] for row in methods(
      "documents", [None, "k128w2s2-qreg-csrec-sched-pagecopy"])]
  assert names == ["cudnn", "whole call", "kernel alone",
                   "whole call [k128w2s2-qreg-csrec-sched-pagecopy]",
                   "kernel alone [k128w2s2-qreg-csrec-sched-pagecopy]"]


def test_a_bracketed_name_traces_to_a_plain_directory(tmp_path):
  x = jnp.ones((8, 8), jnp.float32)
  split("kernel alone [k128-x]", lambda a: a @ a, (x,), perturb_query,
        str(tmp_path), top=1, samples=1)
  assert [p.name for p in tmp_path.iterdir()] == ["kernel_alone__k128_x_"]


def test_an_unknown_variant_is_refused_by_name(capsys):
  from benchmarks.prefill_device_split import main
  with pytest.raises(SystemExit):
    main(["--variants", "k128w2s2-qreg-csrec-sched,no-such-tiles"])
  assert "unknown variants ['no-such-tiles']" in capsys.readouterr().err
