"""Unit tests of the paged KV cache manager (DESIGN.md section 3)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax import cache_state as cs
from lazyattn_jax.cache_state import CacheConfig, CacheState
from lazyattn_jax.doc_key import document_key
from lazyattn_jax.errors import (CacheCapacityError, InvalidRequestError,
                                 LazyAttnError)
from lazyattn_jax.paged_cache import Admission, PagedKVCache

# One shared shape, so the module-level jitted transitions compile once.
CONFIG = CacheConfig(num_pages=16, page_size=4, num_layers=2, num_kv_heads=2,
                     head_dim=3, dtype="float32", max_docs=4,
                     max_pages_per_doc=6)
CACHE = PagedKVCache(CONFIG)
LRU_CACHE = PagedKVCache(dataclasses.replace(CONFIG, eviction="lru"))


def key(doc_id: int):
  return document_key([doc_id, doc_id + 1], "test-model")


def insert_one(state, doc_key, length, pages):
  """Registers one document; (state, slot, ok) as for a batch of one."""
  pages = jnp.asarray(pages, jnp.int32)
  row = jnp.full((CONFIG.max_pages_per_doc,), -1, jnp.int32)
  row = row.at[:pages.shape[0]].set(pages)
  state, slots, ok = cs.insert_documents(
      state, jnp.asarray([doc_key], jnp.int32), jnp.asarray([length], jnp.int32),
      row[None])
  return state, slots[0], ok & (slots[0] >= 0)


def leaves(state: CacheState) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]


def assert_same_state(a: CacheState, b: CacheState):
  la, lb = leaves(a), leaves(b)
  assert len(la) == len(lb)
  for x, y in zip(la, lb):
    assert x.dtype == y.dtype and x.shape == y.shape
    np.testing.assert_array_equal(x, y)


def write_marker(state: CacheState, pages, value: float) -> CacheState:
  """Simulates the model writing KV into `pages` (the test's 'prefill')."""
  pages = jnp.asarray(pages, jnp.int32)
  return state.replace(k=state.k.at[:, :, pages].set(value),
                       v=state.v.at[:, :, pages].set(-value))


# ------------------------------------------------------------------ config


def test_config_normalizes_dtype_and_is_hashable():
  a = dataclasses.replace(CONFIG, dtype=jnp.bfloat16)
  b = dataclasses.replace(CONFIG, dtype=np.dtype("bfloat16"))
  assert a.dtype == "bfloat16" and a == b and hash(a) == hash(b)
  assert CONFIG.max_doc_tokens == 24
  assert CONFIG.pool_shape == (2, 2, 16, 4, 3)


@pytest.mark.parametrize("field,value", [
    ("num_pages", 0), ("page_size", -1), ("num_layers", 0),
    ("num_kv_heads", 0), ("head_dim", 2.5), ("max_docs", 0),
    ("max_pages_per_doc", 0), ("page_size", True),
    ("dtype", "int32"), ("dtype", "not-a-dtype"),
    ("num_pages", 2**30),  # num_pages * page_size overflows int32
])
def test_config_rejects_bad_field(field, value):
  with pytest.raises(ValueError, match=field):
    dataclasses.replace(CONFIG, **{field: value})


def test_config_requires_keywords():
  with pytest.raises(TypeError):
    CacheConfig(16, 4, 2, 2, 3, "float32", 4, 6)  # pylint: disable=too-many-function-args


def test_init_state_is_empty():
  state = cs.init_cache_state(CONFIG)
  assert state.k.shape == CONFIG.pool_shape and state.k.dtype == jnp.float32
  assert state.v.shape == CONFIG.pool_shape
  assert state.doc_pages.shape == (4, 6)
  assert CACHE.stats(state) == dict(
      free_pages=16, used_pages=0, cached_docs=0, cached_doc_pages=0,
      docs_in_use=0, evictable_pages=0, free_doc_slots=4)
  assert np.all(np.asarray(state.doc_pages) == -1)


def test_tables_are_committed_to_the_host_device():
  """The tables sit on the host CPU device (committed, so every transition
  runs there); tests/multi_device/test_cache_placement.py runs an engine
  with the pool elsewhere."""
  state = cs.init_cache_state(CONFIG)
  host = cs.host_device()
  assert host is not None and host.platform == "cpu"
  for leaf in (state.page_refcount, state.doc_pages, state.clock):
    assert leaf.devices() == {host} and leaf.committed
  explicit = cs.init_cache_state(CONFIG, table_device=jax.devices()[0])
  assert explicit.doc_key.devices() == {jax.devices()[0]}


def test_tables_follow_the_default_device_without_a_cpu_backend(monkeypatch):
  """With JAX_PLATFORMS naming only an accelerator there is no CPU device:
  the tables then go where the pool goes, uncommitted, as they used to."""
  def no_cpu(backend=None):
    raise RuntimeError(f"Unknown backend {backend}")
  monkeypatch.setattr(jax, "local_devices", no_cpu)
  assert cs.host_device() is None
  state = cs.init_cache_state(CONFIG)
  assert not state.page_refcount.committed
  assert CACHE.stats(state)["free_pages"] == 16


# -------------------------------------------------------------- doc keys


def test_document_key():
  k1 = document_key([1, 2, 3], "m")
  assert k1 == document_key(np.array([1, 2, 3]), "m")
  assert k1 != document_key([1, 2, 3], "other-model")
  assert k1 != document_key([3, 2, 1], "m")
  assert k1 != document_key([1, 2], "m")
  assert document_key([], "m") != document_key([0], "m")
  for word in k1:
    assert isinstance(word, int) and -2**31 <= word < 2**31
  with pytest.raises(InvalidRequestError, match="token_ids"):
    document_key([1.5, 2.0], "m")
  with pytest.raises(InvalidRequestError, match="token_ids"):
    document_key([[1, 2]], "m")
  with pytest.raises(InvalidRequestError, match="model_id"):
    document_key([1], 7)


# -------------------------------------------------------- page allocation


def test_allocate_release_round_trip():
  state = cs.init_cache_state(CONFIG)
  state, pages, ok = cs.allocate_pages(state, 5, max_count=8)
  assert bool(ok)
  np.testing.assert_array_equal(pages, [0, 1, 2, 3, 4, -1, -1, -1])
  state, pages, ok = cs.allocate_pages(state, 3, max_count=8)
  np.testing.assert_array_equal(pages[:3], [5, 6, 7])
  assert int(CACHE.free_page_count(state)) == 8
  state = cs.release_pages(state, jnp.array([1, 3, -1, 6], jnp.int32))
  assert int(CACHE.free_page_count(state)) == 11
  # First fit: the lowest run of 4 consecutive free pages (free: 1, 3, 6,
  # 8-15), not the holes before it.
  state, pages, ok = cs.allocate_pages(state, 4, max_count=8)
  np.testing.assert_array_equal(pages, [8, 9, 10, 11, -1, -1, -1, -1])
  # No run of 5 is left (free: 1, 3, 6, 12-15): the lowest free pages.
  state, pages, ok = cs.allocate_pages(state, 5, max_count=8)
  assert bool(ok)
  np.testing.assert_array_equal(pages[:5], [1, 3, 6, 12, 13])
  refcount = np.asarray(state.page_refcount)
  np.testing.assert_array_equal(refcount[:14], 1)
  np.testing.assert_array_equal(refcount[14:], 0)
  state = cs.release_pages(state, jnp.arange(14, dtype=jnp.int32))
  assert int(CACHE.free_page_count(state)) == 16
  assert np.all(np.asarray(state.page_refcount) == 0)


def test_allocate_document_pages_gives_each_document_a_run():
  state = cs.init_cache_state(CONFIG)  # 16 pages
  state, _, _ = cs.allocate_pages(state, 8, max_count=8)
  state = cs.release_pages(state, jnp.array([1, 3, 6], jnp.int32))
  # Free: 1, 3, 6, 8-15.  Each document takes the lowest run that fits it,
  # in row order; a padding row (0 pages) takes none.
  state, rows, ok = cs.allocate_document_pages(
      state, jnp.array([2, 3, 0, 1], jnp.int32), max_pages=4)
  assert bool(ok)
  np.testing.assert_array_equal(rows, [[8, 9, -1, -1], [10, 11, 12, -1],
                                       [-1, -1, -1, -1], [1, -1, -1, -1]])
  # Free: 3, 6, 13-15.  No run of 4: the lowest free pages.
  state, rows, ok = cs.allocate_document_pages(
      state, jnp.array([4], jnp.int32), max_pages=4)
  np.testing.assert_array_equal(rows, [[3, 6, 13, 14]])
  refcount = np.asarray(state.page_refcount)
  np.testing.assert_array_equal(refcount, [1] * 15 + [0])


def test_allocate_document_pages_refuses_without_changing_state():
  state = cs.init_cache_state(CONFIG)
  state, _, _ = cs.allocate_pages(state, 10, max_count=16)
  for counts, max_pages in [([3, 4], 4), ([5], 4), ([-1, 1], 4)]:
    new, rows, ok = cs.allocate_document_pages(
        state, jnp.array(counts, jnp.int32), max_pages=max_pages)
    assert not bool(ok)
    assert np.all(np.asarray(rows) == -1)
    assert_same_state(new, state)


def test_allocate_refuses_without_changing_state():
  state = cs.init_cache_state(CONFIG)
  state, _, _ = cs.allocate_pages(state, 10, max_count=16)
  for count, max_count in [(7, 16), (3, 2), (-1, 4)]:
    new, pages, ok = cs.allocate_pages(state, count, max_count=max_count)
    assert not bool(ok)
    assert np.all(np.asarray(pages) == -1)
    assert_same_state(new, state)


def test_allocate_count_is_traced():
  """Different counts reuse one compiled allocation."""
  traces = []

  def counted_allocate(state, count, max_count):
    traces.append(max_count)  # runs once per trace, not per call
    return cs.allocate_pages(state, count, max_count)

  allocate = jax.jit(counted_allocate, static_argnames="max_count")
  state = cs.init_cache_state(CONFIG)
  for count in range(4):
    _, pages, ok = allocate(state, jnp.int32(count), max_count=4)
    assert bool(ok) and int(jnp.sum(pages >= 0)) == count
  assert traces == [4]


# ------------------------------------------------------- document table


def test_lookup_insert_acquire_release():
  state = cs.init_cache_state(CONFIG)
  state, pages, _ = cs.allocate_pages(state, 2, max_count=6)
  state, slot, ok = insert_one(state, key(1), 7, pages)
  assert bool(ok) and int(slot) == 0
  keys = jnp.array([key(1), key(2), key(1)], jnp.int32)
  np.testing.assert_array_equal(cs.lookup_documents(state, keys),
                                [0, -1, 0])
  assert int(state.doc_len[0]) == 7 and int(state.doc_num_pages[0]) == 2
  np.testing.assert_array_equal(state.page_refcount[:3], [1, 1, 0])

  # A slot listed twice is acquired twice, and released twice.
  state = cs.acquire_documents(state, jnp.array([0, 0, -1], jnp.int32))
  assert int(state.doc_users[0]) == 2
  np.testing.assert_array_equal(state.page_refcount[:2], [3, 3])
  assert int(state.doc_last_used[0]) == 0 and int(state.clock) == 1
  assert int(cs.evictable_page_count(state)) == 0
  state = cs.release_documents(state, jnp.array([0, -1, 0], jnp.int32))
  assert int(state.doc_users[0]) == 0
  np.testing.assert_array_equal(state.page_refcount[:2], [1, 1])
  assert int(cs.evictable_page_count(state)) == 2

  state = cs.evict_documents(state, 16)
  np.testing.assert_array_equal(cs.lookup_documents(state, keys),
                                [-1, -1, -1])
  assert int(CACHE.free_page_count(state)) == 16


def test_insert_refuses_when_table_full_or_length_bad():
  state = cs.init_cache_state(CONFIG)
  for doc in range(CONFIG.max_docs):
    state, pages, _ = cs.allocate_pages(state, 1, max_count=6)
    state, slot, ok = insert_one(state, key(doc), 3, pages)
    assert bool(ok) and int(slot) == doc
  state, pages, _ = cs.allocate_pages(state, 1, max_count=6)
  new, slot, ok = insert_one(state, key(99), 3, pages)
  assert not bool(ok) and int(slot) == -1
  assert_same_state(new, state)
  state = cs.evict_documents(state, 0, slots_needed=1)
  new, slot, ok = insert_one(state, key(99), 0, pages)
  assert not bool(ok) and int(slot) == -1
  assert_same_state(new, state)


def test_transitions_compose_under_one_jit():
  @jax.jit
  def admit_two(state):
    state, pages, ok1 = cs.allocate_pages(state, 3, max_count=6)
    state, slot, ok2 = insert_one(state, key(5), 10, pages)
    state = cs.acquire_documents(state, slot[None])
    state = cs.acquire_documents(state, slot[None])
    return state, ok1 & ok2

  state, ok = admit_two(cs.init_cache_state(CONFIG))
  assert bool(ok)
  np.testing.assert_array_equal(state.page_refcount[:4], [3, 3, 3, 0])


# -------------------------------------------------------------- admission


def test_admit_and_finish_round_trip():
  state0 = cs.init_cache_state(CONFIG)
  state, adm = CACHE.admit(state0, [key(1), key(2)], [5, 4], private_tokens=9)
  assert isinstance(adm, Admission)
  assert adm.doc_hit == [False, False] and adm.missing_docs == [0, 1]
  assert adm.doc_pages == [[0, 1], [2]] and adm.private_pages == [3, 4, 5]
  assert state.k is state0.k and state.v is state0.v  # pool not copied
  assert CACHE.stats(state)["used_pages"] == 6
  state = CACHE.finish(state, adm)
  assert CACHE.stats(state) == dict(
      free_pages=13, used_pages=3, cached_docs=2, cached_doc_pages=3,
      docs_in_use=0, evictable_pages=3, free_doc_slots=2)
  state = cs.evict_documents(state, 16)
  # Only the clocks remember the request: the LRU clock and the read count.
  assert int(state.reads_since_aging) == 2
  assert_same_state(state.replace(clock=state0.clock,
                                  reads_since_aging=state0.reads_since_aging),
                    state0)


def test_cache_hit_is_zero_copy():
  state = cs.init_cache_state(CONFIG)
  state, first = CACHE.admit(state, [key(1)], [9], private_tokens=2)
  state = write_marker(state, first.doc_pages[0], 7.0)  # doc prefill
  state = write_marker(state, first.private_pages, 1.0)
  k_before, v_before = np.asarray(state.k), np.asarray(state.v)

  # The same document again, now at a different position (behind doc 2).
  new, second = CACHE.admit(state, [key(2), key(1)], [4, 9], private_tokens=2)
  assert second.doc_hit == [False, True] and second.missing_docs == [0]
  assert second.doc_slots[1] == first.doc_slots[0]
  assert second.doc_pages[1] == first.doc_pages[0]  # same physical pages
  assert new.k is state.k and new.v is state.v  # nothing was written
  np.testing.assert_array_equal(np.asarray(new.k), k_before)
  np.testing.assert_array_equal(np.asarray(new.v), v_before)
  # The query's pages are never shared.
  assert not set(second.private_pages) & set(first.private_pages)
  assert not set(second.private_pages) & set(sum(second.doc_pages, []))
  # Doc table + two readers.
  refcount = np.asarray(new.page_refcount)
  np.testing.assert_array_equal(refcount[first.doc_pages[0]], 3)


def test_duplicate_missing_doc_is_allocated_once():
  state = cs.init_cache_state(CONFIG)
  state, adm = CACHE.admit(state, [key(1), key(2), key(1)], [6, 3, 6],
                           private_tokens=1)
  assert adm.missing_docs == [0, 1]
  assert adm.doc_hit == [False, False, False]
  assert adm.doc_slots[0] == adm.doc_slots[2] != adm.doc_slots[1]
  assert adm.doc_pages[0] == adm.doc_pages[2] == [0, 1]
  stats = CACHE.stats(state)
  assert stats["cached_docs"] == 2 and stats["used_pages"] == 4
  refcount = np.asarray(state.page_refcount)
  np.testing.assert_array_equal(refcount[[0, 1]], 3)  # table + listed twice
  state = CACHE.finish(state, adm)
  np.testing.assert_array_equal(np.asarray(state.page_refcount)[:4],
                                [1, 1, 1, 0])


def _cache_docs(state, doc_ids, length=8, cache=CACHE):
  """Admits and finishes one request per doc, in order (LRU order = order)."""
  for doc in doc_ids:
    state, adm = cache.admit(state, [key(doc)], [length], 0)
    state = cache.finish(state, adm)
  return state


def _cached(state, doc_ids):
  slots = cs.lookup_documents(state, jnp.array([key(d) for d in doc_ids]))
  return [d for d, s in zip(doc_ids, np.asarray(slots)) if s >= 0]


@pytest.mark.parametrize("cache, kept", [
    # LRU forgets doc 1's popularity: it goes first, then 3, 4, 2.
    (LRU_CACHE, [[2, 3, 4], [2, 4], [2], []]),
    # LFU keeps doc 1 (3 reads) and doc 2 (2 reads) longest, and among the
    # docs read once evicts the older first: 3, 4, 2, 1.
    (CACHE, [[1, 2, 4], [1, 2], [1], []]),
], ids=["lru", "lfu"])
def test_eviction_order(cache, kept):
  # Doc 1 read three times, then 2, 3, 4 once each, then 2 again.
  state = _cache_docs(cs.init_cache_state(cache.config), [1, 1, 1, 2, 3, 4],
                      cache=cache)
  state = _cache_docs(state, [2], cache=cache)  # 2 is now the most recent
  assert cache.stats(state)["free_pages"] == 8
  slots = cs.lookup_documents(state, jnp.array([key(d) for d in
                                                   [1, 2, 3, 4]]))
  # Read counts are kept under either policy.
  np.testing.assert_array_equal(np.asarray(state.doc_uses)[np.asarray(slots)],
                                [3, 2, 1, 1])
  state = cs.evict_documents(state, 9, policy=cache.config.eviction)
  assert _cached(state, [1, 2, 3, 4]) == kept[0]
  state = cs.evict_documents(state, 12, policy=cache.config.eviction)
  assert _cached(state, [1, 2, 3, 4]) == kept[1]
  # Already free enough: no-op.
  state = cs.evict_documents(state, 3, policy=cache.config.eviction)
  assert _cached(state, [1, 2, 3, 4]) == kept[1]
  state = cs.evict_documents(state, 14, policy=cache.config.eviction)
  assert _cached(state, [1, 2, 3, 4]) == kept[2]
  state = cs.evict_documents(state, 15, policy=cache.config.eviction)
  assert _cached(state, [1, 2, 3, 4]) == kept[3]


def test_lfu_ties_go_to_the_lower_slot():
  # Two docs read once at the same clock tick (one request): equal uses and
  # equal recency, so the lower slot goes first, deterministically.
  state, adm = CACHE.admit(cs.init_cache_state(CONFIG), [key(1), key(2)], [8, 8], 0)
  state = CACHE.finish(state, adm)
  assert adm.doc_slots == [0, 1]
  state = cs.evict_documents(state, 14)
  assert _cached(state, [1, 2]) == [2]


def test_eviction_forgets_the_read_count():
  # A document evicted and cached again starts from zero reads, so it is
  # not protected by the reads it had before.
  state = _cache_docs(cs.init_cache_state(CONFIG), [1, 1, 1])
  state = cs.evict_documents(state, 16)
  state = _cache_docs(state, [2, 2, 1])
  assert _cached(state, [1, 2]) == [1, 2]
  state = cs.evict_documents(state, 14)
  assert _cached(state, [1, 2]) == [2]


def test_read_counts_halve_every_window():
  window = cs.FREQUENCY_WINDOW_PER_SLOT * CONFIG.max_docs  # 64 reads
  state, pages, _ = cs.allocate_pages(cs.init_cache_state(CONFIG), 2, max_count=6)
  state, slot_a, _ = insert_one(state, key(1), 4, pages[:1])
  state, slot_b, _ = insert_one(state, key(2), 4, pages[1:2])
  slots = jnp.array([slot_a] * 5 + [slot_b] * 2 + [-1], jnp.int32)
  for _ in range(9):  # 63 reads: one short of the window
    state = cs.acquire_documents(state, slots)
  assert [int(state.doc_uses[slot_a]), int(state.doc_uses[slot_b])] == [45, 18]
  assert int(state.reads_since_aging) == 63
  state = cs.acquire_documents(state, slots[5:7])  # reads 64 and 65
  assert [int(state.doc_uses[slot_a]), int(state.doc_uses[slot_b])] == [22, 10]
  assert int(state.reads_since_aging) == 65 - window


def test_unknown_eviction_policy_is_refused():
  with pytest.raises(ValueError, match=r"eviction must be one of"):
    dataclasses.replace(CONFIG, eviction="fifo")
  with pytest.raises(ValueError, match=r"policy must be one of"):
    cs.evict_documents(cs.init_cache_state(CONFIG), 1, policy="mru")


def test_admission_evicts_lru_only_as_needed():
  cache = LRU_CACHE
  state = _cache_docs(cs.init_cache_state(cache.config), [1, 2, 3, 4], cache=cache)
  state = _cache_docs(state, [1], cache=cache)
  # 8 free; a new doc of 2 pages + 8 private pages needs 10: evict doc 2 only.
  state, adm = cache.admit(state, [key(5)], [8], private_tokens=32)
  assert _cached(state, [1, 2, 3, 4, 5]) == [1, 3, 4, 5]
  assert adm.doc_hit == [False] and adm.evicted
  # A hit, or a miss that fits the free pages and slots, evicts nothing.
  _, hit = cache.admit(state, [key(5)], [8], private_tokens=0)
  _, fits = cache.admit(_cache_docs(cs.init_cache_state(cache.config), [1],
                                    cache=cache), [key(6)], [4],
                        private_tokens=32)
  assert not hit.evicted and not fits.evicted


def test_admission_evicts_lfu_only_as_needed():
  state = _cache_docs(cs.init_cache_state(CONFIG), [3, 3, 1, 2, 4])
  # 8 free; a new doc of 2 pages + 8 private pages needs 10: LFU evicts the
  # oldest of the docs read once (1), not doc 3 (read twice, but longer ago,
  # so LRU would take it).
  state, adm = CACHE.admit(state, [key(5)], [8], private_tokens=32)
  assert _cached(state, [1, 2, 3, 4, 5]) == [2, 3, 4, 5]
  assert adm.doc_hit == [False]


def test_eviction_spares_documents_in_use():
  state = _cache_docs(cs.init_cache_state(CONFIG), [1, 2])
  state, live = CACHE.admit(state, [key(1)], [8], 0)  # doc 1 (oldest) in use
  state = cs.evict_documents(state, 16)
  assert _cached(state, [1, 2]) == [1]
  assert CACHE.stats(state)["free_pages"] == 14
  state = CACHE.finish(state, live)
  state = cs.evict_documents(state, 16)
  assert CACHE.stats(state)["free_pages"] == 16


def test_evict_for_document_slots():
  state = _cache_docs(cs.init_cache_state(CONFIG), [1, 2, 3, 4], length=1)
  assert CACHE.stats(state)["free_doc_slots"] == 0
  state = cs.evict_documents(state, 0, slots_needed=2)
  assert _cached(state, [1, 2, 3, 4]) == [3, 4]
  # Admission evicts for a table slot even when pages are plentiful.
  state = _cache_docs(state, [5, 6])
  state, adm = CACHE.admit(state, [key(7)], [1], 0)
  assert _cached(state, [3, 4, 5, 6, 7]) == [4, 5, 6, 7]
  assert adm.evicted


def test_refusal_leaves_state_unchanged():
  state = _cache_docs(cs.init_cache_state(CONFIG), [1, 2])  # 4 pages, evictable
  state, live = CACHE.admit(state, [key(3)], [8], private_tokens=16)  # 6 pages
  before = leaves(state)
  # 6 free + 4 evictable = 10 < 11 needed.
  with pytest.raises(CacheCapacityError, match=r"needs 11 pages.*only 10"):
    CACHE.admit(state, [key(4)], [12], private_tokens=32)
  for old, now in zip(before, leaves(state)):
    np.testing.assert_array_equal(old, now)
  # A document the request reads cannot be evicted to make room for it:
  # 6 free + 2 (doc 2) = 8 pages, not the 10 counted if doc 1 were evictable.
  with pytest.raises(CacheCapacityError, match=r"needs 9 pages.*only 8"):
    CACHE.admit(state, [key(1), key(5)], [8, 4], private_tokens=32)
  for old, now in zip(before, leaves(state)):
    np.testing.assert_array_equal(old, now)
  # The unchanged state still works; exactly 10 pages fit.
  state, adm = CACHE.admit(state, [key(4)], [12], private_tokens=28)
  assert len(adm.private_pages) == 7
  assert CACHE.stats(state)["free_pages"] == 0
  assert _cached(state, [1, 2, 3, 4]) == [3, 4]


def test_refusal_when_document_slots_run_out():
  state, live = CACHE.admit(cs.init_cache_state(CONFIG), [key(1), key(2), key(3)],
                            [1, 1, 1], 0)
  with pytest.raises(CacheCapacityError, match="document slots"):
    CACHE.admit(state, [key(4), key(5)], [1, 1], 0)


@pytest.mark.parametrize("doc_keys,lengths,private,error,match", [
    ([key(1)], [0], 0, InvalidRequestError, "empty document"),
    ([key(1)], [25], 0, CacheCapacityError, "max_pages_per_doc"),
    ([key(1)], [65], 0, CacheCapacityError, "whole pool"),
    ([key(1)], [3, 4], 0, InvalidRequestError, "differ in length"),
    ([key(1)], [3], -1, InvalidRequestError, "private_tokens"),
    ([(1, 2, 3)], [3], 0, InvalidRequestError, r"doc_keys\[0\]"),
    ([(2**31, 0)], [3], 0, InvalidRequestError, r"doc_keys\[0\]"),
    ([key(1)], [2.0], 0, InvalidRequestError, r"doc_lengths\[0\]"),
])
def test_admit_rejects_bad_input(doc_keys, lengths, private, error, match):
  state = cs.init_cache_state(CONFIG)
  with pytest.raises(error, match=match):
    CACHE.admit(state, doc_keys, lengths, private)
  assert issubclass(error, LazyAttnError)


def test_type_errors():
  with pytest.raises(TypeError, match="config"):
    PagedKVCache({"num_pages": 4})
  with pytest.raises(TypeError, match="admission"):
    CACHE.finish(cs.init_cache_state(CONFIG), None)
