"""The Mosaic GPU decode's block plan made in one Pallas launch
(gpu_decode_plan_kernel.plan_decode_kernel, `MgpuDecodeBlockSizes.
plan_in_kernel`) against the XLA plan (`plan_decode`), array for array and
bit for bit: in the Mosaic GPU interpreter on random page metadata (dead,
partial and shuffled pages, shifts that change inside a block, padding
rows, rows with no live page, page counts that are not whole 128-page
pieces), lowered for CUDA, and on the GPU; the shapes it refuses; and the
whole decode call with it and with dependent launch."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_decode_mgpu
from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_decode_mgpu import (default_decode_block_sizes,
                                            lazy_decode_mgpu, plan_decode)
from pallas_kernels.gpu_decode_plan_kernel import (
    decode_plan_kernel_unsupported, plan_decode_kernel)
from pallas_kernels.testing import contract_specs
from tests.rope_configs import LLAMA3
from tests.test_mgpu_plan_records import (assert_same_plans,
                                         random_page_fields)

HEAD_DIM = 128
# The 16-bit default's steps, with the XLA plan (BLOCKS) or the kernel.
BLOCKS = MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True,
                              plan_in_kernel=False)
WITH_KERNEL = dataclasses.replace(BLOCKS, plan_in_kernel=True)


def decode_inputs(seed, *, batch, num_logical, page_size):
  """(page_table, page_pos, page_shift, page_len, q_pos [B, 1]):
  `random_page_fields`, each row's query at its own position; row 0 a
  padding row, row 1 (if any) one too (q_pos -5, odd seeds) or at 0."""
  rng = np.random.default_rng(seed)
  table, pos, shift, length = random_page_fields(rng, batch, num_logical,
                                                 page_size)
  q_pos = rng.integers(0, num_logical * page_size, (batch, 1))
  q_pos[0] = -1
  if batch > 1:
    q_pos[1] = -5 if seed % 2 else 0
  return [jnp.asarray(a, jnp.int32) for a in (table, pos, shift, length,
                                              q_pos)]


def assert_same_plan(args, *, interpret, page_size, block_sizes=WITH_KERNEL):
  kw = dict(rope=LLAMA3, head_dim=HEAD_DIM,
            num_pages=args[0].size, page_size=page_size)
  expected = jax.jit(lambda *a: plan_decode(
      *a, block_sizes=dataclasses.replace(block_sizes, plan_in_kernel=False),
      **kw))(*args)
  got = jax.jit(lambda *a: plan_decode(
      *a, block_sizes=block_sizes, interpret=interpret, **kw))(*args)
  assert_same_plans(got, expected)
  return expected


CASES = [
    # seed, batch, logical pages, page size, block_kv
    (1, 3, 128, 16, 128),
    (2, 2, 200, 16, 128),  # the last piece overlaps the one before
    (3, 3, 272, 8, 128),  # 16 pages a block
    (4, 3, 136, 8, 64),
    (5, 4, 512, 16, 128),
]


@pytest.mark.parametrize("case", CASES)
def test_plan_kernel_matches_the_xla_plan_in_the_interpreter(case):
  seed, batch, num_logical, page_size, block_kv = case
  args = decode_inputs(seed, batch=batch, num_logical=num_logical,
                       page_size=page_size)
  sizes = dataclasses.replace(WITH_KERNEL, block_kv=block_kv)
  assert decode_plan_kernel_unsupported(
      num_logical_pages=num_logical, page_size=page_size,
      block_sizes=sizes) is None
  plan = assert_same_plan(args, interpret=True, page_size=page_size,
                          block_sizes=sizes)
  assert int(np.asarray(plan.n_steps).max()) > 0  # not a vacuous case
  assert int(np.asarray(plan.n_steps)[0]) == 0  # the padding row


# The 16-bit default (plan_in_kernel None) takes the kernel on the GPU and
# the XLA plan when interpreting; float8's segment steps never take it.
@pytest.mark.parametrize("sizes,interpret,num_logical,kernel_calls", [
    (WITH_KERNEL, True, 128, 1), (BLOCKS, True, 128, 0),
    (WITH_KERNEL, True, 120, 0), (WITH_KERNEL, True, 132, 0),
    (default_decode_block_sizes(jnp.bfloat16), False, 128, 1),
    (default_decode_block_sizes(jnp.bfloat16), True, 128, 0),
    (default_decode_block_sizes(jnp.bfloat16), False, 120, 0),
    (default_decode_block_sizes(jnp.float8_e4m3fn), False, 128, 0)])
def test_plan_decode_takes_the_kernel_only_where_asked_and_supported(
    monkeypatch, sizes, interpret, num_logical, kernel_calls):
  calls = []
  real = gpu_decode_mgpu.plan_decode_kernel
  monkeypatch.setattr(gpu_decode_mgpu, "plan_decode_kernel",
                      lambda *a, **k: calls.append(1) or real(*a, **k))
  args = decode_inputs(7, batch=2, num_logical=num_logical, page_size=16)
  jax.eval_shape(lambda *a: plan_decode(
      *a, rope=LLAMA3, head_dim=HEAD_DIM, num_pages=2 * num_logical,
      page_size=16, block_sizes=sizes, interpret=interpret), *args)
  assert len(calls) == kernel_calls


@pytest.mark.parametrize("sizes,num_logical,page_size,message", [
    (MgpuDecodeBlockSizes(), 128, 16, "block plans with the RoPE"),
    (dataclasses.replace(BLOCKS, fields_in_kernel=True), 128, 16,
     "block plans with the RoPE"),
    (dataclasses.replace(BLOCKS, block_kv=64), 128, 16,
     "pages per block, at least 8, got 4"),
    (BLOCKS, 120, 16, "at least 128 logical pages"),
    (BLOCKS, 132, 16, "a multiple of the 8 pages per block, got 132"),
])
def test_plan_kernel_refuses_shapes_it_does_not_take(sizes, num_logical,
                                                     page_size, message):
  assert message in decode_plan_kernel_unsupported(
      num_logical_pages=num_logical, page_size=page_size, block_sizes=sizes)
  args = decode_inputs(8, batch=1, num_logical=num_logical,
                       page_size=page_size)
  with pytest.raises(ValueError, match=message):
    plan_decode_kernel(*args, num_pages=num_logical, page_size=page_size,
                       block_sizes=sizes, interpret=True)


@pytest.mark.parametrize("plan_in_kernel", [False, True, None])
@pytest.mark.parametrize("dependent_launch", [False, True])
def test_dependent_launch_lowers_to_grid_dependency_control(
    plan_in_kernel, dependent_launch):
  """The decode kernel waits (and the plan kernel lets it launch) only where
  asked: the instructions in the CUDA lowering of the whole call at the
  benchmark's shape (B 64, 8K context, pages of 16)."""
  sizes = dataclasses.replace(BLOCKS, plan_in_kernel=plan_in_kernel,
                              dependent_launch=dependent_launch)
  module = jax.export.export(jax.jit(lambda *a: lazy_decode_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=sizes)),
      platforms=["cuda"])(*contract_specs(
          batch=64, q_len=1, num_heads=32, num_kv_heads=8, head_dim=HEAD_DIM,
          num_pages=64 * 512, page_size=16, num_logical_pages=512,
          dtype=jnp.bfloat16)).mlir_module()
  with_plan_kernel = plan_in_kernel is not False  # None: not interpreting
  assert len(re.findall(r"custom_call @mosaic_gpu", module)) == (
      1 + with_plan_kernel)
  assert ("griddepcontrol.wait" in module) == dependent_launch
  assert ("griddepcontrol.launch_dependents" in module) == (
      dependent_launch and with_plan_kernel)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_plan_kernel_matches_the_xla_plan_on_the_gpu(case):
  seed, batch, num_logical, page_size, block_kv = case
  args = decode_inputs(seed, batch=batch, num_logical=num_logical,
                       page_size=page_size)
  assert_same_plan(
      args, interpret=False, page_size=page_size,
      block_sizes=dataclasses.replace(WITH_KERNEL, block_kv=block_kv))


# With dependent_launch the decode kernel may start before the plan ends: a
# read before its wait would race (and differ).
@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    WITH_KERNEL, dataclasses.replace(WITH_KERNEL, dependent_launch=True),
    dataclasses.replace(BLOCKS, dependent_launch=True),
], ids=["plan_kernel", "plan_kernel_dependent_launch", "dependent_launch"])
def test_whole_call_matches_the_xla_plan_and_a_plain_launch(sizes):
  batch, num_logical, page_size, kv_heads, group = 8, 256, 16, 4, 4
  table, pos, shift, length, q_pos = decode_inputs(
      9, batch=batch, num_logical=num_logical, page_size=page_size)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  pages = (kv_heads, batch * num_logical, page_size, HEAD_DIM)
  k = jax.random.normal(keys[0], pages, jnp.bfloat16)
  v = jax.random.normal(keys[1], pages, jnp.bfloat16)
  q = jax.random.normal(keys[2], (batch, 1, kv_heads * group, HEAD_DIM),
                        jnp.bfloat16)
  run = lambda s: np.asarray(jax.jit(lambda *a: lazy_decode_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=s))(
          q, k, v, table, pos, shift, length, q_pos).astype(jnp.float32))
  got = run(sizes)
  assert np.all(np.isfinite(got[1:]))  # row 0 is a padding row
  np.testing.assert_array_equal(got, run(BLOCKS))
