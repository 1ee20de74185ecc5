"""The Mosaic GPU prefill's plan made in one Pallas launch
(gpu_prefill_plan_kernel.plan_prefill_kernel) against the XLA plan
(gpu_prefill_mgpu_plan.plan_prefill), array for array and bit for bit: in
the Mosaic GPU interpreter on random page metadata (dead, partial and
shuffled pages, shifts that change inside a block, padding query rows,
page counts that do not fill the last KV block), lowered for CUDA, and on
the GPU; the shapes it refuses; and `choose_prefill_plan`'s choice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import gpu_prefill_mgpu
from pallas_kernels.gpu_block_sizes import MgpuBlockSizes
from pallas_kernels.gpu_prefill_mgpu_plan import plan_prefill
from pallas_kernels.gpu_prefill_plan_kernel import (plan_kernel_unsupported,
                                                    plan_prefill_kernel)
from tests.mgpu_prefill_helpers import BENCH, _specs
from tests.rope_configs import LLAMA3, PLAIN
from tests.test_mgpu_plan_records import (assert_same_plans,
                                         random_page_fields)

PAGE_SIZE = 16
HEAD_DIM = 128


def plan_inputs(seed, *, batch, num_logical, q_len):
  """(page_table, page_pos, page_shift, page_len, q_pos) of 16-token pages:
  `random_page_fields`, a chunk at a random position with up to
  four padding rows first."""
  rng = np.random.default_rng(seed)
  table, pos, shift, length = random_page_fields(rng, batch, num_logical,
                                                 PAGE_SIZE)
  q_pos = int(rng.integers(0, num_logical * PAGE_SIZE)) + np.arange(q_len)
  q_pos = np.repeat(q_pos[None], batch, axis=0)
  q_pos[:, :int(rng.integers(0, 5))] = -1
  return [jnp.asarray(a, jnp.int32) for a in (table, pos, shift, length,
                                              q_pos)]


def assert_same_plan(args, *, interpret, **kw):
  expected = jax.jit(lambda *a: plan_prefill(*a, **kw))(*args)
  got = jax.jit(lambda *a: plan_prefill_kernel(*a, interpret=interpret,
                                               **kw))(*args)
  assert_same_plans(got, expected)
  return expected


CASES = [
    # seed, batch, logical pages, q_len, group, block_kv, warpgroups, rope
    # (, other MgpuBlockSizes fields)
    (1, 2, 150, 130, 4, 128, 2, LLAMA3),
    (13, 1, 263, 200, 3, 64, 1, PLAIN),
]
SLOW_CASES = [
    (10, 2, 129, 128, 1, 128, 2, LLAMA3),
    # The query rotated by XLA: the plan's query table is a placeholder.
    (11, 1, 140, 128, 4, 128, 2, LLAMA3, dict(query_rope_in_kernel=False)),
    (14, 1, 300, 257, 2, 64, 2, PLAIN),
    (15, 2, 544, 512, 4, 128, 2, LLAMA3),
    (16, 1, 150, 257, 8, 128, 1, LLAMA3),
]


def _case_kw(case):
  seed, batch, num_logical, q_len, group, block_kv, wgs, rope, *more = case
  args = plan_inputs(seed, batch=batch, num_logical=num_logical, q_len=q_len)
  kw = dict(rope=rope, group=group, head_dim=HEAD_DIM,
            num_pages=batch * num_logical, page_size=PAGE_SIZE,
            block_sizes=MgpuBlockSizes(block_kv=block_kv,
                                       num_compute_wgs=wgs,
                                       **(more[0] if more else {})))
  return args, kw


@pytest.mark.parametrize("case", CASES)
def test_plan_kernel_matches_the_xla_plan_in_the_interpreter(case):
  args, kw = _case_kw(case)
  plan = assert_same_plan(args, interpret=True, **kw)
  assert int(np.asarray(plan.n_steps).max()) > 0  # not a vacuous case


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES)
def test_plan_kernel_matches_the_xla_plan_in_the_interpreter_more(case):
  args, kw = _case_kw(case)
  assert_same_plan(args, interpret=True, **kw)


def test_plan_kernel_lowers_for_cuda():
  """At the H200 benchmark's shape (B 4, 544 pages, a 512-token chunk)."""
  shapes = [jax.ShapeDtypeStruct((4, 544), jnp.int32)] * 4 + [
      jax.ShapeDtypeStruct((4, 512), jnp.int32)]
  exported = jax.export.export(
      jax.jit(lambda *a: plan_prefill_kernel(
          *a, rope=LLAMA3, group=4, head_dim=HEAD_DIM, num_pages=4 * 544,
          page_size=PAGE_SIZE)), platforms=["cuda"])(*shapes)
  assert "mosaic_gpu" in exported.mlir_module()


@pytest.mark.parametrize("kwargs,message", [
    (dict(head_dim=64), "head dim 128, got 64"),
    (dict(num_logical_pages=128), "more than 128 logical pages, got 128"),
    (dict(q_len=127), "at least 128 query tokens, got 127"),
    (dict(block_sizes=MgpuBlockSizes(cos_sin_in_records=False)),
     "records that carry cos / sin"),
])
def test_plan_kernel_refuses_shapes_it_does_not_take(kwargs, message):
  base = dict(num_logical_pages=150, q_len=130, head_dim=HEAD_DIM,
              block_sizes=MgpuBlockSizes())
  base.update(kwargs)
  assert message in plan_kernel_unsupported(**base)
  num_logical, q_len = base["num_logical_pages"], base["q_len"]
  args = plan_inputs(1, batch=1, num_logical=num_logical, q_len=q_len)
  with pytest.raises(ValueError, match=message):
    plan_prefill_kernel(*args, rope=LLAMA3, group=4,
                        head_dim=base["head_dim"], num_pages=num_logical,
                        page_size=PAGE_SIZE, block_sizes=base["block_sizes"])


# None (the default): the kernel on the GPU, the XLA plan when interpreting.
@pytest.mark.parametrize("plan_in_kernel,interpret,num_logical,kernel_calls", [
    (True, False, 150, 1), (True, True, 150, 1), (True, False, 100, 0),
    (False, False, 150, 0), (None, False, 150, 1), (None, True, 150, 0),
    (None, False, 100, 0)])
def test_choose_prefill_plan_takes_the_kernel_where_asked_and_supported(
    monkeypatch, plan_in_kernel, interpret, num_logical, kernel_calls):
  calls = []
  monkeypatch.setattr(gpu_prefill_mgpu, "plan_prefill_kernel",
                      lambda *a, **k: calls.append(1) or plan_prefill(
                          *a, **{n: v for n, v in k.items()
                                 if n != "interpret"}))
  args = plan_inputs(1, batch=1, num_logical=num_logical, q_len=130)
  # Traced only (the choice is made while tracing): no plan is computed.
  plan = jax.eval_shape(lambda *a: gpu_prefill_mgpu.choose_prefill_plan(
      *a, rope=LLAMA3, group=4, head_dim=HEAD_DIM,
      num_pages=num_logical, page_size=PAGE_SIZE,
      block_sizes=MgpuBlockSizes(plan_in_kernel=plan_in_kernel),
      interpret=interpret), *args)
  assert len(calls) == kernel_calls
  assert plan.records.shape[0] == 1


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES + SLOW_CASES)
def test_plan_kernel_matches_the_xla_plan_on_the_gpu(case):
  args, kw = _case_kw(case)
  assert_same_plan(args, interpret=False, **kw)


def _whole_calls_agree(*, batch, num_logical, q_len, kv_heads, interpret,
                       sizes=MgpuBlockSizes(plan_in_kernel=True)):
  """lazy_prefill_mgpu with `sizes`: the output of the XLA plan and a
  plain launch, to the bit."""
  table, pos, shift, length, q_pos = plan_inputs(
      15, batch=batch, num_logical=num_logical, q_len=q_len)
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(keys[0], (batch, q_len, 2 * kv_heads, HEAD_DIM),
                        jnp.bfloat16)
  pool = (kv_heads, batch * num_logical, PAGE_SIZE, HEAD_DIM)
  k_pages = jax.random.normal(keys[1], pool, jnp.bfloat16)
  v_pages = jax.random.normal(keys[2], pool, jnp.bfloat16)
  run = lambda sizes: np.asarray(gpu_prefill_mgpu.lazy_prefill_mgpu(
      q, k_pages, v_pages, table, pos, shift, length, q_pos, rope=LLAMA3,
      sm_scale=HEAD_DIM ** -0.5, block_sizes=sizes,
      interpret=interpret).astype(jnp.float32))
  with_kernel = run(sizes)
  assert np.all(np.isfinite(with_kernel))
  np.testing.assert_array_equal(with_kernel, run(
      MgpuBlockSizes(plan_in_kernel=False, dependent_launch=False)))


# With dependent_launch the attention kernel may start before the plan ends:
# a read before its wait would race (and differ).
@pytest.mark.gpu
@pytest.mark.parametrize("sizes", [
    MgpuBlockSizes(),
    MgpuBlockSizes(plan_in_kernel=True, dependent_launch=False),
    MgpuBlockSizes(plan_in_kernel=False, dependent_launch=True),
], ids=["default", "plan_kernel", "dependent_launch"])
def test_whole_call_matches_the_xla_plan_and_a_plain_launch(sizes):
  _whole_calls_agree(batch=2, num_logical=200, q_len=256, kv_heads=4,
                     interpret=False, sizes=sizes)


@pytest.mark.parametrize("plan_in_kernel", [False, True, None])
@pytest.mark.parametrize("dependent_launch", [False, True])
def test_dependent_launch_lowers_to_grid_dependency_control(
    plan_in_kernel, dependent_launch):
  """The attention kernel waits (and the plan kernel lets it launch) only
  where asked: the instructions in the CUDA lowering of the whole call."""
  sizes = MgpuBlockSizes(plan_in_kernel=plan_in_kernel,
                         dependent_launch=dependent_launch)
  module = jax.export.export(jax.jit(
      lambda *a: gpu_prefill_mgpu.lazy_prefill_mgpu(
          *a, rope=LLAMA3, sm_scale=jnp.float32(0.088), block_sizes=sizes)),
      platforms=["cuda"])(*_specs(**BENCH)).mlir_module()
  assert ("griddepcontrol.wait" in module) == dependent_launch
  assert ("griddepcontrol.launch_dependents" in module) == (
      dependent_launch and plan_in_kernel is not False)


@pytest.mark.slow
def test_whole_call_with_the_plan_kernel_matches_the_default_interpreted():
  _whole_calls_agree(batch=1, num_logical=130, q_len=128, kv_heads=1,
                     interpret=True)
