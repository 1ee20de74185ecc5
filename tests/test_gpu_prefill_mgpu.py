"""Lazy prefill on Hopper through Pallas Mosaic GPU (gpu_prefill_mgpu*.py).

On CPU: the kernel is lowered for CUDA with jax.export (the Pallas Mosaic GPU
lowering runs here and catches layout, shape and shared-memory errors), run
in the Mosaic GPU interpreter on small cases (ring, barriers, TMA page
copies, step records, rotation, masks and the V fix-up all execute; the two
matmuls become jnp dots), and its argument checks are tested.
On a GPU (`@pytest.mark.gpu`): parity with the jnp reference and the float64
truth on cases with ragged documents, an empty page (page_len 0), NaN in
every unused page and padding slot, padding rows (q_pos -1), shuffled
physical pages and one physical document read by two rows at different
shifts (pallas_kernels.testing.make_case), plus a benchmark-like layout.
float8 pages: test_gpu_prefill_mgpu_float8.py; the plan's step records:
test_mgpu_plan_records.py; shared helpers: mgpu_prefill_helpers.py.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import lazy_attention_reference
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes, lazy_prefill_mgpu
from pallas_kernels.testing import (contiguous_block_count, make_case,
                                    relative_error)
from tests.mgpu_prefill_helpers import (BENCH, BF16_TOLERANCE, _call, _check,
                                        _doc_layout_case, _specs, gpu_case,
                                        needs_interpreter)
from tests.rope_configs import LLAMA3, PLAIN


def _export(args, block_sizes=None):
  fn = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=block_sizes))
  return export.export(fn, platforms=["cuda"])(*args)


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


def test_interpret_without_the_interpreter_names_the_missing_module(
    monkeypatch):
  from pallas_kernels import gpu_mgpu_parts
  # None in sys.modules makes the import fail as on a jax without the module.
  monkeypatch.setitem(sys.modules,
                      "jax._src.pallas.mosaic_gpu.interpret.params", None)
  with pytest.raises(ImportError, match="mosaic_gpu.interpret"):
    gpu_mgpu_parts.interpreter_params()


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
