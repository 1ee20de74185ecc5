"""Typed errors of lazyattn_jax.

Callers catch `LazyAttnError` for anything this library refuses.  At
submission, `InvalidRequestError` says the input is wrong and
`CacheCapacityError` that the input is fine but the cache, as configured,
cannot hold it.  Later, `RequestFailedError` says the engine failed while
serving a request it had accepted, and `EngineClosedError` that the engine
was closed.  `InvalidOptionError` says an engine option is malformed or does
not apply to the engine it was given to; it is raised when the engine (or
the option) is made, before anything runs.
"""

from __future__ import annotations

__all__ = ["LazyAttnError", "CacheCapacityError", "InvalidRequestError",
           "InvalidOptionError", "RequestFailedError", "EngineClosedError",
           "ResultTakenError", "TensorParallelError"]


class LazyAttnError(Exception):
  """Base class of every error raised by lazyattn_jax on purpose."""


class CacheCapacityError(LazyAttnError):
  """A request cannot fit in the paged KV pool even after evicting every
  document that no live request reads (or a document is longer than the
  cache holds per document).  The cache state is left unchanged."""


class InvalidRequestError(LazyAttnError, ValueError):
  """Bad user input (empty document, token id out of range, bad sampling
  parameter, ...).  Also a `ValueError`, so generic handlers catch it."""


class InvalidOptionError(LazyAttnError, ValueError):
  """An engine option that is malformed (a learned preamble of the wrong
  shape or dtype, a recompute length that is not a whole number of pages)
  or that does not apply (answer-quality options in a mode without a
  document step, a chat preamble without a chat template).  Also a
  `ValueError`, like the other settings' errors."""


class RequestFailedError(LazyAttnError):
  """The engine failed while serving an accepted request.  The request's
  pages were released and the engine kept serving; `result` is its
  `GenerationResult` (finish_reason "error")."""

  def __init__(self, message: str, result=None):
    super().__init__(message)
    self.result = result


class EngineClosedError(LazyAttnError):
  """The engine was closed (`LazyEngine.close`) and cannot serve."""


class ResultTakenError(LazyAttnError, LookupError):
  """A call waiting for its request's result (`generate`, a stream) found
  the request ended and its result taken by another caller's
  `pop_result`."""


class TensorParallelError(LazyAttnError, ValueError):
  """A model cannot be split over the devices asked for (head counts or
  widths not divisible by the device count, more devices than exist, a
  mesh of the wrong form).  Raised before any weight is placed; the message
  names the counts and what would work instead.  Also a `ValueError`."""
