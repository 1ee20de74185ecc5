"""`PagedKVCache`: jitted cache transitions and host-side request admission.

The class holds only the static `CacheConfig`; the cache itself is an
immutable `CacheState` that every method takes and returns, so a caller's
state is never modified (a refused admission simply keeps using the old one).

Why the pool is never copied (instead of buffer donation):
  None of the bookkeeping transitions touches `k`/`v`, which are by far the
  largest arrays.  If they went through `jax.jit` as inputs and outputs, the
  compiled function would have to either copy them or alias them through
  `donate_argnums`.  Donation would invalidate the caller's input state, which
  breaks the contract that a refused or abandoned transition leaves the old
  state usable (and would make `admit` unable to keep the old state on
  `CacheCapacityError`).  So each wrapper here strips the pool first
  (`state.replace(k=None, v=None)`; `None` is an empty pytree), runs the
  jitted transition on the small tables only, and re-attaches the very same
  `k`/`v` buffers to the result.  Zero bytes of the pool move, no buffer is
  invalidated, and the compiled functions do not depend on the pool's dtype or
  size.  Only the model's forward pass writes the pool (inside the engine's own
  jit, where donating the pool is the engine's choice).

Compilation: jitted functions are module-level, so every `PagedKVCache` with
the same table shapes shares their compile cache.  `admit`/`finish` pad their
variable-length inputs (documents per request, missing documents, private
pages) to powers of two with a small floor, so a steady workload compiles a
bounded number of times.

Concurrency note for the engine: a missing document is inserted into the
table (and a later admission sees it as a hit) as soon as it is admitted, i.e.
before its KV is prefilled.  The engine must prefill every `missing_docs`
entry before any request reading that slot runs attention over it, or take
it back out with `drop_documents` if it never will.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lazyattn_jax import cache_state as cs
from lazyattn_jax.cache_state import CacheConfig, CacheState
from lazyattn_jax.errors import (CacheCapacityError, InvalidRequestError,
                                 LazyAttnError)
from pallas_kernels.sizes import ceil_div, next_power_of_two

__all__ = ["Admission", "PagedKVCache"]

_INT32_MIN, _INT32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max


@dataclasses.dataclass(frozen=True)
class Admission:
  """What `PagedKVCache.admit` reserved for one request.

  Attributes:
    doc_slots: document-table slot of each of the request's documents, in the
      request's order (a key listed twice appears twice).
    doc_pages: physical page ids of each document, in order (one list per
      document of the request; shared pages for hits).
    doc_hit: whether each document was already cached before this admission.
      A key that was missing is a miss at every position it is listed.
    missing_docs: indices into the request's documents whose KV must be
      prefilled now; each missing key appears once (its first occurrence).
    private_pages: pages for the request's own query and generated tokens.
    evicted: whether it evicted cached documents to make room (their pages
      or slots are now its own).
  """

  doc_slots: list[int]
  doc_pages: list[list[int]]
  doc_hit: list[bool]
  missing_docs: list[int]
  private_pages: list[int]
  evicted: bool = False


# ------------------------------------------------------ jitted transitions
#
# All of these run on a state whose k/v are None (see module docstring).

_free_count_jit = jax.jit(cs.free_page_count)
_remove_jit = jax.jit(cs.remove_documents)


@jax.jit
def _plan_admission(tables: CacheState, keys: jax.Array, key_present: jax.Array):
  """Looks the request's documents up and measures the room for the rest.

  Args:
    keys: int32[nb, 2] document keys, padded; key_present: bool[nb].

  Returns:
    slots (int32[nb], -1 for misses and padding), free pages, pages and doc
    slots that eviction could free without touching the documents this
    request hits (it is about to read them), and free document slots.
  """
  slots = jnp.where(key_present, cs.lookup_documents(tables, keys), -1)
  hit = cs._histogram(slots, tables.max_docs) > 0
  evictable = cs._evictable(tables) & ~hit
  return (slots, cs.free_page_count(tables),
          jnp.sum(jnp.where(evictable, tables.doc_num_pages, 0),
                  dtype=jnp.int32),
          jnp.sum(evictable, dtype=jnp.int32), cs.free_doc_slot_count(tables))


@functools.partial(jax.jit, static_argnames=("private_max", "eviction"))
def _commit_admission(tables: CacheState, hit_slots, miss_keys, miss_lengths,
                      miss_num_pages, miss_index, private_count, *,
                      private_max: int, eviction: str):
  """All state changes of one admission, as one compiled transition.

  Args:
    hit_slots: int32[nb] slot of each request document that was a hit, else -1.
    miss_keys, miss_lengths, miss_num_pages: int32[mb, 2], [mb], [mb] the
      distinct missing documents (padding rows have length 0, 0 pages).
    miss_index: int32[nb] for each request document, its row in the missing
      list, or -1.
    private_count: int32[] private pages wanted (<= private_max).

  Returns:
    (tables, doc_slots int32[nb], doc_rows int32[nb, max_pages_per_doc],
     private_pages int32[private_max], ok bool[]).
  """
  mb = miss_lengths.shape[0]
  M = tables.max_pages_per_doc
  # Hits first, so that eviction cannot take a document this request reads.
  tables = cs.acquire_documents(tables, hit_slots)
  missing_pages = jnp.sum(miss_num_pages)
  tables = cs.evict_documents(tables, missing_pages + private_count,
                              jnp.sum(miss_lengths >= 1, dtype=jnp.int32),
                              policy=eviction)
  # Each missing document in its own run of consecutive pages where one
  # is free (the kernels copy such blocks whole).
  tables, rows, ok_docs = cs.allocate_document_pages(tables, miss_num_pages,
                                                     max_pages=M)
  tables, new_slots, ok_insert = cs.insert_documents(tables, miss_keys,
                                                     miss_lengths, rows)
  tables, private_pages, ok_private = cs.allocate_pages(
      tables, private_count, max_count=private_max)
  miss_slots = jnp.where(miss_index >= 0,
                         new_slots[jnp.clip(miss_index, 0, mb - 1)], -1)
  tables = cs.acquire_documents(tables, miss_slots)
  doc_slots = jnp.where(miss_index >= 0, miss_slots, hit_slots)
  return (tables, doc_slots, cs._doc_page_rows(tables, doc_slots),
          private_pages, ok_docs & ok_insert & ok_private)


@jax.jit
def _finish_request(tables: CacheState, doc_slots, private_pages):
  tables = cs.release_documents(tables, doc_slots)
  return cs.release_pages(tables, private_pages)


@jax.jit
def _stats(tables: CacheState):
  doc_pages = jnp.sum(jnp.where(tables.doc_valid, tables.doc_num_pages, 0))
  return dict(
      free_pages=cs.free_page_count(tables),
      used_pages=jnp.sum(tables.page_refcount > 0),
      cached_docs=jnp.sum(tables.doc_valid),
      cached_doc_pages=doc_pages,
      docs_in_use=jnp.sum(tables.doc_valid & (tables.doc_users > 0)),
      evictable_pages=cs.evictable_page_count(tables),
      free_doc_slots=cs.free_doc_slot_count(tables),
  )


# ---------------------------------------------------------------- helpers


def _tables(state: CacheState) -> CacheState:
  """The state without its pool (see module docstring)."""
  if not isinstance(state, CacheState):
    raise TypeError(f"state must be a CacheState, got {type(state).__name__}")
  return state.replace(k=None, v=None)


def _with_pool(tables: CacheState, state: CacheState) -> CacheState:
  return tables.replace(k=state.k, v=state.v)


# Floors of the padded sizes: padding a few more int32 entries costs nothing,
# while every distinct size is one more compilation (about a second on CPU).
_MIN_DOC_BUCKET = 8  # documents per request, and missing documents
_MIN_PAGE_BUCKET = 16  # private pages per request


def _padded(values: Sequence[int], size: int, fill: int = -1) -> np.ndarray:
  out = np.full((size,), fill, np.int32)
  out[:len(values)] = values
  return out


def _check_key(key, index: int) -> tuple[int, int]:
  try:
    high, low = key
  except (TypeError, ValueError):
    raise InvalidRequestError(
        f"doc_keys[{index}] must be a pair of int32 words (from "
        f"document_key), got {key!r}") from None
  for word in (high, low):
    if (isinstance(word, bool) or not isinstance(word, (int, np.integer))
        or not _INT32_MIN <= word <= _INT32_MAX):
      raise InvalidRequestError(
          f"doc_keys[{index}] must be a pair of int32 words (from "
          f"document_key), got {key!r}")
  return int(high), int(low)


class PagedKVCache:
  """Static cache configuration plus the jitted transitions over `CacheState`.

  Every method is functional: it takes a `CacheState` and returns a new one,
  sharing the caller's `k`/`v` buffers (never copied, never donated).
  """

  def __init__(self, config: CacheConfig):
    if not isinstance(config, CacheConfig):
      raise TypeError(
          f"config must be a CacheConfig, got {type(config).__name__}")
    self.config = config

  def free_page_count(self, state: CacheState) -> int:
    """Pages nobody holds."""
    return int(_free_count_jit(_tables(state)))

  def drop_documents(self, state: CacheState, slots: Sequence[int]
                     ) -> CacheState:
    """Removes these documents from the table if nobody reads them (their
    KV was never written, say); see `cache_state.remove_documents`."""
    slots = _padded(list(slots), next_power_of_two(len(slots),
                                                      _MIN_DOC_BUCKET))
    return _with_pool(_remove_jit(_tables(state), slots), state)

  # --- host-side request life cycle ------------------------------------------

  def pages_for(self, num_tokens: int) -> int:
    """Pages needed to hold `num_tokens` tokens."""
    return ceil_div(num_tokens, self.config.page_size)

  def admit(self, state: CacheState, doc_keys: Sequence[tuple[int, int]],
            doc_lengths: Sequence[int], private_tokens: int
            ) -> tuple[CacheState, Admission]:
    """Reserves everything one request needs, or refuses it cleanly.

    Looks every document up; distinct missing documents get fresh pages and a
    table slot (a key listed twice is allocated once); `private_tokens` get
    `ceil(private_tokens / page_size)` private pages; every document of the
    request (hits and misses, with repetition) is acquired.  Unread documents
    are evicted in the order of `CacheConfig.eviction`, only as far as
    needed.

    Args:
      state: the cache (not modified).
      doc_keys: `document_key` of each document, in the request's order.
      doc_lengths: true token length of each document (>= 1).
      private_tokens: query plus generated tokens to reserve room for.

    Returns:
      (new_state, Admission).

    Raises:
      InvalidRequestError: mismatched lists, a non-positive document length,
        negative `private_tokens`, or a bad key.
      CacheCapacityError: a document longer than the table's per-document
        limit (`max_pages_per_doc * page_size` tokens) or than the whole
        pool, or
        free pages plus pages of evictable documents (not counting documents
        this request reads) cannot hold the missing documents plus the private
        pages, or there are not enough document slots.  The message gives the
        numbers; the caller keeps its unchanged `state`.
    """
    cfg = self.config
    doc_keys = list(doc_keys)
    doc_lengths = list(doc_lengths)
    if len(doc_keys) != len(doc_lengths):
      raise InvalidRequestError(
          f"doc_keys and doc_lengths differ in length: {len(doc_keys)} vs "
          f"{len(doc_lengths)}")
    keys = [_check_key(key, i) for i, key in enumerate(doc_keys)]
    for i, length in enumerate(doc_lengths):
      if isinstance(length, bool) or not isinstance(length, (int, np.integer)):
        raise InvalidRequestError(
            f"doc_lengths[{i}] must be an int, got {type(length).__name__}")
      if length < 1:
        raise InvalidRequestError(
            f"doc_lengths[{i}] is {length}: an empty document cannot be cached")
      if self.pages_for(length) > cfg.num_pages:
        raise CacheCapacityError(
            f"document {i} has {length} tokens = {self.pages_for(length)} "
            f"pages, more than the whole pool ({cfg.num_pages} pages of "
            f"{cfg.page_size} tokens)")
      if length > cfg.max_doc_tokens:
        raise CacheCapacityError(
            f"document {i} has {length} tokens, more than a document may hold "
            f"(max_pages_per_doc * page_size = {cfg.max_pages_per_doc} * "
            f"{cfg.page_size} = {cfg.max_doc_tokens})")
    if (isinstance(private_tokens, bool)
        or not isinstance(private_tokens, (int, np.integer))
        or private_tokens < 0):
      raise InvalidRequestError(
          f"private_tokens must be an int >= 0, got {private_tokens!r}")

    tables = _tables(state)
    n = len(keys)
    nb = next_power_of_two(n, _MIN_DOC_BUCKET)
    key_array = np.zeros((nb, 2), np.int32)
    key_array[:n] = np.asarray(keys, np.int32).reshape(n, 2)
    plan = _plan_admission(tables, key_array, np.arange(nb) < n)
    slots, free_pages, evictable_pages, evictable_docs, free_slots = (
        jax.device_get(plan))
    slots = [int(s) for s in slots[:n]]

    # Distinct missing keys, in order of first occurrence.
    missing_docs: list[int] = []
    miss_row_of_key: dict[tuple[int, int], int] = {}
    miss_index = []
    for i, (key, slot) in enumerate(zip(keys, slots)):
      if slot >= 0:
        miss_index.append(-1)
        continue
      if key not in miss_row_of_key:
        miss_row_of_key[key] = len(missing_docs)
        missing_docs.append(i)
      miss_index.append(miss_row_of_key[key])
    miss_pages = [self.pages_for(int(doc_lengths[i])) for i in missing_docs]
    private_count = self.pages_for(int(private_tokens))
    pages_needed = sum(miss_pages) + private_count
    pages_available = int(free_pages) + int(evictable_pages)
    if pages_needed > pages_available:
      raise CacheCapacityError(
          f"request needs {pages_needed} pages ({sum(miss_pages)} for "
          f"{len(missing_docs)} missing cache entries (documents, and a "
          f"preamble not yet cached) + {private_count} private "
          f"for {private_tokens} tokens) but only {pages_available} can be "
          f"made free ({int(free_pages)} free + {int(evictable_pages)} in "
          f"evictable documents) of a {cfg.num_pages}-page pool")
    slots_available = int(free_slots) + int(evictable_docs)
    if len(missing_docs) > slots_available:
      raise CacheCapacityError(
          f"request needs {len(missing_docs)} document slots but only "
          f"{slots_available} can be made free ({int(free_slots)} free + "
          f"{int(evictable_docs)} evictable) of max_docs={cfg.max_docs}")

    mb = next_power_of_two(len(missing_docs), _MIN_DOC_BUCKET)
    miss_keys = np.zeros((mb, 2), np.int32)
    if missing_docs:
      miss_keys[:len(missing_docs)] = [keys[i] for i in missing_docs]
    miss_lengths = _padded([doc_lengths[i] for i in missing_docs], mb, 0)
    private_max = next_power_of_two(private_count, _MIN_PAGE_BUCKET)
    new_tables, doc_slots, doc_rows, private_pages, ok = _commit_admission(
        tables, _padded(slots, nb), miss_keys, miss_lengths,
        _padded(miss_pages, mb, 0), _padded(miss_index, nb),
        np.int32(private_count), private_max=private_max,
        eviction=cfg.eviction)
    doc_slots, doc_rows, private_pages, ok = jax.device_get(
        (doc_slots, doc_rows, private_pages, ok))
    if not ok:
      # The capacity checks above make this unreachable unless the state
      # breaks the ownership invariant; refuse rather than return a bad state.
      raise LazyAttnError(
          "internal error: admission failed after its capacity check passed; "
          "the cache state is inconsistent")

    admission = Admission(
        doc_slots=[int(s) for s in doc_slots[:n]],
        doc_pages=[[int(p) for p in row[:self.pages_for(int(length))]]
                   for row, length in zip(doc_rows[:n], doc_lengths)],
        doc_hit=[s >= 0 for s in slots],
        missing_docs=missing_docs,
        private_pages=[int(p) for p in private_pages[:private_count]],
        # Eviction goes only as far as the free pages and slots fall short.
        evicted=(pages_needed > int(free_pages) or
                 len(missing_docs) > int(free_slots)),
    )
    return _with_pool(new_tables, state), admission

  def finish(self, state: CacheState, admission: Admission) -> CacheState:
    """Releases a finished request's documents and private pages.

    Its documents stay cached (evictable once nobody else reads them); its
    private pages become free.
    """
    if not isinstance(admission, Admission):
      raise TypeError(
          f"admission must be an Admission, got {type(admission).__name__}")
    slots = admission.doc_slots
    pages = admission.private_pages
    slots = _padded(slots, next_power_of_two(len(slots), _MIN_DOC_BUCKET))
    pages = _padded(pages, next_power_of_two(len(pages), _MIN_PAGE_BUCKET))
    tables = _finish_request(_tables(state), slots, pages)
    return _with_pool(tables, state)

  def stats(self, state: CacheState) -> dict[str, int]:
    """Host-side snapshot: free_pages, used_pages, cached_docs,
    cached_doc_pages, docs_in_use, evictable_pages, free_doc_slots."""
    return {name: int(value)
            for name, value in jax.device_get(_stats(_tables(state))).items()}
