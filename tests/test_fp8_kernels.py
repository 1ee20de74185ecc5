"""float8 (e4m3) KV pages in the lazy attention kernels, checked on CPU.

Every implementation (xla; GPU Triton decode and prefill in generic
interpret mode; TPU decode and prefill under `pltpu.InterpretParams()`)
runs on the same quantized pages as the jnp reference:

- against the reference and the float64 truth of the *dequantized* pages at
  the kernels' usual tolerances (1e-5 float32, 2e-2 bfloat16): dequantizing
  in registers must compute the contract on exactly those pages (the scales
  are powers of two, so widening and scaling are exact);
- against the truth of the *unquantized* pages at QUANTIZATION_TOLERANCE.

Cases carry NaN in every slot that must not be read and NaN scales on every
page no row uses.  Also here: the argument checks for scales, the scale
rule, and `jax.export` lowering of the float8 kernels for TPU and CUDA.
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
from pallas_kernels.gpu_decode import lazy_decode_gpu
from pallas_kernels.gpu_prefill import lazy_prefill_gpu
from models.quantized_pool import write_quantized_rows
from pallas_kernels.kv_quant import (FP8_DTYPE, FP8_MAX, dequantize_pages,
                                     power_of_two_scale, quantize)
from pallas_kernels.testing import (contract_specs, make_case, numpy_truth,
                                    quantize_case, relative_error, zero_args)
from pallas_kernels.tpu_decode import lazy_decode_tpu
from pallas_kernels.tpu_prefill import lazy_prefill_tpu
from tests.rope_configs import LLAMA3, PLAIN

TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 2e-2}
# Quantized against unquantized pages.  Each dequantized K and V element is
# within 2^-4 of its value, relative (round to nearest with e4m3's 3-bit
# mantissa; power-of-two scales keep normal values normal), and the rounding
# error is about uniform, RMS 2^-4 / sqrt(3) = 0.036 relative.  The output
# is a softmax-weighted mean of V rows (its V error is at most V's RMS
# error) plus the weights' change from K's error in the scores (about the
# same size again for unit-scale scores); measured 0.02-0.03 on these cases.
# 2^-4 bounds the two together without covering a real bug (a wrong scale
# or page gives errors of order 1).
QUANTIZATION_TOLERANCE = 2.0**-4


@dataclasses.dataclass(frozen=True)
class Case:
  impl: str
  q_len: int
  dtype: str
  heads: tuple[int, int] = (9, 3)
  head_dim: int = 32
  page_size: int = 8
  max_doc_len: int = 20  # under 8: every document within one page
  base_position: int = 0
  rope: RopeConfig = PLAIN
  v_magnitude: float = 1.0  # V's values are scaled by it

  @property
  def id(self):
    return (f"{self.impl}_T{self.q_len}_{self.dtype}_{self.heads[0]}-"
            f"{self.heads[1]}_p{self.page_size}_doc{self.max_doc_len}"
            f"{'' if self.v_magnitude == 1 else f'_v{self.v_magnitude:g}'}")


CASES = [
    Case("xla", 1, "float32"),
    Case("xla", 7, "bfloat16", max_doc_len=5, rope=LLAMA3),
    Case("gpu", 1, "bfloat16", base_position=2**20),
    Case("gpu", 7, "float32", heads=(8, 8), max_doc_len=6),
    # Small V scales: P times the scale sank below float16's range (5e-2
    # relative error); the Mosaic kernels and XLA were right.
    Case("gpu", 1, "float16", v_magnitude=1e-4),
    Case("gpu", 5, "float16", heads=(4, 2), v_magnitude=1e-4),
    Case("xla", 5, "float16", heads=(4, 2), v_magnitude=1e-4),
    Case("tpu", 1, "float32", max_doc_len=7, rope=LLAMA3),
    Case("tpu", 7, "bfloat16", heads=(4, 4), page_size=16,
         base_position=60000),
]


def _dequantized(case, k_scales, v_scales):
  """The quantized case's pages as float32 (NaN where a slot or scale is)."""
  return dataclasses.replace(
      case, k_pages=np.asarray(dequantize_pages(case.k_pages, k_scales)),
      v_pages=np.asarray(dequantize_pages(case.v_pages, v_scales)))


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_float8_pages_match_reference_and_unquantized_truth(case):
  # crc32, not hash(): str hashes change with each process (PYTHONHASHSEED),
  # so a failing case could not be run again.
  rng = np.random.default_rng(zlib.crc32(case.id.encode()))
  lazy = make_case(rng, batch=2, q_len=case.q_len, num_heads=case.heads[0],
                   num_kv_heads=case.heads[1], head_dim=case.head_dim,
                   page_size=case.page_size, dtype=jnp.dtype(case.dtype),
                   max_doc_len=case.max_doc_len,
                   base_position=case.base_position)
  lazy = dataclasses.replace(lazy, v_pages=lazy.v_pages * case.v_magnitude)
  fp8, k_scales, v_scales = quantize_case(lazy)
  assert fp8.k_pages.dtype == FP8_DTYPE
  out = lazy_attention(*fp8.args(), rope=case.rope, impl=case.impl,
                       interpret=True, k_scales=k_scales, v_scales=v_scales)
  assert out.shape == lazy.q.shape and out.dtype == lazy.q.dtype
  out = np.asarray(out.astype(jnp.float32))
  assert not np.isnan(out).any(), "NaN leaked into the output"
  reference = np.asarray(lazy_attention_reference(
      *fp8.args(), rope=case.rope, k_scales=k_scales,
      v_scales=v_scales).astype(jnp.float32))
  same_pages = numpy_truth(_dequantized(fp8, k_scales, v_scales), case.rope)
  tol = TOLERANCE[case.dtype]
  assert relative_error(out, reference) <= tol
  assert relative_error(out, same_pages) <= tol
  err = relative_error(out, numpy_truth(lazy, case.rope))
  assert err <= QUANTIZATION_TOLERANCE, f"vs unquantized: {err:.3g}"
  assert err > 0  # the pages really were quantized
  assert np.all(out[lazy.q_pos < 0] == 0.0), "padding rows must be zero"


def test_scale_rule_is_a_power_of_two_that_never_saturates():
  amax = jnp.asarray([0.0, 1e-30, 0.37, 448.0, 449.0, 896.0, 3e4],
                     jnp.float32)
  scale = np.asarray(power_of_two_scale(amax))
  assert scale[0] == 0.0
  mantissa, _ = np.frexp(scale[1:])
  assert np.all(mantissa == 0.5), "scales are powers of two"
  assert np.all(np.asarray(amax[1:]) / scale[1:] <= FP8_MAX)
  assert np.all(np.asarray(amax[1:]) / scale[1:] > FP8_MAX / 2), "tight"
  values = jnp.asarray([0.37, -0.2, 1e-3], jnp.float32)
  s = power_of_two_scale(jnp.max(jnp.abs(values)))
  back = np.asarray(quantize(values, s).astype(jnp.float32) * s)
  np.testing.assert_allclose(back, np.asarray(values), rtol=2.0**-4)
  assert np.all(np.asarray(quantize(values, 0.0).astype(jnp.float32)) == 0)


def test_scale_rule_below_float32s_normal_range():
  # amax / 448 under float32's smallest normal was flushed to 0 on CPU and
  # gave a scale of 1, which a page then kept: a later token of 0.005-0.01
  # in it read back 17% off.  (A subnormal amax is itself flushed to 0.)
  tiny = np.finfo(np.float32).tiny
  amax = jnp.asarray([1e-35, 4e-36, 1e-37, 2e-38], jnp.float32)
  scale = np.asarray(power_of_two_scale(amax))
  np.testing.assert_array_equal(scale[1:], tiny)
  assert scale[0] == 2.0**-125 and np.all(np.asarray(amax) / scale <= FP8_MAX)
  pages = jnp.zeros((1, 4, 8), jnp.uint8)
  scales = jnp.zeros((1, 1), jnp.float32)
  pages, scales = write_quantized_rows(
      pages, scales, jnp.array([0], jnp.int32),
      jnp.full((1, 1, 8), 4e-36, jnp.float32), 4)
  later = jnp.linspace(0.005, 0.01, 8, dtype=jnp.float32)[None, None]
  pages, scales = write_quantized_rows(pages, scales, jnp.array([1], jnp.int32),
                                       later, 4)
  back = np.asarray(jax.lax.bitcast_convert_type(pages, FP8_DTYPE)
                    .astype(jnp.float32)[0, 1] * scales[0, 0])
  np.testing.assert_allclose(back, np.asarray(later[0, 0]), rtol=2.0**-4)


def _fp8_args(**sizes):
  args = zero_args(**sizes)
  args[1] = args[1].astype(FP8_DTYPE)
  args[2] = args[2].astype(FP8_DTYPE)
  scales = jnp.ones(args[1].shape[:2], jnp.float32)
  return args, scales


SIZES = dict(batch=1, q_len=1, num_heads=4, num_kv_heads=2, head_dim=16,
             num_pages=6, page_size=8, num_logical_pages=2)


@pytest.mark.parametrize("k_scales,v_scales,match", [
    (None, "ok", r"float8_e4m3fn pages need k_scales \(float32 \[K, "
                 r"num_pages\] = \(2, 6\)\), got None"),
    ("ok", None, "float8_e4m3fn pages need v_scales"),
    ("ok", jnp.ones((2, 5), jnp.float32),
     r"v_scales shape \(2, 5\) must be \[K, num_pages\] = \(2, 6\)"),
    (jnp.ones((2, 6, 8), jnp.float32), "ok",
     r"k_scales shape \(2, 6, 8\) must be \[K, num_pages\]"),
    (jnp.ones((2, 6), jnp.bfloat16), "ok",
     "k_scales must be float32, got bfloat16"),
    ("ok", 1.0, "v_scales must be an array, got float"),
])
def test_bad_scales_raise_value_error_naming_them(k_scales, v_scales, match):
  args, ok = _fp8_args(**SIZES)
  k_scales = ok if isinstance(k_scales, str) else k_scales
  v_scales = ok if isinstance(v_scales, str) else v_scales
  with pytest.raises(ValueError, match=match):
    lazy_attention(*args, rope=PLAIN, impl="xla", k_scales=k_scales,
                   v_scales=v_scales)


def test_scales_with_unquantized_pages_and_mixed_pools_are_refused():
  args = zero_args(**SIZES)
  scales = jnp.ones((2, 6), jnp.float32)
  with pytest.raises(ValueError, match="k_scales is only taken with "
                     "float8_e4m3fn pages; k_pages is float32"):
    lazy_attention(*args, rope=PLAIN, impl="xla", k_scales=scales,
                   v_scales=scales)
  fp8_args, scales = _fp8_args(**SIZES)
  mixed = list(fp8_args)
  mixed[2] = args[2]  # float32 values with float8 keys
  with pytest.raises(ValueError, match="v_pages dtype float32 must equal "
                     "k_pages dtype float8_e4m3fn"):
    lazy_attention(*mixed, rope=PLAIN, impl="xla", k_scales=scales,
                   v_scales=scales)
  e5m2 = list(fp8_args)
  e5m2[1] = e5m2[2] = args[1].astype(jnp.float8_e5m2)
  with pytest.raises(ValueError, match="k_pages dtype float8_e5m2 must "
                     "equal q dtype float32"):
    lazy_attention(*e5m2, rope=PLAIN, impl="xla")


def _fp8_specs(dtype, q_len, num_heads, num_kv_heads, head_dim, page_size):
  specs = contract_specs(batch=2, q_len=q_len, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, head_dim=head_dim,
                         num_pages=64, page_size=page_size,
                         num_logical_pages=20, dtype=dtype)
  pages = jax.ShapeDtypeStruct(specs[1].shape, FP8_DTYPE)
  scales = jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32)
  return [specs[0], pages, pages, *specs[3:], scales, scales]


def _export(kernel, specs, platform):
  def attend(*a):
    return kernel(*a[:8], rope=LLAMA3, sm_scale=jnp.float32(0.1),
                  interpret=False, k_scales=a[8], v_scales=a[9])

  checks = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
  return export.export(jax.jit(attend), platforms=[platform],
                       disabled_checks=checks)(*specs)


@pytest.mark.parametrize("kernel,q_len", [(lazy_decode_gpu, 1),
                                          (lazy_prefill_gpu, 16)],
                         ids=["decode", "prefill"])
def test_float8_gpu_kernels_export_for_cuda(kernel, q_len):
  specs = _fp8_specs(jnp.bfloat16, q_len, 32, 8, 128, 16)
  exported = _export(kernel, specs, "cuda")
  assert "__gpu$xla.gpu.triton" in exported.mlir_module()
  assert exported.out_avals[0].shape == (2, q_len, 32, 128)


@pytest.mark.parametrize("kernel,q_len,dtype", [
    (lazy_decode_tpu, 1, jnp.bfloat16), (lazy_prefill_tpu, 16, jnp.float32)],
    ids=["decode", "prefill"])
def test_float8_tpu_kernels_export_for_tpu(kernel, q_len, dtype):
  specs = _fp8_specs(dtype, q_len, 9, 3, 64, 16)
  exported = _export(kernel, specs, "tpu")
  assert "tpu_custom_call" in exported.mlir_module()
  assert exported.out_avals[0].dtype == dtype


def test_float8_gpu_prefill_takes_the_mosaic_kernel_with_a_plan():
  """On Hopper, float8 prefill runs the Mosaic GPU kernel (its converter
  warpgroup dequantizes), as 16-bit pages do: `plan_lazy_attention` makes
  a plan, and `lazy_attention` with it lowers to one Mosaic GPU call per
  layer and no Triton call."""
  from pallas_kernels.lazy_attention import (_gpu_prefill_kernel,
                                             plan_lazy_attention)
  specs = _fp8_specs(jnp.bfloat16, 16, 32, 8, 128, 16)
  assert _gpu_prefill_kernel(specs[0], specs[1], False) == "mosaic"
  assert _gpu_prefill_kernel(specs[0], specs[1], True) == "triton"

  def attend(*a):
    plan = plan_lazy_attention(a[0], a[1], *a[3:8], rope=LLAMA3, impl="gpu")
    assert plan is not None
    return lazy_attention(*a[:8], rope=LLAMA3, sm_scale=jnp.float32(0.1),
                          impl="gpu", plan=plan, k_scales=a[8],
                          v_scales=a[9])

  exported = export.export(jax.jit(attend), platforms=["cuda"])(*specs)
  module = exported.mlir_module()
  assert "mosaic_gpu" in module and "triton" not in module
  assert exported.out_avals[0].shape == (2, 16, 32, 128)
