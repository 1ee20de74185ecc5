"""Answer-quality options (QualityOptions) in the engine, lazy and block:
parity with the dense layout (models/dense_layout.py), cache keys that
follow the preamble, and zero-copy accounting.  Faults and refusals are in
test_engine_quality_faults.py."""

from __future__ import annotations

import numpy as np
import pytest

from lazyattn_jax.doc_key import document_key, embeddings_key
from lazyattn_jax.modes import make_mode
from lazyattn_jax.quality_options import QualityOptions
from pallas_kernels.sizes import ceil_div
from tests.engine_helpers import dense_greedy as _dense_greedy
from tests.engine_quality_helpers import (CHAT, OPTIONS, OTHER_SINK, PREFIX,
                                          SINK, OtherChatTokenizer, query_ids,
                                          quality_engine, recomputed_tokens,
                                          relative_error, table_keys)
from tests.test_engine import (PAGE, greedy, model_and_config,  # noqa: F401
                               random_tokens)
from tests.test_engine_faults import assert_pages_accounted_for

STEPS = 5
DOC_LENS = {"a": 7, "b": 12, "c": 3, "d": 2, "e": 9}
# The second request reads c and a from the cache at new positions, behind
# a document shorter than a page.
REQUESTS = [("a", "b", "c"), ("d", "c", "a", "e")]
TEXT_QUERIES = ["Who built it?", "And when?"]
_DENSE = {}  # (option, request) -> dense greedy; lazy and block share it
DENSE_LEN = 192  # every dense pass padded to one length: one compiled shape


def dense_greedy(*args, **layout):
  return _dense_greedy(*args, pad_to=DENSE_LEN, **layout)


@pytest.fixture(scope="module")
def docs(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(71)
  return {name: random_tokens(rng, n, config.vocab_size)
          for name, n in DOC_LENS.items()}


@pytest.fixture(scope="module")
def id_queries(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(72)
  return [random_tokens(rng, n, config.vocab_size) for n in (6, 4)]


def _dense(model, key, docs, query, layout):
  if key not in _DENSE:
    _DENSE[key] = dense_greedy(model, docs, query, STEPS, **layout)
  return _DENSE[key]


def _check(result, want):
  tokens, logits = want
  assert relative_error(result.first_logits, logits) < 1e-4
  assert result.token_ids == tokens


@pytest.mark.parametrize("mode", ["lazy", "block"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_engine_equals_the_dense_layout(model_and_config, docs, id_queries,
                                        mode, name):
  model, _, _ = model_and_config
  quality, layout, tokenizer = OPTIONS[name]
  engine = quality_engine(model_and_config, quality, mode=mode,
                          tokenizer=tokenizer)
  queries = TEXT_QUERIES if tokenizer is not None else id_queries
  k = layout.get("recompute_tokens", 0)
  seen, work, copies = set(), 0, 0
  for i, names in enumerate(REQUESTS):
    request_docs = [docs[n] for n in names]
    result = engine.generate(queries[i], request_docs, greedy(STEPS))
    ids = query_ids(tokenizer, queries[i])
    _check(result, _dense(model, (name, i), request_docs, ids, layout))
    assert result.doc_hits == [n in seen for n in names]
    lens = [DOC_LENS[n] for n in names]
    own = recomputed_tokens(lens, k) + len(ids)
    encoded = sum(DOC_LENS[n] for n in set(names) - seen)
    # The preamble once, in the first request's tokens where it is tokens
    # (a learned one's positions are not).
    first = 0 if i else len(engine._mode.preamble or ()) - (
        engine._mode.learned_preamble_positions)
    assert result.prefill_tokens_computed == own + encoded + first
    assert result.prompt_tokens == (
        sum(lens) + len(ids) + len(engine._mode.preamble or ()) -
        engine._mode.learned_preamble_positions)
    # Read from the cache: hit documents less their recomputed first pages
    # (a missed later document's head is recomputed and encoded: never
    # cached), and a chat preamble after the first request.
    hit_tokens = sum(n - (min(k, n) if d else 0) for d, (n, doc) in
                     enumerate(zip(lens, names)) if doc in seen)
    chat = (len(engine._mode.preamble or ()) -
            engine._mode.learned_preamble_positions)
    assert result.cached_prompt_tokens == hit_tokens + (chat if i else 0)
    work += own
    heads = [0] + [min(k, n) for n in lens[1:]]
    copies += sum(ceil_div(n, PAGE) - ceil_div(h, PAGE)
                  for n, h in zip(lens, heads))
    seen |= set(names)
  preamble = {"sink": len(SINK), "chat": len(PREFIX)}.get(
      name.split("+")[0], 0)
  stats = engine.stats
  # Every token prefilled is counted once: the preamble and each document
  # once, each request's recomputed heads and query every time.
  assert stats.prefill_tokens_computed == (
      preamble + sum(DOC_LENS.values()) + work)
  assert stats.preambles_prefilled == (1 if preamble else 0)
  assert stats.documents_prefilled == len(DOC_LENS)
  # Lazy reads every shared page in place; block copies only the pages that
  # are not recomputed (the preamble is read in place).
  assert stats.kv_pages_written_for_cached_docs == (
      0 if mode == "lazy" else copies)
  assert_pages_accounted_for(engine)


def test_text_query_after_a_sink_keeps_the_chat_prefix_as_document_0(
    model_and_config, docs):
  """With a learned preamble the chat prefix a text query brings is the
  request's first document (encoded after the sink, never recomputed);
  doc_hits still lists only the caller's documents."""
  model, _, _ = model_and_config
  quality, layout, _ = OPTIONS["sink+recompute"]
  engine = quality_engine(model_and_config, quality, tokenizer=CHAT)
  request_docs = [docs["b"], docs["c"]]
  result = engine.generate(TEXT_QUERIES[0], request_docs, greedy(STEPS))
  _check(result, dense_greedy(model, [PREFIX] + request_docs,
                              query_ids(CHAT, TEXT_QUERIES[0]), STEPS,
                              **layout))
  assert result.doc_hits == [False, False]
  assert engine.generate(TEXT_QUERIES[1], request_docs,
                         greedy(2)).doc_hits == [True, True]
  assert_pages_accounted_for(engine)


def test_document_keys_follow_the_preamble():
  doc = (5, 6, 7)

  def entries(quality, tokenizer=None):
    mode = make_mode("lazy", PAGE, "model", quality, tokenizer=tokenizer,
                     hidden_size=64, max_doc_tokens=64)
    return mode.entries([doc])[0]

  plain = entries(None)
  sink = entries(QualityOptions(preamble="sink", sink=SINK))
  chat = entries(QualityOptions(preamble="chat"), CHAT)
  other_chat = entries(QualityOptions(preamble="chat"), OtherChatTokenizer())
  # The same sink (another array with the same bytes) is the same entry.
  assert entries(QualityOptions(preamble="sink", sink=SINK.copy())) == sink
  other_sink = entries(QualityOptions(preamble="sink", sink=OTHER_SINK))
  assert len({plain[-1], sink[-1], other_sink[-1], chat[-1],
              other_chat[-1]}) == 5
  assert len({sink[0], other_sink[0], chat[0], other_chat[0]}) == 4
  # The chat prefix has the key it has as a leading document.
  assert chat[0] == document_key(PREFIX, "model")
  # Recompute changes what a request reads, not what is cached.
  assert entries(QualityOptions(recompute=True)) == plain
  # A sink's key covers its dtype and shape, not only its bytes.
  assert embeddings_key(SINK.reshape(6, 32), "model") != sink[0]
  assert embeddings_key(SINK.view(np.int32), "model") != sink[0]


def test_a_cache_kept_across_a_preamble_change_misses_and_the_same_hits(
    model_and_config, docs, id_queries):
  """One pool and table handed from engine to engine, as if the options
  changed under a warm cache: another sink, no preamble or another chat
  prefix never returns a stale document; the same preamble hits."""
  model, _, _ = model_and_config
  request_docs = [docs["a"], docs["c"]]
  engine, results = None, {}

  def run(name, quality, tokenizer=None, query=id_queries[0]):
    nonlocal engine
    successor = quality_engine(model_and_config, quality, tokenizer=tokenizer,
                               nan_pool=engine is None)
    if engine is not None:
      successor.rounds.state = engine.state
    engine = successor
    results[name] = engine.generate(query, request_docs, greedy(STEPS))
    return results[name].doc_hits, engine.stats.preambles_prefilled

  sink = QualityOptions(preamble="sink", sink=SINK)
  assert run("sink", sink) == ([False, False], 1)
  assert run("other sink", QualityOptions(preamble="sink",
                                          sink=OTHER_SINK)) == (
      [False, False], 1)
  assert run("same sink", QualityOptions(preamble="sink",
                                         sink=SINK.copy())) == ([True, True], 0)
  assert run("none", None) == ([False, False], 0)
  chat = QualityOptions(preamble="chat")
  text = TEXT_QUERIES[0]
  assert run("chat", chat, CHAT, text) == ([False, False], 1)
  assert run("other chat", chat, OtherChatTokenizer(), text) == (
      [False, False], 1)
  assert run("same chat", chat, CHAT, text) == ([True, True], 0)
  _check(results["other sink"], dense_greedy(
      model, request_docs, id_queries[0], STEPS,
      preamble_embeddings=OTHER_SINK))
  for name, again in (("sink", "same sink"), ("chat", "same chat")):
    assert results[again].token_ids == results[name].token_ids
    np.testing.assert_allclose(results[again].first_logits,
                               results[name].first_logits, rtol=1e-5,
                               atol=1e-5)
  assert_pages_accounted_for(engine)


def test_recompute_reads_shared_pages_in_place(model_and_config, docs,
                                               id_queries):
  """Documents encoded ahead of use are read at new positions with their
  first pages recomputed: their pages are never written again."""
  model, _, _ = model_and_config
  quality, layout, _ = OPTIONS["sink+recompute"]
  engine = quality_engine(model_and_config, quality)
  assert engine.encode_documents([docs["b"], docs["a"]]) == [False, False]
  assert engine.encode_documents([docs["a"]]) == [True]
  assert (engine.stats.preambles_prefilled,
          engine.stats.documents_prefilled) == (1, 2)
  held = np.flatnonzero(np.asarray(engine.state.page_refcount))
  k_before = np.asarray(engine.state.k)[:, :, held]
  v_before = np.asarray(engine.state.v)[:, :, held]
  engine.reset_stats()
  request_docs = [docs["a"], docs["b"]]
  result = engine.generate(id_queries[0], request_docs, greedy(STEPS))
  _check(result, dense_greedy(model, request_docs, id_queries[0], STEPS,
                              **layout))
  assert result.doc_hits == [True, True]
  # b's first page and the query are all this request prefilled.
  assert (result.prefill_tokens_computed ==
          engine.stats.prefill_tokens_computed == PAGE + len(id_queries[0]))
  assert engine.stats.kv_pages_written_for_cached_docs == 0
  np.testing.assert_array_equal(np.asarray(engine.state.k)[:, :, held],
                                k_before)
  np.testing.assert_array_equal(np.asarray(engine.state.v)[:, :, held],
                                v_before)
  assert_pages_accounted_for(engine)


def test_pressure_never_leaves_a_document_without_its_preamble(
    model_and_config):
  """A pool that holds about half the corpus (12 pages; a request takes up
  to 7): documents are evicted all the time, the preamble never (every
  admission reads it before evicting), so no cached document is ever
  without its preamble's KV; answers stay right.  Both eviction orders, in
  one test so that they share compiled programs."""
  model, config, _ = model_and_config
  quality, layout, _ = OPTIONS["sink+recompute"]
  for eviction in ("lru", "lfu"):
    rng = np.random.default_rng(73)
    corpus = [random_tokens(rng, int(n), config.vocab_size)
              for n in rng.integers(3, 8, size=6)]
    engine = quality_engine(model_and_config, quality, num_pages=12,
                            eviction=eviction)
    preamble_key = engine._mode.preamble.key
    seen, misses_after_seen = set(), 0
    for i in range(10):
      picks = [int(p) for p in rng.choice(6, size=2, replace=False)]
      query = random_tokens(rng, 3, config.vocab_size)
      result = engine.generate(query, [corpus[p] for p in picks], greedy(2))
      misses_after_seen += sum(p in seen and not hit
                               for p, hit in zip(picks, result.doc_hits))
      seen |= set(picks)
      assert preamble_key in table_keys(engine)
      if i % 4 == 3:
        _check(result, dense_greedy(model, [corpus[p] for p in picks], query,
                                    2, **layout))
    assert misses_after_seen > 0, eviction  # evicted and encoded again
    assert engine.stats.preambles_prefilled == 1
    assert_pages_accounted_for(engine)
