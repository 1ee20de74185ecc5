"""The `documents` field and the registry behind `POST /v1/documents`.

A document in a request is a string, `{"text": ...}`, `{"token_ids": [...]}`
or `{"id": ...}`.  Ids come from `POST /v1/documents`: the registry keeps
each registered document's token ids under an id made from them, so a
client can refer to a document without resending it.  The id names the
content, not a place in the KV cache: a registered document that the cache
has since evicted is encoded again on its next use.  The same text sent by
any client is the same cache entry, whether given as text or by id.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import threading

import numpy as np

from lazyattn_jax.server.errors import bad_request, not_found

ID_PREFIX = "doc-"


@dataclasses.dataclass(frozen=True)
class DocumentSpec:
  """One entry of a `documents` field: exactly one of text, token_ids, id."""
  index: int
  text: str | None = None
  token_ids: tuple[int, ...] | None = None
  id: str | None = None


def parse_documents(items: list, field: str = "documents") -> list[DocumentSpec]:
  """Checks the shape of each entry; raises APIError 400 naming it."""
  specs = []
  for i, item in enumerate(items):
    where = f"{field}[{i}]"
    if isinstance(item, str):
      item = {"text": item}
    if not isinstance(item, dict) or len(item) != 1:
      raise bad_request(
          f"{where} must be a string or an object with exactly one of "
          f"'text', 'token_ids' or 'id'", param=where)
    (kind, value), = item.items()
    if kind == "text":
      if not isinstance(value, str) or not value.strip():
        raise bad_request(f"{where}.text must be non-empty text",
                          param=f"{where}.text")
      specs.append(DocumentSpec(i, text=value))
    elif kind == "token_ids":
      if (not isinstance(value, list) or not value or
          not all(type(t) is int for t in value)):
        raise bad_request(f"{where}.token_ids must be a non-empty list of "
                          f"integers", param=f"{where}.token_ids")
      specs.append(DocumentSpec(i, token_ids=tuple(value)))
    elif kind == "id":
      if not isinstance(value, str):
        raise bad_request(f"{where}.id must be a string", param=f"{where}.id")
      specs.append(DocumentSpec(i, id=value))
    else:
      raise bad_request(
          f"{where} has an unknown key {kind!r}; use 'text', 'token_ids' or "
          f"'id'", param=where)
  return specs


def document_id(token_ids) -> str:
  """The id of a document's token ids (the same for every client)."""
  data = np.asarray(token_ids, dtype="<i8").tobytes()
  return ID_PREFIX + hashlib.blake2b(data, digest_size=12).hexdigest()


class DocumentRegistry:
  """Token ids of registered documents by id, least recently used forgotten
  past `capacity`.  Thread-safe.

  Args:
    capacity: how many documents to remember.
  """

  def __init__(self, capacity: int):
    self.capacity = capacity
    self._tokens: collections.OrderedDict[str, tuple[int, ...]] = (
        collections.OrderedDict())
    self._lock = threading.Lock()

  def __len__(self) -> int:
    with self._lock:
      return len(self._tokens)

  def register(self, token_ids) -> str:
    """Remembers a document (already tokenized and checked); returns its id."""
    tokens = tuple(int(t) for t in token_ids)
    doc_id = document_id(tokens)
    with self._lock:
      self._tokens[doc_id] = tokens
      self._tokens.move_to_end(doc_id)
      while len(self._tokens) > self.capacity:
        self._tokens.popitem(last=False)
    return doc_id

  def resolve(self, specs: list[DocumentSpec], field: str = "documents"):
    """Engine documents (text or token ids) for `specs`; an unknown id is a
    404 that names it."""
    documents = []
    with self._lock:
      for spec in specs:
        if spec.id is None:
          documents.append(spec.text if spec.text is not None
                           else list(spec.token_ids))
          continue
        tokens = self._tokens.get(spec.id)
        if tokens is None:
          raise not_found(f"no document with id {spec.id!r} (register it "
                          f"with POST /v1/documents)",
                          param=f"{field}[{spec.index}].id",
                          code="document_not_found")
        self._tokens.move_to_end(spec.id)
        documents.append(list(tokens))
    return documents
