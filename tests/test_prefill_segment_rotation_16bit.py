"""The Mosaic GPU prefill's per-segment query rotation in packed 16-bit
arithmetic (MgpuBlockSizes.segment_rotation_16bit, the default) against the
f32 form: both within the bf16 tolerance of the float64 truth, not the same
bits (the switch reaches the kernel), and the 16-bit form's error at most
1.5x the f32 form's (measured 1.1-1.2x; docs/kernels.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes, lazy_prefill_mgpu
from pallas_kernels.testing import make_case, numpy_truth, relative_error
from tests.mgpu_prefill_helpers import (BF16_TOLERANCE, _call, _check,
                                        gpu_case, needs_interpreter)
from tests.rope_configs import LLAMA3, PLAIN

# The 16-bit form may lose at most this factor of the f32 form's error
# against the float64 truth.
ERROR_RATIO = 1.5


def test_default_rotates_segments_in_16bit():
  assert MgpuBlockSizes().segment_rotation_16bit
  assert not MgpuBlockSizes(
      segment_rotation_16bit=False).segment_rotation_16bit


def _both_forms(lazy, rope, sizes, outputs):
  """Checks the 16-bit form (`sizes`) and the f32 form against the truth
  and each other; `outputs(block sizes)` runs the call."""
  f32 = dataclasses.replace(sizes, segment_rotation_16bit=False)
  out16 = np.asarray(outputs(sizes).astype(jnp.float32))
  out32 = np.asarray(outputs(f32).astype(jnp.float32))
  _check(out16, lazy, rope)
  _check(out32, lazy, rope)
  assert not np.array_equal(out16, out32), "the switch changed nothing"
  truth = numpy_truth(lazy, rope)
  err16, err32 = relative_error(out16, truth), relative_error(out32, truth)
  assert err16 <= BF16_TOLERANCE
  assert err16 <= ERROR_RATIO * err32, (err16, err32)


@needs_interpreter
@pytest.mark.parametrize("rope,base,head_dim", [
    (PLAIN, 5000, 64), pytest.param(LLAMA3, 2**20, 128, marks=pytest.mark.slow)],
    ids=["plain_base5000_h64", "llama3_base2^20_h128"])
def test_parity_interpret(rope, base, head_dim):
  """Ragged documents (several segments a CTA, some one step long) at
  large positions, two warpgroups in ping-pong."""
  rng = np.random.default_rng(base % 97)
  lazy = make_case(rng, batch=1, q_len=9, num_heads=4, num_kv_heads=2,
                   head_dim=head_dim, page_size=16, dtype=jnp.bfloat16,
                   max_doc_len=60, base_position=base)
  _both_forms(lazy, rope, MgpuBlockSizes(block_kv=64),
              lambda sizes: _call(lazy.args(), rope=rope, interpret=True,
                                  block_sizes=sizes))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ((8, 2), 128, 16, 70, 2**20, LLAMA3, MgpuBlockSizes()),
    ((9, 3), 64, 8, 37, 60000, PLAIN, MgpuBlockSizes()),
], ids=["8-2_H128_llama3", "9-3_H64_plain"])
def test_parity_gpu(case):
  lazy, rope = gpu_case(case)
  head_dim = case[1]
  args = [jnp.asarray(a) for a in lazy.args()]

  def outputs(sizes):
    return jax.jit(lambda *a: lazy_prefill_mgpu(
        *a, rope=rope, sm_scale=jnp.float32(head_dim ** -0.5),
        block_sizes=sizes))(*args)
  _both_forms(lazy, rope, case[-1], outputs)
