"""The paged KV cache as a functional pytree, and its pure transitions.

`CacheState` holds the K/V page pool, a refcount per page, and the document
table.  Every transition here is a pure, jit-compatible function: state in, new
state out (`state.replace(...)`), no hidden mutation, no host sync, and no
per-page Python or `fori_loop` iteration: allocation, release, sharing and
eviction are a handful of vectorized scans, sorts and scatters (the one
loop is `allocate_document_pages`'s scan over an admission's documents).

Ownership model (the invariant every transition keeps):
- `page_refcount[p]` is the number of holders of page `p`.  A cached document
  holds each of its pages once (the document table's reference); every live
  request that reads the document holds each of its pages once more (once per
  time it lists the document); a request's private pages (query and generated
  tokens) are held once by that request.
- A page is free iff its refcount is 0.  The free list is derived from the
  refcounts, never stored on its own, so the two cannot disagree.
- A page belongs to at most one document.  So a document nobody reads
  (`doc_users == 0`) has all its pages at refcount 1, and evicting it frees
  exactly `doc_num_pages` pages.
- There is no reserved sentinel page: -1 marks "no page" / "no slot" in every
  index array, and scatters route -1 out of bounds and drop it.

Transitions never touch `k`/`v` (the model writes those), which lets
`PagedKVCache` run them on a copy of the state whose `k`/`v` are `None`, so
the pool is never copied (see paged_cache.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from lazyattn_jax.cache_config import (EVICTION_POLICIES,
                                       FREQUENCY_WINDOW_PER_SLOT, CacheConfig)
from lazyattn_jax.page_allocation import choose_page_rows, choose_pages
from models.quantized_pool import QuantizedPool, zeros_pool

__all__ = [
    "CacheConfig",
    "CacheState",
    "host_device",
    "init_cache_state",
    "lookup_documents",
    "allocate_pages",
    "allocate_document_pages",
    "release_pages",
    "insert_documents",
    "acquire_documents",
    "release_documents",
    "evict_documents",
    "remove_documents",
    "free_page_count",
    "evictable_page_count",
    "free_doc_slot_count",
    "EVICTION_POLICIES",
    "FREQUENCY_WINDOW_PER_SLOT",
]

_INT32_MAX = np.iinfo(np.int32).max


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class CacheState:
  """The paged KV pool, page refcounts and document table (all device arrays).

  `k`/`v` may be `None` in the copy `PagedKVCache` hands to its jitted
  transitions; every transition here leaves them untouched.
  """

  # [K, L, num_pages, page_size, H] keys rotated at their stored angle, and
  # values: arrays, or models.quantized_pool.QuantizedPool (float8 pages and
  # float32 scales [K, L, num_pages]) when config.dtype is float8_e4m3fn.
  k: jax.Array | QuantizedPool | None
  v: jax.Array | QuantizedPool | None
  page_refcount: jax.Array  # int32[num_pages] holders of each page; 0 = free
  doc_key: jax.Array  # int32[max_docs, 2] document_key of each slot
  doc_valid: jax.Array  # bool[max_docs] slot holds a cached document
  doc_len: jax.Array  # int32[max_docs] true token length
  doc_num_pages: jax.Array  # int32[max_docs] pages the document occupies
  doc_pages: jax.Array  # int32[max_docs, max_pages_per_doc] page ids, -1 padded
  doc_users: jax.Array  # int32[max_docs] live requests reading the document
  doc_last_used: jax.Array  # int32[max_docs] clock of the last acquire
  doc_uses: jax.Array  # int32[max_docs] acquires since insertion, aged
  reads_since_aging: jax.Array  # int32[] acquires since doc_uses last halved
  clock: jax.Array  # int32[] LRU clock, advanced by every acquire

  def replace(self, **changes) -> "CacheState":
    return dataclasses.replace(self, **changes)

  @property
  def num_pages(self) -> int:
    return self.page_refcount.shape[0]

  @property
  def max_docs(self) -> int:
    return self.doc_valid.shape[0]

  @property
  def max_pages_per_doc(self) -> int:
    return self.doc_pages.shape[1]


def host_device() -> jax.Device | None:
  """This process's first CPU device, where the cache's tables live; None
  where jax runs without its CPU backend (JAX_PLATFORMS naming only an
  accelerator)."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def init_cache_state(config: CacheConfig,
                     table_device: jax.Device | None = None) -> CacheState:
  """An empty cache: zeroed pool, every page free, no documents.

  The pool goes where `config.pool_sharding` puts it (the default device
  when None).  The tables (refcounts and the document table) go to
  `table_device`, by default `host_device()`: the host reads them back
  after every admission, and on an accelerator that read would wait for
  every step queued before it.  No compiled step reads both (the steps take
  page ids from the host), so tables and pool may sit on different devices.
  """
  D, M = config.max_docs, config.max_pages_per_doc
  tables = dict(
      page_refcount=np.zeros((config.num_pages,), np.int32),
      doc_key=np.zeros((D, 2), np.int32),
      doc_valid=np.zeros((D,), np.bool_),
      doc_len=np.zeros((D,), np.int32),
      doc_num_pages=np.zeros((D,), np.int32),
      doc_pages=np.full((D, M), -1, np.int32),
      doc_users=np.zeros((D,), np.int32),
      doc_last_used=np.zeros((D,), np.int32),
      doc_uses=np.zeros((D,), np.int32),
      reads_since_aging=np.zeros((), np.int32),
      clock=np.zeros((), np.int32),
  )
  device = table_device or host_device()
  tables = (jax.device_put(tables, device) if device is not None
            else jax.tree_util.tree_map(jnp.asarray, tables))
  return CacheState(
      k=zeros_pool(config.pool_shape, config.dtype,
                   device=config.pool_sharding),
      v=zeros_pool(config.pool_shape, config.dtype,
                   device=config.pool_sharding),
      **tables)


# ----------------------------------------------------------------- helpers


def _histogram(indices: jax.Array, length: int) -> jax.Array:
  """int32[length]: how often each index in [0, length) occurs in `indices`.

  Entries outside [0, length) (in particular -1) are ignored: they are routed
  to `length` and dropped, because a negative index would otherwise wrap.
  """
  indices = jnp.asarray(indices, jnp.int32).reshape(-1)
  in_range = (indices >= 0) & (indices < length)
  safe = jnp.where(in_range, indices, length)
  return jnp.zeros((length,), jnp.int32).at[safe].add(1, mode="drop")


def _doc_page_rows(state: CacheState, slots: jax.Array) -> jax.Array:
  """int32[n, max_pages_per_doc]: page rows of `slots`, all -1 for slot -1."""
  slots = jnp.asarray(slots, jnp.int32)
  present = (slots >= 0) & (slots < state.max_docs)
  rows = state.doc_pages[jnp.where(present, slots, 0)]
  return jnp.where(present[:, None], rows, -1)


def _evictable(state: CacheState) -> jax.Array:
  """bool[max_docs]: cached documents that no live request reads."""
  return state.doc_valid & (state.doc_users == 0)


# ------------------------------------------------------------- transitions


def lookup_documents(state: CacheState, keys: jax.Array) -> jax.Array:
  """int32[n]: the document slot holding each key of int32[n, 2], or -1."""
  keys = jnp.asarray(keys, jnp.int32)
  match = jnp.all(state.doc_key[None, :, :] == keys[:, None, :], axis=-1)
  match &= state.doc_valid[None, :]  # [n, max_docs]
  return jnp.where(jnp.any(match, axis=1),
                   jnp.argmax(match, axis=1).astype(jnp.int32), -1)


def free_page_count(state: CacheState) -> jax.Array:
  """int32[]: pages with refcount 0."""
  return jnp.sum(state.page_refcount == 0, dtype=jnp.int32)


def evictable_page_count(state: CacheState) -> jax.Array:
  """int32[]: pages that evicting every unread document would free."""
  return jnp.sum(jnp.where(_evictable(state), state.doc_num_pages, 0),
                 dtype=jnp.int32)


def free_doc_slot_count(state: CacheState) -> jax.Array:
  """int32[]: document table rows not holding a document."""
  return jnp.sum(~state.doc_valid, dtype=jnp.int32)


def allocate_pages(state: CacheState, count: jax.Array, max_count: int
                   ) -> tuple[CacheState, jax.Array, jax.Array]:
  """Takes `count` free pages and sets their refcount to 1: the lowest run
  of `count` consecutive free pages, else the lowest-numbered free pages
  (`page_allocation.choose_pages`).

  Args:
    state: the cache.
    count: int32[] pages wanted (traced); must be in [0, max_count].
    max_count: static length of the returned page array.

  Returns:
    (state, pages, ok): `pages` is int32[max_count] with the allocated page
    ids first and -1 after them.  If fewer than `count` pages are free (or
    `count` is outside [0, max_count]), `ok` is False, `pages` is all -1 and
    the state is returned unchanged.
  """
  count = jnp.asarray(count, jnp.int32)
  free = state.page_refcount == 0
  ok = (count >= 0) & (count <= max_count) & (jnp.sum(free) >= count)
  pages = choose_pages(free, jnp.where(ok, count, 0), max_count)
  refcount = state.page_refcount + _histogram(pages, state.num_pages)
  return state.replace(page_refcount=refcount), pages, ok


def allocate_document_pages(state: CacheState, counts: jax.Array,
                            max_pages: int
                            ) -> tuple[CacheState, jax.Array, jax.Array]:
  """Pages for several documents, each allocated alone (so each lands in
  one run of consecutive free pages where there is one,
  `page_allocation.choose_page_rows`), refcounts set to 1.

  Args:
    counts: int32[R] pages of each document (traced; 0 for padding rows).
    max_pages: static width of the returned rows.

  Returns:
    (state, rows int32[R, max_pages] with each document's page ids first
    and -1 after them, ok).  All or nothing: if a count is outside
    [0, max_pages] or fewer pages are free than the counts add up to, `ok`
    is False, every row is -1 and the state is returned unchanged.
  """
  counts = jnp.asarray(counts, jnp.int32)
  free = state.page_refcount == 0
  ok = (jnp.all((counts >= 0) & (counts <= max_pages))
        & (jnp.sum(free) >= jnp.sum(counts)))
  rows = choose_page_rows(free, jnp.where(ok, counts, 0), max_pages)
  refcount = state.page_refcount + _histogram(rows, state.num_pages)
  return state.replace(page_refcount=refcount), rows, ok


def release_pages(state: CacheState, pages: jax.Array) -> CacheState:
  """Drops one reference to each listed page (-1 entries are ignored).

  A page listed twice loses two references.  Releasing a page nobody holds
  is a caller bug; it is not clamped, so invariant checks can see it.
  """
  refcount = state.page_refcount - _histogram(pages, state.num_pages)
  return state.replace(page_refcount=refcount)


def insert_documents(state: CacheState, keys: jax.Array, lengths: jax.Array,
                     pages: jax.Array) -> tuple[CacheState, jax.Array, jax.Array]:
  """Registers freshly allocated pages as cached documents, one per row.

  The pages must already have refcount 1 (from `allocate_pages`); that
  reference now belongs to the document table.  Rows with `lengths < 1` are
  padding and ignored.  Free document slots are used lowest first.

  Args:
    keys: int32[m, 2] document keys (not already in the table).
    lengths: int32[m] true token lengths.
    pages: int32[m, max_pages_per_doc] page ids, -1 padded at the end.

  Returns:
    (state, slots int32[m] (-1 for padding rows), ok): ok is False, slots all
    -1 and the state unchanged if fewer document slots are free than rows to
    insert.
  """
  keys = jnp.asarray(keys, jnp.int32)
  lengths = jnp.asarray(lengths, jnp.int32)
  pages = jnp.asarray(pages, jnp.int32)
  m = lengths.shape[0]
  real = lengths >= 1
  (free_slots,) = jnp.nonzero(~state.doc_valid, size=m, fill_value=-1)
  rank = jnp.cumsum(real) - 1
  ok = jnp.sum(real) <= jnp.sum(~state.doc_valid)
  slots = jnp.where(real & ok, free_slots[jnp.clip(rank, 0, m - 1)], -1)
  slots = slots.astype(jnp.int32)
  target = jnp.where(slots >= 0, slots, state.max_docs)  # dropped when -1

  def put(table, rows):
    return table.at[target].set(rows, mode="drop")

  return state.replace(
      doc_key=put(state.doc_key, keys),
      doc_valid=put(state.doc_valid, jnp.ones((m,), jnp.bool_)),
      doc_len=put(state.doc_len, lengths),
      doc_num_pages=put(state.doc_num_pages,
                        jnp.sum(pages >= 0, axis=1, dtype=jnp.int32)),
      doc_pages=put(state.doc_pages, pages),
      doc_users=put(state.doc_users, jnp.zeros((m,), jnp.int32)),
      doc_last_used=put(state.doc_last_used,
                        jnp.broadcast_to(state.clock, (m,))),
      doc_uses=put(state.doc_uses, jnp.zeros((m,), jnp.int32)),
  ), slots, ok


def acquire_documents(state: CacheState, slots: jax.Array) -> CacheState:
  """A request starts reading these documents (-1 entries ignored).

  Each listed slot gains a user and each of its pages a reference; a slot
  listed twice is acquired twice.  The listed documents become the most
  recently used, and the clock advances by one.  Each listing also counts as
  one read in `doc_uses`; once `FREQUENCY_WINDOW_PER_SLOT * max_docs` reads
  have been counted since the last halving, every count halves (integer
  division), so popularity is measured over a sliding horizon.
  """
  slots = jnp.asarray(slots, jnp.int32)
  rows = _doc_page_rows(state, slots)
  target = jnp.where(slots >= 0, slots, state.max_docs)
  reads = _histogram(slots, state.max_docs)
  # Capped so that the int32 read counter cannot overflow on a huge table.
  window = min(FREQUENCY_WINDOW_PER_SLOT * state.max_docs, _INT32_MAX // 2)
  reads_since = state.reads_since_aging + jnp.sum(reads)
  age = reads_since >= window
  uses = state.doc_uses + reads
  return state.replace(
      doc_users=state.doc_users + reads,
      page_refcount=state.page_refcount + _histogram(rows, state.num_pages),
      doc_last_used=state.doc_last_used.at[target].set(state.clock,
                                                       mode="drop"),
      doc_uses=jnp.where(age, uses // 2, uses),
      reads_since_aging=jnp.where(age, reads_since - window, reads_since),
      clock=state.clock + 1,
  )


def release_documents(state: CacheState, slots: jax.Array) -> CacheState:
  """Inverse of `acquire_documents` for users and refcounts (-1 ignored).

  `doc_last_used` keeps the acquire time: recency is "last started reading".
  """
  slots = jnp.asarray(slots, jnp.int32)
  rows = _doc_page_rows(state, slots)
  return state.replace(
      doc_users=state.doc_users - _histogram(slots, state.max_docs),
      page_refcount=state.page_refcount - _histogram(rows, state.num_pages),
  )


def evict_documents(state: CacheState, pages_needed: jax.Array,
                    slots_needed: jax.Array | int = 0, *,
                    policy: str = "lfu") -> CacheState:
  """Evicts unread documents in `policy` order until enough is free.

  The order (see `CacheConfig.eviction`): "lru" sorts the evictable documents
  (`doc_users == 0`) by `doc_last_used`; "lfu" by `doc_uses`, then
  `doc_last_used`.  Remaining ties go to the lower slot index.  Stops at the
  shortest prefix of that order after which at least `pages_needed` pages
  and `slots_needed` document slots are free, or after all of them if even
  that is not enough (the caller compares `free_page_count` afterwards).
  Evicting drops the document table's reference to each page; pages reaching
  refcount 0 become free.
  """
  if policy not in EVICTION_POLICIES:
    raise ValueError(
        f"policy must be one of {EVICTION_POLICIES}, got {policy!r}")
  pages_needed = jnp.asarray(pages_needed, jnp.int32)
  slots_needed = jnp.asarray(slots_needed, jnp.int32)
  page_deficit = pages_needed - free_page_count(state)
  slot_deficit = slots_needed - free_doc_slot_count(state)

  evictable = _evictable(state)
  last_used = jnp.where(evictable, state.doc_last_used, _INT32_MAX)
  if policy == "lru":
    order = jnp.argsort(last_used, stable=True)
  else:
    uses = jnp.where(evictable, state.doc_uses, _INT32_MAX)
    slot = jnp.arange(state.max_docs, dtype=jnp.int32)
    # The slot is a key too: lax.sort is not stable by default.
    order = jax.lax.sort((uses, last_used, slot), num_keys=3)[-1]
  sorted_evictable = evictable[order]
  sorted_pages = jnp.where(sorted_evictable, state.doc_num_pages[order], 0)
  # Pages / slots freed by evicting everything before position i.
  pages_before = jnp.cumsum(sorted_pages) - sorted_pages
  docs_before = jnp.cumsum(sorted_evictable) - sorted_evictable
  evict_sorted = sorted_evictable & ((pages_before < page_deficit) |
                                     (docs_before < slot_deficit))
  evict = jnp.zeros_like(evictable).at[order].set(evict_sorted)

  return _drop(state, evict)


def remove_documents(state: CacheState, slots: jax.Array) -> CacheState:
  """Drops the listed documents from the table (-1 entries ignored), each
  only if no live request reads it: as `evict_documents`, but of these
  documents, whatever their order.  Used to take back documents whose KV
  was never written."""
  slots = jnp.asarray(slots, jnp.int32)
  listed = _histogram(slots, state.max_docs) > 0
  return _drop(state, listed & _evictable(state))


def _drop(state: CacheState, drop: jax.Array) -> CacheState:
  """Removes the documents of mask bool[max_docs]; the table's reference to
  each of their pages goes, so pages nobody else holds become free."""
  rows = jnp.where(drop[:, None], state.doc_pages, -1)
  return state.replace(
      page_refcount=state.page_refcount - _histogram(rows, state.num_pages),
      doc_key=jnp.where(drop[:, None], 0, state.doc_key),
      doc_valid=state.doc_valid & ~drop,
      doc_len=jnp.where(drop, 0, state.doc_len),
      doc_num_pages=jnp.where(drop, 0, state.doc_num_pages),
      doc_pages=jnp.where(drop[:, None], -1, state.doc_pages),
      doc_last_used=jnp.where(drop, 0, state.doc_last_used),
      doc_uses=jnp.where(drop, 0, state.doc_uses),
  )
