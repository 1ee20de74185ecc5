"""Lazy prefill on Hopper through Pallas Mosaic GPU (gpu_prefill_mgpu*.py).

On CPU: the kernel is lowered for CUDA with jax.export (the Pallas Mosaic GPU
lowering runs here and catches layout, shape and shared-memory errors), run
in the Mosaic GPU interpreter on small cases (ring, barriers, TMA page
copies, step records, rotation, masks and the V fix-up all execute; the two
matmuls become jnp dots), and its metadata and argument checks are tested.
On a GPU (`@pytest.mark.gpu`): parity with the jnp reference and the float64
truth on cases with ragged documents, an empty page (page_len 0), NaN in
every unused page and padding slot, padding rows (q_pos -1), shuffled
physical pages and one physical document read by two rows at different
shifts (pallas_kernels.testing.make_case), plus a benchmark-like layout.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import RopeConfig, lazy_attention_reference
from pallas_kernels.gpu_prefill_mgpu import (MgpuBlockSizes, RecordLayout,
                                             lazy_prefill_mgpu, step_records)
from pallas_kernels.testing import (contract_specs, contiguous_block_count,
                                    make_case, numpy_truth, relative_error)

PLAIN = RopeConfig(theta=10000.0)
LLAMA3 = RopeConfig(theta=500000.0, factor=8.0, low_freq_factor=1.0,
                    high_freq_factor=4.0, original_max_position=8192)
BF16_TOLERANCE = 2e-2


def _specs(batch, q_len, heads, kv_heads, head_dim, pages, page_size,
           logical, dtype=jnp.bfloat16):
  return contract_specs(batch=batch, q_len=q_len, num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=head_dim,
                        num_pages=pages, page_size=page_size,
                        num_logical_pages=logical, dtype=dtype)


def _export(args, block_sizes=None):
  fn = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=block_sizes))
  return export.export(fn, platforms=["cuda"])(*args)


# Benchmark shape: B 4, 512-token chunk, 8192 tokens of context in 16
# documents of 512 plus the chunk's own 32 pages, Hq/Hkv 32/8, H 128, page 16.
BENCH = dict(batch=4, q_len=512, heads=32, kv_heads=8, head_dim=128,
             pages=4 * 544, page_size=16, logical=544)


@pytest.mark.parametrize("block_sizes", [
    None,
    MgpuBlockSizes(block_kv=64, num_compute_wgs=2, num_stages=2,
                   query_in_f32=True),
    MgpuBlockSizes(block_kv=128, num_compute_wgs=1, num_stages=2),
    MgpuBlockSizes(block_kv=64, num_compute_wgs=1, num_stages=4,
                   mask_fast_path=False),
    MgpuBlockSizes(schedule_barrier=False),
    MgpuBlockSizes(query_in_registers=False),
    MgpuBlockSizes(cos_sin_in_records=False),
    MgpuBlockSizes(cos_sin_in_records=False, query_in_registers=False),
], ids=["default", "k64w2s2_f32", "k128w1s2", "k64w1s4_nofast",
        "no_sched", "query_in_smem", "cos_sin_copied",
        "cos_sin_copied_smem"])
def test_export_lowers_for_cuda_benchmark_shape(block_sizes):
  exported = _export(_specs(**BENCH), block_sizes)
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (4, 512, 32, 128)
  assert exported.out_avals[0].dtype == jnp.bfloat16


@pytest.mark.parametrize("head_dim,page_size,dtype", [
    (64, 8, jnp.bfloat16), (128, 16, jnp.float16), (64, 16, jnp.float16)])
def test_export_lowers_for_cuda_small_shape(head_dim, page_size, dtype):
  args = _specs(batch=2, q_len=7, heads=9, kv_heads=3, head_dim=head_dim,
                pages=40, page_size=page_size, logical=20, dtype=dtype)
  exported = _export(args)
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (2, 7, 9, head_dim)


# The interpreter is a private jax API; where a jax lacks it the interpreter
# parity tests are skipped (the GPU parity tests still cover the kernel).
def _has_interpreter() -> bool:
  try:
    return importlib.util.find_spec(
        "jax._src.pallas.mosaic_gpu.interpret.params") is not None
  except ImportError:
    return False


needs_interpreter = pytest.mark.skipif(
    not _has_interpreter(), reason="this jax has no Mosaic GPU interpreter")


def test_interpret_without_the_interpreter_names_the_missing_module(
    monkeypatch):
  from pallas_kernels import gpu_mgpu_parts
  # None in sys.modules makes the import fail as on a jax without the module.
  monkeypatch.setitem(sys.modules,
                      "jax._src.pallas.mosaic_gpu.interpret.params", None)
  with pytest.raises(ImportError, match="mosaic_gpu.interpret"):
    gpu_mgpu_parts.interpreter_params()


def _call(args, *, rope=PLAIN, block_sizes=None, interpret=False):
  head_dim = args[0].shape[-1]
  return lazy_prefill_mgpu(*[jnp.asarray(a) for a in args], rope=rope,
                           sm_scale=jnp.float32(head_dim ** -0.5),
                           block_sizes=block_sizes, interpret=interpret)


def test_argument_errors():
  args = _specs(batch=1, q_len=4, heads=2, kv_heads=1, head_dim=128,
                pages=4, page_size=16, logical=2)
  zeros = lambda s, dtype=None: jnp.zeros(s.shape, dtype or s.dtype)
  good = [zeros(a) for a in args]
  f32 = [zeros(a, jnp.float32) if i < 3 else zeros(a)
         for i, a in enumerate(args)]
  with pytest.raises(ValueError, match="q dtype"):
    _call(f32)
  mixed = list(good)
  mixed[1] = zeros(args[1], jnp.float16)
  mixed[2] = zeros(args[2], jnp.float16)
  with pytest.raises(ValueError, match="k_pages dtype"):
    _call(mixed)
  odd = [zeros(a) for a in _specs(batch=1, q_len=4, heads=2, kv_heads=1,
                                  head_dim=96, pages=4, page_size=16,
                                  logical=2)]
  with pytest.raises(ValueError, match="head dim"):
    _call(odd)
  pages12 = [zeros(a) for a in _specs(batch=1, q_len=4, heads=2, kv_heads=1,
                                      head_dim=128, pages=4, page_size=12,
                                      logical=2)]
  with pytest.raises(ValueError, match="page_size"):
    _call(pages12)
  pages256 = [zeros(a) for a in _specs(batch=1, q_len=4, heads=2,
                                       kv_heads=1, head_dim=128, pages=4,
                                       page_size=256, logical=2)]
  with pytest.raises(ValueError, match="page_size"):
    _call(pages256)  # 256-slot pages do not divide block_kv = 128
  pages128 = [zeros(a) for a in _specs(batch=1, q_len=4, heads=2,
                                       kv_heads=1, head_dim=128, pages=4,
                                       page_size=128, logical=2)]
  with pytest.raises(ValueError, match="page_size"):
    _call(pages128, block_sizes=MgpuBlockSizes(block_kv=64))
  with pytest.raises(ValueError, match="shared memory"):
    _call(good, block_sizes=MgpuBlockSizes(block_kv=128, num_compute_wgs=2,
                                           num_stages=3))
  with pytest.raises(ValueError, match="shared memory"):  # f32 query
    _call(good, block_sizes=MgpuBlockSizes(query_in_f32=True))
  with pytest.raises(ValueError, match="q_pos"):
    _call(good[:-1] + [jnp.zeros((1, 3), jnp.int32)])
  with pytest.raises(ValueError, match="block_kv"):
    MgpuBlockSizes(block_kv=32)
  with pytest.raises(ValueError, match="num_compute_wgs"):
    MgpuBlockSizes(num_compute_wgs=3)
  with pytest.raises(ValueError, match="num_stages"):
    MgpuBlockSizes(num_stages=1)


def test_step_records():
  # Pages (ppb = 2): [0, 3) shift 5, page 3 dead, [4, 7) shift 0 with page 6
  # half full; page 7 dead.
  page_shift = jnp.array([[5, 5, 5, 5, 0, 0, 0, 0]], jnp.int32)
  live = jnp.array([[1, 1, 1, 0, 1, 1, 1, 0]], bool)
  page_len = jnp.array([[4, 4, 4, 4, 4, 4, 2, 4]], jnp.int32)
  page_pos = jnp.arange(8, dtype=jnp.int32)[None] * 4
  page_table = jnp.array([[7, 6, 5, 4, 3, 2, 1, 0]], jnp.int32)
  records, num_steps, step_first, shift = jax.jit(functools_partial())(
      page_table, page_pos, page_shift, page_len, live)
  layout = RecordLayout(2)
  records = np.asarray(records[0])
  # Segment 0 = pages [0, 4) (dead page 3 ends it): blocks 0, 1.
  # Segment 1 = pages [4, 7): blocks 2, 3.
  assert int(num_steps[0]) == 4
  assert np.asarray(step_first[0, :5]).tolist() == [0, 2, 4, 6, 2**31 - 1]
  assert np.asarray(shift[0, :2]).tolist() == [5, 0]
  lim = records[:4, layout.lim:layout.lim + 2].tolist()
  assert lim == [[4, 4], [4, 0], [4, 4], [2, 0]]
  assert records[:4, layout.phys:layout.phys + 2].tolist() == [
      [7, 6], [5, 4], [3, 2], [1, 0]]
  assert records[:4, layout.seg].tolist() == [0, 0, 1, 1]
  assert records[:4, layout.new_seg].tolist() == [1, 0, 1, 0]
  assert records[:4, layout.fixup].tolist() == [0, 1, 0, 1]
  assert records[:4, layout.max_pos].tolist() == [7, 11, 23, 25]
  assert layout.width % 32 == 0


def functools_partial():
  def fn(*args):
    return step_records(*args, num_pages=8, page_size=4, pages_per_block=2)
  return fn


def _check(out, lazy, rope):
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  assert out.shape == lazy.q.shape
  assert not np.isnan(out).any(), "NaN leaked into the output"
  reference = np.asarray(lazy_attention_reference(
      *[jnp.asarray(a) for a in lazy.args()], rope=rope).astype(jnp.float32))
  err_ref = relative_error(out, reference.astype(np.float64))
  assert err_ref <= BF16_TOLERANCE, f"vs reference: {err_ref:.3g}"
  if lazy.q.size <= 4096 * 64:
    err_truth = relative_error(out, numpy_truth(lazy, rope))
    assert err_truth <= BF16_TOLERANCE, f"vs float64 truth: {err_truth:.3g}"
  padding = lazy.q_pos < 0
  if padding.any():
    assert np.all(out[padding] == 0.0), "padding rows must be exactly zero"


@needs_interpreter
def test_parity_interpret():
  """Whole kernel in the Mosaic GPU interpreter (CPU), two warpgroups."""
  rng = np.random.default_rng(0)
  lazy = make_case(rng, batch=2, q_len=7, num_heads=8, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16)
  _check(_call(lazy.args(), interpret=True), lazy, PLAIN)


@needs_interpreter
@pytest.mark.parametrize("num_compute_wgs", [
    1, pytest.param(2, marks=pytest.mark.slow)])
def test_parity_interpret_contiguous_pages(num_compute_wgs):
  """Pages in allocation order: most 4-page steps have consecutive ids and
  take one TMA copy per block; the steps across the empty page and at the
  rows' ends do not and copy page by page, in the same call."""
  lazy = make_case(np.random.default_rng(5), batch=2, q_len=20, num_heads=2,
                   num_kv_heads=1, head_dim=64, page_size=16,
                   dtype=jnp.bfloat16, max_doc_len=150, shuffle_pages=False)
  merged, blocks = contiguous_block_count(lazy.page_table, 4)
  assert 0 < merged < blocks, (merged, blocks)
  sizes = MgpuBlockSizes(block_kv=64, num_compute_wgs=num_compute_wgs)
  assert sizes.copy_contiguous_blocks
  _check(_call(lazy.args(), interpret=True, block_sizes=sizes), lazy, PLAIN)


def _doc_layout_case(rng, *, num_docs, doc_len, q_len, num_heads, num_kv_heads,
                     head_dim, page_size, dtype=jnp.bfloat16):
  """Benchmark-like layout: whole-page documents stored from angle 0 at
  shift = their start, then the chunk's own pages; shuffled physical pages.
  Most KV steps take the fast path (full pages, fully visible)."""
  from pallas_kernels.testing import LazyCase
  doc_pages = doc_len // page_size
  own_pages = -(-q_len // page_size)
  pages = num_docs * doc_pages + own_pages
  page = np.arange(pages)
  page_pos = (page * page_size)[None].astype(np.int32)
  page_shift = np.where(page < num_docs * doc_pages,
                        page * page_size // doc_len * doc_len, 0)
  page_len = np.full((1, pages), page_size, np.int32)
  page_len[0, -1] = q_len - (own_pages - 1) * page_size
  table = rng.permutation(pages).astype(np.int32)[None]
  shape = (num_kv_heads, pages, page_size, head_dim)
  k = rng.standard_normal(shape).astype(np.float32)
  v = rng.standard_normal(shape).astype(np.float32)
  tail = table[0, -1]
  k[:, tail, page_len[0, -1]:] = np.nan  # padding slots of the last page
  v[:, tail, page_len[0, -1]:] = np.nan
  q = rng.standard_normal((1, q_len, num_heads, head_dim)).astype(np.float32)
  q_pos = (num_docs * doc_len + np.arange(q_len, dtype=np.int32))[None]
  return LazyCase(q.astype(dtype), k.astype(dtype), v.astype(dtype), table,
                  page_pos, page_shift[None].astype(np.int32), page_len,
                  q_pos)


@pytest.mark.slow
@needs_interpreter
def test_parity_interpret_fast_path():
  """Documents in whole pages: unmasked steps (lax.cond fast path)."""
  lazy = _doc_layout_case(np.random.default_rng(2), num_docs=2, doc_len=128,
                          q_len=20, num_heads=4, num_kv_heads=1, head_dim=64,
                          page_size=16)
  _check(_call(lazy.args(), rope=LLAMA3, interpret=True), lazy, LLAMA3)
  # The f32 query (one rounding per segment) with 64-key steps.
  f32_query = MgpuBlockSizes(block_kv=64, query_in_f32=True)
  _check(_call(lazy.args(), rope=LLAMA3, interpret=True,
               block_sizes=f32_query), lazy, LLAMA3)


@needs_interpreter
@pytest.mark.parametrize(
    "schedule_barrier,query_in_registers,cos_sin_in_records", [
        pytest.param(False, True, False, marks=pytest.mark.slow),
        pytest.param(True, False, False, marks=pytest.mark.slow),
        (True, True, False), (True, True, True),
        pytest.param(True, False, True, marks=pytest.mark.slow)])
def test_parity_interpret_segments_of_several_steps(schedule_barrier,
                                                    query_in_registers,
                                                    cos_sin_in_records):
  """Documents of three 64-key steps (the query is rotated ahead, during
  the P V product of the step before a segment's first); a half-full page
  in the middle of document 1 (NaN in its unused slots); group 1 puts two
  token blocks in one CTA, one of them with padding rows.  With
  cos_sin_in_records each segment's rotation reads its cos / sin from the
  step's record."""
  lazy = _doc_layout_case(np.random.default_rng(5), num_docs=2, doc_len=192,
                          q_len=70, num_heads=2, num_kv_heads=2, head_dim=64,
                          page_size=16)
  page = 12 + 5  # a page in the middle of document 1
  lazy.page_len[0, page] = 9
  for pages in (lazy.k_pages, lazy.v_pages):
    pages[:, lazy.page_table[0, page], 9:] = np.nan
  sizes = MgpuBlockSizes(block_kv=64, schedule_barrier=schedule_barrier,
                         query_in_registers=query_in_registers,
                         cos_sin_in_records=cos_sin_in_records)
  _check(_call(lazy.args(), rope=LLAMA3, interpret=True, block_sizes=sizes),
         lazy, LLAMA3)


@pytest.mark.slow
@needs_interpreter
def test_parity_interpret_one_warpgroup_page8():
  """One warpgroup, 8-slot pages (16 pages per 128-key block, segments
  straddle blocks), H 128, two row tiles."""
  rng = np.random.default_rng(1)
  lazy = make_case(rng, batch=2, q_len=40, num_heads=8, num_kv_heads=2,
                   head_dim=128, page_size=8, dtype=jnp.bfloat16,
                   base_position=60000)
  out = _call(lazy.args(), rope=LLAMA3, interpret=True,
              block_sizes=MgpuBlockSizes(num_compute_wgs=1, num_stages=2))
  _check(out, lazy, LLAMA3)


@pytest.mark.slow
@needs_interpreter
def test_parity_interpret_odd_group_pads_a_token_block():
  """Hq/Hkv 9/3 with two warpgroups: 3 (token block, head) units do not
  split over 2 warpgroups, so T is padded by a whole extra block whose
  unit must neither write into the output nor disturb the others."""
  from pallas_kernels.gpu_prefill_mgpu import padded_query_len
  assert padded_query_len(7, 3, 2) == 128
  rng = np.random.default_rng(3)
  lazy = make_case(rng, batch=1, q_len=7, num_heads=9, num_kv_heads=3,
                   head_dim=64, page_size=8, dtype=jnp.bfloat16)
  _check(_call(lazy.args(), interpret=True), lazy, PLAIN)


@needs_interpreter
def test_parity_interpret_mha_and_page_offset():
  """Hq = Hkv (group 1): the two warpgroups of a CTA take two different
  token blocks.  The same plan, run with page_offset into a pool that holds
  the case's pages after garbage pages, gives the same result."""
  from pallas_kernels.gpu_prefill_mgpu import (lazy_prefill_mgpu_planned,
                                               plan_prefill)
  rng = np.random.default_rng(4)
  lazy = make_case(rng, batch=1, q_len=70, num_heads=2, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=2, max_doc_len=60)
  args = [jnp.asarray(a) for a in lazy.args()]
  q, k_pages, v_pages, table, pos, shift, length, q_pos = args
  num_pages = k_pages.shape[1]
  plan = plan_prefill(table, pos, shift, length, q_pos, rope=PLAIN, group=1,
                      head_dim=64, num_pages=num_pages, page_size=16)
  offset = 5
  garbage = jnp.full((2, offset) + k_pages.shape[2:], jnp.nan, k_pages.dtype)
  shifted = lambda pages: jnp.concatenate([garbage, pages], axis=1)
  out = lazy_prefill_mgpu_planned(
      q, shifted(k_pages), shifted(v_pages), q_pos, plan, rope=PLAIN,
      sm_scale=jnp.float32(64 ** -0.5), page_offset=jnp.int32(offset),
      interpret=True)
  _check(out, lazy, PLAIN)


@pytest.mark.parametrize("num_compute_wgs,cos_sin_in_records",
                         [(1, False), (2, False), (2, True)])
def test_float8_export_lowers_for_cuda(num_compute_wgs, cos_sin_in_records):
  """float8 pages: a converter warpgroup widens the e4m3 ring (four
  warpgroups with the ping-pong's two compute warpgroups)."""
  specs = list(_specs(**BENCH))
  pages = jax.ShapeDtypeStruct(specs[1].shape, jnp.float8_e4m3fn)
  scales = jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32)
  sizes = MgpuBlockSizes(num_compute_wgs=num_compute_wgs,
                         cos_sin_in_records=cos_sin_in_records)
  fn = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=sizes,
      k_scales=a[8], v_scales=a[9]))
  exported = export.export(fn, platforms=["cuda"])(
      specs[0], pages, pages, *specs[3:], scales, scales)
  assert exported.out_avals[0].dtype == jnp.bfloat16


@needs_interpreter
@pytest.mark.parametrize("num_compute_wgs,cos_sin_in_records", [
    # The default: each record carries its cos / sin.  Slow for CI time:
    # float8 pages are opt-in; their lowering for cuda is checked in the
    # fast tier above, their parity on the GPU (test_parity_gpu_float8).
    pytest.param(1, True, marks=pytest.mark.slow),
    pytest.param(1, False, marks=pytest.mark.slow),  # a cos / sin ring
    # Four warpgroups: the interpreter runs each in a host computation whose
    # barrier waits block a thread of XLA's CPU pool (one per core); with
    # two cores, two blocked waits starve the other two warpgroups and the
    # run hangs.  Runs where there are cores enough (the GPU machine).
    pytest.param(2, False, marks=pytest.mark.skipif(
        (os.cpu_count() or 1) < 4,
        reason="the Mosaic GPU interpreter needs >= 4 cores for 4 "
        "warpgroups"))])
def test_parity_interpret_float8(num_compute_wgs, cos_sin_in_records):
  """float8 pages with NaN in unused slots and NaN scales on unused pages;
  bf16 queries on f16 operands; V values tiny (scales down to 2^-27) and
  2^6 apart between pages, so P times a V scale would leave f16's normal
  range without acc's V-scale unit.  Two warpgroups: the ping-pong with a
  16-bit K / V tile both read."""
  from pallas_kernels.testing import quantize_case
  from tests.test_gpu_decode_mgpu import _check_float8
  rng = np.random.default_rng(3)
  lazy = make_case(rng, batch=1, q_len=7, num_heads=8, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16,
                   max_doc_len=100)
  v = np.asarray(lazy.v_pages, np.float32) * 2.0**-20
  v[:, 1::3] *= 2.0**6
  lazy = dataclasses.replace(lazy, v_pages=v.astype(lazy.v_pages.dtype))
  fp8, k_scales, v_scales = quantize_case(lazy)
  assert np.isnan(np.asarray(k_scales)).any(), "no NaN scale to skip"
  out = lazy_prefill_mgpu(
      *[jnp.asarray(a) for a in fp8.args()], rope=LLAMA3,
      sm_scale=jnp.float32(64 ** -0.5), interpret=True, k_scales=k_scales,
      v_scales=v_scales,
      block_sizes=MgpuBlockSizes(num_compute_wgs=num_compute_wgs,
                                 cos_sin_in_records=cos_sin_in_records))
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


def test_float8_argument_errors():
  """Scales without float8 pages (and the reverse), and float32 query
  storage with float8 pages, are refused before any work."""
  rng = np.random.default_rng(4)
  lazy = make_case(rng, batch=1, q_len=3, num_heads=2, num_kv_heads=1,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16)
  from pallas_kernels.testing import quantize_case
  fp8, k_scales, v_scales = quantize_case(lazy)
  args = [jnp.asarray(a) for a in fp8.args()]
  call = functools.partial(lazy_prefill_mgpu, rope=PLAIN,
                           sm_scale=jnp.float32(0.125))
  with pytest.raises(ValueError, match="float8_e4m3fn pages need k_scales"):
    call(*args)
  with pytest.raises(ValueError, match="16-bit query storage"):
    call(*args, k_scales=k_scales, v_scales=v_scales,
         block_sizes=MgpuBlockSizes(query_in_f32=True))
  plain = [jnp.asarray(a) for a in lazy.args()]
  with pytest.raises(ValueError, match="k_scales"):
    call(*plain, k_scales=k_scales, v_scales=v_scales)


def test_plan_units_and_steps():
  """Plan of a 100-token chunk after 160 tokens of context, group 4, two
  warpgroups: 2 token blocks x 4 heads = 8 units = 4 CTAs, and the CTAs of
  token block 0 skip the pages only block 1 can see."""
  from pallas_kernels.gpu_prefill_mgpu import plan_prefill
  pages, page_size = 17, 16  # 10 context pages + 7 for the chunk
  page_pos = jnp.arange(pages, dtype=jnp.int32)[None] * page_size
  page_len = jnp.full((1, pages), page_size, jnp.int32).at[0, 16].set(4)
  zeros = jnp.zeros((1, pages), jnp.int32)
  q_pos = (160 + jnp.arange(100, dtype=jnp.int32))[None]
  plan = plan_prefill(jnp.arange(pages, dtype=jnp.int32)[None], page_pos,
                      zeros, page_len, q_pos, rope=PLAIN, group=4,
                      head_dim=64, num_pages=pages, page_size=page_size,
                      block_sizes=MgpuBlockSizes(block_kv=64))
  assert plan.row_pos.shape == (1, 128)
  assert np.asarray(plan.row_pos[0, :100]).tolist() == list(range(160, 260))
  assert np.all(np.asarray(plan.row_pos[0, 100:]) == -(2**31))
  # Block 1 holds padding rows: its oldest row is the padding sentinel, so
  # every one of its steps goes through the mask.
  assert np.asarray(plan.min_row).tolist() == [[160, -(2**31)]]
  # One segment, 4 pages a step.  Block 0 (160..223) sees pages 0..13:
  # steps starting at pages 0, 4, 8, 12.  Block 1 sees page 16 too.
  assert np.asarray(plan.n_steps).tolist() == [[4, 4, 5, 5]]


def test_plan_records_carry_cos_sin():
  """cos_sin_in_records: each record is the copied form's, then its
  segment's cos and sin (f32 bits, those the copied form's plan holds per
  segment); a kernel given a plan of the other width refuses it; shared
  memory grows by the wider record ring."""
  from pallas_kernels.gpu_block_sizes import smem_bytes
  from pallas_kernels.gpu_prefill_mgpu import (mgpu_prefill_kernel,
                                               plan_prefill)
  pages, page_size, head_dim = 12, 16, 64
  page_pos = jnp.arange(pages, dtype=jnp.int32)[None] * page_size
  # Three documents of 4 pages at their own shifts.
  shift = jnp.asarray([[700] * 4 + [90000] * 4 + [0] * 4], jnp.int32)
  page_len = jnp.full((1, pages), page_size, jnp.int32)
  q_pos = (pages * page_size + jnp.arange(8, dtype=jnp.int32))[None]
  make = lambda sizes: plan_prefill(
      jnp.arange(pages, dtype=jnp.int32)[None], page_pos, shift, page_len,
      q_pos, rope=LLAMA3, group=1, head_dim=head_dim, num_pages=pages,
      page_size=page_size, block_sizes=sizes)
  plain = make(MgpuBlockSizes(block_kv=64, cos_sin_in_records=False))
  sizes = MgpuBlockSizes(block_kv=64, cos_sin_in_records=True)
  carried = make(sizes)
  layout = RecordLayout(4, cos_sin_dim=head_dim)
  records = np.asarray(carried.records)
  assert records.shape[-1] == layout.width == 32 + 64
  np.testing.assert_array_equal(records[..., :layout.cos_sin],
                                np.asarray(plain.records))
  cos_sin = records[..., layout.cos_sin:layout.cos_sin + head_dim].view(
      np.float32).reshape(*records.shape[:2], 2, head_dim // 2)
  steps = int(np.max(np.asarray(carried.n_steps)))
  assert steps == 3
  segs = records[0, :steps, layout.seg]
  assert segs.tolist() == [0, 1, 2]
  np.testing.assert_array_equal(
      cos_sin[0, :steps], np.asarray(plain.cos_sin)[0, segs])
  assert carried.cos_sin.shape == (1, pages, 2, 0)  # none beside them
  assert not np.allclose(cos_sin[0, 0], cos_sin[0, 1])
  # A plan made for other block sizes: refused before any work.
  q = jnp.zeros((1, 64, 2, head_dim), jnp.bfloat16)
  kv = jnp.zeros((2, pages, page_size, head_dim), jnp.bfloat16)
  with pytest.raises(ValueError, match="make the plan with the kernel's"):
    mgpu_prefill_kernel(q, kv, kv, plain, out_dtype=jnp.bfloat16,
                        block_sizes=sizes, interpret=True)
  wider = smem_bytes(MgpuBlockSizes(cos_sin_in_records=True), 128)
  narrower = smem_bytes(MgpuBlockSizes(cos_sin_in_records=False), 128)
  assert wider - narrower == 2 * 2 * 128 * 4


GPU_CASES = [
    # (heads, head_dim, page_size, q_len, base_position, rope, block sizes)
    ((32, 8), 128, 16, 64, 0, PLAIN, None),
    ((32, 8), 128, 16, 200, 2**20, LLAMA3, None),
    ((9, 3), 64, 8, 37, 60000, PLAIN, None),
    ((8, 8), 128, 16, 130, 0, LLAMA3,
     MgpuBlockSizes(block_kv=128, num_compute_wgs=1, num_stages=2)),
    ((32, 8), 128, 16, 64, 5000, PLAIN,
     MgpuBlockSizes(block_kv=64, num_compute_wgs=1, num_stages=4,
                    mask_fast_path=False, query_in_f32=True)),
    ((32, 8), 128, 16, 200, 2**20, LLAMA3,
     MgpuBlockSizes(block_kv=64, query_in_f32=True)),
    # The two warpgroups without the ping-pong (the default has it); with
    # group 1 they run different token blocks.
    ((32, 8), 128, 16, 200, 2**20, LLAMA3,
     MgpuBlockSizes(schedule_barrier=False)),
    ((8, 8), 128, 16, 130, 0, LLAMA3, MgpuBlockSizes(schedule_barrier=False)),
    # The producer copies each step's cos / sin apart from its record (the
    # default carries them in the record).
    ((32, 8), 128, 16, 200, 2**20, LLAMA3,
     MgpuBlockSizes(cos_sin_in_records=False)),
    ((8, 8), 128, 16, 130, 0, LLAMA3,
     MgpuBlockSizes(cos_sin_in_records=False, query_in_registers=False)),
]


def gpu_case(case):
  """(lazy case, rope) of a GPU_CASES-shaped entry: three rows of four
  documents each, bf16."""
  heads, head_dim, page_size, q_len, base, rope, _ = case
  rng = np.random.default_rng(q_len + head_dim)
  lazy = make_case(rng, batch=3, q_len=q_len, num_heads=heads[0],
                   num_kv_heads=heads[1], head_dim=head_dim,
                   page_size=page_size, dtype=jnp.bfloat16,
                   docs_per_row=4, max_doc_len=300, base_position=base)
  return lazy, rope


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: (
    f"{c[0][0]}-{c[0][1]}_H{c[1]}_p{c[2]}_T{c[3]}_base{c[4]}_{c[6]}"))
def test_parity_gpu(case):
  lazy, rope = gpu_case(case)
  head_dim, block_sizes = case[1], case[-1]
  out = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a, rope=rope, sm_scale=jnp.float32(head_dim ** -0.5),
      block_sizes=block_sizes))(*[jnp.asarray(a) for a in lazy.args()])
  _check(out, lazy, rope)


@pytest.mark.gpu
@pytest.mark.parametrize("num_compute_wgs,cos_sin_in_records",
                         [(1, False), (2, False), (2, True)])
def test_parity_gpu_float8(num_compute_wgs, cos_sin_in_records):
  """float8 pages on the GPU: documents at shifts near 2^20, NaN in unused
  slots and NaN scales on unused pages, one and two compute warpgroups
  (and cos / sin read from the step records)."""
  from pallas_kernels.testing import quantize_case
  from tests.test_gpu_decode_mgpu import _check_float8
  rng = np.random.default_rng(11)
  lazy = make_case(rng, batch=3, q_len=200, num_heads=32, num_kv_heads=8,
                   head_dim=128, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=4, max_doc_len=300, base_position=2**20)
  fp8, k_scales, v_scales = quantize_case(lazy)
  sizes = MgpuBlockSizes(num_compute_wgs=num_compute_wgs,
                         cos_sin_in_records=cos_sin_in_records)
  out = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=sizes, k_scales=a[8], v_scales=a[9]))(
          *[jnp.asarray(a) for a in fp8.args()], k_scales, v_scales)
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


@pytest.mark.gpu
@pytest.mark.parametrize("float8", [False, True], ids=["bf16", "float8"])
def test_parity_gpu_contiguous_pages(float8):
  """Pages in allocation order: whole-block TMA copies (into the swizzled
  ring slot) beside page-by-page ones in one call; 16-bit and float8."""
  from tests.test_gpu_decode_mgpu import check_call_on_pages
  lazy = make_case(np.random.default_rng(13), batch=3, q_len=200,
                   num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                   dtype=jnp.bfloat16, docs_per_row=4, max_doc_len=300,
                   base_position=2**20, shuffle_pages=False)
  merged, blocks = contiguous_block_count(lazy.page_table, 8)
  assert 0 < merged < blocks, (merged, blocks)
  call = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      k_scales=a[8] if float8 else None, v_scales=a[9] if float8 else None))
  check_call_on_pages(call, lazy, LLAMA3, float8=float8)


@pytest.mark.gpu
def test_lazy_attention_float8_prefill_runs_mosaic_with_a_plan_gpu():
  """The model's path on float8 pages: `plan_lazy_attention` once, then
  `lazy_attention` with the plan (the Mosaic kernel on Hopper)."""
  from pallas_kernels import lazy_attention
  from pallas_kernels.lazy_attention import plan_lazy_attention
  from pallas_kernels.testing import quantize_case
  from tests.test_gpu_decode_mgpu import _check_float8
  rng = np.random.default_rng(12)
  lazy = make_case(rng, batch=2, q_len=130, num_heads=32, num_kv_heads=8,
                   head_dim=128, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=3, max_doc_len=200, base_position=2**20)
  fp8, k_scales, v_scales = quantize_case(lazy)

  def attend(*a):
    plan = plan_lazy_attention(a[0], a[1], *a[3:8], rope=LLAMA3, impl="gpu")
    assert plan is not None, "float8 prefill must take the Mosaic kernel"
    return lazy_attention(*a[:8], rope=LLAMA3, impl="gpu", plan=plan,
                          sm_scale=jnp.float32(128 ** -0.5),
                          k_scales=a[8], v_scales=a[9])

  out = jax.jit(attend)(*[jnp.asarray(a) for a in fp8.args()], k_scales,
                        v_scales)
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["pages", "documents"])
def test_benchmark_layout_gpu(layout):
  """Documents of 512 at their own shifts + the chunk's own pages, like the
  benchmark (smaller batch and context), each page shuffled and each
  document's pages consecutive."""
  from benchmarks.mgpu_prefill_cases import build_inputs
  args = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0),
                      batch=2, q_len=256, context=2048, layout=layout)
  lazy_args = args[:8]
  out = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5)))(*lazy_args)
  reference = lazy_attention_reference(*lazy_args, rope=LLAMA3,
                                       sm_scale=128 ** -0.5)
  out = np.asarray(out.astype(jnp.float32))
  reference = np.asarray(reference.astype(jnp.float32)).astype(np.float64)
  assert not np.isnan(out).any()
  assert relative_error(out, reference) <= BF16_TOLERANCE


def test_lazy_attention_picks_the_prefill_kernel():
  """impl="gpu" prefill: Mosaic (Hopper) for the 16-bit shapes it handles;
  Triton for float32, page sizes it cannot tile, and interpret mode.  On this
  CPU-only machine there is no local GPU, so lowering targets Hopper."""
  from pallas_kernels.lazy_attention import _gpu_prefill_kernel
  q16 = jnp.zeros((1, 8, 4, 128), jnp.bfloat16)
  pages16 = jnp.zeros((1, 4, 16, 128), jnp.bfloat16)
  assert _gpu_prefill_kernel(q16, pages16, interpret=False) == "mosaic"
  assert _gpu_prefill_kernel(q16, pages16, interpret=True) == "triton"
  q32, pages32 = q16.astype(jnp.float32), pages16.astype(jnp.float32)
  assert _gpu_prefill_kernel(q32, pages32, interpret=False) == "triton"
  pages12 = jnp.zeros((1, 4, 12, 128), jnp.bfloat16)
  assert _gpu_prefill_kernel(q16, pages12, interpret=False) == "triton"
