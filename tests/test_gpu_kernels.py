"""GPU (Pallas, Triton lowering) decode and prefill kernels.

On CPU the kernels run with pallas_call(interpret=True); the same sweep runs
on a real GPU under `@pytest.mark.gpu` (skipped by CPU CI).  Every case draws
fresh random inputs (pallas_kernels.testing.make_case: ragged documents, an
empty page between documents, a physical page read by two rows at different
shifts, shuffled physical pages, padding query rows, NaN in every unused page
and padding slot) and is checked against the float64 NumPy truth and the jnp
reference.  The case list covers every value of every swept axis without the
full cross product (interpret mode is slow).
"""

from __future__ import annotations

import dataclasses
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import RopeConfig, lazy_attention, lazy_attention_reference
from pallas_kernels.gpu_block_sizes import GpuBlockSizes, block_sizes_for
from pallas_kernels.gpu_common import fold_last_axis, prefix_sum
from pallas_kernels.gpu_decode import lazy_decode_gpu
from pallas_kernels.gpu_prefill import lazy_prefill_gpu, prefill_segments
from pallas_kernels.testing import (contract_specs, make_case, numpy_truth,
                                    relative_error, zero_args)
from tests.rope_configs import LLAMA3, PLAIN

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
  heads: tuple[int, int]  # (Hq, Hkv)
  head_dim: int
  page_size: int
  dtype: str
  q_len: int
  base_position: int = 0
  rope: RopeConfig = PLAIN

  @property
  def id(self):
    scaling = "llama3" if self.rope.factor else "plain"
    return (f"{self.heads[0]}-{self.heads[1]}_H{self.head_dim}_"
            f"p{self.page_size}_{self.dtype}_T{self.q_len}_"
            f"base{self.base_position}_{scaling}")


# Every Hq/Hkv, H, page size, dtype and T appears with several partners;
# large shifts (up to 2^20) and Llama-3 scaling appear for both kernels and
# both dtypes.
CASES = [
    # decode (T == 1)
    Case((9, 3), 64, 8, "float32", 1),
    Case((32, 8), 128, 16, "bfloat16", 1, base_position=2**20, rope=LLAMA3),
    Case((8, 8), 128, 16, "float32", 1, base_position=60000, rope=LLAMA3),
    Case((9, 3), 64, 8, "bfloat16", 1, base_position=2**20),
    # prefill, T == 7
    Case((9, 3), 64, 16, "float32", 7, base_position=2**20),
    Case((8, 8), 64, 8, "bfloat16", 7, rope=LLAMA3),
    Case((32, 8), 128, 8, "float32", 7),
    # prefill, T == 64
    Case((32, 8), 128, 8, "float32", 64, base_position=2**20, rope=LLAMA3),
    Case((8, 8), 128, 16, "bfloat16", 64, base_position=60000),
    Case((9, 3), 128, 16, "bfloat16", 64),
]


def _run_case(case: Case, *, interpret: bool, seed_salt: int = 0):
  seed = zlib.crc32(case.id.encode()) + seed_salt
  rng = np.random.default_rng(seed)
  dtype = jnp.bfloat16 if case.dtype == "bfloat16" else np.float32
  lazy = make_case(rng, batch=2, q_len=case.q_len, num_heads=case.heads[0],
                   num_kv_heads=case.heads[1], head_dim=case.head_dim,
                   page_size=case.page_size, dtype=dtype,
                   base_position=case.base_position)
  out = lazy_attention(*lazy.args(), rope=case.rope, impl="gpu",
                       interpret=interpret)
  assert out.shape == lazy.q.shape and out.dtype == lazy.q.dtype
  out = np.asarray(out.astype(jnp.float32))
  assert not np.isnan(out).any(), "NaN leaked into the output"
  # Truth from the (possibly bf16-rounded) inputs, in float64.
  truth = numpy_truth(lazy, case.rope)
  reference = np.asarray(
      lazy_attention_reference(*lazy.args(), rope=case.rope).astype(
          jnp.float32))
  tol = TOLERANCE[case.dtype]
  err_truth = relative_error(out, truth)
  err_reference = relative_error(out, reference.astype(np.float64))
  assert err_truth <= tol, f"vs float64 truth: {err_truth:.3g} > {tol}"
  assert err_reference <= tol, f"vs reference: {err_reference:.3g} > {tol}"
  padding = lazy.q_pos < 0
  if padding.any():
    assert np.all(out[padding] == 0.0), "padding rows must be exactly zero"


# The interpreter runs four of the cases in the slow tier only, for CI
# time (the Triton kernels serve GPUs without Mosaic): the rest still cover
# each head layout, head dim, page size, dtype, query length and RoPE.
SLOW_IN_INTERPRETER = {
    "8-8_H128_p16_float32_T1_base60000_llama3",
    "9-3_H64_p8_bfloat16_T1_base1048576_plain",
    "9-3_H64_p16_float32_T7_base1048576_plain",
    "8-8_H128_p16_bfloat16_T64_base60000_plain",
}


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.slow) if c.id in SLOW_IN_INTERPRETER
    else c for c in CASES], ids=lambda c: c.id)
def test_parity_interpret(case):
  _run_case(case, interpret=True)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_parity_gpu(case):
  _run_case(case, interpret=False, seed_salt=1)


def _call_kernel(kernel, lazy, rope, block_sizes, interpret):
  out = jax.jit(lambda *a: kernel(
      *a, rope=rope, sm_scale=jnp.float32(lazy.q.shape[-1] ** -0.5),
      interpret=interpret, block_sizes=block_sizes))(*lazy.args())
  return np.asarray(out.astype(jnp.float32))


@pytest.mark.parametrize("kernel,q_len,block_sizes", [
    # Blocks of 2 pages and 3 splits: blocks that hold two documents (two
    # work items), splits that get no item at all.
    (lazy_decode_gpu, 1, GpuBlockSizes(block_kv=16, kv_splits=3)),
    # Row tiles of 16 rows over 4 heads: causal skipping differs per tile;
    # single-page blocks.
    (lazy_prefill_gpu, 12, GpuBlockSizes(block_q=16, block_kv=16)),
], ids=["decode_small_blocks", "prefill_small_tiles"])
def test_small_blocks_interpret(kernel, q_len, block_sizes):
  rng = np.random.default_rng(7)
  lazy = make_case(rng, batch=3, q_len=q_len, num_heads=8, num_kv_heads=2,
                   head_dim=32, page_size=8, docs_per_row=4, max_doc_len=20)
  out = _call_kernel(kernel, lazy, PLAIN, block_sizes, interpret=True)
  assert not np.isnan(out).any()
  assert relative_error(out, numpy_truth(lazy, PLAIN)) <= 1e-5


@pytest.mark.parametrize("kernel,q_len", [(lazy_decode_gpu, 1),
                                          (lazy_prefill_gpu, 5)],
                         ids=["decode", "prefill"])
def test_page_size_not_power_of_two_interpret(kernel, q_len):
  rng = np.random.default_rng(11)
  lazy = make_case(rng, batch=2, q_len=q_len, num_heads=4, num_kv_heads=2,
                   head_dim=32, page_size=12, max_doc_len=30)
  out = _call_kernel(kernel, lazy, PLAIN, None, interpret=True)
  assert relative_error(out, numpy_truth(lazy, PLAIN)) <= 1e-5


def test_prefill_segments():
  shift = jnp.array([[4, 4, 9, 9, 9, 0, 0, 0]], jnp.int32)
  live = jnp.array([[1, 1, 1, 0, 1, 1, 1, 0]], bool)
  segments, segment_of_page = jax.jit(prefill_segments)(shift, live)
  # Runs: [0, 2) shift 4; [2, 4) shift 9 (page 3 dead ends it); [4, 5) shift
  # 9; [5, 7) shift 0, ending after the last live page.
  assert segments[0, :4].tolist() == [[0, 2, 4], [2, 4, 9], [4, 5, 9],
                                      [5, 7, 0]]
  assert segment_of_page[0].tolist() == [0, 0, 1, 1, 2, 3, 3, 3]


@pytest.mark.parametrize("shape", [(1,), (9,), (3, 544), (2, 4, 33)])
def test_prefix_sum_matches_cumsum(shape):
  x = np.random.default_rng(3).integers(0, 50, size=shape).astype(np.int32)
  got = jax.jit(prefix_sum)(jnp.asarray(x))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, axis=-1))


@pytest.mark.parametrize("shape", [(1,), (4, 8), (2, 3, 16)])
def test_fold_last_axis_matches_reductions(shape):
  x = np.random.default_rng(4).integers(-9, 9, size=shape).astype(np.int32)
  for op, reduce in ((jnp.maximum, np.max), (jnp.minimum, np.min)):
    got = jax.jit(lambda a, op=op: fold_last_axis(op, a))(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), reduce(x, axis=-1))
  got = fold_last_axis(jnp.logical_or, jnp.asarray(x > 5))
  np.testing.assert_array_equal(np.asarray(got), np.any(x > 5, axis=-1))


def test_block_sizes_validation_and_lookup():
  with pytest.raises(ValueError, match="block_q"):
    GpuBlockSizes(block_q=24)
  with pytest.raises(ValueError, match="block_kv"):
    GpuBlockSizes(block_kv=8)
  with pytest.raises(ValueError, match="kv_splits"):
    GpuBlockSizes(kv_splits=0)
  with pytest.raises(ValueError, match="kernel"):
    block_sizes_for("encode", dtype=jnp.float32, head_dim=64, group=1,
                    page_size=16)
  for kernel in ("decode", "prefill"):
    for dtype in (jnp.float32, jnp.bfloat16):
      sizes = block_sizes_for(kernel, dtype=dtype, head_dim=128, group=4,
                              page_size=16)
      assert isinstance(sizes, GpuBlockSizes)


def test_head_dim_must_be_power_of_two():
  args = zero_args(batch=1, q_len=1, num_heads=2, num_kv_heads=1,
                   head_dim=48, num_pages=4, page_size=8,
                   num_logical_pages=2)
  with pytest.raises(ValueError, match="head dim"):
    lazy_decode_gpu(*args, rope=PLAIN, sm_scale=jnp.float32(0.1))


@pytest.mark.parametrize("kernel,q_len", [(lazy_decode_gpu, 1),
                                          (lazy_prefill_gpu, 64)],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32],
                         ids=["bfloat16", "float32"])
def test_export_lowers_for_cuda(kernel, q_len, dtype):
  """Real Triton lowering (not interpret) of both kernels, on CPU."""
  batch, heads, head_dim = 2, 32, 128
  args = contract_specs(batch=batch, q_len=q_len, num_heads=heads,
                        num_kv_heads=8, head_dim=head_dim, num_pages=64,
                        page_size=16, num_logical_pages=20, dtype=dtype)
  fn = jax.jit(lambda *a: kernel(*a, rope=LLAMA3, sm_scale=jnp.float32(0.1),
                                 interpret=False))
  exported = export.export(
      fn, platforms=["cuda"],
      disabled_checks=[
          export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
      ])(*args)
  text = exported.mlir_module()
  assert "__gpu$xla.gpu.triton" in text
  assert exported.out_avals[0].shape == (batch, q_len, heads, head_dim)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,q_len", [(lazy_decode_gpu, 1),
                                          (lazy_prefill_gpu, 19)],
                         ids=["decode", "prefill"])
@pytest.mark.parametrize("head_dim", [16, 32])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32],
                         ids=["bfloat16", "float32"])
def test_small_head_dims_gpu(kernel, q_len, head_dim, dtype):
  """The Triton kernels score K in head-dim halves: at H 16 each dot's inner
  size is 8, under what a tensor-core dot takes, so only the real Triton
  compiler shows whether these head dims lower and compute right."""
  rng = np.random.default_rng(head_dim + q_len)
  lazy = make_case(rng, batch=2, q_len=q_len, num_heads=8, num_kv_heads=2,
                   head_dim=head_dim, page_size=16, dtype=dtype,
                   base_position=5000)
  out = _call_kernel(kernel, lazy, LLAMA3, None, interpret=False)
  assert not np.isnan(out).any()
  tol = TOLERANCE["bfloat16" if dtype == jnp.bfloat16 else "float32"]
  assert relative_error(out, numpy_truth(lazy, LLAMA3)) <= tol
