"""`plan_lazy_attention` and the `page_offset` / `plan` arguments of
`lazy_attention`: one per-batch plan shared by every layer, and layers that
read their pages at an offset of one page array (models/llama.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from pallas_kernels import (lazy_attention, lazy_attention_reference,
                            plan_lazy_attention)
from pallas_kernels.gpu_decode_mgpu import DecodePlan
from pallas_kernels.gpu_prefill_mgpu import PrefillPlan
from pallas_kernels.testing import make_case, relative_error
from tests.rope_configs import PLAIN as ROPE


def _with_garbage_pages(pages, offset):
  """The same pool after `offset` NaN pages: page p moves to p + offset."""
  garbage = np.full((pages.shape[0], offset) + pages.shape[2:], np.nan,
                    pages.dtype)
  return np.concatenate([garbage, pages], axis=1)


@pytest.mark.parametrize("q_len", [1, 7])
def test_page_offset_reads_the_shifted_pages(q_len):
  lazy = make_case(np.random.default_rng(q_len), q_len=q_len)
  q, k, v, table, pos, shift, length, q_pos = lazy.args()
  offset = 6
  out = lazy_attention(q, _with_garbage_pages(k, offset),
                       _with_garbage_pages(v, offset), table, pos, shift,
                       length, q_pos, rope=ROPE, impl="xla",
                       page_offset=offset)
  reference = lazy_attention_reference(*lazy.args(), rope=ROPE)
  out = np.asarray(out)
  assert not np.isnan(out).any()
  assert relative_error(out, np.asarray(reference, np.float64)) <= 1e-5
  # A traced offset (a layer index inside a scan) is right too.
  traced = np.asarray(jax.jit(lambda o: lazy_attention(
      q, _with_garbage_pages(k, offset), _with_garbage_pages(v, offset),
      table, pos, shift, length, q_pos, rope=ROPE, impl="xla",
      page_offset=o))(jnp.int32(offset)))
  assert not np.isnan(traced).any()
  assert relative_error(traced, np.asarray(reference, np.float64)) <= 1e-5


def test_plan_exists_only_for_the_mosaic_kernels():
  bf16 = jnp.bfloat16
  lazy = make_case(np.random.default_rng(0), q_len=7, num_heads=8,
                   num_kv_heads=2, head_dim=128, dtype=np.float32)
  q, k, _, table, pos, shift, length, q_pos = lazy.args()
  meta = (table, pos, shift, length, q_pos)
  q16 = jax.ShapeDtypeStruct(q.shape, bf16)
  k16 = jax.ShapeDtypeStruct(k.shape, bf16)
  # No local GPU: impl="gpu" lowers for Hopper, so bf16 prefill has a plan.
  plan = plan_lazy_attention(q16, k16, *meta, rope=ROPE, impl="gpu")
  assert isinstance(plan, PrefillPlan)
  assert plan.row_pos.shape == (q.shape[0], 64)
  assert plan_lazy_attention(q16, k16, *meta, rope=ROPE, impl="xla") is None
  assert plan_lazy_attention(q, k, *meta, rope=ROPE, impl="gpu") is None
  # Decode has its own plan (the Mosaic GPU decode kernel), float32 none.
  decode = jax.ShapeDtypeStruct((q.shape[0], 1) + q.shape[2:], bf16)
  decode_plan = plan_lazy_attention(decode, k16, table, pos, shift, length,
                                    q_pos[:, :1], rope=ROPE, impl="gpu")
  assert isinstance(decode_plan, DecodePlan)
  assert decode_plan.n_steps.shape == (q.shape[0],)
  decode32 = jax.ShapeDtypeStruct(decode.shape, jnp.float32)
  assert plan_lazy_attention(decode32, k, table, pos, shift, length,
                             q_pos[:, :1], rope=ROPE, impl="gpu") is None
  assert plan_lazy_attention(q16, k16, *meta, rope=ROPE, impl="gpu",
                             interpret=True) is None


def test_plan_and_page_offset_lower_for_cuda():
  """The planned Mosaic path, with a traced offset, exports for CUDA."""
  spec = jax.ShapeDtypeStruct
  batch, q_len, heads, kv_heads, head_dim, page_size = 2, 64, 8, 2, 128, 16
  layer_pages, layers, logical = 12, 3, 6

  def forward(q, pages, table, pos, shift, length, q_pos, layer):
    layer_pool = spec((kv_heads, layer_pages, page_size, head_dim), q.dtype)
    plan = plan_lazy_attention(q, layer_pool, table, pos, shift, length,
                               q_pos, rope=ROPE, impl="gpu")
    assert plan is not None
    return lazy_attention(q, pages, pages, table, pos, shift, length, q_pos,
                          rope=ROPE, impl="gpu", plan=plan,
                          page_offset=layer * layer_pages)

  ints = spec((batch, logical), jnp.int32)
  exported = export.export(jax.jit(forward), platforms=["cuda"])(
      spec((batch, q_len, heads, head_dim), jnp.bfloat16),
      spec((kv_heads, layers * layer_pages, page_size, head_dim),
           jnp.bfloat16), ints, ints, ints, ints,
      spec((batch, q_len), jnp.int32), spec((), jnp.int32))
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (batch, q_len, heads, head_dim)


@pytest.mark.parametrize("q_len,logical,plan_kernels", [
    (128, 136, 1), (128, 128, 0), (64, 136, 0),  # prefill: > 128 pages,
    (1, 128, 1), (1, 120, 0)])  # >= 128 queries; decode: >= 128 pages
def test_plans_come_from_the_plan_kernels_where_they_take_the_shape(
    q_len, logical, plan_kernels):
  """On the GPU a model's per-forward plan is one Mosaic GPU launch (the
  prefill or decode plan kernel) where that kernel takes the shape, else
  the XLA plan: the custom calls in the CUDA lowering."""
  spec = jax.ShapeDtypeStruct
  batch, heads, kv_heads, head_dim, page_size = 2, 8, 2, 128, 16
  pool = spec((kv_heads, batch * logical, page_size, head_dim), jnp.bfloat16)
  ints = spec((batch, logical), jnp.int32)
  exported = export.export(jax.jit(lambda *meta: plan_lazy_attention(
      spec((batch, q_len, heads, head_dim), jnp.bfloat16), pool, *meta,
      rope=ROPE, impl="gpu")), platforms=["cuda"])(
          ints, ints, ints, ints, spec((batch, q_len), jnp.int32))
  module = exported.mlir_module()
  assert module.count("custom_call @mosaic_gpu") == plan_kernels


def test_bad_plan_and_offset_raise():
  lazy = make_case(np.random.default_rng(1), q_len=7)
  args = lazy.args()
  bf16 = jnp.bfloat16
  plan = plan_lazy_attention(
      jax.ShapeDtypeStruct(lazy.q.shape, bf16),
      jax.ShapeDtypeStruct(lazy.k_pages.shape, bf16), *args[3:], rope=ROPE,
      impl="gpu")
  with pytest.raises(ValueError, match="plan was given"):
    lazy_attention(*args, rope=ROPE, impl="xla", plan=plan)
  with pytest.raises(ValueError, match="page_offset must be a scalar"):
    lazy_attention(*args, rope=ROPE, impl="xla", page_offset=np.zeros(2))
  with pytest.raises(ValueError, match="page_table"):
    lazy_attention(*args, rope=ROPE, impl="xla",
                   page_offset=lazy.k_pages.shape[1])


@pytest.mark.gpu
def test_planned_layers_match_unplanned_gpu():
  """On a Hopper GPU: one plan, three layers at offsets of one page array,
  against the reference on each layer's own pool."""
  rng = np.random.default_rng(2)
  layers = [make_case(np.random.default_rng(10), q_len=100, num_heads=32,
                      num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
            for _ in range(3)]
  base = layers[0]
  for layer in layers[1:]:  # same metadata, fresh K/V per layer
    layer.k_pages = rng.standard_normal(base.k_pages.shape).astype(
        base.k_pages.dtype)
    layer.v_pages = rng.standard_normal(base.v_pages.shape).astype(
        base.v_pages.dtype)
  meta = base.args()[3:]
  k_all = jnp.concatenate([jnp.asarray(c.k_pages) for c in layers], axis=1)
  v_all = jnp.concatenate([jnp.asarray(c.v_pages) for c in layers], axis=1)
  q = jnp.asarray(base.q)
  pages = base.k_pages.shape[1]
  plan = plan_lazy_attention(q, base.k_pages, *meta, rope=ROPE, impl="gpu")
  assert plan is not None
  for index, layer in enumerate(layers):
    out = lazy_attention(q, k_all, v_all, *meta, rope=ROPE, impl="gpu",
                         plan=plan, page_offset=index * pages)
    reference = lazy_attention_reference(q, *layer.args()[1:], rope=ROPE)
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out[np.asarray(base.q_pos) >= 0]).any()
    assert relative_error(out, np.asarray(
        reference.astype(jnp.float32), np.float64)) <= 2e-2


def test_plan_for_other_shapes_is_refused():
  lazy = make_case(np.random.default_rng(5), q_len=7, num_heads=8,
                   num_kv_heads=2, head_dim=128)
  args = [jnp.asarray(a) for a in lazy.args()]
  bf16 = [a.astype(jnp.bfloat16) if i < 3 else a for i, a in enumerate(args)]
  q, k, v, table, pos, shift, length, q_pos = bf16
  plan = plan_lazy_attention(q, k, table, pos, shift, length, q_pos,
                             rope=ROPE, impl="gpu")
  longer = jnp.concatenate([q] * 20, axis=1)  # 140 tokens > 64 planned
  longer_pos = jnp.concatenate([q_pos] * 20, axis=1)
  with pytest.raises(ValueError, match="plan was made for"):
    jax.eval_shape(lambda: lazy_attention(
        longer, k, v, table, pos, shift, length, longer_pos, rope=ROPE,
        impl="gpu", plan=plan))
