"""Document identity: a 64-bit hash of a document's token ids and the model.

The same text tokenized by a different tokenizer, or encoded by a different
model, has different KV, so the model/tokenizer id is part of the key.  So
is the key of the preamble a document was encoded after, if any: the same
document after another chat prefix or another learned sink has different
KV.  A learned sink (vectors, not tokens) is keyed by its bytes, dtype and
shape.  The hash is returned as two signed int32 words because JAX runs
without x64 and the document table stores keys as int32[max_docs, 2].
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import numpy as np

from lazyattn_jax.errors import InvalidRequestError

__all__ = ["document_key", "embeddings_key"]

# Bumped if the byte layout below ever changes, so old keys cannot alias new ones.
_KEY_FORMAT = b"lazyattn-doc-key-v1"
_CONTEXT_TAG = b"after-context"
_EMBEDDINGS_FORMAT = b"lazyattn-embeddings-key-v1"


def document_key(token_ids: Sequence[int] | np.ndarray, model_id: str,
                 context: tuple[int, int] | None = None) -> tuple[int, int]:
  """Hashes a document's token ids together with the model/tokenizer id.

  Args:
    token_ids: the document's token ids (a sequence or 1-D integer array).
    model_id: identifies the model and tokenizer the KV is encoded with.
    context: the key of the preamble the document is encoded after, or None
      (encoded alone; the key is then what it always was).

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
  hasher = _hasher(_KEY_FORMAT, model_id)
  hasher.update(struct.pack("<Q", ids.size))
  hasher.update(ids.astype("<i8").tobytes())
  if context is not None:
    # After the length-prefixed tokens, so no key without a context can
    # have these bytes.
    high, low = context
    hasher.update(_CONTEXT_TAG + struct.pack("<ii", int(high), int(low)))
  high, low = struct.unpack("<ii", hasher.digest())
  return high, low


def embeddings_key(vectors: np.ndarray, model_id: str) -> tuple[int, int]:
  """Key of input vectors used in place of token embeddings (a learned
  preamble): a hash of their dtype, shape and bytes, and the model id."""
  if not isinstance(model_id, str):
    raise InvalidRequestError(
        f"model_id must be a str, got {type(model_id).__name__}")
  vectors = np.ascontiguousarray(vectors)
  hasher = _hasher(_EMBEDDINGS_FORMAT, model_id)
  dtype = str(vectors.dtype).encode("utf-8")
  hasher.update(struct.pack("<Q", len(dtype)) + dtype)
  hasher.update(struct.pack("<Q", vectors.ndim))
  hasher.update(struct.pack(f"<{vectors.ndim}Q", *vectors.shape))
  hasher.update(vectors.tobytes())
  high, low = struct.unpack("<ii", hasher.digest())
  return high, low


def _hasher(tag: bytes, model_id: str):
  hasher = hashlib.blake2b(digest_size=8)
  hasher.update(tag)
  model_bytes = model_id.encode("utf-8")
  # Length prefixes keep (model_id, tokens) pairs from running into each other.
  hasher.update(struct.pack("<Q", len(model_bytes)))
  hasher.update(model_bytes)
  return hasher
