"""Engine tests on CPU (XLA attention path): parity, reuse, batching, errors."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from lazyattn_jax.cache_state import CacheConfig
from lazyattn_jax.config import split_settings
from lazyattn_jax.engine import LazyEngine, Request
from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
from lazyattn_jax.sampling import SamplingParams
from models.config import LlamaConfig
from models.llama import Llama
from tests.engine_helpers import dense_greedy

PAGE = 4


@pytest.fixture(scope="module")
def model_and_config(engine_impl):
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=512)
  model = Llama(config, rngs=nnx.Rngs(0))
  return model, config, engine_impl


def make_engine(model_and_config, *, num_pages=96, max_batch=4,
                decode_steps=4, mode="lazy", eviction="lfu", tokenizer=None,
                quality=None, **engine_kwargs):
  """The tiny test engine: a float32 pool of `num_pages` pages of PAGE
  tokens; `engine_kwargs` are SchedulerConfig / RunnerConfig fields."""
  model, config, impl = model_and_config
  cache_config = CacheConfig(num_pages=num_pages, page_size=PAGE,
                             num_layers=config.num_layers,
                             num_kv_heads=config.num_kv_heads,
                             head_dim=config.head_dim, dtype="float32",
                             max_docs=32, max_pages_per_doc=16,
                             eviction=eviction)
  scheduler, runner = split_settings(
      None, None, dict(impl=impl, max_batch=max_batch,
                       decode_steps=decode_steps, **engine_kwargs))
  return LazyEngine(config, model, cache_config, mode=mode,
                    scheduler=scheduler, runner=runner, tokenizer=tokenizer,
                    quality=quality)


def random_tokens(rng, n, vocab):
  return [int(t) for t in rng.integers(1, vocab, size=n)]


def greedy(n):
  return SamplingParams(max_new_tokens=n, temperature=0.0, stop_token_ids=())


def test_lazy_generation_matches_dense_block_diagonal_reference(model_and_config):
  model, config, _ = model_and_config
  rng = np.random.default_rng(1)
  docs = [random_tokens(rng, n, config.vocab_size) for n in (7, 12, 5)]
  query = random_tokens(rng, 6, config.vocab_size)
  engine = make_engine(model_and_config)
  result = engine.generate(query, docs, greedy(16))
  want_tokens, want_logits = dense_greedy(model, docs, query, 16)
  rel = (np.linalg.norm(result.first_logits - want_logits) /
         np.linalg.norm(want_logits))
  assert rel < 1e-4, rel
  assert result.token_ids == want_tokens
  assert result.doc_hits == [False, False, False]


def test_reuse_in_new_order_and_position_equals_fresh_encoding(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(2)
  a, b, c = (random_tokens(rng, n, config.vocab_size) for n in (9, 6, 11))
  query = random_tokens(rng, 5, config.vocab_size)
  warm = make_engine(model_and_config)
  warm.generate(query, [a, b], greedy(3))
  # Same documents, new order, behind a new document: b and a are hits.
  reused = warm.generate(query, [c, b, a], greedy(8))
  fresh = make_engine(model_and_config).generate(query, [c, b, a], greedy(8))
  assert reused.doc_hits == [False, True, True]
  assert fresh.doc_hits == [False, False, False]
  assert reused.token_ids == fresh.token_ids
  np.testing.assert_allclose(reused.first_logits, fresh.first_logits,
                             rtol=1e-5, atol=1e-5)


def test_cache_hit_writes_no_kv_and_shares_pages(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(3)
  doc = random_tokens(rng, 10, config.vocab_size)
  engine = make_engine(model_and_config)
  first_id = engine.submit(random_tokens(rng, 4, config.vocab_size), [doc],
                           greedy(2))
  engine.step()
  first_live = engine.scheduler.live[0] if engine.scheduler.live else None
  while engine.has_work():
    engine.step()
  first = engine.pop_result(first_id)
  k_before = np.asarray(engine.state.k)
  v_before = np.asarray(engine.state.v)
  # A second request placing the same document behind another one.
  other = random_tokens(rng, 7, config.vocab_size)
  rid = engine.submit(random_tokens(rng, 3, config.vocab_size), [other, doc],
                      greedy(2))
  engine.rounds.state, new = engine.scheduler.admit(engine.state)
  assert len(new) == 1
  live = new[0]
  assert live.admission.doc_hit == [False, True]
  if first_live is not None:
    assert live.admission.doc_pages[1] == first_live.admission.doc_pages[0]
  engine.rounds._prefill_round(new)
  while engine.has_work():
    engine.step()
  result = engine.pop_result(rid)
  assert result.doc_hits == [False, True]
  k_after, v_after = np.asarray(engine.state.k), np.asarray(engine.state.v)
  written = set(live.admission.doc_pages[0]) | set(live.admission.private_pages)
  changed = {p for p in range(k_before.shape[2])
             if not (np.array_equal(k_before[:, :, p], k_after[:, :, p],
                                    equal_nan=True) and
                     np.array_equal(v_before[:, :, p], v_after[:, :, p],
                                    equal_nan=True))}
  # Only the new document's pages and the request's own pages changed; the
  # reused document's pages were read in place.
  assert changed <= written
  assert not changed & set(live.admission.doc_pages[1])
  assert first.doc_hits == [False]


def test_concurrent_requests_prefill_a_shared_missing_document_once(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(4)
  shared = random_tokens(rng, 8, config.vocab_size)
  other = random_tokens(rng, 5, config.vocab_size)
  engine = make_engine(model_and_config)
  requests = [Request(tuple(random_tokens(rng, 4, config.vocab_size)),
                      (tuple(shared),), greedy(3)),
              Request(tuple(random_tokens(rng, 6, config.vocab_size)),
                      (tuple(other), tuple(shared)), greedy(3))]
  results = engine.generate_batch(requests)
  assert engine.stats.documents_prefilled == 2
  assert engine.stats.prefill_tokens_computed == 8 + 5 + 4 + 6
  for request, result in zip(requests, results):
    alone = make_engine(model_and_config).generate(
        request.query, request.documents, request.sampling)
    assert result.token_ids == alone.token_ids


def test_continuous_batching_join_and_leave(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(5)
  docs = [random_tokens(rng, 6, config.vocab_size) for _ in range(3)]
  queries = [random_tokens(rng, 5, config.vocab_size) for _ in range(3)]
  lengths = [3, 12, 7]
  engine = make_engine(model_and_config, decode_steps=2)
  results = {}
  def step():
    for r in engine.step():
      results[r.request_id] = r
  ids = [engine.submit(queries[0], docs[:2], greedy(lengths[0]))]
  step()
  ids.append(engine.submit(queries[1], docs[1:], greedy(lengths[1])))
  step()
  # Request 1 is mid-decode when request 2 joins.
  assert any(l.request_id == ids[1] and not l.done for l in engine.scheduler.live)
  ids.append(engine.submit(queries[2], docs[::-1], greedy(lengths[2])))
  while engine.has_work():
    step()
  assert sorted(results) == ids
  for i, rid in enumerate(ids):
    doc_set = [docs[:2], docs[1:], docs[::-1]][i]
    alone = make_engine(model_and_config).generate(queries[i], doc_set,
                                                   greedy(lengths[i]))
    assert results[rid].token_ids == alone.token_ids
    assert len(results[rid].token_ids) == lengths[i]


def test_compile_count_is_bounded_over_varied_requests(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(6)
  engine = make_engine(model_and_config, num_pages=160)
  corpus = [random_tokens(rng, int(n), config.vocab_size)
            for n in rng.integers(3, 24, size=8)]
  requests = []
  for _ in range(16):
    picks = rng.choice(len(corpus), size=int(rng.integers(1, 4)), replace=False)
    requests.append(Request(
        tuple(random_tokens(rng, int(rng.integers(2, 20)), config.vocab_size)),
        tuple(tuple(corpus[i]) for i in picks),
        greedy(int(rng.integers(1, 10)))))
  # jit caches are process-wide: count the compilations this test causes.
  start = engine.compile_count
  engine.generate_batch(requests[:8])
  first_half = engine.compile_count - start
  engine.generate_batch(requests[8:])
  second_half = engine.compile_count - start - first_half
  # Buckets: prefill (rows x length x pages) and decode (rows x pages) are
  # powers of two, so 8 requests of varied sizes need a bounded set of
  # programs and a second like workload adds at most a handful.
  assert engine.programs_used <= 16, engine.programs_used
  assert first_half <= 16, first_half
  assert second_half <= 4, second_half


def test_sampling_seed_topk_topp_and_stop(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(7)
  doc = random_tokens(rng, 6, config.vocab_size)
  query = random_tokens(rng, 4, config.vocab_size)
  engine = make_engine(model_and_config)
  hot = SamplingParams(max_new_tokens=10, temperature=1.5, top_k=20,
                       top_p=0.9, seed=11, stop_token_ids=())
  a = engine.generate(query, [doc], hot)
  b = engine.generate(query, [doc], hot)
  c = engine.generate(query, [doc], dataclasses.replace(hot, seed=12))
  assert a.token_ids == b.token_ids
  assert a.token_ids != c.token_ids
  # top_k=1 is greedy whatever the temperature.
  g = engine.generate(query, [doc], greedy(6))
  k1 = engine.generate(query, [doc], dataclasses.replace(hot, top_k=1,
                                                         max_new_tokens=6))
  assert k1.token_ids == g.token_ids
  # Stop on the third greedy token: output ends with it, reason "stop".
  stop = g.token_ids[2]
  first_stop = g.token_ids.index(stop)
  s = engine.generate(query, [doc], SamplingParams(
      max_new_tokens=6, stop_token_ids=(stop,)))
  assert s.token_ids == g.token_ids[:first_stop + 1]
  assert s.finish_reason == "stop"
  assert g.finish_reason == "length" and len(g.token_ids) == 6


def _state_leaves(engine):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(engine.state)]


@pytest.mark.parametrize("bad", [
    dict(documents=[[]], error=InvalidRequestError, match="document 0 is empty"),
    dict(documents=[[1] * 200], error=CacheCapacityError, match="document 0"),
    dict(query=[1] * 520, error=InvalidRequestError, match="positions"),
    dict(sampling=dict(max_new_tokens=0), error=InvalidRequestError,
         match="max_new_tokens"),
    dict(sampling=dict(temperature=-1.0), error=InvalidRequestError,
         match="temperature"),
    dict(sampling=dict(top_p=0.0), error=InvalidRequestError, match="top_p"),
    dict(sampling=dict(top_p=1.5), error=InvalidRequestError, match="top_p"),
    dict(query=[1, 10**6], error=InvalidRequestError, match="outside"),
    dict(documents=[[-3, 4]], error=InvalidRequestError, match="outside"),
    dict(query=[], error=InvalidRequestError, match="query is empty"),
])
def test_bad_input_raises_typed_error_and_leaves_state(model_and_config, bad):
  _, config, _ = model_and_config
  engine = make_engine(model_and_config, num_pages=40)
  engine.generate([5, 6, 7], [[1, 2, 3, 4, 5]], greedy(2))
  before = _state_leaves(engine)
  stats_before = dataclasses.asdict(engine.stats)
  with pytest.raises(bad["error"], match=bad["match"]):
    sampling = bad.get("sampling")
    sampling = (SamplingParams(**sampling) if sampling is not None
                else greedy(2))
    engine.generate(bad.get("query", [5, 6]), bad.get("documents", [[1, 2]]),
                    sampling)
  after = _state_leaves(engine)
  assert all(np.array_equal(x, y, equal_nan=True) for x, y in zip(before, after))
  assert dataclasses.asdict(engine.stats) == stats_before
  assert not engine.has_work()


def test_request_larger_than_pool_is_refused_at_admission(model_and_config):
  _, config, _ = model_and_config
  engine = make_engine(model_and_config, num_pages=12)
  rng = np.random.default_rng(8)
  docs = [random_tokens(rng, 16, config.vocab_size) for _ in range(3)]
  with pytest.raises(CacheCapacityError, match="pages"):
    engine.generate(random_tokens(rng, 4, config.vocab_size), docs, greedy(4))
  assert not engine.has_work()


def test_unrolled_decode_layers_give_the_same_tokens(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(9)
  docs = [random_tokens(rng, 7, config.vocab_size)]
  query = random_tokens(rng, 5, config.vocab_size)
  scanned = make_engine(model_and_config).generate(query, docs, greedy(6))
  unrolled = make_engine(model_and_config, decode_layer_unroll=True).generate(
      query, docs, greedy(6))
  assert unrolled.token_ids == scanned.token_ids


def test_prefill_budget_spreads_a_burst_over_steps(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(10)
  requests = [Request(tuple(random_tokens(rng, 6, config.vocab_size)),
                      (tuple(random_tokens(rng, 12, config.vocab_size)),),
                      greedy(4)) for _ in range(4)]
  engine = make_engine(model_and_config, prefill_tokens_per_step=20)
  ids = [engine.submit(r.query, r.documents, r.sampling) for r in requests]
  results = {r.request_id: r for r in engine.step()}
  # 18 prefill tokens per request: the budget of 20 admits two per step.
  assert len(engine.scheduler.waiting) == 2
  while engine.has_work():
    for r in engine.step():
      results[r.request_id] = r
  alone = make_engine(model_and_config)
  for request_id, r in zip(ids, requests):
    assert results[request_id].token_ids == alone.generate(
        r.query, r.documents, r.sampling).token_ids


def test_reset_stats_keeps_the_cache(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(9)
  doc = random_tokens(rng, 10, config.vocab_size)
  query = random_tokens(rng, 4, config.vocab_size)
  engine = make_engine(model_and_config)
  engine.generate(query, [doc], greedy(2))
  assert engine.stats.prefill_tokens_computed > 0
  used = engine.stats.peak_pages_used
  assert used > 0
  engine.reset_stats()
  assert engine.stats.prefill_tokens_computed == 0
  assert engine.stats.generated_tokens == 0
  # The document's pages are still cached: the peak restarts from them.
  cached = -(-len(doc) // PAGE)
  assert engine.stats.peak_pages_used == cached
  again = engine.generate(query, [doc], greedy(2))
  assert again.doc_hits == [True]
  assert engine.stats.prefill_tokens_computed == len(query)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_requests_with_cached_documents_get_first_tokens_first(model_and_config,
                                                               mode):
  """One round: requests needing fewer new documents are served first, and a
  request reading a document another request of the round encodes waits for
  it.  Tokens match each request run alone."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(11)
  a, b, c, d = (random_tokens(rng, n, config.vocab_size) for n in (12, 10, 8, 9))
  docs = {"a": a, "b": b, "c": c, "d": d}
  layout = [("a", "b"), ("c",), ("b", "c"), ("d",)]  # c is cached beforehand
  requests = [Request(tuple(random_tokens(rng, 5, config.vocab_size)),
                      tuple(tuple(docs[n]) for n in names), greedy(3))
              for names in layout]
  # 16 new document tokens per group: [c-only, d] (0 + 9), then [b, c]
  # (b: 10), then [a, b] (a: 12, b is encoded by then).
  engine = make_engine(model_and_config, mode=mode, first_token_group_tokens=16)
  engine.encode_documents([c])
  engine.reset_stats()
  results = engine.generate_batch(requests)
  ttft = [r.ttft_s for r in results]
  assert ttft[1] < ttft[2] < ttft[0], ttft
  assert ttft[3] < ttft[2], ttft
  # The round's work before each first token: d and two queries; then b and
  # a query; then a and a query.
  assert [r.prefill_tokens_before_first_token for r in results] == [
      9 + 10 + 10 + 5 + 12 + 5, 9 + 10, 9 + 10 + 10 + 5, 9 + 10]
  assert [r.doc_hits for r in results] == [[False, False], [True], [True, True],
                                           [False]]
  # Every missing document encoded exactly once.
  assert engine.stats.documents_prefilled == 3
  assert engine.stats.prefill_tokens_computed == 12 + 10 + 9 + 4 * 5
  for request, result in zip(requests, results):
    alone = make_engine(model_and_config, mode=mode)
    alone.encode_documents([c])
    want = alone.generate(request.query, request.documents, request.sampling)
    assert result.token_ids == want.token_ids
    np.testing.assert_allclose(result.first_logits, want.first_logits,
                               rtol=1e-5, atol=1e-5)


def test_first_token_group_tokens_must_be_positive(model_and_config):
  with pytest.raises(ValueError, match="first_token_group_tokens"):
    make_engine(model_and_config, first_token_group_tokens=0)


def test_full_mode_first_token_waits_for_the_whole_prompt(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(12)
  doc = random_tokens(rng, 7, config.vocab_size)
  query = random_tokens(rng, 4, config.vocab_size)
  result = make_engine(model_and_config, mode="full").generate(query, [doc],
                                                               greedy(2))
  assert result.prefill_tokens_before_first_token == 7 + 4


@pytest.mark.parametrize("eviction", ["lfu", "lru"])
def test_eviction_policy_decides_whether_a_popular_document_survives(
    model_and_config, eviction):
  """A document read three times, then a run of one-off documents that
  overflows the pool: LFU keeps the popular one, LRU lets it go."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(11)
  popular = random_tokens(rng, 8, config.vocab_size)  # 2 pages
  one_offs = [random_tokens(rng, 8, config.vocab_size) for _ in range(6)]
  query = random_tokens(rng, 3, config.vocab_size)  # private: 1 page
  engine = make_engine(model_and_config, num_pages=12, eviction=eviction)
  hits = [engine.generate(query, [popular], greedy(1)).doc_hits[0]
          for _ in range(3)]
  assert hits == [False, True, True]
  for doc in one_offs:  # 5 documents fill the pool; the 6th evicts one
    assert engine.generate(query, [doc], greedy(1)).doc_hits == [False]
  popular_hit = engine.generate(query, [popular], greedy(1)).doc_hits[0]
  assert popular_hit == (eviction == "lfu")
