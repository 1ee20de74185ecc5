"""Turning text into the token layout of a lazy request.

A string query is wrapped in the model's chat format.  The chat text before
the user's words (system prompt, user-turn header) is the same for every
request, so it becomes the first cached "document": encoded once, read in
place by every request.  Documents follow it inside the user turn, each
tokenized on its own (no BOS) and ended with a blank line; the query and the
chat text after it (end of turn, assistant header) come last.
"""

from __future__ import annotations

from typing import Sequence

from lazyattn_jax.errors import InvalidRequestError

_SENTINEL = "\u0000lazyattn-user-text\u0000"
DOCUMENT_SEPARATOR = "\n\n"


def chat_parts(tokenizer, user_text: str) -> tuple[list[int], list[int]]:
  """(shared chat prefix ids, query ids) for a one-turn chat.

  Without a chat template the prefix is empty and the query is the plain text.
  """
  if tokenizer.chat_template is None:
    return [], tokenizer.encode(user_text)
  rendered = tokenizer.render_chat([{"role": "user", "content": _SENTINEL}])
  if rendered.count(_SENTINEL) != 1:
    return [], tokenizer.chat_prompt(user_text)
  before, after = rendered.split(_SENTINEL)
  return tokenizer.encode(before), tokenizer.encode(user_text + after)


def encode_request(tokenizer, query, documents: Sequence):
  """Token layout of a request given as text or ids.

  Returns (query_ids, document_ids, num_leading): `num_leading` documents were
  added in front (the chat prefix) and are not the caller's documents.
  A token-id query (a sequence of ints) is used exactly as given.
  """
  docs = []
  for i, doc in enumerate(documents):
    if isinstance(doc, str):
      if tokenizer is None:
        raise InvalidRequestError("text documents need a tokenizer; pass token ids")
      if not doc.strip():
        raise InvalidRequestError(f"document {i} is empty")
      # Document text is data: special-token spellings in it stay plain text.
      docs.append(tokenizer.encode(doc + DOCUMENT_SEPARATOR, parse_special=False))
    else:
      docs.append(list(doc))
  if isinstance(query, str):
    if tokenizer is None:
      raise InvalidRequestError("a text query needs a tokenizer; pass token ids")
    if not query.strip():
      raise InvalidRequestError("query is empty")
    prefix, query_ids = chat_parts(tokenizer, query)
    if prefix:
      return query_ids, [prefix] + docs, 1
    return query_ids, docs, 0
  return list(query), docs, 0
