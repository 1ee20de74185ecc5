"""The kernel benchmarks' helpers on CPU (benchmarks/kernel_cases.py,
kernel_timing.py, kernels_report.py): the benchmarks themselves need a GPU,
so their inputs, FLOP count, dense baselines' layout, timer and report are
checked here."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kernel_cases as cases
from benchmarks.kernel_timing import (SETTLE_S, ChainTimer, perturb_lazy,
                                      perturb_none, perturb_positions,
                                      perturb_query, time_pair, time_per_call)
from benchmarks.kernels import Result
from benchmarks.kernels_report import report


def test_page_metadata_shifts_documents_and_keeps_own_pages_in_place():
  rng = np.random.default_rng(0)
  doc_tokens, own = 2 * cases.DOC_LEN, 3 * cases.PAGE_SIZE
  table, pos, shift, length = cases.page_metadata(rng, 2, doc_tokens, own)
  pages = (doc_tokens + own) // cases.PAGE_SIZE
  assert table.shape == pos.shape == shift.shape == length.shape == (2, pages)
  # Every row reads its own physical pages, each page once.
  assert sorted(np.asarray(table).ravel().tolist()) == list(range(2 * pages))
  per_doc = cases.DOC_LEN // cases.PAGE_SIZE
  want_shift = [0] * per_doc + [cases.DOC_LEN] * per_doc + [0] * 3
  assert np.asarray(shift[1]).tolist() == want_shift
  assert np.asarray(pos[0]).tolist() == [
      p * cases.PAGE_SIZE for p in range(pages)]
  assert np.all(np.asarray(length) == cases.PAGE_SIZE)


def test_page_metadata_documents_layout_keeps_each_document_consecutive():
  from pallas_kernels.testing import contiguous_block_count
  rng = np.random.default_rng(0)
  doc_tokens, own = 3 * cases.DOC_LEN, 2 * cases.PAGE_SIZE
  per_doc = cases.DOC_LEN // cases.PAGE_SIZE
  shuffled = cases.page_metadata(rng, 4, doc_tokens, own)
  table, pos, shift, length = cases.page_metadata(rng, 4, doc_tokens, own,
                                                  layout="documents")
  for other, mine in zip(shuffled[1:], (pos, shift, length)):
    np.testing.assert_array_equal(np.asarray(other), np.asarray(mine))
  table = np.asarray(table)
  pages = 3 * per_doc + 2
  assert sorted(table.ravel().tolist()) == list(range(4 * pages))
  for row in table:
    for first in range(0, 3 * per_doc, per_doc):  # each document
      assert np.all(np.diff(row[first:first + per_doc]) == 1)
    assert row[-1] == row[-2] + 1  # the row's own pages
  # The documents themselves are shuffled: not one run across the pool.
  assert not np.all(np.diff(table.ravel()) == 1)
  # 8-page blocks: every one inside a document is one copy; the last
  # block of a row is padded, and the shuffled layout has none.
  assert contiguous_block_count(table, 8) == (4 * 3 * per_doc // 8, 4 * 13)
  assert contiguous_block_count(np.asarray(shuffled[0]), 8)[0] == 0
  with pytest.raises(ValueError, match="layout"):
    cases.page_metadata(rng, 1, doc_tokens, own, layout="docs")


def test_visible_pairs_counts_the_causal_mask():
  page_pos = np.array([[0, 16, 32]])
  page_len = np.array([[16, 16, 5]])  # keys at positions 0..36
  q_pos = np.array([[34, 36]])
  assert cases.visible_pairs(q_pos, page_pos, page_len) == 35 + 37


def test_dense_from_pages_follows_the_page_table():
  pages = jnp.arange(2 * 4 * 2 * 3).reshape(2, 4, 2, 3)  # [K, pages, P, H]
  table = jnp.array([[2, 0], [1, 3]])
  dense = cases.dense_from_pages(pages, table)  # [B, M * P, K, H]
  assert dense.shape == (2, 4, 2, 3)
  np.testing.assert_array_equal(dense[0, :2, 1], pages[1, 2])
  np.testing.assert_array_equal(dense[1, 2:, 0], pages[0, 3])


def test_chain_timer_times_a_chain_and_perturbs_every_call():
  q = jnp.ones((4, 8), jnp.float32)
  timer = ChainTimer(lambda q: q * 2.0, [(q,)], perturb_query,
                     target_total_s=0.001)
  assert timer.steps >= 3 and timer.sample() > 0
  lazy_args = (q, None, None, None, None, None, None,
               jnp.zeros((4, 1), jnp.int32))
  out = perturb_lazy(lazy_args, jnp.float32(0))
  np.testing.assert_array_equal(out[0], q)
  np.testing.assert_array_equal(out[7], lazy_args[7])


def test_chain_timer_takes_a_row_of_several_outputs():
  # mgpu_prefill_check's cudnn-split row returns its two calls' outputs
  # (it failed on `.astype` of a tuple): one is summed, the other is read
  # once, so a custom call that makes it stays in the timed program.
  q = jnp.ones((4, 8), jnp.float32)
  timer = ChainTimer(lambda q: (q * 2.0, q * 3.0), [(q,)], perturb_query,
                     target_total_s=0.001)
  assert timer.sample() > 0


def test_perturb_none_adds_no_pass_over_the_query():
  """perturb_query's step adds zero to all of q (a pass of its own before
  a custom call); perturb_none's does not, and its chain still times."""
  q = jnp.ones((4, 8), jnp.float32)

  def adds_on_q(perturb):
    timer = ChainTimer(lambda q: q * 2.0, [(q,)], perturb,
                       target_total_s=0.001)
    assert timer.sample() > 0
    hlo = timer.step.lower(timer.zero, timer.arg_sets).as_text()
    return sum("stablehlo.add" in line and line.endswith(": tensor<4x8xf32>")
               for line in hlo.splitlines())

  assert perturb_none((q,), jnp.float32(0))[0] is q
  assert adds_on_q(perturb_query) == 1
  assert adds_on_q(perturb_none) == 0


def test_perturb_positions_orders_the_chain_through_q_pos_alone():
  """perturb_positions leaves q as it is (no pass over it before a kernel
  that rotates q itself) and makes q_pos depend on the run-time zero."""
  q = jnp.ones((4, 8), jnp.float32)
  q_pos = jnp.arange(4, dtype=jnp.int32)[:, None]
  lazy_args = (q, None, None, None, None, None, None, q_pos)
  out = perturb_positions(lazy_args, jnp.float32(0))
  assert out[0] is q and out[1:7] == lazy_args[1:7]
  np.testing.assert_array_equal(out[7], q_pos)
  jaxpr = jax.make_jaxpr(lambda z: perturb_positions(lazy_args, z)[7])(
      jnp.float32(0))
  assert any(e.primitive.name == "add" for e in jaxpr.jaxpr.eqns)
  # A zero above 1e30 (never at run time) would move every position.
  moved = perturb_positions(lazy_args, jnp.float32(2e30))[7]
  np.testing.assert_array_equal(moved, q_pos + 1)


def test_chain_timer_settles_before_a_sample():
  """sample(settle_s) first runs whole untimed chains for at least
  settle_s, then its `steps` timed steps; sample() runs only the timed
  ones."""
  q = jnp.ones((4, 8), jnp.float32)
  timer = ChainTimer(lambda q: q * 2.0, [(q,)], perturb_query,
                     target_total_s=0.001)
  step, calls = timer.step, []

  def counted(*args):
    calls.append(1)
    return step(*args)

  timer.step = counted
  timer.sample()
  assert len(calls) == timer.steps
  calls.clear()
  start = time.perf_counter()
  timer.sample(settle_s=0.05)
  assert time.perf_counter() - start >= 0.05
  assert len(calls) >= 2 * timer.steps and len(calls) % timer.steps == 0


def test_per_call_and_paired_timings_settle_every_sample(sample_settles):
  """time_per_call and time_pair settle each sample for SETTLE_S (each
  call timed at its own clock under a power cap)."""
  settles = sample_settles
  q = jnp.ones((4, 8), jnp.float32)
  assert time_per_call(lambda q: q * 2.0, [(q,)], perturb_query,
                       repeats=3) > 0
  assert settles == [SETTLE_S] * 3
  settles.clear()
  a, b = time_pair(lambda q: q * 2.0, [(q,)], lambda q: q + 1.0, [(q,)],
                   perturb_query, rounds=2)
  assert a > 0 and b > 0 and settles == [SETTLE_S] * 4


def test_report_judges_the_prefill_bar_at_the_whole_call(capsys):
  results = [
      Result("prefill", "chunk512", "cudnn", 1.0, flops=1e12),
      Result("prefill", "chunk512", "lazy[v]", 2.0, flops=1e12),
      Result("prefill", "chunk512", "lazy-mosaic", 1.0 / 0.95, flops=1e12),
      Result("prefill", "chunk512", "lazy-mosaic per-layer", 1.0 / 0.85,
             flops=1e12),
  ]
  report(results, [], [("chunk512", 4, 512, 8192)], None, "v")
  text = capsys.readouterr().out
  assert "lazy-mosaic prefill >= 0.9x cuDNN TFLOP/s at chunk512 (issue 16): " \
         "PASS (0.950x" in text
  assert "lazy-mosaic per-layer prefill >= 0.9x cuDNN TFLOP/s at chunk512 " \
         "(issue 16): MISS (0.850x" in text
  assert "lazy[v] prefill >= 0.9x" in text and "MISS (0.500x" in text
  # A prefill-only run judges no decode bar: rows that did not run are no
  # MISS, and the prefill tile candidates ("lazy-mosaic[...]") are no
  # decode variants.
  assert "shift-0" not in text and "TB/s" not in text
  assert "paged_attention" not in text


def test_report_judges_the_mosaic_decode_without_the_triton_rows(capsys):
  results = [
      Result("decode", "B64/ctx8192", "lazy-mosaic[d]", 1.0, bytes=4.2e12),
      Result("decode", "B64/ctx8192", "lazy-mosaic-shift0[d]", 0.99,
             bytes=4.2e12),
      Result("prefill", "chunk512", "lazy-mosaic[k64]", 1.0, flops=1e12),
  ]
  report(results, [(64, 8192)], [], None, None)
  text = capsys.readouterr().out
  assert "lazy-mosaic[d] / shift-0 time <= 1.02 at every decode shape: " \
         "PASS (worst 1.010)" in text
  assert "lazy-mosaic[d] >= 4.1 TB/s at B64/ctx8192: PASS (4.20" in text
  assert "k64" not in text and "MISS" not in text


def test_report_says_a_triton_decode_that_failed_everywhere_missed(capsys):
  # Every variant failed at the tuning shapes, so none was chosen: that is
  # a MISS, not a section that did not run.
  results = [Result("decode", "B64/ctx8192", f"tune:lazy[{v}]", None,
                    bytes=1e9) for v in ("a", "b")]
  report(results, [(64, 8192)], [], None, None)
  text = capsys.readouterr().out
  assert "lazy / shift-0 time <= 1.05: MISS (not measured" in text
  assert ">= 2.5 TB/s KV read at B64/ctx8192: MISS (not measured)" in text


def test_planned_float8_sets_plan_with_the_float8_default_tiles():
  # With block sizes None the plan took the 16-bit default (one step per
  # block) while the float8 kernel takes segment steps: the per-layer
  # float8 row of the "default" variant failed on the plan check.
  from benchmarks import kernel_cases
  _, _, _, _, lazy_sets, _ = kernel_cases.decode_inputs(
      jax.random.PRNGKey(0), np.random.default_rng(0), 2, 512)
  for sets in (lazy_sets, kernel_cases.fp8_sets(lazy_sets)):
    planned = kernel_cases.decode_planned_sets(sets[:1], None)
    # Past the plan's check, to the GPU kernel this CPU cannot run.
    with pytest.raises(ValueError, match="interpret mode"):
      kernel_cases.decode_planned(*planned[0], block_sizes=None)
