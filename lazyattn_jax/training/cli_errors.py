"""Which errors of a training command are the user's (one line, exit 2)."""

from __future__ import annotations

import contextlib

import jax

from lazyattn_jax.default_model import ModelUnavailableError, UnknownModelError
from lazyattn_jax.training.errors import (DataUnavailableError,
                                          TrainingInputError)
from models.errors import ModelFormatError

# A bad setting, model, file or data source: reported in one line.
USER_ERRORS = (TrainingInputError, DataUnavailableError, UnknownModelError,
               ModelUnavailableError, ModelFormatError, FileNotFoundError)


def first_line(error: Exception) -> str:
  return (str(error).splitlines() or [type(error).__name__])[0]


@contextlib.contextmanager
def out_of_memory_hint(args):
  """Turns the device running out of memory in a training step (an XLA
  RESOURCE_EXHAUSTED) into a TrainingInputError that names the settings
  that shrink the step: a setting to change, not a crash."""
  try:
    yield
  except jax.errors.JaxRuntimeError as e:
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    levers = ([] if args.remat else ["--remat"]) + [
        f"a --batch-size under {args.batch_size}",
        f"a --max-len under {args.max_len}"]
    raise TrainingInputError(
        f"the training step does not fit in device memory; try "
        f"{', '.join(levers)} ({first_line(e)})") from None
