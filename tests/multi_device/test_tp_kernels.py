"""The attention kernel and the Block-Attention copies per device under
shard_map, and what crosses devices in a sharded decode step."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lazyattn_jax.block_copy import rerotate_pages
from lazyattn_jax.sharding import tensor_parallel_for
from models.config import LlamaConfig
from models.sharding import shard_map
from pallas_kernels import RopeConfig, lazy_attention, lazy_attention_reference
from pallas_kernels.testing import make_case, relative_error
from tests.multi_device import needs_devices

ROPE = RopeConfig(theta=10000.0)
CONFIG = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, max_position=512)


def _tp(n, config=CONFIG):
  return tensor_parallel_for(config, tensor_parallel=n)


@pytest.mark.parametrize("tp,q_len,impl", [(2, 7, "xla"), (4, 1, "xla"),
                                           (2, 1, "gpu")])
def test_lazy_attention_per_device_matches_reference(tp, q_len, impl):
  """Each device attends with its KV heads' pages and the query heads of
  those KV groups; together they are the whole contract (two layers in one
  page array, read at a page offset, as the model does)."""
  needs_devices(tp)
  rng = np.random.default_rng(tp * 10 + q_len)
  case = make_case(rng, batch=2, q_len=q_len, num_heads=8, num_kv_heads=4,
                   head_dim=16, page_size=4, max_doc_len=14)
  q, k, v, table, pos, shift, plen, q_pos = (jnp.asarray(a)
                                              for a in case.args())
  num_pages = k.shape[1]
  # Layer 1 of a two-layer page array: layer 0's pages are garbage.
  k2, v2 = (jnp.concatenate([jnp.full_like(x, 7.0), x], axis=1)
            for x in (k, v))
  plan = _tp(tp)

  def per_device(q, k, v, *meta):
    return lazy_attention(q, k, v, *meta, rope=ROPE, impl=impl,
                          interpret=impl == "gpu", page_offset=num_pages)

  heads = P(None, None, plan.axis, None)
  run = jax.jit(shard_map(per_device, mesh=plan.mesh,
                          in_specs=(heads, P(plan.axis), P(plan.axis)) +
                          (P(),) * 5, out_specs=heads))
  out = np.asarray(run(q, k2, v2, table, pos, shift, plen, q_pos))
  want = np.asarray(lazy_attention_reference(q, k, v, table, pos, shift, plen,
                                             q_pos, rope=ROPE))
  assert not np.isnan(out).any()
  assert relative_error(out, want) < 1e-5


def test_block_copies_per_device_match_one_device():
  needs_devices(4)
  rng = np.random.default_rng(3)
  shape = (4, 2, 12, 4, 16)  # [K, L, pages, P, H]
  k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32)
          for _ in range(2))
  src = jnp.asarray([1, 5, 2, 0], jnp.int32)
  dst = jnp.asarray([7, 8, 9, 12], jnp.int32)  # 12: a dropped padding entry
  shifts = jnp.asarray([3, 40, 1000, 0], jnp.int32)
  want = rerotate_pages(k, v, src, dst, shifts, ROPE)
  plan = _tp(4)
  ks, vs = (jax.device_put(x, plan.pool_sharding) for x in (k, v))
  copy = jax.jit(rerotate_pages, static_argnames=("rope", "tensor_parallel"))
  got = copy(ks, vs, src, dst, shifts, rope=ROPE, tensor_parallel=plan)
  for x, y in zip(got, want):
    assert x.sharding.spec == P(plan.axis)
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6)


def _collectives(hlo: str) -> list[tuple[str, int]]:
  """(kind, elements of its result) of every collective in compiled HLO."""
  found = []
  for match in re.finditer(
      r"= (\(?[a-z0-9]+\[[^=]*?) (all-reduce|all-gather|reduce-scatter|"
      r"all-to-all|collective-permute)(-start)?\(", hlo):
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
             for dims in re.findall(r"\[([0-9,]*)\]", match.group(1))]
    found.append((match.group(2), max(sizes)))
  return found


@pytest.mark.parametrize("vocab_parallel,tied", [(True, False), (False, True)])
def test_sharded_decode_step_moves_activations_only(vocab_parallel, tied):
  """Megatron's pattern: one all-reduce after each row-parallel projection
  (o_proj, down_proj: two in the layer loop's body), vocab-parallel one
  after the embedding lookup and the logits gathered; no weight or pool
  ever crosses devices (every collective is activation-sized).  On CPU,
  where the compiled HLO is XLA's CPU pipeline's (a GPU's combines and
  schedules collectives its own way)."""
  if jax.default_backend() != "cpu":
    pytest.skip("counts the CPU pipeline's collectives")
  from lazyattn_jax.cache_state import CacheConfig, init_cache_state
  from lazyattn_jax.model_runner import _decode_loop
  from lazyattn_jax.sharding import place_cache_config, place_model
  config = CONFIG.replace(tie_word_embeddings=tied)
  plan = tensor_parallel_for(config, tensor_parallel=2,
                             vocab_parallel=vocab_parallel)
  model = place_model(Llama_(config), config, plan)
  graphdef, params = nnx.split(model)
  cache = place_cache_config(CacheConfig(
      num_pages=64, page_size=4, num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
      dtype="float32", max_pages_per_doc=8), plan)
  state = init_cache_state(cache)
  batch, pages = 4, 8
  ints = lambda *shape: jnp.zeros(shape, jnp.int32)
  args = ((ints(batch),) * 4 + (jnp.ones((batch,), bool),),
          (ints(batch, pages),) * 4 + (ints(batch),),
          (jnp.zeros(batch), ints(batch), jnp.ones(batch), ints(batch)),
          (ints(batch), ints(batch, 4)))
  hlo = _decode_loop.lower(params, state.k, state.v, *args,
                           graphdef=graphdef, impl="xla", num_steps=2,
                           tensor_parallel=plan).compile().as_text()
  found = _collectives(hlo)
  kinds = sorted(kind for kind, _ in found)
  want = ["all-reduce"] * 2  # the compiled loop body appears once
  if vocab_parallel:
    want = ["all-gather"] + want + ["all-reduce"]
  assert kinds == want, found
  biggest = batch * max(CONFIG.hidden_size, CONFIG.vocab_size)
  assert all(size <= biggest for _, size in found), found
  pool = int(np.prod(cache.pool_shape))
  assert biggest < pool // 8


def Llama_(config):
  from models.llama import Llama
  return Llama(config, rngs=nnx.Rngs(0))


def test_sharded_steps_lower_for_cuda():
  """The decode and prefill steps (Mosaic GPU kernels, each plan made once
  and passed to every device) of a 2-device bf16 model export for CUDA from
  CPU, the pool split over KV heads, with no Triton call and so no disabled
  safety check."""
  from jax import export
  from lazyattn_jax.cache_state import CacheConfig
  from lazyattn_jax.model_runner import _decode_loop, _prefill_step
  from lazyattn_jax.sharding import place_cache_config, random_model
  from models.paged_inputs import PagedAttentionInputs
  config = CONFIG.replace(head_dim=128)
  plan = _tp(2, config)
  model = nnx.eval_shape(lambda: random_model(config, plan,
                                              dtype=jnp.bfloat16))
  graphdef, state = nnx.split(model)
  nnx.replace_by_pure_dict(state, jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      nnx.to_pure_dict(state), plan.param_shardings(config)))
  cache = place_cache_config(CacheConfig(
      num_pages=64, page_size=16, num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
      dtype="bfloat16", max_pages_per_doc=8), plan)
  pool = jax.ShapeDtypeStruct(cache.pool_shape, jnp.bfloat16,
                              sharding=plan.pool_sharding)
  whole = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(
      shape, dtype, sharding=plan.replicated)
  batch, pages, length = 4, 8, 64
  sampling = (whole((batch,), jnp.float32), whole((batch,)),
              whole((batch,), jnp.float32), whole((batch,)))
  decode = jax.jit(lambda *a: _decode_loop(
      *a, graphdef=graphdef, impl="gpu", num_steps=2, tensor_parallel=plan))
  exported = export.export(decode, platforms=["cuda"])(
      state, pool, pool, (whole((batch,)),) * 4 + (whole((batch,), bool),),
      (whole((batch, pages)),) * 4 + (whole((batch,)),), sampling,
      (whole((batch,)), whole((batch, 4))))
  text = exported.mlir_module()
  assert exported.nr_devices == 2 and "mosaic_gpu" in text
  assert "xla.gpu.triton" not in text
  assert re.search(r'sharding<@mesh, \[\{"tp"\}, \{\}, \{\}, \{\}, \{\}\]>',
                   text)
  prefill = jax.jit(lambda *a: _prefill_step(
      *a, graphdef=graphdef, impl="gpu", tensor_parallel=plan))
  exported = export.export(prefill, platforms=["cuda"])(
      state, pool, pool, whole((batch, length)),
      PagedAttentionInputs(*(whole((batch, pages)),) * 4,
                           *(whole((batch, length)),) * 3),
      whole((batch,)), sampling)
  assert exported.nr_devices == 2 and "mosaic_gpu" in exported.mlir_module()
