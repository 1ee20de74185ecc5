"""The scheduler and the reuse modes on their own: a cache, no model."""

from __future__ import annotations

import numpy as np
import pytest

from lazyattn_jax.cache_state import CacheConfig, init_cache_state
from lazyattn_jax.config import SchedulerConfig
from lazyattn_jax.errors import CacheCapacityError
from lazyattn_jax.modes import MODES, make_mode
from lazyattn_jax.paged_cache import PagedKVCache
from lazyattn_jax.request_validator import RequestValidator
from lazyattn_jax.requests import TokenRequest
from lazyattn_jax.sampling import SamplingParams
from lazyattn_jax.scheduler import Scheduler

PAGE = 4
VOCAB = 1000


def cache_config(num_pages=64, max_docs=16):
  return CacheConfig(num_pages=num_pages, page_size=PAGE, num_layers=1,
                     num_kv_heads=1, head_dim=2, dtype="float32",
                     max_docs=max_docs, max_pages_per_doc=8)


def make_scheduler(mode="lazy", num_pages=64, max_docs=16, **settings):
  config = cache_config(num_pages, max_docs)
  cache = PagedKVCache(config)
  scheduler = Scheduler(SchedulerConfig(**settings),
                        make_mode(mode, PAGE, "test-model"), cache)
  return scheduler, init_cache_state(config)


def doc(seed, n):
  return tuple(int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, n))


def request(docs, query_len=5, max_new=3):
  return TokenRequest(query=tuple(range(1, query_len + 1)),
                      documents=tuple(docs),
                      sampling=SamplingParams(max_new_tokens=max_new),
                      stop_ids=())


def free_pages(scheduler, state):
  return scheduler.cache.free_page_count(state)


def finish_all(scheduler, state, live):
  for r in live:
    r.tokens.append(1)
    r.done = True
  return scheduler.retire(state)


def test_admission_stops_at_max_batch_and_keeps_order():
  scheduler, state = make_scheduler(max_batch=2)
  for i in range(3):
    scheduler.add(i, request([doc(i, 6)]), 0.0)
  state, new = scheduler.admit(state)
  assert [r.request_id for r in new] == [0, 1]
  assert [entry[0] for entry in scheduler.waiting] == [2]


def test_prefill_budget_spreads_admission_over_rounds():
  # 6 + 5 prefill tokens per request: a budget of 11 admits one per round
  # (the round stops once its work reaches the budget).
  scheduler, state = make_scheduler(prefill_tokens_per_step=11)
  for i in range(3):
    scheduler.add(i, request([doc(i, 6)]), 0.0)
  state, new = scheduler.admit(state)
  assert len(new) == 1 and new[0].prefill_tokens == 11


def test_a_request_that_does_not_fit_waits_for_live_requests():
  # 8 pages: the first request takes 2 (document) + 2 (own) pages; the second
  # needs 5 more and waits until the first retires.
  scheduler, state = make_scheduler(num_pages=8)
  scheduler.add(0, request([doc(0, 8)], query_len=5, max_new=3), 0.0)
  scheduler.add(1, request([doc(1, 12)], query_len=5, max_new=3), 0.0)
  state, new = scheduler.admit(state)
  assert [r.request_id for r in new] == [0]
  scheduler.start(new)
  state, again = scheduler.admit(state)
  assert again == [] and len(scheduler.waiting) == 1
  state, results = finish_all(scheduler, state, new)
  assert [r.request_id for r in results] == [0]
  state, later = scheduler.admit(state)  # evicts the unread document 0
  assert [r.request_id for r in later] == [1]


def test_an_interrupted_admission_leaves_queue_and_state_as_they_were(
    monkeypatch):
  scheduler, state = make_scheduler()
  for i in range(3):
    scheduler.add(i, request([doc(i, 6)]), 0.0)
  layout = scheduler.mode.layout
  calls = []

  def interrupted(*args):
    calls.append(1)
    if len(calls) == 2:
      raise KeyboardInterrupt
    return layout(*args)
  monkeypatch.setattr(scheduler.mode, "layout", interrupted)
  with pytest.raises(KeyboardInterrupt):
    scheduler.admit(state)
  assert [entry[0] for entry in scheduler.waiting] == [0, 1, 2]
  assert free_pages(scheduler, state) == 64  # the caller's state is unchanged
  monkeypatch.undo()
  state, new = scheduler.admit(state)
  assert [r.request_id for r in new] == [0, 1, 2]


def test_a_request_that_never_fits_finishes_with_an_error():
  scheduler, state = make_scheduler(num_pages=4)
  scheduler.add(0, request([doc(0, 16)]), 0.0)
  state, new = scheduler.admit(state)
  assert new == []
  (result,) = scheduler.retire(state)[1]
  assert result.finish_reason == "error"
  assert result.error.startswith("CacheCapacityError")
  assert free_pages(scheduler, state) == 4


def test_first_token_groups_serve_cached_requests_first():
  scheduler, state = make_scheduler(first_token_group_tokens=16)
  a, b, c, d = doc(1, 12), doc(2, 10), doc(3, 8), doc(4, 9)
  # c is cached beforehand (as by encode_documents).
  state, admission = scheduler.cache.admit(
      state, scheduler.mode.document_keys([c]), [8], 0)
  state = scheduler.cache.finish(state, admission)
  layout = [(a, b), (c,), (b, c), (d,)]
  for i, docs in enumerate(layout):
    scheduler.add(i, request(docs), 0.0)
  state, new = scheduler.admit(state)
  groups = scheduler.first_token_groups(new)
  assert [[r.request_id for r in g.requests] for g in groups] == [
      [1, 3], [2], [0]]
  # Each missing document is encoded once, in the first group that reads it.
  assert [[len(job.tokens) for job in g.documents] for g in groups] == [
      [9], [10], [12]]


def test_retire_releases_private_pages_and_keeps_documents_cached():
  scheduler, state = make_scheduler()
  scheduler.add(0, request([doc(0, 8)]), 0.0)
  state, new = scheduler.admit(state)
  scheduler.start(new)
  assert free_pages(scheduler, state) == 64 - 2 - 2
  state, (result,) = finish_all(scheduler, state, new)
  assert result.finish_reason == "length" and result.doc_hits == [False]
  assert free_pages(scheduler, state) == 64 - 2  # the document stays cached
  assert scheduler.cache.stats(state)["docs_in_use"] == 0


def test_fail_releases_pages_and_drops_unencoded_documents():
  scheduler, state = make_scheduler()
  scheduler.add(0, request([doc(0, 8), doc(1, 8)]), 0.0)
  state, new = scheduler.admit(state)
  state = scheduler.fail(state, new, RuntimeError("injected"))
  (result,) = scheduler.retire(state)[1]
  assert result.finish_reason == "error"
  assert result.error == "RuntimeError: injected"
  assert free_pages(scheduler, state) == 64
  assert scheduler.cache.stats(state)["cached_docs"] == 0
  # The documents were never encoded: a new request must miss them.
  scheduler.add(1, request([doc(0, 8)]), 0.0)
  state, again = scheduler.admit(state)
  assert again[0].admission.doc_hit == [False]


def test_fail_after_prefill_keeps_the_documents_cached():
  scheduler, state = make_scheduler()
  scheduler.add(0, request([doc(0, 8)]), 0.0)
  state, new = scheduler.admit(state)
  scheduler.start(new)
  state = scheduler.fail(state, new, RuntimeError("in decode"), prefilled=True)
  assert not scheduler.live
  assert scheduler.cache.stats(state)["cached_docs"] == 1
  assert free_pages(scheduler, state) == 64 - 2


def test_cancel_a_waiting_and_a_live_request():
  scheduler, state = make_scheduler(max_batch=1)
  scheduler.add(0, request([doc(0, 8)]), 0.0)
  scheduler.add(1, request([doc(1, 8)]), 0.0)
  state, new = scheduler.admit(state)
  scheduler.start(new)
  state, found = scheduler.cancel(state, 1)
  assert found and not scheduler.waiting
  state, found = scheduler.cancel(state, 0)
  assert found and not scheduler.live
  state, missing = scheduler.cancel(state, 7)
  assert not missing
  results = scheduler.retire(state)[1]
  assert [(r.request_id, r.finish_reason) for r in results] == [
      (1, "cancelled"), (0, "cancelled")]
  assert free_pages(scheduler, state) == 64 - 2  # document 0 stays cached


def test_a_result_taken_by_pop_result_is_not_reported_again():
  # A caller that cancels and pops (as a dropped stream's cleanup does)
  # has the result; the next round must not hand it out a second time.
  scheduler, state = make_scheduler(max_batch=1)
  scheduler.add(0, request([doc(0, 8)]), 0.0)
  scheduler.add(1, request([doc(1, 8)]), 0.0)
  state, new = scheduler.admit(state)
  scheduler.start(new)
  state, _ = scheduler.cancel(state, 0)  # live
  state, _ = scheduler.cancel(state, 1)  # waiting
  assert scheduler.pop_result(0).finish_reason == "cancelled"
  results = scheduler.retire(state)[1]
  assert [(r.request_id, r.finish_reason) for r in results] == [
      (1, "cancelled")]
  assert scheduler.pop_result(1).finish_reason == "cancelled"


@pytest.mark.parametrize("mode", list(MODES))
def test_submit_time_capacity_equals_what_admission_takes(mode):
  """The validator's page count for a request is exactly what admission
  allocates on an empty cache, in every mode, so a request that passes
  validation always fits an idle engine."""
  rng = np.random.default_rng(5)
  config = cache_config(num_pages=256, max_docs=64)
  reuse = make_mode(mode, PAGE, "test-model")
  validator = RequestValidator(None, VOCAB, 4096, config, reuse, ())
  cache = PagedKVCache(config)
  corpus = [doc(i, int(n)) for i, n in enumerate(rng.integers(1, 30, 8))]
  for trial in range(12):
    picks = rng.choice(len(corpus), size=int(rng.integers(1, 5)))
    query = [int(t) for t in rng.integers(1, VOCAB, int(rng.integers(1, 9)))]
    token_request = validator.validate(query, [corpus[i] for i in picks],
                                       SamplingParams(max_new_tokens=int(
                                           rng.integers(1, 20))))
    needs = reuse.cache_needs(token_request)
    state = init_cache_state(config)
    state, _ = cache.admit(state, needs.keys, needs.lengths,
                           needs.private_tokens)
    used = config.num_pages - cache.free_page_count(state)
    small = CacheConfig(**{**config.__dict__, "num_pages": used})
    tight = RequestValidator(None, VOCAB, 4096, small, reuse, ())
    tight.validate(query, [corpus[i] for i in picks], token_request.sampling)
    if used > 1:
      tighter = CacheConfig(**{**config.__dict__, "num_pages": used - 1})
      with pytest.raises(CacheCapacityError, match="pages"):
        RequestValidator(None, VOCAB, 4096, tighter, reuse, ()).validate(
            query, [corpus[i] for i in picks], token_request.sampling)
