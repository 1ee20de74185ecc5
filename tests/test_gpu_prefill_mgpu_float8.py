"""Lazy prefill on float8 pages through Pallas Mosaic GPU
(gpu_prefill_mgpu*.py with k_scales / v_scales).

On CPU: the kernel is lowered for CUDA with jax.export, run in the Mosaic
GPU interpreter (slow tier, and two compute warpgroups only where the host
has four cores), and its float8 argument checks are tested.  On a GPU
(`@pytest.mark.gpu`): parity with one and two compute warpgroups, and the
model's path (`plan_lazy_attention`, then `lazy_attention` with the plan).
The 16-bit kernel's tests: test_gpu_prefill_mgpu.py.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes, lazy_prefill_mgpu
from pallas_kernels.testing import make_case
from tests.mgpu_prefill_helpers import BENCH, _specs, needs_interpreter
from tests.rope_configs import LLAMA3, PLAIN


# plank_pdl: the plan kernel and dependent launch (MgpuBlockSizes;
# both the default since 2026-12-04), else the XLA plan and a plain launch.
@pytest.mark.parametrize("num_compute_wgs,cos_sin_in_records,plank_pdl",
                         [(1, False, False), (2, False, False),
                          (2, True, False), (2, True, True)])
def test_float8_export_lowers_for_cuda(num_compute_wgs, cos_sin_in_records,
                                       plank_pdl):
  """float8 pages: a converter warpgroup widens the e4m3 ring (four
  warpgroups with the ping-pong's two compute warpgroups)."""
  specs = list(_specs(**BENCH))
  pages = jax.ShapeDtypeStruct(specs[1].shape, jnp.float8_e4m3fn)
  scales = jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32)
  sizes = MgpuBlockSizes(num_compute_wgs=num_compute_wgs,
                         cos_sin_in_records=cos_sin_in_records,
                         plan_in_kernel=plank_pdl,
                         dependent_launch=plank_pdl)
  fn = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=sizes,
      k_scales=a[8], v_scales=a[9]))
  exported = export.export(fn, platforms=["cuda"])(
      specs[0], pages, pages, *specs[3:], scales, scales)
  assert exported.out_avals[0].dtype == jnp.bfloat16
  assert ("griddepcontrol.wait" in exported.mlir_module()) == plank_pdl


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


@pytest.mark.gpu
@pytest.mark.parametrize("num_compute_wgs,cos_sin_in_records,plank_pdl",
                         [(1, False, False), (2, False, False),
                          (2, True, False), (2, True, True)])
def test_parity_gpu_float8(num_compute_wgs, cos_sin_in_records, plank_pdl):
  """float8 pages on the GPU: documents at shifts near 2^20, NaN in unused
  slots and NaN scales on unused pages, one and two compute warpgroups
  (and cos / sin read from the step records; and dependent launch)."""
  from pallas_kernels.testing import quantize_case
  from tests.test_gpu_decode_mgpu import _check_float8
  rng = np.random.default_rng(11)
  lazy = make_case(rng, batch=3, q_len=200, num_heads=32, num_kv_heads=8,
                   head_dim=128, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=4, max_doc_len=300, base_position=2**20)
  fp8, k_scales, v_scales = quantize_case(lazy)
  sizes = MgpuBlockSizes(num_compute_wgs=num_compute_wgs,
                         cos_sin_in_records=cos_sin_in_records,
                         plan_in_kernel=plank_pdl,
                         dependent_launch=plank_pdl)
  out = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a[:8], rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=sizes, k_scales=a[8], v_scales=a[9]))(
          *[jnp.asarray(a) for a in fp8.args()], k_scales, v_scales)
  _check_float8(out, lazy, fp8, k_scales, v_scales, LLAMA3)


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
