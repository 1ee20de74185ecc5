"""Typed errors of lazyattn_jax.

Callers catch `LazyAttnError` for anything this library refuses; the two
subclasses separate "the input is wrong" from "the input is fine but the cache
is too small for it right now".
"""

from __future__ import annotations

__all__ = ["LazyAttnError", "CacheCapacityError", "InvalidRequestError"]


class LazyAttnError(Exception):
  """Base class of every error raised by lazyattn_jax on purpose."""


class CacheCapacityError(LazyAttnError):
  """A request cannot fit in the paged KV pool even after evicting every
  document that no live request reads.  The cache state is left unchanged."""


class InvalidRequestError(LazyAttnError, ValueError):
  """Bad user input (empty document, token id out of range, bad sampling
  parameter, ...).  Also a `ValueError`, so generic handlers catch it."""
