"""The producer's L2 prefetch of a step's K and V pages
(`MgpuBlockSizes.l2_prefetch`, `MgpuDecodeBlockSizes.l2_prefetch`,
`gpu_mgpu_producer.produce_kv_ring`): present in the CUDA lowering of both
Mosaic GPU kernels only where asked; on a GPU (`@pytest.mark.gpu`) the
same output, bit for bit, as without, on shuffled pages and on a
document's consecutive pages (whole-block copies)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_block_sizes import MgpuBlockSizes
from pallas_kernels.gpu_decode_mgpu import (default_decode_block_sizes,
                                            lazy_decode_mgpu)
from pallas_kernels.gpu_prefill_mgpu import lazy_prefill_mgpu
from pallas_kernels.testing import contract_specs, make_case
from tests.rope_configs import LLAMA3

DECODE = default_decode_block_sizes(jnp.bfloat16)
FLOAT8_DECODE = default_decode_block_sizes(jnp.float8_e4m3fn)
PREFETCH_INSTRUCTION = "cp.async.bulk.prefetch"


def _lowered(kernel, q_len, block_sizes, dtype=jnp.bfloat16):
  specs = contract_specs(batch=4, q_len=q_len, num_heads=32, num_kv_heads=8,
                         head_dim=128, num_pages=4 * 256, page_size=16,
                         num_logical_pages=256, dtype=dtype)
  if dtype == jnp.float8_e4m3fn:  # float8 pools: queries in bf16, scales
    specs = [jax.ShapeDtypeStruct(specs[0].shape, jnp.bfloat16), *specs[1:]]
    scales = jax.ShapeDtypeStruct((8, 4 * 256), jnp.float32)
    call = lambda *a: kernel(*a[:8], rope=LLAMA3, sm_scale=jnp.float32(0.088),
                             block_sizes=block_sizes, k_scales=a[8],
                             v_scales=a[9])
    specs += [scales, scales]
  else:
    call = lambda *a: kernel(*a, rope=LLAMA3, sm_scale=jnp.float32(0.088),
                             block_sizes=block_sizes)
  return jax.export.export(jax.jit(call), platforms=["cuda"])(
      *specs).mlir_module()


@pytest.mark.parametrize("kernel,q_len,sizes,dtype", [
    (lazy_decode_mgpu, 1, DECODE, jnp.bfloat16),
    (lazy_decode_mgpu, 1, FLOAT8_DECODE, jnp.float8_e4m3fn),
    (lazy_prefill_mgpu, 256, MgpuBlockSizes(), jnp.bfloat16),
], ids=["decode", "decode_float8", "prefill"])
@pytest.mark.parametrize("prefetch", [False, True])
def test_prefetch_is_lowered_only_where_asked(kernel, q_len, sizes, dtype,
                                              prefetch):
  module = _lowered(kernel, q_len,
                    dataclasses.replace(sizes, l2_prefetch=prefetch), dtype)
  assert (PREFETCH_INSTRUCTION in module) == prefetch


def _pages_case(shuffle_pages, q_len):
  lazy = make_case(np.random.default_rng(21), batch=3, q_len=q_len,
                   num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                   dtype=jnp.bfloat16, docs_per_row=4, max_doc_len=300,
                   base_position=2**20, shuffle_pages=shuffle_pages)
  return [jnp.asarray(a) for a in lazy.args()]


@pytest.mark.gpu
@pytest.mark.parametrize("shuffle_pages", [True, False],
                         ids=["shuffled", "consecutive"])
@pytest.mark.parametrize("kernel,q_len,sizes", [
    (lazy_decode_mgpu, 1, DECODE),
    (lazy_prefill_mgpu, 200, MgpuBlockSizes()),
], ids=["decode", "prefill"])
def test_prefetch_changes_nothing_on_the_gpu(kernel, q_len, sizes,
                                              shuffle_pages):
  args = _pages_case(shuffle_pages, q_len)
  run = lambda s: np.asarray(jax.jit(lambda *a: kernel(
      *a, rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5), block_sizes=s))(
          *args).astype(jnp.float32))
  with_prefetch = run(dataclasses.replace(sizes, l2_prefetch=True))
  assert np.isfinite(with_prefetch).all()
  np.testing.assert_array_equal(with_prefetch, run(sizes))
