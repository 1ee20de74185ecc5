"""Property tests of the cache manager: random admit / finish / evict / reuse.

A pure-Python model tracks what the cache must hold: the cached documents and
their pages, the live requests with their documents and private pages.  After
every step the device state must agree with it exactly (refcounts, document
table, free pages), and every owner's pages must still hold the marker value
its owner wrote, so a page freed or handed to someone else while still live
would show up as an overwritten marker.
"""

from __future__ import annotations

import collections
import dataclasses

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import event, settings
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant,
                                 precondition, rule)

from lazyattn_jax import cache_state as cs
from lazyattn_jax.cache_state import FREQUENCY_WINDOW_PER_SLOT, CacheConfig
from lazyattn_jax.doc_key import document_key
from lazyattn_jax.errors import CacheCapacityError
from lazyattn_jax.paged_cache import PagedKVCache

CONFIG = CacheConfig(num_pages=24, page_size=4, num_layers=1, num_kv_heads=1,
                     head_dim=2, dtype="float32", max_docs=6,
                     max_pages_per_doc=5)
# Shared: their jitted functions compile once.
CACHES = {policy: PagedKVCache(dataclasses.replace(CONFIG, eviction=policy))
          for policy in ("lfu", "lru")}
WINDOW = FREQUENCY_WINDOW_PER_SLOT * CONFIG.max_docs  # reads between halvings
NUM_DOCS = 8  # distinct documents a request may draw from
MAX_DOC_TOKENS = CONFIG.max_pages_per_doc * CONFIG.page_size


def pages_of(tokens: int) -> int:
  return -(-tokens // CONFIG.page_size)


def table_leaves(state) -> list[np.ndarray]:
  """Every array of the state except the pool."""
  return [np.asarray(x) for x in
          jax.tree_util.tree_leaves(state.replace(k=None, v=None))]


def doc_marker(doc: int) -> float:
  return -1.0 - doc  # documents write negative markers


def request_marker(rid: int) -> float:
  return 1.0 + rid  # requests write positive markers


class CacheMachine(RuleBasedStateMachine):
  policy = "lfu"

  @initialize(lengths=st.lists(st.integers(1, MAX_DOC_TOKENS),
                               min_size=NUM_DOCS, max_size=NUM_DOCS))
  def setup(self, lengths):
    self.lengths = lengths
    self.keys = [document_key([doc, 7], "prop-model") for doc in range(NUM_DOCS)]
    self.cache = CACHES[self.policy]
    self.state = cs.init_cache_state(self.cache.config)
    self.cached = {}  # doc -> {"slot", "pages", "last_use", "uses"}
    self.reads_since_aging = 0
    self.live = {}  # rid -> {"docs", "admission"}
    self.next_rid = 0
    self.time = 0  # model clock: one tick per admission

  # -------------------------------------------------------------- helpers

  def pages_in_use(self) -> set[int]:
    used = set()
    for entry in self.cached.values():
      used.update(entry["pages"])
    for req in self.live.values():
      used.update(req["admission"].private_pages)
    return used

  def users(self) -> collections.Counter:
    count = collections.Counter()
    for req in self.live.values():
      count.update(req["docs"])
    return count

  def evictable(self, protected=()) -> list[int]:
    users = self.users()
    return [d for d in self.cached if users[d] == 0 and d not in protected]

  def table_docs(self) -> dict[int, int]:
    """doc -> slot, read from the device document table."""
    valid = np.asarray(self.state.doc_valid)
    keys = np.asarray(self.state.doc_key)
    by_key = {k: d for d, k in enumerate(self.keys)}
    found = {}
    for slot in np.flatnonzero(valid):
      doc = by_key[tuple(int(w) for w in keys[slot])]
      assert doc not in found, f"doc {doc} cached twice"
      found[doc] = int(slot)
    return found

  def priority(self, entry: dict) -> tuple[int, ...]:
    """Eviction order key (lowest goes first); equal keys may go either way."""
    if self.policy == "lru":
      return (entry["last_use"],)
    return (entry["uses"], entry["last_use"])

  def count_reads(self, docs):
    """Mirrors one acquire: each listing is a read; counts halve per window."""
    for d in docs:
      self.cached[d]["uses"] += 1
    self.reads_since_aging += len(docs)
    if self.reads_since_aging >= WINDOW:
      event("read counts halved")
      self.reads_since_aging -= WINDOW
      for entry in self.cached.values():
        entry["uses"] //= 2

  def check_eviction(self, before: dict, free_before: int, need_pages: int,
                     need_slots: int, protected=()):
    """Docs that left the table were evicted in policy order, only as
    needed."""
    after = self.table_docs()
    evicted = [d for d in before if d not in after]
    evictable = [d for d in before if self.users()[d] == 0
                 and d not in protected]
    assert set(evicted) <= set(evictable), "evicted a document in use"
    for d in evicted:  # nothing that goes earlier survived
      for s in evictable:
        if s not in evicted:
          assert self.priority(before[d]) <= self.priority(before[s])
    freed = sum(len(before[d]["pages"]) for d in evicted)
    free_slots = CONFIG.max_docs - len(before)
    satisfied = lambda pages, docs: (free_before + pages >= need_pages and
                                     free_slots + docs >= need_slots)
    if evicted:  # the last one evicted was needed
      last = max(self.priority(before[d]) for d in evicted)
      assert any(not satisfied(freed - len(before[d]["pages"]),
                               len(evicted) - 1)
                 for d in evicted if self.priority(before[d]) == last)
    if len(evicted) < len(evictable):  # stopped early: enough is free
      assert satisfied(freed, len(evicted))
    if evicted:
      event("eviction")
    for d in evicted:
      del self.cached[d]

  def write(self, pages, value):
    """Stands in for the model writing KV into `pages` (host-side, so that
    page lists of varying length compile nothing)."""
    k, v = np.array(self.state.k), np.array(self.state.v)
    k[:, :, pages] = value
    v[:, :, pages] = value
    self.state = self.state.replace(k=jnp.asarray(k), v=jnp.asarray(v))

  # ---------------------------------------------------------------- rules

  def admit(self, docs: list[int], private_tokens: int):
    state = self.state
    hits = {d for d in docs if d in self.cached}
    missing = list(dict.fromkeys(d for d in docs if d not in self.cached))
    need_pages = (sum(pages_of(self.lengths[d]) for d in missing) +
                  pages_of(private_tokens))
    free = CONFIG.num_pages - len(self.pages_in_use())
    evictable = self.evictable(protected=hits)
    fits = (need_pages <= free + sum(len(self.cached[d]["pages"])
                                     for d in evictable) and
            len(missing) <= CONFIG.max_docs - len(self.cached) + len(evictable))
    before_leaves = table_leaves(state)
    k_before = np.asarray(state.k)
    try:
      new_state, adm = self.cache.admit(state, [self.keys[d] for d in docs],
                                        [self.lengths[d] for d in docs],
                                        private_tokens)
    except CacheCapacityError:
      assert not fits, "refused a request that fits"
      event("admission refused")
      after_leaves = table_leaves(state)
      for old, now in zip(before_leaves, after_leaves):
        np.testing.assert_array_equal(old, now)
      return
    assert fits, "admitted a request that does not fit"
    event("admission with a hit" if hits else "admission without hits")
    if len(missing) < len([d for d in docs if d not in hits]):
      event("admission with a repeated missing document")
    # Admission writes no KV: the pool is the very same buffer.
    assert new_state.k is state.k and new_state.v is state.v
    np.testing.assert_array_equal(np.asarray(new_state.k), k_before)
    self.state = new_state

    # Admission acquires the hits before it evicts, the misses after.
    self.count_reads([d for d in docs if d in hits])
    before = dict(self.cached)
    self.check_eviction(before, free, need_pages, len(missing), hits)
    used_after_eviction = self.pages_in_use()

    assert adm.doc_hit == [d in hits for d in docs]
    assert adm.missing_docs == [docs.index(d) for d in missing]
    assert len(adm.private_pages) == pages_of(private_tokens)
    fresh = set(adm.private_pages)
    for i, d in enumerate(docs):
      assert len(adm.doc_pages[i]) == pages_of(self.lengths[d])
      if d in hits:  # zero-copy reuse: the cached pages, with their KV
        assert adm.doc_pages[i] == self.cached[d]["pages"]
        assert adm.doc_slots[i] == self.cached[d]["slot"]
      elif d not in self.cached:  # first occurrence of a miss
        self.cached[d] = dict(slot=adm.doc_slots[i],
                              pages=list(adm.doc_pages[i]), uses=0)
        fresh.update(adm.doc_pages[i])
      else:  # a repeated miss shares the first occurrence's pages
        assert adm.doc_pages[i] == self.cached[d]["pages"]
    n_fresh = len(adm.private_pages) + sum(
        len(self.cached[d]["pages"]) for d in missing)
    assert len(fresh) == n_fresh, "a page was handed out twice"
    assert not fresh & used_after_eviction, "a live page was reallocated"
    self.count_reads([d for d in docs if d not in hits])
    for d in docs:
      self.cached[d]["last_use"] = self.time
    self.time += 1

    # The "model" writes KV: missing documents are prefilled, and the
    # request's private pages get its own marker.
    rid = self.next_rid
    self.next_rid += 1
    for d in missing:
      self.write(self.cached[d]["pages"], doc_marker(d))
    if adm.private_pages:
      self.write(adm.private_pages, request_marker(rid))
    self.live[rid] = dict(docs=list(docs), admission=adm)

  @rule(docs=st.lists(st.integers(0, NUM_DOCS - 1), max_size=4),
        private_tokens=st.integers(0, 28))
  def admit_request(self, docs, private_tokens):
    self.admit(docs, private_tokens)

  @precondition(lambda self: self.cached)
  @rule(data=st.data(), private_tokens=st.integers(0, 8))
  def reuse_cached_docs(self, data, private_tokens):
    """A request made of cached documents, in a new order: all hits."""
    docs = data.draw(st.lists(st.sampled_from(sorted(self.cached)),
                              min_size=1, max_size=4))
    self.admit(docs, private_tokens)

  @precondition(lambda self: self.cached)
  @rule(data=st.data(), copies=st.integers(8, 24))
  def burst_of_reads(self, data, copies):
    """One request lists a cached document many times and finishes: enough
    reads that the read counts halve within a test case."""
    doc = data.draw(st.sampled_from(sorted(self.cached)))
    rid = self.next_rid
    self.admit([doc] * copies, 0)
    self.state = self.cache.finish(self.state,
                                   self.live.pop(rid)["admission"])

  @precondition(lambda self: self.live)
  @rule(data=st.data())
  def finish_request(self, data):
    rid = data.draw(st.sampled_from(sorted(self.live)))
    req = self.live.pop(rid)
    self.state = self.cache.finish(self.state, req["admission"])

  @rule(pages_needed=st.integers(0, CONFIG.num_pages),
        slots_needed=st.integers(0, 2))
  def evict(self, pages_needed, slots_needed):
    free = CONFIG.num_pages - len(self.pages_in_use())
    before = dict(self.cached)
    self.state = cs.evict_documents(self.state, pages_needed, slots_needed,
                                    policy=self.cache.config.eviction)
    self.check_eviction(before, free, pages_needed, slots_needed)

  @rule()
  def finish_all(self):
    """Finish every live request: nothing leaks.  Each page is then either
    free or held exactly once, by the cached document it belongs to."""
    for rid in sorted(self.live):
      self.state = self.cache.finish(self.state, self.live.pop(rid)["admission"])
    self.model_agrees_with_state()
    refcount = np.asarray(self.state.page_refcount)
    doc_pages = self.pages_in_use()
    for page in range(CONFIG.num_pages):
      assert refcount[page] == (1 if page in doc_pages else 0)

  # ------------------------------------------------------------ invariants

  @invariant()
  def model_agrees_with_state(self):
    if not hasattr(self, "state"):
      return
    state = self.state
    refcount = np.asarray(state.page_refcount)
    users = self.users()

    # Refcount of every page == live references in the model.
    expected = np.zeros(CONFIG.num_pages, np.int64)
    for d, entry in self.cached.items():
      expected[entry["pages"]] += 1 + users[d]
    for req in self.live.values():
      expected[req["admission"].private_pages] += 1
    np.testing.assert_array_equal(refcount, expected)

    # No page counted twice: docs' pages and private pages are disjoint.
    owners = collections.Counter()
    for entry in self.cached.values():
      owners.update(entry["pages"])
    for req in self.live.values():
      owners.update(req["admission"].private_pages)
    assert all(n == 1 for n in owners.values()), "a page has two owners"
    free = set(np.flatnonzero(refcount == 0).tolist())
    assert free.isdisjoint(owners)
    assert len(free) + len(owners) == CONFIG.num_pages

    # The device document table is exactly the model's.
    table = self.table_docs()
    assert table == {d: e["slot"] for d, e in self.cached.items()}
    doc_pages = np.asarray(state.doc_pages)
    for d, slot in table.items():
      pages = self.cached[d]["pages"]
      assert int(state.doc_len[slot]) == self.lengths[d]
      assert int(state.doc_num_pages[slot]) == len(pages)
      assert doc_pages[slot, :len(pages)].tolist() == pages
      assert np.all(doc_pages[slot, len(pages):] == -1)
      assert int(state.doc_users[slot]) == users[d]
      assert int(state.doc_uses[slot]) == self.cached[d]["uses"]
    assert np.all(np.asarray(state.doc_users)[~np.asarray(state.doc_valid)]
                  == 0)
    assert int(state.reads_since_aging) == self.reads_since_aging

    # Every owner's pages still hold what it wrote.
    k = np.asarray(state.k)
    for d, entry in self.cached.items():
      assert np.all(k[:, :, entry["pages"]] == doc_marker(d)), (
          f"doc {d}'s KV was overwritten")
    for rid, req in self.live.items():
      pages = req["admission"].private_pages
      assert np.all(k[:, :, pages] == request_marker(rid)), (
          f"request {rid}'s private KV was overwritten")

  def teardown(self):
    """After all requests finish, evicting everything frees the whole pool."""
    if not hasattr(self, "state"):
      return
    self.finish_all()
    self.state = cs.evict_documents(self.state, CONFIG.num_pages,
                                            CONFIG.max_docs, policy=self.cache.config.eviction)
    self.cached.clear()
    self.model_agrees_with_state()
    assert self.cache.stats(self.state) == dict(
        free_pages=CONFIG.num_pages, used_pages=0, cached_docs=0,
        cached_doc_pages=0, docs_in_use=0, evictable_pages=0,
        free_doc_slots=CONFIG.max_docs)


class LruCacheMachine(CacheMachine):
  policy = "lru"


for machine in (CacheMachine, LruCacheMachine):
  machine.TestCase.settings = settings(max_examples=40,
                                       stateful_step_count=30,
                                       deadline=None)
TestCacheProperties = CacheMachine.TestCase
TestLruCacheProperties = LruCacheMachine.TestCase
