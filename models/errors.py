"""The error the weight and tokenizer loaders raise for a bad model file.

Defined here rather than in `lazyattn_jax.errors` because `models` does not
depend on the serving package; callers that serve models (the CLI) catch it
next to their own errors.
"""

from __future__ import annotations

__all__ = ["ModelFileNotFoundError", "ModelFormatError",
           "UnsupportedTokenizerError"]


class ModelFormatError(ValueError):
  """A model file or checkpoint directory that cannot be loaded.

  Raised for corrupted or truncated files, missing or unexpected tensors,
  tensors of the wrong shape or type, and configurations, architectures or
  tokenizers this package does not support.  The message names the file (and
  the tensor or field at fault).  Loaders raise it before they build a model,
  so nothing is half-loaded.  A `ValueError`, so generic handlers catch it.
  """


class ModelFileNotFoundError(ModelFormatError, FileNotFoundError):
  """A file a model needs does not exist: the .gguf file, the checkpoint
  directory, its config.json, its weights, or a shard its index names.

  Also a `FileNotFoundError`, so `except OSError` handlers catch it.
  """


class UnsupportedTokenizerError(ModelFormatError):
  """The file describes a tokenizer this package cannot rebuild exactly.

  A model whose tokenizer is unsupported can still run on token ids.
  """
