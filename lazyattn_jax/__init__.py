"""lazyattn_jax: position-agnostic, zero-copy KV reuse for RAG (DESIGN.md).

The user-facing engine is `LazyEngine` (`LazyEngine.from_pretrained(...)`,
`generate`, `generate_batch`, `generate_stream`) with `SamplingParams` and
`Request`.  The cache manager (DESIGN.md section 3) is a functional pytree, `CacheState`,
with pure jit-compatible transitions in `lazyattn_jax.cache_state` and a
host-side admission layer, `PagedKVCache`, in `lazyattn_jax.paged_cache`.
"""

from lazyattn_jax.cache_state import (
    CacheConfig,
    CacheState,
    acquire_documents,
    allocate_pages,
    evict_documents,
    evictable_page_count,
    free_doc_slot_count,
    free_page_count,
    init_cache_state,
    insert_document,
    insert_documents,
    lookup_documents,
    release_documents,
    release_pages,
)
from lazyattn_jax.doc_key import document_key
from lazyattn_jax.errors import (
    CacheCapacityError,
    InvalidRequestError,
    LazyAttnError,
)
from lazyattn_jax.engine import GenerationResult, LazyEngine, Request
from lazyattn_jax.paged_cache import Admission, PagedKVCache
from lazyattn_jax.sampling import SamplingParams

__all__ = [
    "GenerationResult",
    "LazyEngine",
    "Request",
    "SamplingParams",
    "Admission",
    "CacheCapacityError",
    "CacheConfig",
    "CacheState",
    "InvalidRequestError",
    "LazyAttnError",
    "PagedKVCache",
    "acquire_documents",
    "allocate_pages",
    "document_key",
    "evict_documents",
    "evictable_page_count",
    "free_doc_slot_count",
    "free_page_count",
    "init_cache_state",
    "insert_document",
    "insert_documents",
    "lookup_documents",
    "release_documents",
    "release_pages",
]
