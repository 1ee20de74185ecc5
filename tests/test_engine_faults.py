"""The engine under faults and bad input: rounds roll back, the engine keeps
serving, and nothing leaks.

A fault is injected inside one stage of a round (admission, layout,
document encoding, Block-Attention copies, query prefill, the fetch of a
prefill's first tokens, decode).  After
it: the affected requests end with an error result, every page is
accounted for, documents that were never encoded are not in the cache, and
greedy tokens still equal a fresh engine's.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
import pytest

from lazyattn_jax.engine import Request
from lazyattn_jax.errors import (CacheCapacityError, EngineClosedError,
                                 InvalidOptionError, InvalidRequestError,
                                 RequestFailedError)
from lazyattn_jax.sampling import SamplingParams
from tests.test_engine import (PAGE, greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)


def assert_pages_accounted_for(engine):
  """With nothing in flight, the only held pages are cached documents',
  each held once (by the table), and no document has a reader."""
  assert not engine.has_work()
  state = engine.state
  refcount = np.asarray(state.page_refcount)
  valid = np.asarray(state.doc_valid)
  doc_pages = np.asarray(state.doc_pages)[valid]
  held = np.zeros_like(refcount)
  np.add.at(held, doc_pages[doc_pages >= 0], 1)
  np.testing.assert_array_equal(refcount, held)
  assert not np.asarray(state.doc_users).any()


class Fault:
  """Wraps `owner.name` so that its `at`-th call raises (then behaves)."""

  def __init__(self, monkeypatch, owner, name, at=1, when=None):
    self.calls, self.at, self.when = 0, at, when
    self.original = getattr(owner, name)
    monkeypatch.setattr(owner, name, self)

  def __call__(self, *args, **kwargs):
    if self.when is None or self.when(*args, **kwargs):
      self.calls += 1
      if self.calls == self.at:
        raise RuntimeError("injected fault")
    return self.original(*args, **kwargs)


class FetchFault(Fault):
  """Wraps an async runner call (`prefill_async`, `decode_async`: it
  returns (state, fetch)) so that the fetch of its `at`-th call raises, as
  a device error surfacing there would."""

  def __call__(self, *args, **kwargs):
    state, fetch = self.original(*args, **kwargs)
    if self.when is None or self.when(*args, **kwargs):
      self.calls += 1
      if self.calls == self.at:
        def fetch():
          raise RuntimeError("injected fault")
    return state, fetch


@pytest.fixture(scope="module")
def corpus(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(31)
  docs = {name: random_tokens(rng, n, config.vocab_size)
          for name, n in (("a", 9), ("b", 11), ("c", 7), ("d", 10))}
  queries = [random_tokens(rng, 5, config.vocab_size) for _ in range(3)]
  return docs, queries


def round_requests(corpus):
  docs, queries = corpus
  # a is cached beforehand; b, c, d are new in the round.
  layout = [("a", "b"), ("c",), ("a",), ("d", "b")]
  return [Request(tuple(queries[i % 3]), tuple(tuple(docs[n]) for n in names),
                  greedy(5)) for i, names in enumerate(layout)]


STAGES = {
    # stage: (object path, attribute, call that fails)
    "admission": ("cache", "admit", 2),
    "layout": ("_mode", "layout", 2),
    "encode": ("runner", "encode_documents", 1),
    # With groups of 12 tokens the round is three groups ([a], [c]), ([a, b])
    # and ([d, b]): the second group's encode fails after the first group's
    # requests got their first tokens.
    "later group encode": ("runner", "encode_documents", 2),
    "copies": ("runner", "copy_pages", 1),
    "query prefill": ("runner", "prefill_async", 1),
    # The first group's tokens are fetched after the second group's calls
    # are dispatched: both groups fail.
    "first-token fetch": ("runner", "prefill_async", 1),
    "decode": ("runner", "decode_async", 1),
    # The decode loop ran; reading its tokens back fails.
    "decode fetch": ("runner", "decode_async", 1),
}


FAULT_CASES = [
    (mode, stage, groups)
    for mode, stage in [("lazy", s) for s in STAGES if s != "copies"] + [
        ("block", "copies"), ("block", "encode"), ("prefix", "query prefill"),
        ("full", "decode")]
    for groups in (None, 12)
    if not (stage == "later group encode" and groups is None)]


@pytest.mark.parametrize("mode,stage,group_tokens", FAULT_CASES)
def test_a_fault_in_any_stage_rolls_the_round_back(model_and_config, corpus,
                                                   monkeypatch, mode, stage,
                                                   group_tokens):
  docs, _ = corpus
  engine = make_engine(model_and_config, mode=mode, num_pages=64,
                       first_token_group_tokens=group_tokens)
  warm = engine.generate(corpus[1][0], [docs["a"]], greedy(2))
  owner, name, at = STAGES[stage]
  when = None
  if stage in ("query prefill", "first-token fetch"):  # not an encode
    when = lambda state, rows, plans, samplings: (
        plans[0].q_pos[0] != 0 or mode in ("prefix", "full"))
  if stage == "copies":
    when = lambda state, copies: bool(copies)
  kind = FetchFault if stage in ("first-token fetch", "decode fetch") else Fault
  fault = kind(monkeypatch, getattr(engine, owner), name, at, when)
  requests = round_requests(corpus)
  results = engine.generate_batch(requests)
  assert fault.calls >= at, "the fault was never reached"
  failed = {r.request_id for r in results if r.finish_reason == "error"}
  assert failed, [r.finish_reason for r in results]
  if stage == "later group encode":  # the first group ([a], [c]) goes on
    assert [r.finish_reason == "error" for r in results] == [
        True, False, False, True]
  for r in results:
    if r.request_id in failed:
      assert r.error == "RuntimeError: injected fault"
    else:
      assert r.finish_reason == "length"
  assert_pages_accounted_for(engine)
  monkeypatch.undo()

  # The engine keeps serving, and what it serves is right: the same round
  # again gives a fresh engine's tokens and logits.  A document the failed
  # round admitted but never encoded must be a miss now: read as a hit, its
  # unwritten pages would change the logits.
  again = engine.generate_batch(requests)
  fresh = make_engine(model_and_config, mode=mode, num_pages=64,
                      first_token_group_tokens=group_tokens)
  fresh.generate(corpus[1][0], [docs["a"]], greedy(2))
  want = fresh.generate_batch(requests)
  for got, expected in zip(again, want):
    assert got.finish_reason == "length"
    assert got.token_ids == expected.token_ids
    np.testing.assert_allclose(got.first_logits, expected.first_logits,
                               rtol=1e-5, atol=1e-5)
  assert_pages_accounted_for(engine)
  assert warm.finish_reason == "length"


def test_a_fault_in_one_round_leaves_earlier_live_requests_running(
    model_and_config, corpus, monkeypatch):
  docs, queries = corpus
  engine = make_engine(model_and_config, decode_steps=2)
  long_running = engine.submit(queries[0], [docs["a"]], greedy(9))
  engine.step()  # admitted and decoding
  Fault(monkeypatch, engine.runner, "encode_documents")
  doomed = engine.submit(queries[1], [docs["b"]], greedy(3))
  ended = {r.request_id: r for r in engine.step()}
  assert ended[doomed].finish_reason == "error"
  monkeypatch.undo()
  while engine.has_work():
    ended.update({r.request_id: r for r in engine.step()})
  alone = make_engine(model_and_config).generate(queries[0], [docs["a"]],
                                                 greedy(9))
  assert ended[long_running].token_ids == alone.token_ids
  assert_pages_accounted_for(engine)


def test_generate_raises_request_failed_and_the_engine_goes_on(
    model_and_config, corpus, monkeypatch):
  docs, queries = corpus
  engine = make_engine(model_and_config)
  Fault(monkeypatch, engine.runner, "decode_async")
  with pytest.raises(RequestFailedError, match="injected fault") as info:
    engine.generate(queries[0], [docs["a"]], greedy(4))
  assert info.value.result.finish_reason == "error"
  monkeypatch.undo()
  assert engine.generate(queries[0], [docs["a"]], greedy(4)).doc_hits == [True]
  assert_pages_accounted_for(engine)


def test_a_lost_pool_is_rebuilt_and_every_live_request_fails(
    model_and_config, corpus, monkeypatch):
  """A donated step that fails after consuming the pool leaves no KV: the
  cache restarts empty instead of serving from deleted buffers."""
  docs, queries = corpus
  engine = make_engine(model_and_config)
  engine.generate(queries[0], [docs["a"]], greedy(2))
  original = engine.runner.decode_async

  def consume_then_fail(state, *args):
    state.k.delete()
    raise RuntimeError("device failure")
  monkeypatch.setattr(engine.runner, "decode_async", consume_then_fail)
  (result,) = engine.generate_batch([Request(tuple(queries[1]),
                                             (tuple(docs["b"]),), greedy(3))])
  assert result.finish_reason == "error"
  monkeypatch.setattr(engine.runner, "decode_async", original)
  again = engine.generate(queries[0], [docs["a"]], greedy(2))
  assert again.doc_hits == [False]  # the cache was rebuilt empty
  assert_pages_accounted_for(engine)


def test_a_lost_pool_does_not_fail_requests_already_finished(
    model_and_config, corpus, monkeypatch):
  """A request done at its first token needs no KV: when the same round's
  decode loses the pool, it ends as it would have (it came back an error)."""
  docs, queries = corpus
  engine = make_engine(model_and_config)
  short = engine.submit(queries[0], [docs["a"]], greedy(1))
  long_running = engine.submit(queries[1], [docs["a"]], greedy(6))

  def consume_then_fail(state, *args):
    state.k.delete()
    raise RuntimeError("device failure")
  monkeypatch.setattr(engine.runner, "decode_async", consume_then_fail)
  ended = {r.request_id: r for r in engine.step()}
  monkeypatch.undo()
  assert ended[long_running].finish_reason == "error"
  alone = make_engine(model_and_config).generate(queries[0], [docs["a"]],
                                                 greedy(1))
  assert ended[short].finish_reason == "length"
  assert ended[short].token_ids == alone.token_ids
  assert engine.generate(queries[0], [docs["a"]], greedy(2)).doc_hits == [
      False]  # the cache was rebuilt empty
  assert_pages_accounted_for(engine)


def test_an_interrupt_while_decode_tokens_are_read_keeps_the_cache(
    model_and_config, corpus, monkeypatch):
  """Ctrl-C while a decode loop's tokens come back: the loop's requests end
  (the interrupt propagates), but the new pool was kept, so the cached
  documents stay (the cache was rebuilt empty and every request failed)."""
  docs, queries = corpus
  engine = make_engine(model_and_config)
  engine.generate(queries[0], [docs["a"]], greedy(2))
  other = engine.submit(queries[1], [docs["a"]], greedy(20))
  engine.step()
  decode_async = engine.runner.decode_async

  def interrupted(*args, **kwargs):
    state, _ = decode_async(*args, **kwargs)

    def fetch():
      raise KeyboardInterrupt
    return state, fetch
  monkeypatch.setattr(engine.runner, "decode_async", interrupted)
  with pytest.raises(KeyboardInterrupt):
    engine.generate(queries[2], [docs["a"]], greedy(10))
  monkeypatch.undo()
  # The other request ends with the error; generate's own request was
  # cancelled and its result taken as generate unwound, so no round
  # reports it.
  ended = engine.step()
  assert [(r.request_id, r.finish_reason) for r in ended] == [(other,
                                                                "error")]
  assert not engine.scheduler.has_work()
  assert engine.generate(queries[0], [docs["a"]], greedy(2)).doc_hits == [True]
  assert_pages_accounted_for(engine)


# --- bad input: refused at submit, nothing changes ------------------------------

BAD_SAMPLING = [
    (dict(seed="x"), "seed"), (dict(seed=None), "seed"),
    (dict(seed=2**64), "seed"), (dict(top_k=10**12), "top_k"),
    (dict(temperature="0.5"), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p="1"), "top_p"), (dict(max_new_tokens=True), "max_new_tokens"),
    (dict(stop_token_ids=[2**31]), "stop_token_ids"),
    (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=np.array(5)), "stop_token_ids"),  # was TypeError
    # was accepted, its keys the stop ids
    (dict(stop_token_ids={2: "eos"}), "stop_token_ids must be a sequence"),
]


@pytest.mark.parametrize("fields,match", BAD_SAMPLING)
def test_bad_sampling_is_refused_when_made(fields, match):
  with pytest.raises(InvalidRequestError, match=match):
    SamplingParams(**fields)


def _leaves(engine):
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(engine.state)]


# An override of None keeps the field as it is, so those cases are left out.
@pytest.mark.parametrize("fields,match", [
    case for case in BAD_SAMPLING if None not in case[0].values()] + [
    (dict(stop_token_ids=[10**6]), "stop_token_ids outside")])
def test_bad_sampling_overrides_are_refused_at_submit(model_and_config, fields,
                                                      match):
  engine = make_engine(model_and_config, num_pages=40)
  engine.generate([5, 6, 7], [[1, 2, 3]], greedy(2))
  before = _leaves(engine)
  with pytest.raises(InvalidRequestError, match=match):
    engine.submit([5, 6], [[1, 2]], greedy(2), **fields)
  assert not engine.has_work()
  assert all(np.array_equal(x, y) for x, y in zip(before, _leaves(engine)))
  # The engine still serves.
  assert engine.generate([5, 6], [[1, 2]], greedy(2)).finish_reason == "length"


@pytest.mark.parametrize("query,documents,match", [
    (None, [[1, 2]], "query must be text or a sequence"),
    (7, [[1, 2]], "query must be text or a sequence"),
    (b"\x05\x06", [[1, 2]], "query must be text or a sequence"),
    ([5.0, 6.0], [[1, 2]], "integer token ids"),
    ([True, 6], [[1, 2]], "integer token ids"),
    ([5, 6], [{"text": "x"}], "document 0 must be text or a sequence"),
    ([5, 6], [b"\x01\x02"], "document 0 must be text or a sequence"),
    ([5, 6], [[1, 2.5]], "document 0 must hold integer token ids"),
    ([5, 6], "abc", "documents must be a list"),
    ([5, 6], 3, "documents must be a list"),
    (np.array(5), [[1, 2]], r"query must be a 1-D array of token ids, got "
                            r"shape \(\)"),
    ([5, 6], [np.array(1)], "document 0 must be a 1-D array"),
    ([5, 6], [np.array([[1, 2]])], r"document 0 must be a 1-D array of "
                                   r"token ids, got shape \(1, 2\)"),
])
def test_wrong_input_types_are_invalid_requests(model_and_config, query,
                                                documents, match):
  engine = make_engine(model_and_config, num_pages=40)
  with pytest.raises(InvalidRequestError, match=match):
    engine.generate(query, documents, greedy(2))
  with pytest.raises(InvalidRequestError, match=match):
    engine.generate_batch([Request(query, documents, greedy(2))])
  assert not engine.has_work()


def test_calls_given_the_wrong_container_are_refused_or_find_nothing(
    model_and_config):
  engine = make_engine(model_and_config, num_pages=40)
  with pytest.raises(InvalidRequestError, match="a sequence of Request items"
                     ", got Request"):
    engine.generate_batch(Request([5, 6], [[1, 2]], greedy(2)))
  with pytest.raises(InvalidRequestError, match="document 0 must be a 1-D"):
    engine.encode_documents([np.array(3)])
  # A finished result held, so the lookups do hash the id.
  request_id = engine.submit([5, 6], [[1, 2]], greedy(2))
  while engine.has_work():
    engine.step()
  assert engine.tokens_so_far([request_id]) == []
  assert engine.pop_result([request_id]) is None
  assert engine.pop_result(request_id).finish_reason == "length"
  assert not engine.has_work()
  # True and 1.0 compare equal to 1 but are no request's id: they found
  # and cancelled request 1.
  first = engine.submit([5, 6], [[1, 2]], greedy(2))
  second = engine.submit([5, 6], [[1, 2]], greedy(2))
  assert second == 2
  for not_an_id in (float(first), second == 2, np.float32(second)):
    assert not engine.cancel(not_an_id)
    assert engine.tokens_so_far(not_an_id) == []
  assert engine.request_counts() == {"waiting": 2, "running": 0}
  assert engine.cancel(np.int64(second))  # a numpy integer is an id


def test_encode_documents_flags_a_repeat_as_its_first_occurrence(
    model_and_config):
  """Whether each document was cached when the call began, however the
  call is cut into batches (a repeat in a later batch is not a hit)."""
  a, b, c = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11], [12, 13, 14]
  for batch_size in (None, 1, 2, 3):
    engine = make_engine(model_and_config, num_pages=40)
    engine.encode_documents([c])
    assert engine.encode_documents([a, b, a, c, c],
                                   batch_size=batch_size) == [
        False, False, False, True, True], batch_size


def test_a_failed_encode_leaves_the_documents_it_evicted_evicted(
    model_and_config, monkeypatch):
  """The encode's admission evicted x and gave its pages to y; a later
  chunk of y failed after the first was written there.  x must not come
  back as cached (its pages hold y's first chunk)."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(21)
  x, z, y, query = (random_tokens(rng, n, config.vocab_size)
                    for n in (8, 8, 16, 5))
  engine = make_engine(model_and_config, num_pages=7, max_batch=1,
                       prefill_chunk_tokens=4)
  assert engine.encode_documents([x, z]) == [False, False]
  Fault(monkeypatch, engine.runner, "encode_documents", at=4)
  with pytest.raises(RuntimeError, match="injected fault"):
    engine.encode_documents([y])
  monkeypatch.undo()
  assert_pages_accounted_for(engine)
  fresh = make_engine(model_and_config, num_pages=64, prefill_chunk_tokens=4)
  for document in (x, z):
    got = engine.generate(query, [document], greedy(4))
    want = fresh.generate(query, [document], greedy(4))
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.first_logits, want.first_logits,
                               rtol=1e-5, atol=1e-5)


def test_a_request_cancelled_by_the_callback_is_not_failed_again(
    model_and_config, monkeypatch):
  """The callback cancels a; the decode loop's fetch then fails.  a keeps
  its one result and is released once (it was released twice: a cached
  document's pages went free while it stayed cached)."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(3)
  d1, d2, q1, q2 = (random_tokens(rng, n, config.vocab_size)
                    for n in (8, 8, 5, 5))
  engine = make_engine(model_and_config, num_pages=32)
  a = engine.submit(q1, [d1], greedy(8))
  b = engine.submit(q2, [d1, d2], greedy(8))
  FetchFault(monkeypatch, engine.runner, "decode_async")
  results = engine.step(on_first_tokens=lambda: engine.cancel(a))
  monkeypatch.undo()
  assert sorted((r.request_id, r.finish_reason) for r in results) == [
      (a, "cancelled"), (b, "error")]
  assert_pages_accounted_for(engine)
  fresh = make_engine(model_and_config, num_pages=96)
  got, want = (e.generate(q1, [d1], greedy(4)) for e in (engine, fresh))
  assert got.doc_hits == [True] and got.token_ids == want.token_ids


def test_a_request_done_in_a_failing_group_gets_a_result_when_the_pool_goes(
    model_and_config, monkeypatch):
  """Group 0's first request is done at its first token; its second
  call's fetch fails after group 1's donated encode consumed the pool.
  The done request had no result at all (generate would wait forever)."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(9)
  x, y, qa, qb, qc = (random_tokens(rng, n, config.vocab_size)
                      for n in (8, 8, 4, 4, 4))
  engine = make_engine(model_and_config, num_pages=32, max_prefill_tokens=4,
                       first_token_group_tokens=4)
  engine.encode_documents([x])
  ids = [engine.submit(qa, [x], greedy(1)), engine.submit(qb, [x], greedy(4)),
         engine.submit(qc, [y], greedy(4))]
  FetchFault(monkeypatch, engine.runner, "prefill_async", at=2)

  def consumed(state, *args, **kwargs):
    state.k.delete()
    state.v.delete()
    raise RuntimeError("injected: pool consumed")
  monkeypatch.setattr(engine.runner, "encode_documents", consumed)
  results = engine.step()
  monkeypatch.undo()
  assert sorted(r.request_id for r in results) == sorted(ids)
  assert all(r.finish_reason == "error" for r in results)
  assert not engine.has_work()


@pytest.mark.parametrize("error", [
    MemoryError("Unable to allocate 23.8 GiB for an array"),
    jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory allocating 26214400000 bytes."),
])
def test_a_cache_too_large_for_memory_is_an_option_error(
    model_and_config, monkeypatch, error):
  import lazyattn_jax.engine as engine_module

  def out_of_memory(config):
    raise error

  monkeypatch.setattr(engine_module, "PagedKVCache", out_of_memory)
  with pytest.raises(InvalidOptionError,
                     match=r"the cache does not fit in memory: 40 pages of "
                           rf"{PAGE} tokens \(.* GiB of K and V\)"):
    make_engine(model_and_config, num_pages=40)


def test_other_runtime_errors_while_allocating_pass_through(
    model_and_config, monkeypatch):
  import lazyattn_jax.engine as engine_module

  def broken(config):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")

  monkeypatch.setattr(engine_module, "PagedKVCache", broken)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    make_engine(model_and_config, num_pages=40)


def test_pages_longer_than_the_context_are_refused():
  from lazyattn_jax.loading import default_cache_config
  from tests.training_helpers import tiny_config
  config = tiny_config()
  with pytest.raises(InvalidOptionError, match=rf"page_size "
                     rf"{config.max_position + 1} is longer than the model's"):
    default_cache_config(config, "float32", 16, config.max_position + 1)
  assert default_cache_config(config, "float32", 16,
                              config.max_position).max_pages_per_doc == 1


def test_the_default_prefix_pool_caches_a_page_per_slot(model_and_config):
  """Prefix mode's cache entries are single prompt pages.  Before: the
  default pool had a quarter as many slots as pages, so a prompt of more
  pages than that was refused (CacheCapacityError), however large the
  pool, and only a quarter of the pool could hold cached pages."""
  from lazyattn_jax.config import split_settings
  from lazyattn_jax.engine import LazyEngine
  from lazyattn_jax.loading import default_cache_config
  model, config, impl = model_and_config
  cache = default_cache_config(config, "float32", 64, 4, "prefix")
  assert (cache.max_docs, cache.max_pages_per_doc) == (64, 1)
  scheduler, runner = split_settings(None, None,
                                     dict(impl=impl, max_batch=2))
  engine = LazyEngine(config, model, cache, mode="prefix",
                      scheduler=scheduler, runner=runner)
  rng = np.random.default_rng(0)
  documents = [random_tokens(rng, 40, config.vocab_size) for _ in range(2)]
  query = random_tokens(rng, 3, config.vocab_size)
  first = engine.generate(query, documents, greedy(3))  # 20 full pages
  again = engine.generate(query, documents, greedy(3))
  assert again.token_ids == first.token_ids
  assert again.doc_hits == [True, True]
  lazy = default_cache_config(config, "float32", 64, 4)
  assert (lazy.max_docs, lazy.max_pages_per_doc) == (16, 32)


def test_sampling_must_be_sampling_params(model_and_config):
  engine = make_engine(model_and_config, num_pages=40)
  with pytest.raises(InvalidRequestError, match="SamplingParams"):
    engine.generate([5, 6], [[1, 2]], {"max_new_tokens": 2})


def test_an_engine_after_close_raises_a_clear_error(model_and_config):
  # prepare, pop_result, tokens_so_far, memory and the empty batch and
  # encode calls answered as if open; a request close() dropped then read
  # None from pop_result forever, as one still in flight does.
  engine = make_engine(model_and_config, num_pages=40)
  engine.generate([5, 6], [[1, 2]], greedy(2))
  dropped = engine.submit([5, 6], [[1, 2]], greedy(2))
  engine.close()
  for call in (lambda: engine.generate([5, 6], [[1, 2]], greedy(2)),
               lambda: engine.submit([5, 6], [[1, 2]], greedy(2)),
               lambda: engine.prepare([5, 6], [[1, 2]], greedy(2)),
               engine.step, engine.reset_cache, engine.reset_stats,
               lambda: engine.encode_documents([[1, 2]]),
               lambda: engine.encode_documents([]),
               lambda: engine.generate_batch([]),
               lambda: engine.pop_result(dropped),
               lambda: engine.tokens_so_far(dropped),
               lambda: engine.cancel(dropped),
               lambda: engine.memory, lambda: engine.state):
    with pytest.raises(EngineClosedError, match="closed"):
      call()
  assert not engine.has_work()
  assert engine.request_counts() == {"waiting": 0, "running": 0}


@pytest.mark.parametrize("mode,documents,match", [
    # 33 full pages of prompt: 33 prefix entries for a 32-row table.
    ("prefix", [[3] * (33 * PAGE)], "33 full pages"),
    # A document listed twice occupies twice its pages in full mode.
    ("full", [[3] * 100, [3] * 100], "needs 51 pages"),
])
def test_prefix_and_full_refuse_what_cannot_fit_at_submit(
    model_and_config, mode, documents, match):
  engine = make_engine(model_and_config, mode=mode, num_pages=48)
  ok = Request((5, 6), ((1, 2, 3),), greedy(2))
  with pytest.raises(CacheCapacityError, match=match):
    engine.generate_batch([ok, Request((5, 6), documents, greedy(2))])
  # Nothing of the batch was queued, and no result is left behind.
  assert not engine.has_work()
  assert engine.pop_result(0) is None
  assert engine.generate_batch([ok])[0].finish_reason == "length"


class FakeChatTokenizer:
  """Enough of a tokenizer for text requests: one id per byte."""
  chat_template = "fake"
  stop_token_ids = ()

  def encode(self, text, parse_special=True):
    return [1 + b % 200 for b in text.encode()]

  def render_chat(self, messages):
    return f"<sys>be brief</sys><user>{messages[0]['content']}</user><bot>"

  def decode(self, ids):
    return "".join(chr(65 + t % 26) for t in ids)

  def incremental_decoder(self):
    tokenizer = self

    class Decoder:
      def push(self, ids):
        return tokenizer.decode(ids)

      def finish(self):
        return ""
    return Decoder()


def engine_with_tokenizer(model_and_config, **settings):
  model, config, _ = model_and_config
  engine = make_engine(model_and_config, **settings)
  return type(engine)(config, model, engine.cache_config, engine.mode,
                      scheduler=engine.scheduler_config,
                      runner=engine.runner_config,
                      tokenizer=FakeChatTokenizer())


def test_document_count_error_counts_the_callers_documents(model_and_config):
  engine = engine_with_tokenizer(model_and_config, num_pages=400)
  docs = [f"d{i}" for i in range(32)]  # max_docs is 32
  with pytest.raises(CacheCapacityError,
                     match=r"32 distinct documents plus 1 leading \(the chat "
                           r"prefix or a conversation\) \(33 cache entries\)"):
    engine.generate("a question?", docs, greedy(2))


# --- concurrency ---------------------------------------------------------------

def test_threads_calling_generate_share_the_engine_safely(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(41)
  docs = [random_tokens(rng, int(n), config.vocab_size) for n in (6, 9, 13, 8)]
  jobs = [(random_tokens(rng, 4, config.vocab_size),
           [docs[i % 4], docs[(i + 1) % 4]], greedy(int(rng.integers(2, 7))))
          for i in range(8)]
  want = [make_engine(model_and_config).generate(*job).token_ids
          for job in jobs]
  engine = make_engine(model_and_config, max_batch=3)
  got, errors = {}, []

  def worker(indices):
    try:
      for i in indices:
        got[i] = engine.generate(*jobs[i]).token_ids
    except Exception as e:  # noqa: BLE001 - reported below
      errors.append(e)
  threads = [threading.Thread(target=worker, args=(range(k, 8, 4),))
             for k in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=600)
  assert not errors, errors
  assert [got[i] for i in range(8)] == want
  assert_pages_accounted_for(engine)


def test_cancel_releases_a_running_request(model_and_config, corpus):
  docs, queries = corpus
  engine = make_engine(model_and_config, decode_steps=2)
  request_id = engine.submit(queries[0], [docs["a"], docs["c"]], greedy(20))
  engine.step()
  assert engine.cancel(request_id)
  assert not engine.cancel(request_id)
  (result,) = [r for r in engine.step() if r.request_id == request_id]
  assert result.finish_reason == "cancelled"
  assert 0 < len(result.token_ids) < 20
  assert_pages_accounted_for(engine)


def test_closing_a_stream_early_cancels_its_request(model_and_config, corpus):
  docs, queries = corpus
  engine = engine_with_tokenizer(model_and_config, decode_steps=2)
  stream = engine.generate_stream(queries[0], [docs["a"]], greedy(20))
  assert next(stream)  # the first piece: the request is running
  assert engine.has_work()
  stream.close()
  assert not engine.has_work()
  assert_pages_accounted_for(engine)
  full = list(engine.generate_stream(queries[0], [docs["a"]], greedy(6)))
  want = make_engine(model_and_config).generate(queries[0], [docs["a"]],
                                                greedy(6))
  assert "".join(full) == FakeChatTokenizer().decode(want.token_ids)


def test_a_wait_whose_result_another_caller_took_raises(model_and_config,
                                                        corpus):
  """Another caller driving the engine as the server's loop does (step,
  then pop_result of every result) takes a waiting call's result; the
  generate or stream then stepped the idle engine for ever."""
  from lazyattn_jax.errors import ResultTakenError
  docs, queries = corpus
  engine = engine_with_tokenizer(model_and_config, decode_steps=2)
  stream = engine.generate_stream(queries[0], [docs["a"]], greedy(6))
  assert next(stream)
  while engine.has_work():
    for result in engine.step():
      engine.pop_result(result.request_id)
  with pytest.raises(ResultTakenError, match="taken by another caller"):
    list(stream)
  step = engine.step

  def step_and_pop_everything(**kwargs):
    for result in step(**kwargs):
      engine.pop_result(result.request_id)
    return []
  engine.step = step_and_pop_everything
  with pytest.raises(ResultTakenError, match="taken by another caller"):
    engine.generate(queries[1], [docs["a"]], greedy(3))
  assert not engine.has_work()
  assert_pages_accounted_for(engine)


def test_a_stream_the_gc_drops_inside_a_round_is_cancelled_after_it(
    model_and_config, corpus, monkeypatch):
  """A started stream dropped in a reference cycle is closed by the garbage
  collector on whatever thread allocates: here inside another caller's
  round.  Its cancel ran there, re-entrantly, and the round then overwrote
  the state it had released pages in: they leaked for good (and under
  threads the process could crash)."""
  import gc
  docs, queries = corpus
  engine = engine_with_tokenizer(model_and_config, decode_steps=2)
  stream = engine.generate_stream(queries[0], [docs["a"]], greedy(40))
  next(stream)  # running, holding pages
  cycle = [stream]
  cycle.append(cycle)
  del stream, cycle
  admit = engine.cache.admit

  def admit_then_collect(*args, **kwargs):
    admitted = admit(*args, **kwargs)
    gc.collect()  # as an allocation in the round may
    return admitted
  monkeypatch.setattr(engine.cache, "admit", admit_then_collect)
  other = engine.generate(queries[1], [docs["a"]], greedy(4))
  monkeypatch.undo()
  assert other.finish_reason == "length"
  assert not engine.has_work()
  assert not engine.scheduler.finished  # no result nobody will pop
  assert_pages_accounted_for(engine)


@pytest.mark.slow
def test_churn_soak_with_failing_steps(model_and_config):
  """Many requests through a small pool (documents evicted all the time),
  with faults injected at random into encodes, prefills and decodes: every
  request ends, every page is accounted for, and the requests that
  succeeded match a fresh engine."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(51)
  corpus = [random_tokens(rng, int(n), config.vocab_size)
            for n in rng.integers(5, 20, size=24)]
  jobs = []
  for _ in range(90):
    picks = rng.choice(len(corpus), size=int(rng.integers(1, 4)), replace=False)
    jobs.append((random_tokens(rng, int(rng.integers(2, 8)), config.vocab_size),
                 [corpus[i] for i in picks], greedy(int(rng.integers(1, 6)))))
  engine = make_engine(model_and_config, num_pages=40, max_batch=4,
                       decode_steps=2, first_token_group_tokens=16)
  chance = np.random.default_rng(52)
  for name in ("encode_documents", "prefill_async", "decode"):
    original = getattr(engine.runner, name)

    def flaky(*args, _original=original, **kwargs):
      if chance.random() < 0.06:
        raise RuntimeError("injected fault")
      return _original(*args, **kwargs)
    setattr(engine.runner, name, flaky)
  results, pending = {}, list(range(len(jobs)))
  ids = {}
  while pending or engine.has_work():
    while pending and len(engine.scheduler.waiting) < 3:
      i = pending.pop(0)
      ids[engine.submit(*jobs[i])] = i
    for r in engine.step():
      results[ids[r.request_id]] = r
  assert sorted(results) == list(range(len(jobs)))
  reasons = [r.finish_reason for r in results.values()]
  assert 0 < reasons.count("error") < len(jobs) // 2, reasons
  assert_pages_accounted_for(engine)
  fresh = make_engine(model_and_config, num_pages=40)
  ok = [i for i, r in results.items() if r.finish_reason != "error"]
  for i in rng.choice(ok, size=12, replace=False):
    assert results[i].token_ids == fresh.generate(*jobs[i]).token_ids, i


def test_encode_documents_while_requests_are_in_flight(model_and_config,
                                                       corpus):
  docs, queries = corpus
  engine = make_engine(model_and_config, decode_steps=2)
  running = engine.submit(queries[0], [docs["a"]], greedy(8))
  engine.step()
  assert engine.scheduler.live  # decoding
  assert engine.encode_documents([docs["b"], docs["a"]]) == [False, True]
  ended = {}
  while engine.has_work():
    ended.update({r.request_id: r for r in engine.step()})
  alone = make_engine(model_and_config).generate(queries[0], [docs["a"]],
                                                 greedy(8))
  assert ended[running].token_ids == alone.token_ids
  reused = engine.generate(queries[1], [docs["b"]], greedy(3))
  assert reused.doc_hits == [True]
  assert reused.token_ids == make_engine(model_and_config).generate(
      queries[1], [docs["b"]], greedy(3)).token_ids
  assert_pages_accounted_for(engine)


def test_memory_reports_weights_and_pool(model_and_config):
  model, config, _ = model_and_config
  engine = make_engine(model_and_config, num_pages=40)
  cache = engine.cache_config
  pool = 2 * 4 * int(np.prod(cache.pool_shape))  # K and V, float32
  weights = sum(x.nbytes for x in jax.tree_util.tree_leaves(
      engine.runner.params))
  assert engine.memory == {"weights_bytes": weights, "kv_pool_bytes": pool}
  assert weights > 400_000  # the tiny model's 106,816 float32 parameters


def test_prepare_then_submit_prepared_equals_submit(model_and_config, corpus):
  """A server validates on its handler threads (`prepare`, no lock, no state
  change) and queues from its engine loop (`submit_prepared`)."""
  docs, queries = corpus
  engine = make_engine(model_and_config, decode_steps=2)
  prepared = engine.prepare(queries[0], [docs["a"], docs["b"]], greedy(6))
  assert not engine.has_work()
  with pytest.raises(InvalidRequestError, match="TokenRequest"):
    engine.submit_prepared((queries[0], [docs["a"]]))
  with pytest.raises(InvalidRequestError):
    engine.prepare(queries[0], [[]], greedy(6))
  request_id = engine.submit_prepared(prepared)
  assert engine.request_counts() == {"waiting": 1, "running": 0}
  engine.step()
  assert engine.request_counts() == {"waiting": 0, "running": 1}
  assert 0 < len(engine.tokens_so_far(request_id)) < 6
  while engine.has_work():
    engine.step()
  result = engine.pop_result(request_id)
  assert engine.tokens_so_far(request_id) == []
  want = make_engine(model_and_config).generate(
      queries[0], [docs["a"], docs["b"]], greedy(6))
  assert result.token_ids == want.token_ids
  assert_pages_accounted_for(engine)
