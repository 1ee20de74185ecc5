"""The engine at tensor parallel 2 and 4 against one device: the same
greedy tokens and first logits in every mode, under eviction; and a model
with fewer KV heads than devices (replicated KV heads) with Q/K/V biases
and Q/K norms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from lazyattn_jax.cache_state import CacheConfig
from lazyattn_jax.config import split_settings
from lazyattn_jax.engine import LazyEngine, Request
from lazyattn_jax.sampling import SamplingParams
from lazyattn_jax.sharding import place_model, tensor_parallel_for
from models.config import LlamaConfig
from models.llama import Llama, forward, kv_cache_shape, split_model
from tests.hf_fixtures import contiguous_paged_inputs
from tests.multi_device import needs_devices

PAGE = 4
# Head counts that divide by 4: each device holds whole heads at 2 and 4.
CONFIG = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, max_position=512)


@pytest.fixture(scope="module")
def model():
  return Llama(CONFIG, rngs=nnx.Rngs(0))


def _engine(model, mode, tp, num_pages, impl):
  cache = CacheConfig(num_pages=num_pages, page_size=PAGE,
                      num_layers=CONFIG.num_layers,
                      num_kv_heads=CONFIG.num_kv_heads,
                      head_dim=CONFIG.head_dim, dtype="float32", max_docs=16,
                      max_pages_per_doc=8)
  scheduler, runner = split_settings(None, None, dict(
      impl=impl, max_batch=2, decode_steps=4))
  return LazyEngine(CONFIG, model, cache, mode=mode, scheduler=scheduler,
                    runner=runner, tensor_parallel=tp)


def _workload():
  """Five requests of two documents each over five documents: reuse in new
  orders and positions, and, in a small pool (`_pool`), evictions.  Alike
  requests keep the number of compiled shapes (and the test's time) down."""
  rng = np.random.default_rng(7)
  docs = [rng.integers(1, CONFIG.vocab_size, n).tolist()
          for n in (10, 13, 7, 12, 9)]
  greedy = SamplingParams(max_new_tokens=5, temperature=0.0,
                          stop_token_ids=())
  picks = [(0, 1), (2, 0), (3, 4), (1, 3), (4, 2)]
  return [Request(rng.integers(1, CONFIG.vocab_size, 5).tolist(),
                  [docs[i] for i in pick], greedy) for pick in picks]


def _pool(mode):
  """Fewer pages than the documents (15) and two requests' own pages (6)
  need, so documents are evicted and encoded again, and enough for a block
  request with its copies (17).  One size for every mode: the pool's shape
  is part of every compiled program, so modes share programs."""
  return 20


@pytest.fixture(scope="module")
def one_device(model, engine_impl):
  out = {}
  for mode in ("lazy", "block", "prefix", "full"):
    engine = _engine(model, mode, None, _pool(mode), engine_impl)
    out[mode] = (engine.generate_batch(_workload()), engine.stats)
    engine.close()
  return out


@pytest.mark.parametrize("mode", ["lazy", "block", "prefix", "full"])
@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_engine_matches_one_device(model, one_device, mode, tp, engine_impl):
  needs_devices(tp)
  engine = _engine(model, mode, tp, _pool(mode), engine_impl)
  assert engine.state.k.sharding.spec == P("tp")
  assert engine.state.k.sharding.mesh.size == tp
  results = engine.generate_batch(_workload())
  want, want_stats = one_device[mode]
  for got, ref in zip(results, want):
    assert got.finish_reason == ref.finish_reason != "error"
    assert got.token_ids == ref.token_ids
    assert got.doc_hits == ref.doc_hits
    np.testing.assert_allclose(got.first_logits, ref.first_logits,
                               rtol=1e-4, atol=1e-4)
  assert engine.stats.prefill_tokens_computed == (
      want_stats.prefill_tokens_computed)
  if mode in ("lazy", "block"):
    # The small pool evicted documents that later requests encoded again.
    distinct = len({tuple(d) for r in _workload() for d in r.documents})
    assert engine.stats.documents_prefilled > distinct
  assert engine.state.k.sharding.spec == P("tp")  # donated and returned
  memory = engine.memory
  assert memory["kv_pool_bytes_per_device"] == memory["kv_pool_bytes"] // tp
  # Every device holds the same: the totals are the devices' sum.
  assert memory["weights_bytes"] == tp * memory["weights_bytes_per_device"]
  engine.close()


# A Qwen-like model with both optional parts, and 2 KV heads for 4 devices.
QWEN_LIKE = LlamaConfig.tiny(num_heads=8, num_kv_heads=2, max_position=512,
                             attention_bias=True, qk_norm=True)


def test_fewer_kv_heads_than_devices_replicates_them(engine_impl):
  """2 KV heads on 4 devices: each KV head is held by 2 devices (the pool
  holds 2 copies); logits and the pool's contents equal one device's."""
  needs_devices(4)
  model = Llama(QWEN_LIKE, rngs=nnx.Rngs(1))
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 12)),
                       jnp.int32)
  inputs = contiguous_paged_inputs(np.arange(8).reshape(2, 4), [12, 9],
                                   [0, 0], 12, PAGE)
  shape = kv_cache_shape(QWEN_LIKE, 16, PAGE)

  def run(m, config, tp):
    graphdef, state = split_model(m)
    zeros = jnp.zeros(shape[:0] + (config.num_kv_heads,) + shape[1:],
                      device=None if tp is None else tp.pool_sharding)
    step = jax.jit(lambda s, k, v: forward(graphdef, s, tokens, k, v, inputs,
                                           impl=engine_impl,
                                           tensor_parallel=tp))
    return step(state, zeros, zeros)

  want_logits, want_k, want_v = run(model, QWEN_LIKE, None)
  tp = tensor_parallel_for(QWEN_LIKE, tensor_parallel=4)
  assert tp.kv_replicas == 2
  placed = place_model(model, QWEN_LIKE, tp)
  assert placed.config.num_kv_heads == 4
  layers = placed.layers
  assert layers.k_bias[...].sharding.spec == P(None, "tp")
  assert layers.q_norm[...].sharding.spec == P()
  logits, k, v = run(placed, placed.config, tp)
  np.testing.assert_allclose(np.asarray(logits), np.asarray(want_logits),
                             rtol=2e-5, atol=2e-5)
  # Copies 2h and 2h+1 of the pool both hold KV head h.
  for got, ref in ((k, want_k), (v, want_v)):
    got = np.asarray(got).reshape((2, 2) + shape[1:])
    for copy in range(2):
      np.testing.assert_allclose(got[:, copy], np.asarray(ref), atol=2e-5)


def test_memory_counts_replicated_weights_on_every_device():
  """2 KV heads on 4 devices and an embedding replicated (a vocabulary of
  250 does not split over 4): `weights_bytes` is the devices' sum, as
  `kv_pool_bytes` is.  It counted the KV heads' copies but the replicated
  embedding, LM head and norms once (522,496 bytes of 910,336)."""
  needs_devices(4)
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=2, vocab_size=250,
                            max_position=512)
  cache = CacheConfig(num_pages=16, page_size=PAGE,
                      num_layers=config.num_layers,
                      num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, dtype="float32",
                      max_docs=4, max_pages_per_doc=4)
  engine = LazyEngine(config, Llama(config, rngs=nnx.Rngs(0)), cache,
                      tensor_parallel=4)
  assert not engine.tensor_parallel.vocab_parallel
  memory = engine.memory
  assert memory["weights_bytes"] == 4 * memory["weights_bytes_per_device"]
  assert memory["kv_pool_bytes"] == 4 * memory["kv_pool_bytes_per_device"]
  engine.close()
