"""Which errors of a training command are the user's (one line, exit 2)."""

from __future__ import annotations

from lazyattn_jax.default_model import ModelUnavailableError, UnknownModelError
from lazyattn_jax.training.errors import (DataUnavailableError,
                                          TrainingInputError)
from models.errors import ModelFormatError

# A bad setting, model, file or data source: reported in one line.
USER_ERRORS = (TrainingInputError, DataUnavailableError, UnknownModelError,
               ModelUnavailableError, ModelFormatError, FileNotFoundError)


def first_line(error: Exception) -> str:
  return (str(error).splitlines() or [type(error).__name__])[0]
