"""The Mosaic GPU prefill with the query rotated in the kernel
(MgpuBlockSizes(query_rope_in_kernel=True)): the plan's Q15 table of each
query row's cos | sin, the kernel's in-place rotation of the raw query, its
refusals, its CUDA lowering, interpreter parity on CPU and GPU parity."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.gpu_prefill_mgpu import (MgpuBlockSizes,
                                             lazy_prefill_mgpu,
                                             lazy_prefill_mgpu_planned,
                                             mgpu_prefill_kernel,
                                             plan_prefill)
from pallas_kernels.gpu_prefill_mgpu_plan import (Q15_ONE,
                                                  query_cos_sin_table,
                                                  segment_cos_sin)
from pallas_kernels.testing import make_case, quantize_case, relative_error
from tests.mgpu_prefill_helpers import (BENCH, _call, _check, _specs, gpu_case,
                                        needs_interpreter)
from tests.rope_configs import LLAMA3, PLAIN

IN_KERNEL = MgpuBlockSizes(query_rope_in_kernel=True)
WRONG_PLAN = "make the plan with the kernel's block sizes"


def test_query_table_holds_each_rows_cos_sin_in_q15():
  """Rows at positions near 2^20 (Llama-3 scaling): the table's cos | sin
  are the exact ones within half a Q15 step; padding rows are zero."""
  row_pos = jnp.array([[0, 1, 2**20 + 3, -(2**31)]], jnp.int32)
  table = np.asarray(query_cos_sin_table(row_pos, LLAMA3, 128))
  assert table.shape == (1, 4, 128) and table.dtype == np.int16
  exact = np.asarray(segment_cos_sin(jnp.maximum(row_pos, 0), LLAMA3, 128))
  exact = exact.reshape(1, 4, 128)[:, :3]
  assert np.max(np.abs(table[:, :3] / Q15_ONE - exact)) <= 0.5 / Q15_ONE
  assert np.all(table[0, 0, :64] == Q15_ONE) and np.all(table[0, 0, 64:] == 0)
  assert np.all(table[0, 3] == 0)


def test_the_kernel_rotates_a_16_bit_query_by_default():
  assert MgpuBlockSizes().rotates_query_in_kernel
  assert not MgpuBlockSizes(query_in_f32=True).rotates_query_in_kernel
  assert not MgpuBlockSizes(query_rope_in_kernel=False).rotates_query_in_kernel
  assert IN_KERNEL.rotates_query_in_kernel


def test_query_operand_is_the_raw_query_where_the_kernel_rotates_it():
  """The padded raw query for the kernel that rotates it; the XLA-rotated
  one otherwise.  The timing chain perturbs the per-layer call likewise."""
  from benchmarks.kernel_cases import prefill_planned_perturb
  from benchmarks.kernel_timing import perturb_none, perturb_query
  from pallas_kernels.gpu_prefill_mgpu import (query_operand,
                                               rotated_query_tokens)
  q = jnp.asarray(np.random.default_rng(5).standard_normal((1, 5, 2, 64)),
                  jnp.bfloat16)
  q_pos = jnp.arange(5, dtype=jnp.int32)[None] + 100
  raw = query_operand(q, q_pos, PLAIN, 0.125, 64, MgpuBlockSizes())
  assert raw.shape == (1, 64, 2, 64)
  np.testing.assert_array_equal(raw[:, :5], q)
  assert not np.asarray(raw[:, 5:]).any()
  xla = MgpuBlockSizes(query_rope_in_kernel=False)
  np.testing.assert_array_equal(
      query_operand(q, q_pos, PLAIN, 0.125, 64, xla),
      rotated_query_tokens(q, q_pos, PLAIN, 0.125, 64, in_f32=False))
  assert prefill_planned_perturb() is perturb_none
  assert prefill_planned_perturb(xla) is perturb_query


def test_plan_holds_the_table_only_where_the_kernel_rotates():
  rng = np.random.default_rng(0)
  lazy = make_case(rng, batch=2, q_len=10, num_heads=4, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16)
  make = functools.partial(
      plan_prefill, *[jnp.asarray(a) for a in lazy.args()[3:]], rope=PLAIN,
      group=2, head_dim=64, num_pages=lazy.k_pages.shape[1], page_size=16)
  xla = MgpuBlockSizes(block_kv=64, query_rope_in_kernel=False)
  assert make(block_sizes=xla).query_cos_sin.shape == (2, 64, 0)
  f32 = MgpuBlockSizes(block_kv=64, query_in_f32=True)
  assert make(block_sizes=f32).query_cos_sin.shape == (2, 64, 0)
  plan = make(block_sizes=MgpuBlockSizes(block_kv=64))
  assert plan.query_cos_sin.shape == (2, 64, 64)
  assert np.all(np.asarray(plan.query_cos_sin)[:, 10:] == 0)  # padding rows


def test_refusals():
  with pytest.raises(ValueError, match="16-bit query storage"):
    MgpuBlockSizes(query_rope_in_kernel=True, query_in_f32=True)
  rng = np.random.default_rng(1)
  lazy = make_case(rng, batch=1, q_len=5, num_heads=2, num_kv_heads=1,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16)
  q, k, v, table, pos, shift, length, q_pos = [jnp.asarray(a)
                                               for a in lazy.args()]
  plan_args = dict(rope=PLAIN, group=2, head_dim=64, num_pages=k.shape[1],
                   page_size=16)
  sizes = MgpuBlockSizes(block_kv=64, query_rope_in_kernel=True)
  without_table = plan_prefill(table, pos, shift, length, q_pos, **plan_args,
                               block_sizes=MgpuBlockSizes(
                                   block_kv=64, query_rope_in_kernel=False))
  q_pad = jnp.pad(q, ((0, 0), (0, 59), (0, 0), (0, 0)))
  with pytest.raises(ValueError, match=WRONG_PLAN):
    mgpu_prefill_kernel(q_pad, k, v, without_table, out_dtype=q.dtype,
                        block_sizes=sizes, sm_scale=0.125)
  with_table = plan_prefill(table, pos, shift, length, q_pos, **plan_args,
                            block_sizes=sizes)
  with pytest.raises(ValueError, match="needs sm_scale"):
    mgpu_prefill_kernel(q_pad, k, v, with_table, out_dtype=q.dtype,
                        block_sizes=sizes)
  with pytest.raises(ValueError, match=WRONG_PLAN):
    lazy_prefill_mgpu_planned(q, k, v, q_pos, without_table, rope=PLAIN,
                              sm_scale=0.125, block_sizes=sizes)


def test_check_plan_fits_names_each_mismatch():
  """A plan for other records, another query length or without the query
  table is refused, naming what differs; a fitting one gives its tiles."""
  from pallas_kernels.gpu_prefill_mgpu_plan import RecordLayout, check_plan_fits
  rng = np.random.default_rng(2)
  lazy = make_case(rng, batch=1, q_len=5, num_heads=4, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16)
  sizes = MgpuBlockSizes(block_kv=64)
  plan = plan_prefill(*[jnp.asarray(a) for a in lazy.args()[3:]], rope=PLAIN,
                      group=2, head_dim=64, num_pages=lazy.k_pages.shape[1],
                      page_size=16, block_sizes=sizes)
  layout = RecordLayout(4, cos_sin_dim=64)
  fits = functools.partial(check_plan_fits, plan, layout, sizes, group=2,
                           head_dim=64)
  assert fits(t_pad=64) == plan.n_steps.shape[1] == 1
  with pytest.raises(ValueError, match="needs 4 units over 2 warpgroups"):
    fits(t_pad=128)
  with pytest.raises(ValueError, match="plan records are 96 wide"):
    check_plan_fits(plan, RecordLayout(4), sizes, t_pad=64, group=2,
                    head_dim=64)
  xla = plan._replace(query_cos_sin=plan.query_cos_sin[..., :0])
  with pytest.raises(ValueError, match=WRONG_PLAN):
    check_plan_fits(xla, layout, sizes, t_pad=64, group=2, head_dim=64)
  no_rotation = MgpuBlockSizes(block_kv=64, query_rope_in_kernel=False)
  assert check_plan_fits(xla, layout, no_rotation, t_pad=64, group=2,
                         head_dim=64) == 1


@pytest.mark.parametrize("float8", [False, True], ids=["bf16", "float8"])
def test_export_lowers_for_cuda_benchmark_shape(float8):
  specs = list(_specs(**BENCH))
  scales = ()
  if float8:
    pages = jax.ShapeDtypeStruct(specs[1].shape, jnp.float8_e4m3fn)
    specs[1] = specs[2] = pages
    scales = (jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32),) * 2
  fn = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=IN_KERNEL,
      k_scales=a[8] if float8 else None, v_scales=a[9] if float8 else None))
  exported = export.export(fn, platforms=["cuda"])(*specs, *scales)
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (4, 512, 32, 128)


def _against_the_xla_rotation(lazy, rope, sizes, interpret):
  """The call with `sizes` and with the XLA rotation (its default): the
  same roundings but for the Q15 cos / sin, so within bf16's step."""
  base = dataclasses.replace(sizes, query_rope_in_kernel=False)
  out = _call(lazy.args(), rope=rope, interpret=interpret, block_sizes=sizes)
  xla = _call(lazy.args(), rope=rope, interpret=interpret, block_sizes=base)
  _check(out, lazy, rope)
  err = relative_error(np.asarray(out.astype(jnp.float32)),
                       np.asarray(xla.astype(jnp.float32)).astype(np.float64))
  assert err <= 4e-3, f"vs the XLA rotation: {err:.3g}"


@needs_interpreter
def test_parity_interpret():
  """Positions near 2^20 (Llama-3 scaling); T = 70 pads the last token
  block, and padding rows (q_pos -1) come out zero."""
  rng = np.random.default_rng(7)
  lazy = make_case(rng, batch=1, q_len=70, num_heads=4, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=2, max_doc_len=60, base_position=2**20)
  assert (lazy.q_pos < 0).any()
  _against_the_xla_rotation(
      lazy, LLAMA3, MgpuBlockSizes(block_kv=64, query_rope_in_kernel=True),
      interpret=True)


@needs_interpreter
# Slow for CI time, as test_gpu_prefill_mgpu_float8's interpreter cases:
# float8 pages are opt-in; their GPU parity runs in the GPU tier.
@pytest.mark.slow
def test_parity_interpret_float8():
  """float8 pages: the table rides in the f16 operand tile, the rotated
  query in the bf16 one."""
  from tests.test_gpu_decode_mgpu import _check_float8
  rng = np.random.default_rng(3)
  lazy = make_case(rng, batch=1, q_len=7, num_heads=8, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16,
                   max_doc_len=100, base_position=5000)
  fp8, k_scales, v_scales = quantize_case(lazy)
  out = lazy_prefill_mgpu(
      *[jnp.asarray(a) for a in fp8.args()], rope=LLAMA3,
      sm_scale=jnp.float32(64 ** -0.5), interpret=True, k_scales=k_scales,
      v_scales=v_scales,
      block_sizes=MgpuBlockSizes(num_compute_wgs=1,
                                 query_rope_in_kernel=True))
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


GPU_CASES = [
    # (heads, head_dim, page_size, q_len, base_position, rope, block sizes)
    ((32, 8), 128, 16, 200, 2**20, LLAMA3, IN_KERNEL),
    ((9, 3), 64, 8, 37, 60000, PLAIN, IN_KERNEL),
    ((8, 8), 128, 16, 130, 0, LLAMA3,
     MgpuBlockSizes(query_rope_in_kernel=True, query_in_registers=False)),
    ((32, 8), 128, 16, 64, 5000, PLAIN,
     MgpuBlockSizes(block_kv=64, num_compute_wgs=1, num_stages=4,
                    query_rope_in_kernel=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: (
    f"{c[0][0]}-{c[0][1]}_H{c[1]}_p{c[2]}_T{c[3]}_base{c[4]}"))
def test_parity_gpu(case):
  lazy, rope = gpu_case(case)
  _against_the_xla_rotation(lazy, rope, case[-1], interpret=False)


@pytest.mark.gpu
def test_parity_gpu_float8():
  from tests.test_gpu_decode_mgpu import _check_float8
  rng = np.random.default_rng(11)
  lazy = make_case(rng, batch=2, q_len=100, num_heads=32, num_kv_heads=8,
                   head_dim=128, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=3, max_doc_len=300, base_position=2**20)
  fp8, k_scales, v_scales = quantize_case(lazy)
  out = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=IN_KERNEL, k_scales=a[8], v_scales=a[9]))(
          *[jnp.asarray(a) for a in fp8.args()], k_scales, v_scales)
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["pages", "documents"])
def test_benchmark_layout_gpu(layout):
  """The benchmark's layout (smaller batch and context), against the XLA
  rotation's output."""
  from benchmarks.mgpu_prefill_cases import build_inputs
  args = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0),
                      batch=2, q_len=256, context=2048, layout=layout)[:8]
  run = lambda sizes: np.asarray(jax.jit(lambda *a: lazy_prefill_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=sizes))(*args).astype(jnp.float32))
  out, xla = run(IN_KERNEL), run(MgpuBlockSizes())
  assert not np.isnan(out).any()
  assert relative_error(out, xla.astype(np.float64)) <= 4e-3
