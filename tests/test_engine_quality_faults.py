"""Answer-quality options under faults and bad settings: a failed preamble
encode or recompute prefill rolls back and leaves the others serving;
options that are malformed or do not apply raise InvalidOptionError."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from lazyattn_jax.engine import LazyEngine, Request
from lazyattn_jax.errors import (CacheCapacityError, InvalidOptionError,
                                 InvalidRequestError)
from lazyattn_jax.quality_options import QualityOptions
from tests.engine_quality_helpers import (OPTIONS, SINK, quality_engine,
                                          table_keys)
from tests.test_engine import (PAGE, greedy, model_and_config,  # noqa: F401
                               random_tokens)
from tests.test_engine_faults import Fault, assert_pages_accounted_for

SINK_RECOMPUTE = OPTIONS["sink+recompute"][0]


@pytest.fixture(scope="module")
def corpus(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(81)
  docs = [random_tokens(rng, n, config.vocab_size) for n in (9, 6, 11, 5)]
  queries = [random_tokens(rng, 4, config.vocab_size) for _ in range(3)]
  return docs, queries


def _tables(engine):
  """The cache without its pool: refcounts and the document table."""
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(
      engine.state.replace(k=None, v=None))]


def _ownership(engine):
  """Who holds which page, and what each cached entry is (not the recency
  bookkeeping: an admission that failed still ticked the LRU clock)."""
  state = engine.state
  valid = np.asarray(state.doc_valid)
  return [np.asarray(state.page_refcount), valid,
          np.asarray(state.doc_users)] + [
              np.asarray(x)[valid] for x in (state.doc_key, state.doc_len,
                                             state.doc_pages)]


def _same(a, b):
  return all(np.array_equal(x, y) for x, y in zip(a, b))


def _fresh_results(model_and_config, requests, **settings):
  engine = quality_engine(model_and_config, SINK_RECOMPUTE, **settings)
  return engine.generate_batch(requests)


def test_a_failed_preamble_encode_changes_nothing(model_and_config, corpus,
                                                  monkeypatch):
  docs, queries = corpus
  engine = quality_engine(model_and_config, SINK_RECOMPUTE)
  before, pool = _tables(engine), np.asarray(engine.state.k)
  before_owners = _ownership(engine)
  fault = Fault(monkeypatch, engine.runner, "encode_documents",
                when=lambda state, jobs, **_: jobs[0].is_preamble)
  with pytest.raises(RuntimeError, match="injected fault"):
    engine.encode_documents([docs[0]])
  assert _same(_tables(engine), before)
  requests = [Request(tuple(queries[i]), (tuple(docs[i]), tuple(docs[3])),
                      greedy(4)) for i in range(2)]
  fault.at = 2  # the round's preamble encode
  results = engine.generate_batch(requests)
  assert [r.finish_reason for r in results] == ["error", "error"]
  assert all(r.error == "RuntimeError: injected fault" for r in results)
  assert _same(_ownership(engine), before_owners)
  np.testing.assert_array_equal(np.asarray(engine.state.k), pool)
  assert engine.stats.preambles_prefilled == 0
  monkeypatch.undo()
  again = engine.generate_batch(requests)
  for got, want in zip(again, _fresh_results(model_and_config, requests)):
    assert got.token_ids == want.token_ids
    np.testing.assert_allclose(got.first_logits, want.first_logits,
                               rtol=1e-5, atol=1e-5)
  assert engine.stats.preambles_prefilled == 1
  assert_pages_accounted_for(engine)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_a_failed_recompute_prefill_leaves_other_requests_running(
    model_and_config, corpus, monkeypatch, mode):
  docs, queries = corpus
  engine = quality_engine(model_and_config, SINK_RECOMPUTE, mode=mode,
                          decode_steps=2)
  running = Request(tuple(queries[0]), (tuple(docs[0]), tuple(docs[1])),
                    greedy(9))
  doomed = Request(tuple(queries[1]), (tuple(docs[2]), tuple(docs[0])),
                   greedy(3))
  running_id = engine.submit(running.query, running.documents,
                             running.sampling)
  engine.step()  # admitted and decoding
  before = _ownership(engine)
  # The doomed request's own prefill: its recomputed first page of docs[0]
  # and its query (document encodes are prefills too; they are let through).
  Fault(monkeypatch, engine.runner, "prefill_async",
        when=lambda state, rows, plans, samplings, embeddings=None:
        list(plans[0].tokens[-4:]) == queries[1])
  doomed_id = engine.submit(doomed.query, doomed.documents, doomed.sampling)
  ended = {r.request_id: r for r in engine.step()}
  assert ended[doomed_id].finish_reason == "error"
  assert ended[doomed_id].error == "RuntimeError: injected fault"
  # The round's document (docs[2]) left the table with the failed request.
  assert _same(_ownership(engine), before)
  monkeypatch.undo()
  while engine.has_work():
    ended.update({r.request_id: r for r in engine.step()})
  want = _fresh_results(model_and_config, [running, doomed], mode=mode)
  assert ended[running_id].token_ids == want[0].token_ids
  assert engine.generate_batch([doomed])[0].token_ids == want[1].token_ids
  # Block copies every page but the recomputed first ones: 3 + 1 for the
  # running request, 3 + 2 for the doomed one, twice (its copies were
  # written before its prefill failed).
  assert engine.stats.kv_pages_written_for_cached_docs == (
      0 if mode == "lazy" else 4 + 5 + 5)
  assert_pages_accounted_for(engine)


def test_a_failed_later_group_keeps_the_preamble_an_earlier_group_reads(
    model_and_config, corpus, monkeypatch):
  """The first group encodes the preamble and its documents; the second
  group's document encode fails.  The first group's requests keep their
  preamble (they read it) and finish; the failed ones leave nothing."""
  docs, queries = corpus
  engine = quality_engine(model_and_config, SINK_RECOMPUTE,
                          first_token_group_tokens=12)
  requests = [Request(tuple(queries[0]), (tuple(docs[1]),), greedy(3)),
              Request(tuple(queries[1]), (tuple(docs[0]), tuple(docs[2])),
                      greedy(3))]
  Fault(monkeypatch, engine.runner, "encode_documents", at=2,
        when=lambda state, jobs, **_: not jobs[0].is_preamble)
  first, second = engine.generate_batch(requests)
  assert (first.finish_reason, second.finish_reason) == ("length", "error")
  keys = table_keys(engine)
  assert keys == {engine._mode.preamble.key,
                  engine._mode.document_keys([docs[1]])[0]}
  assert_pages_accounted_for(engine)
  monkeypatch.undo()
  want = _fresh_results(model_and_config, requests)
  assert engine.generate_batch(requests)[1].token_ids == want[1].token_ids
  assert first.token_ids == want[0].token_ids
  assert engine.stats.preambles_prefilled == 1


# --- options that are malformed or do not apply ---------------------------

@pytest.mark.parametrize("fields,match", [
    (dict(preamble="system"), "preamble must be one of"),
    (dict(preamble="sink"), "sink is given exactly when preamble='sink'"),
    (dict(sink=SINK), "sink is given exactly when preamble='sink'"),
    (dict(preamble="sink", sink=SINK.astype(np.int32)), "must hold floats"),
    (dict(preamble="sink", sink=SINK[0]), r"must be \[P, D\]"),
    (dict(preamble="sink", sink=SINK[:0]), r"must be \[P, D\]"),
    (dict(preamble="sink", sink=SINK * np.nan), "NaN or infinity"),
    (dict(preamble="sink", sink="vectors"), "must hold floats"),
    (dict(recompute=1), "recompute must be a bool"),
    (dict(recompute_tokens=4), "recompute_tokens needs recompute=True"),
    (dict(recompute=True, recompute_tokens=0), "recompute_tokens must be"),
])
def test_malformed_options_are_refused_when_made(fields, match):
  with pytest.raises(InvalidOptionError, match=match):
    QualityOptions(**fields)


def test_options_are_frozen_hashable_and_compare_by_content():
  options = QualityOptions(preamble="sink", sink=SINK, recompute=True)
  with pytest.raises(dataclasses.FrozenInstanceError):
    options.recompute = False
  same = QualityOptions(preamble="sink", sink=SINK.copy(), recompute=True)
  assert options == same and hash(options) == hash(same)
  assert options != QualityOptions(preamble="sink", sink=SINK + 1,
                                   recompute=True)
  assert not options.sink.flags.writeable  # a copy nobody can change
  assert not QualityOptions().enabled


@pytest.mark.parametrize("mode,quality,tokenizer,match", [
    ("lazy", QualityOptions(recompute=True, recompute_tokens=6), None,
     r"recompute_tokens=6 is not a multiple of the page size \(4\)"),
    ("block", QualityOptions(preamble="sink", sink=np.ones((3, 65))), None,
     r"shape \(3, 65\).*hidden size 64"),
    ("lazy", QualityOptions(preamble="sink", sink=np.ones((65, 64))), None,
     "the preamble has 65 tokens; the cache holds at most 64"),
    ("lazy", QualityOptions(preamble="chat"), None, "needs a tokenizer"),
    ("prefix", QualityOptions(recompute=True), None,
     r"apply to modes \('lazy', 'block'\), not 'prefix'"),
    ("full", QualityOptions(preamble="sink", sink=SINK), None,
     r"apply to modes \('lazy', 'block'\), not 'full'"),
])
def test_options_that_do_not_apply_are_refused_by_the_engine(
    model_and_config, mode, quality, tokenizer, match):
  with pytest.raises(InvalidOptionError, match=match):
    quality_engine(model_and_config, quality, mode=mode, tokenizer=tokenizer)


def test_options_off_are_accepted_in_every_mode(model_and_config):
  for mode in ("prefix", "full"):
    engine = quality_engine(model_and_config, QualityOptions(), mode=mode,
                            nan_pool=False)
    assert engine.generate([5, 6], [[1, 2, 3]], greedy(2)).finish_reason == (
        "length")
  with pytest.raises(InvalidOptionError, match="must be a QualityOptions"):
    quality_engine(model_and_config, {"recompute": True})


def test_from_pretrained_checks_options_before_loading():
  missing = "/does/not/exist.gguf"
  with pytest.raises(InvalidOptionError, match="not 'full'"):
    LazyEngine.from_pretrained(missing, mode="full", recompute=True)
  with pytest.raises(InvalidOptionError, match="multiple of the page size"):
    LazyEngine.from_pretrained(missing, page_size=4, recompute=True,
                               recompute_tokens=6)
  with pytest.raises(InvalidOptionError, match="needs recompute=True"):
    LazyEngine.from_pretrained(missing, quality=None, recompute_tokens=16)
  # Recompute is on by default, so its k is checked without recompute=True.
  with pytest.raises(InvalidOptionError, match="multiple of the page size"):
    LazyEngine.from_pretrained(missing, page_size=4, recompute_tokens=6)
  with pytest.raises(InvalidOptionError, match="quality must be 'default'"):
    LazyEngine.from_pretrained(missing, quality="best")
  with pytest.raises(TypeError, match="unknown engine settings"):
    LazyEngine.from_pretrained(missing, recompute_pages=1)


def test_requests_are_measured_with_the_preamble_and_recomputed_pages(
    model_and_config):
  """The preamble takes positions and the recomputed pages take pool room:
  a request refused for either raises at submit and changes nothing."""
  engine = quality_engine(model_and_config, SINK_RECOMPUTE)
  engine.generate([5, 6], [[1, 2, 3]], greedy(2))
  before, pool = _tables(engine), np.asarray(engine.state.k)
  # 3 preamble + 504 document + 5 query + 1 generated > 512 positions.
  with pytest.raises(InvalidRequestError,
                     match=r"512 positions \(preamble \+ documents \+ "
                     r"query\) and 513 with max_new_tokens"):
    engine.generate([1] * 5, [[d] * 63 for d in range(1, 9)], greedy(1))
  # Six documents of 15 pages, 1 preamble page, 5 recomputed first pages
  # and 1 for the query: one more than the 96-page pool (without recompute
  # it would fit).
  six = [[d] * 60 for d in range(1, 7)]
  with pytest.raises(CacheCapacityError,
                     match="needs 97 pages but the whole pool has 96"):
    engine.generate([1, 2], six, greedy(1))
  assert _same(_tables(engine), before)
  np.testing.assert_array_equal(np.asarray(engine.state.k), pool, strict=True)
  assert not engine.has_work()
  assert engine.generate([5, 6], [[1, 2, 3]], greedy(2)).doc_hits == [True]
