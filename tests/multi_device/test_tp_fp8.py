"""A float8 pool under tensor parallelism: scales split like the pages."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from lazyattn_jax.cache_config import CacheConfig
from lazyattn_jax.config import split_settings
from lazyattn_jax.engine import LazyEngine
from lazyattn_jax.sampling import SamplingParams
from models.config import LlamaConfig
from models.llama import Llama


# CI time: float8 pools are opt-in; the slow tier runs it (--slow).
@pytest.mark.slow
def test_float8_pool_splits_scales_over_kv_heads_and_matches_one_device():
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=512)
  model = Llama(config, rngs=nnx.Rngs(0))
  results = {}
  for tp in (None, 2):
    cache = CacheConfig(num_pages=64, page_size=8,
                        num_layers=config.num_layers,
                        num_kv_heads=config.num_kv_heads,
                        head_dim=config.head_dim, dtype="float8_e4m3fn",
                        max_docs=16, max_pages_per_doc=8)
    scheduler, runner = split_settings(
        None, None, dict(impl="xla", max_batch=2, decode_steps=4))
    # Block mode: its page copies run per device too.
    engine = LazyEngine(config, model, cache, mode="block",
                        scheduler=scheduler, runner=runner,
                        tensor_parallel=tp)
    results[tp] = engine.generate(
        [5, 6, 7], [list(range(1, 12)), [12, 13, 14]],
        SamplingParams(max_new_tokens=6, temperature=0.0,
                       stop_token_ids=()))
    if tp:
      for pool in (engine.state.k, engine.state.v):
        for x in (pool.pages, pool.scales):
          assert isinstance(x.sharding, NamedSharding)
          assert x.sharding.spec == P("tp")
      memory = engine.memory
      assert memory["kv_pool_bytes_per_device"] * 2 == memory[
          "kv_pool_bytes"]
  assert results[2].token_ids == results[None].token_ids
  np.testing.assert_allclose(results[2].first_logits,
                             results[None].first_logits, atol=1e-5)
