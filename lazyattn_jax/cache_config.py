"""`CacheConfig`: the static shape and policy of the paged KV cache.

Hashable, so it can be a jit static argument.  The state it describes is
`lazyattn_jax.cache_state.CacheState`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from lazyattn_jax.errors import InvalidOptionError
from pallas_kernels.lazy_attention import resolve_impl
from pallas_kernels.tpu_page_metadata import tpu_page_size_need

__all__ = ["CacheConfig", "EVICTION_POLICIES", "FREQUENCY_WINDOW_PER_SLOT",
           "FLOAT8_POOL", "COMPUTE_DTYPES", "check_compute_dtype",
           "check_impl_page_size", "check_matches_model", "check_pool_dtype",
           "out_of_memory_errors"]

_INT32_MAX = np.iinfo(np.int32).max
# Token positions inside the pool and page indices are int32 on device.
MAX_POOL_TOKENS = _INT32_MAX

EVICTION_POLICIES = ("lfu", "lru")
# The one pool dtype other than the model's compute dtype: float8 pages with
# per-page scales, which the kernels widen as they read them.
FLOAT8_POOL = "float8_e4m3fn"
# Dtypes a model may compute in: those the attention kernels take queries in
# (pallas_kernels.lazy_attention).
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# Read counts halve after this many reads per document-table row: about
# W-TinyLFU's sample of 10x the cache, a little longer because halving small
# counts (1 -> 0) blurs the order (docs/design.md, "Eviction").
FREQUENCY_WINDOW_PER_SLOT = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class CacheConfig:
  """Static shape of the cache (hashable, so it can be a jit static argument).

  Attributes:
    num_pages: pages in the pool (N).
    page_size: token slots per page (P).
    num_layers: transformer layers (L).
    num_kv_heads: KV heads per layer (K).
    head_dim: head dimension (H).
    dtype: dtype of the K/V pool, stored as its canonical name (e.g.
      "bfloat16"); any `jnp.dtype`-compatible value is accepted.  A float
      pool is in the model's compute dtype; "float8_e4m3fn" stores float8
      pages with a float32 scale per (KV head, layer, page) for K and for V
      (`models.quantized_pool`), about half the bytes of bf16, whatever
      the model computes in.
    max_docs: rows of the document table.
    max_pages_per_doc: pages one document may occupy, so a document holds at
      most `max_pages_per_doc * page_size` tokens.
    eviction: which unread documents go first when room is needed:
      "lfu" (default): fewest recent reads first, least recently used among
        equals.  Under skewed (Zipf) document popularity this keeps the
        popular head cached where LRU lets a burst of one-off documents
        push it out; counts halve every `FREQUENCY_WINDOW_PER_SLOT *
        max_docs` reads, so a document that stopped being popular ages out.
      "lru": least recently used first.
    pool_sharding: where the pool lies: None for the default device, or a
      `jax.sharding.Sharding` of the [K, L, num_pages, page_size, H] pool
      (the engine sets a split over KV heads under tensor parallelism;
      `lazyattn_jax.sharding`).  A float8 pool's scales [K, L, num_pages]
      take the same sharding, so it must split axis 0 (KV heads) only.
  """

  num_pages: int
  page_size: int = 16
  num_layers: int
  num_kv_heads: int
  head_dim: int
  dtype: Any
  max_docs: int = 1024
  max_pages_per_doc: int
  eviction: str = "lfu"
  pool_sharding: Any = None

  def __post_init__(self):
    if self.pool_sharding is not None and not isinstance(
        self.pool_sharding, jax.sharding.Sharding):
      raise ValueError("CacheConfig.pool_sharding must be a "
                       "jax.sharding.Sharding or None, got "
                       f"{type(self.pool_sharding).__name__}")
    if self.eviction not in EVICTION_POLICIES:
      raise ValueError(
          f"CacheConfig.eviction must be one of {EVICTION_POLICIES}, got "
          f"{self.eviction!r}")
    for name in ("num_pages", "page_size", "num_layers", "num_kv_heads",
                 "head_dim", "max_docs", "max_pages_per_doc"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(
            f"CacheConfig.{name} must be an int, got {type(value).__name__}")
      if value < 1:
        raise ValueError(f"CacheConfig.{name} must be >= 1, got {value}")
      object.__setattr__(self, name, int(value))
    if self.num_pages * self.page_size > MAX_POOL_TOKENS:
      raise ValueError(
          "CacheConfig.num_pages * page_size must fit in int32, got "
          f"{self.num_pages} * {self.page_size}")
    if self.max_pages_per_doc * self.page_size > _INT32_MAX:
      raise ValueError(
          "CacheConfig.max_pages_per_doc * page_size must fit in int32, got "
          f"{self.max_pages_per_doc} * {self.page_size}")
    try:
      dtype = jnp.dtype(self.dtype)
    except TypeError as e:
      raise ValueError(
          f"CacheConfig.dtype is not a dtype: {self.dtype!r}") from e
    if not jnp.issubdtype(dtype, jnp.floating):
      raise ValueError(
          f"CacheConfig.dtype must be a floating dtype, got {dtype.name}")
    if dtype.itemsize == 1 and dtype != jnp.dtype(jnp.float8_e4m3fn):
      raise ValueError("CacheConfig.dtype: the only 8-bit pool is "
                       f"float8_e4m3fn, got {dtype.name}")
    object.__setattr__(self, "dtype", dtype.name)
    if self.pool_sharding is not None:
      # The engine's steps keep only a split of axis 0 (another came back
      # replicated, and a float8 pool's scales could not follow it).
      shard = self.pool_sharding.shard_shape(self.pool_shape)
      if tuple(shard[1:]) != self.pool_shape[1:]:
        raise ValueError(
            f"CacheConfig.pool_sharding may split the pool's axis 0 (KV "
            f"heads) only; its shard of the {list(self.pool_shape)} pool "
            f"is {list(shard)}")

  @property
  def quantized(self) -> bool:
    """Whether the pool holds float8 pages with per-page scales."""
    return jnp.dtype(self.dtype) == jnp.dtype(jnp.float8_e4m3fn)

  @property
  def bytes_per_page(self) -> int:
    """Device bytes of one page id across K and V, every layer and KV head,
    scales included (4 bytes per head and layer each for K and V)."""
    slots = self.num_kv_heads * self.num_layers
    page = slots * self.page_size * self.head_dim * jnp.dtype(
        self.dtype).itemsize
    return 2 * (page + (4 * slots if self.quantized else 0))

  @property
  def pool_bytes(self) -> int:
    """Device bytes of the whole pool (K and V, scales included)."""
    return self.num_pages * self.bytes_per_page

  @property
  def max_doc_tokens(self) -> int:
    """The longest document the table can hold."""
    return self.max_pages_per_doc * self.page_size

  @property
  def pool_shape(self) -> tuple[int, int, int, int, int]:
    """Shape of `CacheState.k` and `.v`: [K, L, num_pages, page_size, H].

    Heads first, so the model can view a pool as one [K, L * num_pages, P, H]
    page array (a free reshape) and hand it to the attention kernel in place;
    with layers first, every layer's slice k[l] would be copied each step.
    """
    return (self.num_kv_heads, self.num_layers, self.num_pages,
            self.page_size, self.head_dim)


def check_compute_dtype(dtype, name: str = "dtype"):
  """`dtype` as a `jnp.dtype` the model can compute in (one of
  COMPUTE_DTYPES); InvalidOptionError naming setting `name` and the value
  otherwise (jnp.dtype itself raises TypeError for a name it does not
  know, and would take int32 or float64)."""
  try:
    parsed = jnp.dtype(dtype)
  except (TypeError, ValueError):
    parsed = None
  if parsed is None or parsed.name not in COMPUTE_DTYPES:
    raise InvalidOptionError(f"{name} must be one of "
                             f"{', '.join(COMPUTE_DTYPES)}, got {dtype!r}")
  return parsed


def check_pool_dtype(pool_dtype, compute_dtype, *, pool_name: str = "kv_dtype",
                     compute_name: str = "dtype") -> None:
  """Raises InvalidOptionError unless a KV pool in `pool_dtype` can serve a
  model that computes in `compute_dtype`: it must be that dtype, or
  float8_e4m3fn (float8 pages with per-page scales).  The model checks its
  pool only when a step runs, so an engine built with any other pool could
  never generate.  `pool_name` and `compute_name` are what the caller's
  user calls the two settings (e.g. "--kv-dtype" and "--dtype")."""
  try:
    pool = jnp.dtype(pool_dtype)
  except (TypeError, ValueError):
    raise InvalidOptionError(
        f"{pool_name} is not a dtype: {pool_dtype!r} (give the compute dtype "
        f"or {FLOAT8_POOL})") from None
  compute = jnp.dtype(compute_dtype)
  if pool in (compute, jnp.dtype(FLOAT8_POOL)):
    return
  other = (f", or {compute_name} {pool.name}"
           if pool.name in COMPUTE_DTYPES else "")
  raise InvalidOptionError(
      f"{pool_name} {pool.name} does not match {compute_name} "
      f"{compute.name}: the KV pool is in the compute dtype or "
      f"{FLOAT8_POOL}; give {pool_name} {compute.name} or {FLOAT8_POOL}"
      f"{other}")


def check_impl_page_size(page_size: int, impl: str, *,
                         name: str = "page_size") -> None:
  """Raises InvalidOptionError naming setting `name` unless the attention
  kernels that `impl` picks here (resolved as `lazy_attention` resolves
  "auto") take pages of `page_size` tokens.  Only the TPU kernels refuse
  some, and only when a step is traced: an engine would build, then fail
  every request.  XLA takes any page size, and on a GPU the Triton kernels
  run where the Mosaic GPU ones do not take it."""
  resolved = resolve_impl(impl)
  need = tpu_page_size_need(page_size) if resolved == "tpu" else None
  if need is None:
    return
  picked = "" if impl == resolved else " (the TPU kernels on this TPU backend)"
  raise InvalidOptionError(
      f"{name} {page_size} does not suit impl {impl!r}{picked}: the TPU "
      f"kernels need a page size that is {need}; choose such a page size, "
      f"or impl 'xla'")


def check_matches_model(cache_config: CacheConfig, config, *,
                        compute_dtype=None) -> None:
  """Raises ValueError naming every field (layers, KV heads, head dim) in
  which `cache_config` differs from the model's `config`, and, given the
  model's `compute_dtype` (`LlamaConfig` does not hold it),
  InvalidOptionError for a pool dtype that cannot serve it
  (`check_pool_dtype`)."""
  if compute_dtype is not None:
    check_compute_dtype(compute_dtype, name="the model's compute dtype")
    check_pool_dtype(cache_config.dtype, compute_dtype,
                     pool_name="cache_config.dtype",
                     compute_name="the model's compute dtype")
  mismatched = [f"cache_config.{name}={getattr(cache_config, name)} (the "
                f"model's is {getattr(config, name)})"
                for name in ("num_layers", "num_kv_heads", "head_dim")
                if getattr(cache_config, name) != getattr(config, name)]
  if mismatched:
    raise ValueError("cache_config does not match the model: " +
                     ", ".join(mismatched))


@contextlib.contextmanager
def out_of_memory_errors(cache_config: CacheConfig):
  """Turns running out of host or device memory while the cache is
  allocated (a MemoryError, an XLA RESOURCE_EXHAUSTED) into an
  InvalidOptionError naming the pool's size: too many pages, or pages too
  large, is a setting to change, not a crash."""
  try:
    yield
  except (MemoryError, jax.errors.JaxRuntimeError) as e:
    if not (isinstance(e, MemoryError) or "RESOURCE_EXHAUSTED" in str(e)):
      raise
    c = cache_config
    raise InvalidOptionError(
        f"the cache does not fit in memory: {c.num_pages} pages of "
        f"{c.page_size} tokens ({c.pool_bytes / 2**30:.1f} GiB of K and V) "
        f"and {c.max_docs} document slots; choose fewer or smaller pages "
        f"({(str(e).splitlines() or [type(e).__name__])[0]})") from None
