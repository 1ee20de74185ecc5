"""The cache's tables live on the host CPU device, apart from the pool.

A serving run in every mode, with the model and the pool on another device
than the tables, leaves each where it was: a compiled step that read both
would have pulled one of them to the other's device.  (Every other test
runs with the tables on the host too, on one device.)
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
from flax import nnx

from lazyattn_jax.cache_state import CacheState, host_device
from models.llama import Llama
from tests.multi_device.test_tp_engine import CONFIG, _engine, _pool, _workload

TABLE_FIELDS = [f.name for f in dataclasses.fields(CacheState)
                if f.name not in ("k", "v")]


def _devices(tree):
  return {device for leaf in jax.tree_util.tree_leaves(tree)
          for device in leaf.devices()}


@pytest.mark.parametrize("mode", ["lazy", "block", "prefix", "full"])
def test_tables_stay_on_the_host_and_the_pool_on_its_device(mode,
                                                             engine_impl):
  host = host_device()
  other = next(d for d in jax.devices() if d != host)
  with jax.default_device(other):
    engine = _engine(Llama(CONFIG, rngs=nnx.Rngs(0)), mode, None,
                     _pool(mode), engine_impl)
    results = engine.generate_batch(_workload())
  state = engine.state
  if mode in ("lazy", "block"):  # 5 documents: some evicted, encoded again
    assert engine.stats.documents_prefilled > 5
  for name in TABLE_FIELDS:
    assert _devices(getattr(state, name)) == {host}, name
  assert _devices((state.k, state.v)) == {other}
  engine.close()
  assert all(len(r.token_ids) == 5 for r in results)


def test_a_pool_sharding_may_split_the_kv_heads_only():
  """Another split came back replicated from the first step (a float8
  pool failed inside JAX): it is refused when the config is made."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  import numpy as np
  from lazyattn_jax.cache_state import CacheConfig
  from tests.multi_device import needs_devices
  needs_devices(2)
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  config = dict(num_pages=8, page_size=4, num_layers=2, num_kv_heads=2,
                head_dim=8, dtype="float32", max_pages_per_doc=4)
  CacheConfig(**config, pool_sharding=NamedSharding(mesh, P("x")))
  with pytest.raises(ValueError, match=r"may split the pool's axis 0 \(KV "
                     r"heads\) only; its shard of the \[2, 2, 8, 4, 8\] pool "
                     r"is \[2, 2, 8, 4, 4\]"):
    CacheConfig(**config, pool_sharding=NamedSharding(
        mesh, P(None, None, None, None, "x")))
