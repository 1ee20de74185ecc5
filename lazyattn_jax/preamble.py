"""The shared preamble documents are encoded after (QualityOptions.preamble).

It is one cache entry like a document, under its own key, listed first by
every request and every `encode_documents` call, so it is a hit whenever it
is cached and, being read at every admission, is acquired before eviction
runs: once encoded it stays.  If it is missing (never encoded, or dropped by
a failed round), the admission that finds it missing encodes it again before
any document that depends on it.  Documents encoded after it carry its key
in theirs (doc_key.py), so another preamble never returns their KV.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from lazyattn_jax.doc_key import document_key, embeddings_key
from lazyattn_jax.errors import InvalidOptionError
from lazyattn_jax.quality_options import QualityOptions
from lazyattn_jax.requests import chat_prefix


@dataclasses.dataclass(frozen=True, eq=False)
class Preamble:
  """An engine's preamble.

  Attributes:
    key: its cache key.
    tokens: its token ids (for a learned preamble, placeholders that only
      give its length).
    embeddings: float [P, D] input vectors of a learned preamble, else None.
    from_chat: it is the chat template's prefix, which a text query would
      otherwise bring as a leading document.
  """
  key: tuple[int, int]
  tokens: tuple[int, ...]
  embeddings: np.ndarray | None = None
  from_chat: bool = False

  def __len__(self) -> int:
    return len(self.tokens)


def make_preamble(options: QualityOptions, *, model_id: str, tokenizer,
                  hidden_size: int, max_doc_tokens: int) -> Preamble | None:
  """The preamble `options` ask for, or None; raises InvalidOptionError if
  it cannot be made for this model, tokenizer and cache."""
  if options.preamble is None:
    return None
  if options.preamble == "sink":
    options.check_sink_width(hidden_size)
    sink = options.sink
    preamble = Preamble(embeddings_key(sink, model_id), (0,) * len(sink),
                        sink)
  else:
    prefix = chat_prefix(tokenizer) if tokenizer is not None else []
    if not prefix:
      raise InvalidOptionError(
          "QualityOptions(preamble='chat') needs a tokenizer whose chat "
          "template puts text before the user's words")
    # The same key as the prefix cached as a leading document: encoded
    # alone from position 0, it has the same KV.
    preamble = Preamble(document_key(prefix, model_id), tuple(prefix),
                        from_chat=True)
  if len(preamble) > max_doc_tokens:
    raise InvalidOptionError(
        f"the preamble has {len(preamble)} tokens; the cache holds at most "
        f"{max_doc_tokens} per entry (max_pages_per_doc * page_size)")
  return preamble
