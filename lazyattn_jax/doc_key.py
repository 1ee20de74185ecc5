"""Document identity: a 64-bit hash of a document's token ids and the model.

The same text tokenized by a different tokenizer, or encoded by a different
model, has different KV, so the model/tokenizer id is part of the key.  The
hash is returned as two signed int32 words because JAX runs without x64 and
the document table stores keys as int32[max_docs, 2].
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

from lazyattn_jax.errors import InvalidRequestError

__all__ = ["document_key"]

# Bumped if the byte layout below ever changes, so old keys cannot alias new ones.
_KEY_FORMAT = b"lazyattn-doc-key-v1"


def document_key(token_ids: Sequence[int] | np.ndarray,
                 model_id: str) -> tuple[int, int]:
  """Hashes a document's token ids together with the model/tokenizer id.

  Args:
    token_ids: the document's token ids (a sequence or 1-D integer array).
    model_id: identifies the model and tokenizer the KV is encoded with.

  Returns:
    (high, low): the 64-bit blake2b digest as two signed int32 words.

  Raises:
    InvalidRequestError: `token_ids` is not a 1-D sequence of integers, or
      `model_id` is not a string.
  """
  if not isinstance(model_id, str):
    raise InvalidRequestError(
        f"model_id must be a str, got {type(model_id).__name__}")
  ids = np.asarray(token_ids)
  if ids.size == 0:
    ids = ids.astype(np.int64)
  if ids.ndim != 1 or ids.dtype.kind not in "iu":
    raise InvalidRequestError(
        "token_ids must be a 1-D sequence of integers, got array of shape "
        f"{ids.shape} and dtype {ids.dtype}")
  hasher = hashlib.blake2b(digest_size=8)
  hasher.update(_KEY_FORMAT)
  model_bytes = model_id.encode("utf-8")
  # Length prefixes keep (model_id, tokens) pairs from running into each other.
  hasher.update(struct.pack("<Q", len(model_bytes)))
  hasher.update(model_bytes)
  hasher.update(struct.pack("<Q", ids.size))
  hasher.update(ids.astype("<i8").tobytes())
  high, low = struct.unpack("<ii", hasher.digest())
  return high, low
