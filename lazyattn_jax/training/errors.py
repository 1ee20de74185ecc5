"""Typed errors of lazyattn_jax.training.

`TrainingInputError` (also a ValueError) is a bad setting, shape or file
given by the caller; the command lines turn it into one `error:` line and
exit status 2.  `DataUnavailableError` says a data source cannot be had
here (a package or data set that is not installed).
"""

from __future__ import annotations

from lazyattn_jax.errors import LazyAttnError

__all__ = ["TrainingError", "TrainingInputError", "SinkFormatError",
           "OutputPathError", "DataUnavailableError"]


class TrainingError(LazyAttnError):
  """Base class of every error lazyattn_jax.training raises on purpose."""


class TrainingInputError(TrainingError, ValueError):
  """A bad training setting, sample or array shape; the message names it."""


class SinkFormatError(TrainingInputError):
  """A learned-sink file or array that is not a float32 [P, D] "sink" of the
  expected width, or not a readable safetensors file."""


class OutputPathError(TrainingInputError):
  """An output directory that cannot be made or written: a file in its
  place, no permission, or a write under it that failed."""


class DataUnavailableError(TrainingError, RuntimeError):
  """A data source that cannot be loaded here (not installed, no data)."""
