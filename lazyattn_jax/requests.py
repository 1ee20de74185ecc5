"""Requests and results, and the one path that turns user input into tokens.

A string query is wrapped in the model's chat format.  The chat text before
the user's words (system prompt, user-turn header) is the same for every
request, so it becomes the first cached "document": encoded once, read in
place by every request.  Documents follow it inside the user turn, each
tokenized on its own (no BOS) and ended with a blank line; the query and the
chat text after it (end of turn, assistant header) come last.

What a request must satisfy for one engine: request_validator.py.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Sequence

import numpy as np

from lazyattn_jax.errors import InvalidRequestError
from lazyattn_jax.sampling import SamplingParams

DOCUMENT_SEPARATOR = "\n\n"
_SENTINEL = "\u0000lazyattn-user-text\u0000"
FINISH_REASONS = ("stop", "length", "error", "cancelled")


@dataclasses.dataclass(frozen=True)
class Request:
  """A query with its retrieved documents.

  `query` and each document are token ids or, with an engine that has a
  tokenizer, strings (a string query is wrapped in the chat format).
  """
  query: Sequence[int] | str
  documents: Sequence[Sequence[int] | str] = ()
  sampling: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class TokenRequest:
  """A validated request in token ids.

  The first `leading` documents are not the caller's (the shared chat
  prefix a text query brings, or a server's conversation: `prepare`'s
  `leading_documents`) and are not reported back; `stop_ids` are the stop
  tokens in effect (the sampling's, or the model's defaults).
  `chat_prefix_in_preamble`: prepared for an engine whose preamble is the
  chat prefix, so the first leading document's copy of it is already gone
  (`RequestValidator.check` does not remove it twice).
  """
  query: tuple[int, ...]
  documents: tuple[tuple[int, ...], ...]
  sampling: SamplingParams
  stop_ids: tuple[int, ...] = ()
  leading: int = 0
  chat_prefix_in_preamble: bool = False


@dataclasses.dataclass
class GenerationResult:
  """What one request produced.

  Attributes:
    request_id: id returned by `submit`.
    token_ids: generated tokens (the stop token included, if one was hit).
    doc_hits: per document, whether its KV was already cached (True) or had
      to be encoded for this request (False).
    ttft_s: seconds from submission to the first generated token.
    latency_s: seconds from submission to the last token.
    finish_reason: "stop" (a stop token), "length" (max_new_tokens),
      "error" (the engine failed while serving it; see `error`) or
      "cancelled" (`LazyEngine.cancel`).
    prompt_tokens: preamble (QualityOptions), document and query tokens
      (a learned preamble's positions are vectors, not tokens, and not
      counted).
    prefill_tokens_computed: tokens prefilled for this request: the
      documents (and a chat preamble) its admission encoded, its recomputed
      first pages (QualityOptions.recompute) and its query.  The engine's
      `stats` count all work, a learned preamble's positions included.
    cached_prompt_tokens: prompt tokens whose KV the request read from
      cache entries it did not encode (hit documents, less their recomputed
      first pages; a cached chat preamble); Block-Attention's re-rotated
      copies of cached documents count.
    prefill_tokens_before_first_token: tokens the engine prefilled in this
      request's admission round, for it and for other requests, before its
      first token came out: its wait in that round, measured in work rather
      than seconds (so it means the same on any device).
    first_logits: float32[V] logits that produced the first token.
    text: the generated text (special tokens skipped) when the engine has a
      tokenizer, else None.
    error: for finish_reason "error", what went wrong.
  """
  request_id: int
  token_ids: list[int]
  doc_hits: list[bool]
  ttft_s: float
  latency_s: float
  finish_reason: str
  prompt_tokens: int
  prefill_tokens_computed: int
  prefill_tokens_before_first_token: int = 0
  cached_prompt_tokens: int = 0
  first_logits: np.ndarray | None = None
  text: str | None = None
  error: str | None = None

  @property
  def decode_time_per_token_s(self) -> float:
    """Seconds per generated token after the first (TPOT); 0 for one."""
    n = len(self.token_ids)
    return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


# --- tokenization --------------------------------------------------------------


def chat_parts(tokenizer, user_text: str) -> tuple[list[int], list[int]]:
  """(shared chat prefix ids, query ids) for a one-turn chat.

  Without a chat template the prefix is BOS where the model expects one
  (else empty) and the query is the plain text.  Raises ValueError where
  the template refuses the conversation (its `raise_exception`).
  """
  if tokenizer.chat_template is None:
    bos = tokenizer.bos_token_id
    return ([bos] if tokenizer.add_bos_token and bos is not None else [],
            tokenizer.encode(user_text))
  parts = split_at_user_text(tokenizer, [], user_text)
  if parts is None:
    return [], tokenizer.chat_prompt(user_text)
  before, rest = parts
  return tokenizer.encode(before), tokenizer.encode(rest)


def split_at_user_text(tokenizer, history: list[dict], user_text: str
                       ) -> tuple[str, str] | None:
  """The chat template's text for `history` then a user turn of
  `user_text`, cut where that turn's words start: (the text before them,
  the words as the template writes them (its filters applied, Llama 3's
  `trim` say) and the rest), or None where the template does not write a
  fixed text before them.  Raises ValueError where the template refuses
  the conversation."""
  import jinja2
  try:
    marked = tokenizer.render_chat(
        history + [{"role": "user", "content": _SENTINEL}])
    whole = tokenizer.render_chat(
        history + [{"role": "user", "content": user_text}])
  except jinja2.TemplateError as e:
    raise ValueError(f"the model's chat template refuses this "
                     f"conversation: {e}") from None
  if marked.count(_SENTINEL) != 1:
    return None
  before = marked.split(_SENTINEL)[0]
  if not whole.startswith(before):
    return None
  return before, whole[len(before):]


def chat_prefix(tokenizer) -> list[int]:
  """The chat template's text before the user's words, in token ids (the
  same for every one-turn chat; [] without a chat template)."""
  return chat_parts(tokenizer, "")[0]


def is_token_sequence(value) -> bool:
  # bytes and bytearray are sequences of ints too, but never token ids.
  return (isinstance(value, (Sequence, np.ndarray)) and
          not isinstance(value, (str, bytes, bytearray)))


def checked_token_ids(tokens, what: str, vocab_size: int, *,
                      text_ok: bool = True) -> tuple[int, ...]:
  """Checks a sequence of token ids: ints (not bools) in [0, vocab_size).
  `text_ok`: the caller would have taken text instead (the message says
  so)."""
  if not is_token_sequence(tokens):
    raise InvalidRequestError(
        f"{what} must be {'text or ' if text_ok else ''}a sequence of token "
        f"ids, got {type(tokens).__name__}")
  if isinstance(tokens, np.ndarray):
    if tokens.ndim != 1:
      raise InvalidRequestError(
          f"{what} must be a 1-D array of token ids, got shape "
          f"{tokens.shape}")
    tokens = tokens.tolist()
  # Plain ints are the common case: checked and copied by C loops (this
  # runs for every document of every request, between the engine's steps).
  # Anything else must still be an integral number, never a bool or float.
  if set(map(type, tokens)) <= {int}:
    ids = tuple(tokens)
  else:
    for t in tokens:
      if isinstance(t, (bool, np.bool_)) or not isinstance(t, numbers.Integral):
        raise InvalidRequestError(
            f"{what} must hold integer token ids, got {type(t).__name__} {t!r}")
    ids = tuple(int(t) for t in tokens)
  if not ids:
    raise InvalidRequestError(f"{what} is empty")
  if min(ids) < 0 or max(ids) >= vocab_size:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    raise InvalidRequestError(
        f"{what} has token ids outside [0, {vocab_size}): {bad[:5]}")
  return ids


def encode_documents(tokenizer, documents, vocab_size: int):
  """Token ids of each document (text or ids), checked."""
  if not is_token_sequence(documents):
    raise InvalidRequestError(
        f"documents must be a list of documents, got "
        f"{type(documents).__name__}")
  docs = []
  for i, doc in enumerate(documents):
    if isinstance(doc, str):
      if tokenizer is None:
        raise InvalidRequestError("text documents need a tokenizer; pass token ids")
      if not doc.strip():
        raise InvalidRequestError(f"document {i} is empty")
      # Document text is data: special-token spellings in it stay plain text.
      doc = tokenizer.encode(doc + DOCUMENT_SEPARATOR, parse_special=False)
    docs.append(checked_token_ids(doc, f"document {i}", vocab_size))
  return docs


def encode_request(tokenizer, query, documents, vocab_size: int):
  """Token layout of a request given as text or ids.

  Returns (query_ids, document_ids, num_leading): `num_leading` documents were
  added in front (the chat prefix) and are not the caller's documents.  A
  token-id query is used exactly as given.
  """
  docs = encode_documents(tokenizer, documents, vocab_size)
  if not isinstance(query, str):
    return checked_token_ids(query, "query", vocab_size), docs, 0
  if tokenizer is None:
    raise InvalidRequestError("a text query needs a tokenizer; pass token ids")
  if not query.strip():
    raise InvalidRequestError("query is empty")
  try:
    prefix, query_ids = chat_parts(tokenizer, query)
  except ValueError as e:  # the chat template refused it
    raise InvalidRequestError(str(e)) from None
  query_ids = checked_token_ids(query_ids, "query", vocab_size)
  if prefix:
    return query_ids, [checked_token_ids(prefix, "chat prefix", vocab_size)] + docs, 1
  return query_ids, docs, 0


def arrival_time(value) -> float:
  """A `submit` arrival_time as a float, or InvalidRequestError (a bad one
  would fail the round that retires the request, with pages held)."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Real)
      or not np.isfinite(value)):
    raise InvalidRequestError(
        f"arrival_time must be a finite time.perf_counter() value, got "
        f"{value!r}")
  now = time.perf_counter()
  if value > now:  # a time.time() value, say: TTFT would come out negative
    raise InvalidRequestError(
        f"arrival_time {value!r} is later than now (time.perf_counter() is "
        f"{now!r}); give the time.perf_counter() value when the request "
        f"arrived")
  return float(value)


def text_vocab_limit(tokenizer, config) -> int | None:
  """The first token id the model may not generate: its tokenizer's size
  where the embedding has more rows (padding, as in Qwen2's checkpoints),
  whose ids no text shows; None when every id may be drawn (or the
  tokenizer does not say its size)."""
  size = getattr(tokenizer, "vocab_size", None)
  return size if size is not None and size < config.vocab_size else None


def default_stop_ids(tokenizer, config) -> tuple[int, ...]:
  """Stop tokens of a model: its tokenizer's, else the config's EOS."""
  if tokenizer is not None:
    return tuple(tokenizer.stop_token_ids)
  eos = getattr(config, "eos_token_id", None)
  if eos is None:
    return ()
  return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
