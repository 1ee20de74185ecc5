"""Lazy decode on Hopper through Pallas Mosaic GPU (gpu_decode_mgpu*.py).

On CPU: the kernel is lowered for CUDA with jax.export (the Pallas Mosaic GPU
lowering runs here and catches layout, shape and shared-memory errors; the
export needs no disabled safety check), run in the Mosaic GPU interpreter on
small cases (ring, barriers, TMA page copies, step records, KV splits,
rotation, masks and the V fix-up all execute; the two matmuls become jnp
dots), and its plan, dispatch and argument checks are tested.  On a GPU
(`@pytest.mark.gpu`): parity with the jnp reference and the float64 truth,
mirroring tests/test_gpu_kernels.py.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import (lazy_attention, lazy_attention_reference,
                            plan_lazy_attention)
from pallas_kernels.gpu_decode_block_sizes import (MgpuDecodeBlockSizes,
                                                   mgpu_decode_kv_splits)
from pallas_kernels.gpu_decode_mgpu import (DecodePlan,
                                            default_decode_block_sizes,
                                            lazy_decode_mgpu, plan_decode)
from pallas_kernels.gpu_prefill_mgpu_plan import RecordLayout
from pallas_kernels.testing import (contract_specs, contiguous_block_count,
                                    make_case, numpy_truth, relative_error)
from tests.mgpu_prefill_helpers import (  # the same checks as prefill
    BF16_TOLERANCE, _check, _doc_layout_case, needs_interpreter)
from tests.rope_configs import LLAMA3, PLAIN


def _specs(batch, heads, kv_heads, head_dim, pages, page_size, logical,
           dtype=jnp.bfloat16):
  return contract_specs(batch=batch, q_len=1, num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=head_dim,
                        num_pages=pages, page_size=page_size,
                        num_logical_pages=logical, dtype=dtype)


def _custom_calls(exported):
  return set(re.findall(r"stablehlo.custom_call @([\w$.]+)\(",
                        exported.mlir_module()))


# (B, Hq, Hkv, H, page size, logical pages, dtype, rope, block sizes).
# Groups 1, 4, 8; H 64 and 128; pages of 8 to 64; the benchmark shape
# (B 64, 8K context, Llama-3-8B heads).
EXPORT_CASES = [
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3, None),
    (2, 8, 8, 128, 16, 20, jnp.bfloat16, PLAIN, None),
    (2, 8, 2, 64, 32, 20, jnp.float16, LLAMA3, None),
    (3, 64, 8, 128, 64, 9, jnp.bfloat16, LLAMA3, None),
    (2, 9, 3, 64, 8, 30, jnp.float16, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, num_stages=4, kv_splits=3)),
    (2, 32, 8, 128, 16, 40, jnp.bfloat16, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, num_stages=3, mask_fast_path=False)),
    # Persistent grids: the benchmark shape on the SM count, and few CTAs.
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3,
     MgpuDecodeBlockSizes(persistent=True)),
    (3, 8, 2, 64, 8, 30, jnp.float16, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, persistent=True, num_ctas=4)),
]


@pytest.mark.parametrize("case", EXPORT_CASES, ids=lambda c: (
    f"B{c[0]}_{c[1]}-{c[2]}_H{c[3]}_p{c[4]}_{jnp.dtype(c[6]).name}"
    f"_{'llama3' if c[7].factor else 'plain'}_{c[8] is not None}"))
def test_export_lowers_for_cuda(case):
  """The Mosaic GPU custom call is in jax.export's stable list: the export
  runs with every safety check on (Triton's needs one disabled)."""
  check_export(case)


def check_export(case):
  """lazy_decode_mgpu of an EXPORT_CASES-style case exports for cuda
  through the Mosaic GPU custom call alone."""
  batch, heads, kv_heads, head_dim, page_size, logical, dtype, rope, bs = case
  args = _specs(batch, heads, kv_heads, head_dim, 4 * logical, page_size,
                logical, dtype)
  fn = jax.jit(lambda *a: lazy_decode_mgpu(
      *a, rope=rope, sm_scale=jnp.float32(0.088), block_sizes=bs))
  exported = export.export(fn, platforms=["cuda"])(*args)
  assert _custom_calls(exported) == {"mosaic_gpu_v2"}
  assert exported.out_avals[0].shape == (batch, 1, heads, head_dim)
  assert exported.out_avals[0].dtype == jnp.dtype(dtype)


def test_lazy_attention_decode_exports_through_mosaic():
  """impl="gpu" decode (the dispatch, and the planned path with a traced
  page offset) exports for CUDA with no Triton call and no disabled safety
  check."""
  args = _specs(4, 32, 8, 128, 256, 16, 64)

  def planned(q, k, v, table, pos, shift, length, q_pos, offset):
    plan = plan_lazy_attention(q, k, table, pos, shift, length, q_pos,
                               rope=LLAMA3, impl="gpu")
    assert isinstance(plan, DecodePlan)
    return lazy_attention(q, k, v, table, pos, shift, length, q_pos,
                          rope=LLAMA3, impl="gpu", plan=plan,
                          page_offset=offset)

  plain = lambda *a: lazy_attention(*a, rope=LLAMA3, impl="gpu")
  offset = jax.ShapeDtypeStruct((), jnp.int32)
  for fn, fn_args in ((plain, args), (planned, (*args, offset))):
    exported = export.export(jax.jit(fn), platforms=["cuda"])(*fn_args)
    assert _custom_calls(exported) == {"mosaic_gpu_v2"}


def _call(lazy, *, rope, block_sizes, interpret):
  head_dim = lazy.q.shape[-1]
  return lazy_decode_mgpu(*[jnp.asarray(a) for a in lazy.args()], rope=rope,
                          sm_scale=jnp.float32(head_dim ** -0.5),
                          block_sizes=block_sizes, interpret=interpret)


def _ragged_case(seed, **kwargs):
  """make_case with T == 1 and its last row made a padding row."""
  lazy = make_case(np.random.default_rng(seed), q_len=1, **kwargs)
  q_pos = lazy.q_pos.copy()
  q_pos[-1] = -1
  return dataclasses.replace(lazy, q_pos=q_pos)


@needs_interpreter
# CI time: both slow.  16-bit pools decode by block steps by default
# (test_gpu_decode_blocks), float8 pools on the persistent grid
# (test_parity_interpret_float8 below, fast).
@pytest.mark.slow
@pytest.mark.parametrize("persistent", [False, True],
                         ids=["cta-per-item", "persistent"])
def test_parity_interpret_ragged(persistent):
  """Ragged documents (some shorter than a page), an empty page (page_len
  0), NaN in every unused page and padding slot, a padding row, shuffled
  physical pages, one physical document read at two shifts; two KV splits,
  so a split starts inside a segment.  Persistent: 12 work items (of 4, 3
  and 0 steps: rows of 8, 6 and 0 steps in two splits) on 3 CTAs, each
  streaming four through one K/V ring, so an item starts at an odd ring
  step."""
  lazy = _ragged_case(0, batch=3, num_heads=8, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_doc_len=150)
  live = lazy.page_len > 0
  assert (lazy.page_len[live] < 16).any(), "no document shorter than a page"
  assert ((lazy.page_len == 0) & (lazy.page_pos < lazy.q_pos)).any()
  assert np.isnan(np.asarray(lazy.k_pages, np.float32)).any()
  shared = lazy.page_table[0, 0]
  rows = np.nonzero(lazy.page_table == shared)
  assert len(set(lazy.page_shift[rows].tolist())) >= 2, "no shared document"
  bs = MgpuDecodeBlockSizes(block_kv=64, kv_splits=2, persistent=persistent,
                            num_ctas=3)
  _check(_call(lazy, rope=PLAIN, block_sizes=bs, interpret=True), lazy, PLAIN)


@needs_interpreter
@pytest.mark.parametrize("block_sizes", [
    MgpuDecodeBlockSizes(block_kv=64, kv_splits=2),
    pytest.param(MgpuDecodeBlockSizes(
        block_kv=64, steps_by_block=True, rope_in_kernel=True,
        fields_in_kernel=True), marks=pytest.mark.slow)],
    ids=["segment-steps", "block-steps-fields"])
def test_parity_interpret_contiguous_pages(block_sizes):
  """Pages in allocation order: most 4-page steps have consecutive ids (one
  TMA copy per block), the others copy page by page; with the page fields
  read in the kernel too."""
  # One kv head (G 4): half the CTAs of the cases above, for CI time.
  lazy = _ragged_case(0, batch=3, num_heads=4, num_kv_heads=1, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_doc_len=150,
                      shuffle_pages=False)
  merged, blocks = contiguous_block_count(lazy.page_table, 4)
  assert 0 < merged < blocks, (merged, blocks)
  assert block_sizes.copy_contiguous_blocks
  _check(_call(lazy, rope=PLAIN, block_sizes=block_sizes, interpret=True),
         lazy, PLAIN)


@needs_interpreter
def test_parity_interpret_whole_pages_llama3():
  """Whole-page documents at shifts up to 2^20 (unmasked fast-path steps),
  pages of 8 (8 TMA copies per step), MHA (G 1); two splits of 5 steps,
  so the second split starts at a document's second step."""
  lazy = _doc_layout_case(np.random.default_rng(1), num_docs=2, doc_len=128,
                          q_len=1, num_heads=2, num_kv_heads=2, head_dim=64,
                          page_size=8)
  base = 2**20
  lazy = dataclasses.replace(lazy, q_pos=lazy.q_pos + base, page_pos=lazy.page_pos + base,
                       page_shift=lazy.page_shift + base)
  bs = MgpuDecodeBlockSizes(block_kv=64, num_stages=3, kv_splits=2)
  _check(_call(lazy, rope=LLAMA3, block_sizes=bs, interpret=True), lazy,
         LLAMA3)


@pytest.mark.parametrize("dtype,head_dim,page_size", [
    (jnp.bfloat16, 128, 16), (jnp.float16, 64, 8)])
def test_float8_export_lowers_for_cuda(dtype, head_dim, page_size):
  """float8 pages: the ring holds e4m3, widened in the kernel."""
  specs = list(_specs(2, 32, 8, head_dim, 64, page_size, 20, dtype))
  pages = jax.ShapeDtypeStruct(specs[1].shape, jnp.float8_e4m3fn)
  scales = jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32)
  fn = jax.jit(lambda *a: lazy_attention(
      *a[:8], rope=LLAMA3, impl="gpu", k_scales=a[8], v_scales=a[9]))
  exported = export.export(fn, platforms=["cuda"])(
      specs[0], pages, pages, *specs[3:], scales, scales)
  assert _custom_calls(exported) == {"mosaic_gpu_v2"}
  assert exported.out_avals[0].dtype == jnp.dtype(dtype)


def _check_float8(out, lazy, fp8, k_scales, v_scales, rope):
  """As test_fp8_kernels: the reference on the same float8 pages and the
  float64 truth of the dequantized pages at the 16-bit tolerance, the
  unquantized truth at the quantization tolerance."""
  from pallas_kernels.kv_quant import dequantize_pages
  from tests.test_fp8_kernels import QUANTIZATION_TOLERANCE
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  assert not np.isnan(out).any(), "NaN leaked into the output"
  reference = np.asarray(lazy_attention_reference(
      *[jnp.asarray(a) for a in fp8.args()], rope=rope, k_scales=k_scales,
      v_scales=v_scales).astype(jnp.float32))
  assert relative_error(out, reference) <= BF16_TOLERANCE
  same_pages = dataclasses.replace(
      fp8, k_pages=np.asarray(dequantize_pages(fp8.k_pages, k_scales)),
      v_pages=np.asarray(dequantize_pages(fp8.v_pages, v_scales)))
  assert relative_error(out, numpy_truth(same_pages, rope)) <= BF16_TOLERANCE
  err = relative_error(out, numpy_truth(lazy, rope))
  assert 0 < err <= QUANTIZATION_TOLERANCE, f"vs unquantized: {err:.3g}"
  assert np.all(out[lazy.q_pos < 0] == 0.0), "padding rows must be zero"


def check_call_on_pages(call, lazy, rope, *, float8: bool):
  """Runs call(*lazy.args()) (16-bit pages) and checks it, or with `float8`
  call(*args of lazy's pages quantized, k_scales, v_scales), checked as
  `_check_float8`."""
  from pallas_kernels.testing import quantize_case
  if not float8:
    _check(call(*[jnp.asarray(a) for a in lazy.args()]), lazy, rope)
    return
  fp8, k_scales, v_scales = quantize_case(lazy)
  out = call(*[jnp.asarray(a) for a in fp8.args()], k_scales, v_scales)
  _check_float8(out, lazy, fp8, k_scales, v_scales, rope)


@needs_interpreter
@pytest.mark.parametrize("persistent", [
    pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["cta-per-item", "persistent"])
def test_parity_interpret_float8(persistent):
  """float8 pages with NaN in unused slots and NaN scales on unused pages,
  a padding row, two splits; f16 queries (e4m3 -> f16 in one conversion).
  Persistent: three splits (of 3, 3 and 1 steps, and three empty ones of
  the padding row) on 2 CTAs: an item starts at an odd ring step."""
  from pallas_kernels.testing import quantize_case
  lazy = _ragged_case(5, batch=2, num_heads=4, num_kv_heads=1, head_dim=64,
                      page_size=16, dtype=jnp.float16, max_doc_len=100)
  fp8, k_scales, v_scales = quantize_case(lazy)
  assert np.isnan(np.asarray(k_scales)).any(), "no NaN scale to skip"
  out = lazy_decode_mgpu(
      *[jnp.asarray(a) for a in fp8.args()], rope=LLAMA3,
      sm_scale=jnp.float32(64 ** -0.5), interpret=True, k_scales=k_scales,
      v_scales=v_scales,
      block_sizes=MgpuDecodeBlockSizes(block_kv=64,
                                       kv_splits=3 if persistent else 2,
                                       persistent=persistent, num_ctas=2))
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


@needs_interpreter
def test_parity_interpret_float8_default_tiles():
  """float8 pages at the tiles the engine runs them with (block_kv 128 on
  the persistent grid; two CTAs here): each step widens two 64-row pieces
  of K and of V.  Needs more XLA CPU threads than this machine's 2 cores
  (conftest's NPROC)."""
  from pallas_kernels.testing import quantize_case
  lazy = _ragged_case(5, batch=2, num_heads=4, num_kv_heads=1, head_dim=64,
                      page_size=16, dtype=jnp.float16, max_doc_len=200)
  fp8, k_scales, v_scales = quantize_case(lazy)
  tiles = dataclasses.replace(default_decode_block_sizes(jnp.float8_e4m3fn),
                              num_ctas=2)
  assert tiles.block_kv == 128 and tiles.persistent
  out = lazy_decode_mgpu(
      *[jnp.asarray(a) for a in fp8.args()], rope=LLAMA3,
      sm_scale=jnp.float32(64 ** -0.5), interpret=True, k_scales=k_scales,
      v_scales=v_scales, block_sizes=tiles)
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


@needs_interpreter
@pytest.mark.parametrize("operand", [
    "float16", pytest.param("query", marks=pytest.mark.slow)])
def test_parity_interpret_float8_small_and_mixed_v_scales(operand):
  """bf16 queries on float8 pages whose V values are tiny (scales near
  2^-27) and differ by 2^6 between pages of one row: P times a V scale
  would fall below f16's normal range (to zero for most of them), so the
  kernel keeps acc in units of the row's largest V scale seen so far (with
  f16 operands, the default, and with q's dtype).  On the persistent grid
  (float8's default) of 2 CTAs for 8 work items: each item starts its unit
  afresh after the one before it on the same CTA."""
  from pallas_kernels.testing import quantize_case
  lazy = _ragged_case(6, batch=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_doc_len=100)
  v = np.asarray(lazy.v_pages, np.float32) * 2.0**-20
  v[:, 1::3] *= 2.0**6  # every third page larger than the rest
  lazy = dataclasses.replace(lazy, v_pages=v.astype(lazy.v_pages.dtype))
  fp8, k_scales, v_scales = quantize_case(lazy)
  used = np.asarray(v_scales)[~np.isnan(np.asarray(v_scales))]
  assert used.max() <= 2.0**-20 and used.max() / used.min() >= 2.0**5
  out = lazy_decode_mgpu(
      *[jnp.asarray(a) for a in fp8.args()], rope=LLAMA3,
      sm_scale=jnp.float32(64 ** -0.5), interpret=True, k_scales=k_scales,
      v_scales=v_scales,
      block_sizes=MgpuDecodeBlockSizes(block_kv=64, kv_splits=2,
                                       persistent=True, num_ctas=2,
                                       float8_operand=operand))
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


def two_document_plan(block_sizes):
  """plan_decode of two rows, pages of 16, H 64.  Row 0: doc A (pages 0-2,
  shift 0), doc B (pages 3-4, shift 48; page 4 holds 5 tokens), then a page
  after q_pos 68; row 1: padding."""
  table = np.array([[5, 6, 7, 1, 2, 3], [0, 0, 0, 0, 0, 0]], np.int32)
  pos = np.array([[0, 16, 32, 48, 64, 80], [0] * 6], np.int32)
  shift = np.array([[0, 0, 0, 48, 48, 0], [0] * 6], np.int32)
  length = np.array([[16, 16, 16, 16, 5, 16], [16] * 6], np.int32)
  q_pos = np.array([[68], [-1]], np.int32)
  return plan_decode(*(jnp.asarray(a) for a in (table, pos, shift, length,
                                                q_pos)),
                     rope=PLAIN, head_dim=64, num_pages=8, page_size=16,
                     block_sizes=block_sizes)


def test_plan_decode_steps():
  """Steps hold only live pages (not empty, not after q_pos), one segment
  per step; padding rows have none."""
  plan = two_document_plan(MgpuDecodeBlockSizes(block_kv=64))
  assert isinstance(plan, DecodePlan)
  layout = RecordLayout(4)
  # Doc A: one step (pages 0-2).  Doc B spans blocks 0 and 1: page 3 alone,
  # then page 4 (5 slots); page 5 starts after q_pos and is not read.
  assert np.asarray(plan.n_steps).tolist() == [3, 0]
  rec = np.asarray(plan.records)
  lims = rec[0, :3, layout.lim:layout.lim + 4].tolist()
  assert lims == [[16, 16, 16, 0], [0, 0, 0, 16], [5, 0, 0, 0]]
  assert rec[0, 0, layout.phys:layout.phys + 3].tolist() == [5, 6, 7]
  assert rec[0, 1, layout.phys + 3] == 1 and rec[0, 2, layout.phys] == 2
  assert rec[0, :3, layout.new_seg].tolist() == [1, 1, 0]
  assert rec[0, :3, layout.seg].tolist() == [0, 1, 1]
  assert rec[0, :3, layout.fixup].tolist() == [1, 1, 1]
  assert rec[0, 2, layout.max_pos] == 68
  cos_sin = np.asarray(plan.cos_sin)  # segment 1: the shift 48
  np.testing.assert_allclose(cos_sin[0, 1, 0, 0], np.cos(48.0), atol=1e-6)
  assert np.asarray(plan.q_pos).tolist()[0] == 68
  assert np.asarray(plan.q_pos)[1] < 0


def test_kv_splits():
  """As many splits as fill the SMs once (132 with no GPU attached), each
  with at least four steps."""
  from pallas_kernels.gpu_decode_block_sizes import gpu_sm_count
  bs = MgpuDecodeBlockSizes()
  sms = gpu_sm_count()
  # B 64 or 32 x K 8 fill the SMs already: one split.
  assert mgpu_decode_kv_splits(bs, batch=64, num_kv_heads=8,
                               max_steps=64) == 1
  assert mgpu_decode_kv_splits(bs, batch=32, num_kv_heads=8,
                               max_steps=64) == 1
  # B 8 x K 8 = 64 CTAs: two splits on 132 SMs.
  assert mgpu_decode_kv_splits(bs, batch=8, num_kv_heads=8,
                               max_steps=64) == sms // 64
  # Short rows keep at least four steps per split.
  assert mgpu_decode_kv_splits(bs, batch=1, num_kv_heads=8,
                               max_steps=9) == 2
  assert mgpu_decode_kv_splits(MgpuDecodeBlockSizes(kv_splits=5), batch=1,
                               num_kv_heads=1, max_steps=1) == 5


def test_persistent_grid_size():
  """One CTA per work item unless persistent; persistent takes at most
  num_ctas (the SM count when None: 132 with no GPU attached)."""
  from pallas_kernels.gpu_decode_block_sizes import (HOPPER_SM_COUNT,
                                                     gpu_sm_count,
                                                     mgpu_decode_num_ctas)
  assert mgpu_decode_num_ctas(MgpuDecodeBlockSizes(), 1024) == 1024
  persistent = MgpuDecodeBlockSizes(persistent=True)
  assert mgpu_decode_num_ctas(persistent, 1024) == gpu_sm_count()
  assert mgpu_decode_num_ctas(persistent, 12) == min(12, gpu_sm_count())
  few = MgpuDecodeBlockSizes(persistent=True, num_ctas=5)
  assert mgpu_decode_num_ctas(few, 12) == 5
  assert mgpu_decode_num_ctas(few, 3) == 3
  if jax.default_backend() == "cpu":
    assert gpu_sm_count() == HOPPER_SM_COUNT
  with pytest.raises(ValueError, match="num_ctas must be >= 1"):
    MgpuDecodeBlockSizes(persistent=True, num_ctas=0)


@pytest.mark.parametrize("kv_dtype,expected", [
    (jnp.bfloat16, (False, True, True)), (jnp.float8_e4m3fn, (True, False, False))])
def test_decode_defaults_by_pool_dtype(monkeypatch, kv_dtype, expected):
  """`lazy_attention` decode launches (persistent, steps_by_block,
  rope_in_kernel): one CTA per work item and block steps with the rope in
  the kernel on 16-bit pools, segment steps on the persistent grid on
  float8 pools (default_decode_block_sizes); `plan_lazy_attention` plans
  for the same form."""
  import pallas_kernels.gpu_decode_mgpu_kernel as kernel_module
  defaults = default_decode_block_sizes(kv_dtype)
  assert (defaults.persistent, defaults.steps_by_block,
          defaults.rope_in_kernel) == expected
  launched = []
  real = kernel_module.mgpu_decode_num_ctas
  monkeypatch.setattr(kernel_module, "mgpu_decode_num_ctas",
                      lambda bs, n: launched.append(
                          (bs.persistent, bs.steps_by_block,
                           bs.rope_in_kernel)) or real(bs, n))
  # A batch of 5 rows, which no other test traces lazy_attention with: a
  # cached trace would not call the kernel builder again.
  specs = list(_specs(5, 32, 8, 128, 64, 16, 20, jnp.bfloat16))
  pages = jax.ShapeDtypeStruct(specs[1].shape, kv_dtype)
  scales = ([jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32)] * 2
            if kv_dtype == jnp.float8_e4m3fn else [None, None])

  def planned(*a):
    plan = plan_lazy_attention(a[0], a[1], *a[3:8], rope=LLAMA3, impl="gpu")
    assert (plan.cos_sin.shape[-1] == 0) == defaults.rope_in_kernel
    return lazy_attention(*a[:8], rope=LLAMA3, impl="gpu", plan=plan,
                          k_scales=a[8], v_scales=a[9])
  jax.make_jaxpr(planned)(specs[0], pages, pages, *specs[3:], *scales)
  assert launched == [expected]


@pytest.mark.parametrize("change,message", [
    (dict(q_len=2), "one query token"),
    (dict(dtype=jnp.float32), "bfloat16 or float16"),
    (dict(k_dtype=jnp.float8_e5m2), "float8_e4m3fn"),
    (dict(head_dim=32), "head dim"),
    (dict(page_size=12), "page_size"),
    (dict(heads=130, kv_heads=2), "at most 64 query heads"),
])
def test_argument_errors(change, message):
  from pallas_kernels.gpu_decode_mgpu import mosaic_decode_unsupported
  sizes = dict(q_len=1, heads=8, kv_heads=2, head_dim=128, page_size=16,
               dtype=jnp.bfloat16)
  sizes.update(change)
  k_dtype = sizes.pop("k_dtype", sizes["dtype"])
  q_shape = (1, sizes["q_len"], sizes["heads"], sizes["head_dim"])
  k_shape = (sizes["kv_heads"], 4, sizes["page_size"], sizes["head_dim"])
  reason = mosaic_decode_unsupported(q_shape, sizes["dtype"], k_shape,
                                     k_dtype)
  assert reason is not None and message in reason
  if k_dtype == sizes["dtype"]:  # lazy_decode_mgpu raises the same reason
    args = [jnp.zeros(s.shape, s.dtype) for s in contract_specs(
        batch=1, q_len=sizes["q_len"], num_heads=sizes["heads"],
        num_kv_heads=sizes["kv_heads"], head_dim=sizes["head_dim"],
        num_pages=4, page_size=sizes["page_size"], num_logical_pages=2,
        dtype=sizes["dtype"])]
    with pytest.raises(ValueError, match=re.escape(message)):
      lazy_decode_mgpu(*args, rope=PLAIN, sm_scale=0.1)


def test_block_size_errors():
  with pytest.raises(ValueError, match="block_kv must be 64 or 128"):
    MgpuDecodeBlockSizes(block_kv=32)
  with pytest.raises(ValueError, match="num_stages must be >= 2"):
    MgpuDecodeBlockSizes(num_stages=1)
  with pytest.raises(ValueError, match="kv_splits must be >= 1"):
    MgpuDecodeBlockSizes(kv_splits=0)
  from pallas_kernels.gpu_decode_mgpu import mosaic_decode_unsupported
  reason = mosaic_decode_unsupported((1, 1, 8, 128), jnp.bfloat16,
                                     (2, 4, 16, 128), jnp.bfloat16,
                                     MgpuDecodeBlockSizes(num_stages=3))
  assert "shared memory" in reason


def test_lazy_attention_picks_the_decode_kernel():
  """impl="gpu" decode: Mosaic (Hopper; no local GPU here, so lowering
  targets Hopper) for 16-bit queries with 16-bit or float8 pools; Triton
  for float32, page sizes it cannot tile and interpret mode.  The plan
  follows."""
  from pallas_kernels.lazy_attention import _gpu_decode_kernel
  q16 = jnp.zeros((1, 1, 4, 128), jnp.bfloat16)
  pages16 = jnp.zeros((1, 4, 16, 128), jnp.bfloat16)
  assert _gpu_decode_kernel(q16, pages16, interpret=False) == "mosaic"
  assert _gpu_decode_kernel(q16, pages16, interpret=True) == "triton"
  q32, pages32 = q16.astype(jnp.float32), pages16.astype(jnp.float32)
  assert _gpu_decode_kernel(q32, pages32, interpret=False) == "triton"
  pages8 = pages16.astype(jnp.float8_e4m3fn)
  assert _gpu_decode_kernel(q16, pages8, interpret=False) == "mosaic"
  assert _gpu_decode_kernel(q32, pages8, interpret=False) == "triton"
  pages12 = jnp.zeros((1, 4, 12, 128), jnp.bfloat16)
  assert _gpu_decode_kernel(q16, pages12, interpret=False) == "triton"
  meta = [jnp.zeros((1, 2), jnp.int32)] * 4 + [jnp.zeros((1, 1), jnp.int32)]
  assert isinstance(plan_lazy_attention(q16, pages16, *meta, rope=PLAIN,
                                        impl="gpu"), DecodePlan)
  assert isinstance(plan_lazy_attention(q16, pages8, *meta, rope=PLAIN,
                                        impl="gpu"), DecodePlan)
  assert plan_lazy_attention(q32, pages32, *meta, rope=PLAIN,
                             impl="gpu") is None


def test_lazy_attention_refuses_a_prefill_plan_for_decode():
  q = jnp.zeros((1, 4, 4, 128), jnp.bfloat16)
  pages = jnp.zeros((1, 4, 16, 128), jnp.bfloat16)
  meta = [jnp.zeros((1, 2), jnp.int32)] * 4
  plan = plan_lazy_attention(q, pages, *meta, jnp.zeros((1, 4), jnp.int32),
                             rope=PLAIN, impl="gpu")
  with pytest.raises(ValueError, match="needs a DecodePlan"):
    lazy_attention(q[:, :1], pages, pages, *meta,
                   jnp.zeros((1, 1), jnp.int32), rope=PLAIN, impl="gpu",
                   plan=plan)


# On a GPU: (Hq, Hkv), H, page size, base position, rope, block sizes.
GPU_CASES = [
    ((32, 8), 128, 16, 0, PLAIN, None),
    ((32, 8), 128, 16, 2**20, LLAMA3, None),
    ((9, 3), 64, 8, 60000, PLAIN, None),
    ((8, 8), 128, 16, 0, LLAMA3,
     MgpuDecodeBlockSizes(block_kv=64, num_stages=4, kv_splits=3)),
    ((64, 8), 128, 32, 5000, PLAIN,
     MgpuDecodeBlockSizes(mask_fast_path=False, kv_splits=1)),
    ((8, 2), 64, 64, 2**20, LLAMA3, MgpuDecodeBlockSizes(num_stages=3)),
    # Persistent: 5 rows x 8 kv heads x 2 splits on 7 CTAs (items of
    # different lengths and a padding row's empty ones share each ring).
    ((32, 8), 128, 16, 2**20, LLAMA3,
     MgpuDecodeBlockSizes(persistent=True, num_ctas=7, kv_splits=2)),
    ((8, 2), 64, 8, 0, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, num_stages=4, persistent=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: (
    f"{c[0][0]}-{c[0][1]}_H{c[1]}_p{c[2]}_base{c[3]}_{c[5]}"))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_parity_gpu(case, dtype):
  heads, head_dim, page_size, base, rope, block_sizes = case
  lazy = _ragged_case(head_dim + page_size, batch=5, num_heads=heads[0],
                      num_kv_heads=heads[1], head_dim=head_dim,
                      page_size=page_size, dtype=dtype, docs_per_row=4,
                      max_doc_len=300, base_position=base)
  out = jax.jit(lambda *a: lazy_decode_mgpu(
      *a, rope=rope, sm_scale=jnp.float32(head_dim ** -0.5),
      block_sizes=block_sizes))(*[jnp.asarray(a) for a in lazy.args()])
  _check(out, lazy, rope)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("persistent", [False, True],
                         ids=["dispatch", "persistent"])
def test_parity_gpu_float8(dtype, persistent):
  from pallas_kernels.testing import quantize_case
  lazy = _ragged_case(7, batch=5, num_heads=32, num_kv_heads=8,
                      head_dim=128, page_size=16, dtype=dtype,
                      docs_per_row=4, max_doc_len=300, base_position=2**20)
  fp8, k_scales, v_scales = quantize_case(lazy)
  if persistent:
    call = lambda *a: lazy_decode_mgpu(
        *a[:8], rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
        k_scales=a[8], v_scales=a[9],
        block_sizes=MgpuDecodeBlockSizes(persistent=True, num_ctas=9))
  else:
    call = lambda *a: lazy_attention(
        *a[:8], rope=LLAMA3, impl="gpu", k_scales=a[8], v_scales=a[9])
  out = jax.jit(call)(*[jnp.asarray(a) for a in fp8.args()], k_scales,
                      v_scales)
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


@pytest.mark.gpu
@pytest.mark.parametrize("block_sizes,float8", [
    (None, False),
    (MgpuDecodeBlockSizes(kv_splits=3), False),
    (MgpuDecodeBlockSizes(persistent=True, kv_splits=2), True)],
    ids=["default", "segment-steps", "float8-persistent"])
def test_parity_gpu_contiguous_pages(block_sizes, float8):
  """Pages in allocation order: whole-block TMA copies (8 pages of 16)
  beside page-by-page ones in one call."""
  lazy = _ragged_case(17, batch=5, num_heads=32, num_kv_heads=8,
                      head_dim=128, page_size=16, dtype=jnp.bfloat16,
                      docs_per_row=4, max_doc_len=300, base_position=2**20,
                      shuffle_pages=False)
  merged, blocks = contiguous_block_count(lazy.page_table, 8)
  assert 0 < merged < blocks, (merged, blocks)
  call = jax.jit(lambda *a: lazy_decode_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=block_sizes, k_scales=a[8] if float8 else None,
      v_scales=a[9] if float8 else None))
  check_call_on_pages(call, lazy, LLAMA3, float8=float8)


@pytest.mark.gpu
def test_lazy_attention_decode_gpu_matches_triton():
  """The dispatched (Mosaic) decode against the Triton kernel on a long
  benchmark-like layout: 16 documents of 512 tokens at their own shifts."""
  from pallas_kernels.gpu_decode import lazy_decode_gpu
  lazy = _doc_layout_case(np.random.default_rng(3), num_docs=16, doc_len=512,
                          q_len=1, num_heads=32, num_kv_heads=8,
                          head_dim=128, page_size=16)
  args = [jnp.asarray(a) for a in lazy.args()]
  out = lazy_attention(*args, rope=LLAMA3, impl="gpu")
  triton = lazy_decode_gpu(*args, rope=LLAMA3, sm_scale=jnp.float32(
      128 ** -0.5))
  out = np.asarray(out.astype(jnp.float32))
  triton = np.asarray(triton.astype(jnp.float32)).astype(np.float64)
  assert relative_error(out, triton) <= BF16_TOLERANCE
  _check(out, lazy, LLAMA3)
