"""What a request must satisfy for one engine, checked before anything is
queued (`RequestValidator`), so the same condition always raises the same
error and a refused request changes nothing: `InvalidRequestError` for bad
input, `CacheCapacityError` for a request the cache as configured can never
hold.  Tokenization: requests.py.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from typing import Iterable

from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
from lazyattn_jax.requests import (Request, TokenRequest, checked_token_ids,
                                   encode_documents, encode_request,
                                   is_token_sequence)
from lazyattn_jax.sampling import SamplingParams
from pallas_kernels.sizes import ceil_div


def merge_sampling(sampling, overrides: dict) -> SamplingParams:
  """`sampling` (default SamplingParams()) with keyword overrides applied;
  an override of None keeps the field."""
  if sampling is None:
    sampling = SamplingParams()
  if not isinstance(sampling, SamplingParams):
    raise InvalidRequestError(
        f"sampling must be a SamplingParams, got {type(sampling).__name__}")
  if overrides:
    fields = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
      raise InvalidRequestError(f"unknown sampling options {unknown}; "
                                f"known: {sorted(fields)}")
    sampling = dataclasses.replace(
        sampling, **{k: v for k, v in overrides.items() if v is not None})
  return sampling


class RequestValidator:
  """Everything a request must satisfy for one engine, checked at once.

  Args:
    tokenizer: a `models.tokenizer.LlamaTokenizer`, or None (ids only).
    vocab_size, max_position: the model's.
    cache_config: the paged pool's `CacheConfig`.
    mode: the engine's `modes.ReuseMode` (what the request will occupy).
    default_stop_ids: stop tokens when a request names none.
  """

  def __init__(self, tokenizer, vocab_size: int, max_position: int,
               cache_config, mode, default_stop_ids: tuple[int, ...]):
    self.tokenizer = tokenizer
    self.vocab_size = vocab_size
    self.max_position = max_position
    self.cache_config = cache_config
    self.mode = mode
    self.default_stop_ids = default_stop_ids
    # The requests `validate` returned and that are still alive: `check`
    # passes them as they are (it runs between the engine's steps).
    self._issued = weakref.WeakValueDictionary()

  def validate(self, query, documents=(), sampling=None,
               overrides: dict | None = None, *,
               fit_max_new_tokens: bool = False,
               leading_documents: int = 0) -> TokenRequest:
    """Returns the request in tokens; raises InvalidRequestError or
    CacheCapacityError and changes nothing.  With `fit_max_new_tokens`,
    `max_new_tokens` is an upper bound, lowered to what the prompt leaves
    of the model's positions and of the whole pool (as an OpenAI server's
    default `max_tokens` is).  The first `leading_documents` of
    `documents` are not the caller's (a server's conversation): they count
    in `TokenRequest.leading`."""
    sampling = merge_sampling(sampling, overrides or {})
    stop_ids = sampling.stop_token_ids
    if stop_ids is None:
      stop_ids = self.default_stop_ids
    bad = [t for t in stop_ids if not 0 <= t < self.vocab_size]
    if bad:
      raise InvalidRequestError(
          f"stop_token_ids outside [0, {self.vocab_size}): {bad[:5]}")
    query, docs, leading = encode_request(self.tokenizer, query, documents,
                                          self.vocab_size)
    given = len(docs) - leading  # the documents passed in
    if (isinstance(leading_documents, bool)
        or not isinstance(leading_documents, numbers.Integral)
        or not 0 <= leading_documents <= given):
      raise InvalidRequestError(
          f"leading_documents must count documents in [0, {given}], got "
          f"{leading_documents!r}")
    docs, leading = self._chat_prefix_as_preamble(
        docs, leading + int(leading_documents))
    request = TokenRequest(query, tuple(docs), sampling, tuple(stop_ids),
                           leading, self._preamble_is_chat_prefix)
    if fit_max_new_tokens:
      request = self._fit_max_new_tokens(request)
    self._check_positions(request)
    self._check_capacity(request)
    self._issued[id(request)] = request
    return request

  def validate_batch(self, requests) -> list[TokenRequest]:
    """`validate` for each of a sequence of `Request` items, all before
    any is queued; raises on the first bad one, naming its index ("item
    1: query is empty"), and changes nothing."""
    if isinstance(requests, (Request, str)) or not isinstance(
        requests, Iterable):
      raise InvalidRequestError(
          f"generate_batch takes a sequence of Request items, got "
          f"{type(requests).__name__}")
    validated = []
    for i, r in enumerate(requests):
      if not isinstance(r, Request):
        raise InvalidRequestError(
            f"generate_batch takes Request items; item {i} is "
            f"{type(r).__name__}")
      try:
        validated.append(self.validate(r.query, r.documents, r.sampling))
      except (InvalidRequestError, CacheCapacityError) as error:
        raise type(error)(f"item {i}: {error}") from None
    return validated

  def check(self, request) -> TokenRequest:
    """A TokenRequest made elsewhere (by hand, or by `validate` on another
    process or engine) checked against this engine as `validate` checks
    its own: token and stop ids in the vocabulary, positions, the cache;
    where this engine's preamble is the chat prefix, a first leading
    document that starts with it loses that copy, as in `validate`, unless
    the request was prepared for such a preamble
    (`chat_prefix_in_preamble`: the copy is already gone).  Such a request
    holds no chat prefix, so an engine without that preamble refuses it
    rather than serve it without one.  Returns it with its ids as tuples;
    raises InvalidRequestError or CacheCapacityError."""
    if self._issued.get(id(request)) is request:
      return request
    if not isinstance(request, TokenRequest):
      raise InvalidRequestError(
          f"expected the TokenRequest of prepare(), got "
          f"{type(request).__name__}")
    sampling = request.sampling
    if not isinstance(sampling, SamplingParams):
      raise InvalidRequestError(
          f"sampling must be a SamplingParams, got {type(sampling).__name__}")
    if not is_token_sequence(request.documents):
      raise InvalidRequestError(
          f"documents must be a sequence of token-id sequences, got "
          f"{type(request.documents).__name__}")
    docs = tuple(checked_token_ids(d, f"document {i}", self.vocab_size,
                                   text_ok=False)
                 for i, d in enumerate(request.documents))
    leading = request.leading
    if (isinstance(leading, bool) or not isinstance(leading, numbers.Integral)
        or not 0 <= leading <= len(docs)):
      raise InvalidRequestError(
          f"leading must count documents in [0, {len(docs)}], got "
          f"{leading!r}")
    # Prepared where the chat prefix was a leading document: here it may
    # be the preamble (else the prompt would hold it twice).  Once only.
    leading = int(leading)
    if not request.chat_prefix_in_preamble:
      docs, leading = self._chat_prefix_as_preamble(docs, leading)
    elif not self._preamble_is_chat_prefix:
      raise InvalidRequestError(
          "the request was prepared for an engine whose preamble is the "
          "chat prefix, so it holds no chat prefix, and this engine has no "
          "such preamble: prepare it on this engine")
    stop_ids = request.stop_ids
    stop_ids = (() if is_token_sequence(stop_ids) and len(stop_ids) == 0
                else checked_token_ids(stop_ids, "stop_ids", self.vocab_size,
                                       text_ok=False))
    request = TokenRequest(
        checked_token_ids(request.query, "query", self.vocab_size,
                          text_ok=False), tuple(docs), sampling, stop_ids,
        leading, self._preamble_is_chat_prefix)
    self._check_positions(request)
    self._check_capacity(request)
    return request

  @property
  def _preamble_is_chat_prefix(self) -> bool:
    preamble = self.mode.preamble
    return preamble is not None and preamble.from_chat

  def _chat_prefix_as_preamble(self, docs, leading: int):
    """(docs, leading) where this engine's preamble is the chat prefix: a
    first leading document that starts with it loses it, since the
    preamble holds it.  That is the prefix a text query brings as a
    document (dropped whole), or a server's conversation rendered from
    the template's start (`server.prompts.chat_query`: its rest stays)."""
    if not (leading and self._preamble_is_chat_prefix):
      return tuple(docs), leading
    first, prefix = tuple(docs[0]), self.mode.preamble.tokens
    if first[:len(prefix)] != prefix:
      return tuple(docs), leading
    if len(first) == len(prefix):
      return tuple(docs[1:]), leading - 1
    return (first[len(prefix):],) + tuple(docs[1:]), leading

  def _fit_max_new_tokens(self, request: TokenRequest) -> TokenRequest:
    """`request` with max_new_tokens at most what the prompt leaves: of
    the model's positions, and of the whole pool's pages.  In every mode
    the new tokens only add to the request's private tokens, so the count
    that fits the pool is solved from one `cache_needs`.  Where not even
    one token fits the pool it becomes 1, and the capacity check then
    refuses the prompt for the pages it needs with one new token."""
    cfg, sampling = self.cache_config, request.sampling
    most = min(sampling.max_new_tokens,
               self.max_position - self._prompt_positions(request))
    if most < 1:
      return request  # the position check refuses the prompt
    needs = self.mode.cache_needs(request)
    entry_pages = needs.pages(cfg.page_size) - ceil_div(needs.private_tokens,
                                                        cfg.page_size)
    prompt_private = needs.private_tokens - sampling.max_new_tokens
    room = (cfg.num_pages - entry_pages) * cfg.page_size - prompt_private
    most = min(most, max(room, 1))
    if most == sampling.max_new_tokens:
      return request
    return dataclasses.replace(request, sampling=dataclasses.replace(
        sampling, max_new_tokens=most))

  def _prompt_positions(self, request: TokenRequest) -> int:
    return (self.mode.preamble_tokens + sum(map(len, request.documents)) +
            len(request.query))

  def _check_positions(self, request: TokenRequest):
    prompt = self._prompt_positions(request)
    total = prompt + request.sampling.max_new_tokens
    if prompt >= self.max_position:  # no room for even one new token
      raise InvalidRequestError(
          f"prompt needs {prompt} positions (preamble + documents + query) "
          f"and {total} with max_new_tokens, but the model allows "
          f"{self.max_position}")
    if total > self.max_position:
      raise InvalidRequestError(
          f"request needs {total} positions (preamble + documents + query + "
          f"max_new_tokens) but the model allows {self.max_position}")

  def documents(self, documents) -> list[tuple[int, ...]]:
    """Documents alone, tokenized and checked as `validate` does them."""
    docs = encode_documents(self.tokenizer, documents, self.vocab_size)
    self._check_document_lengths(docs, leading=0)
    return docs

  def _check_document_lengths(self, documents, leading: int):
    cfg = self.cache_config
    for i, doc in enumerate(documents):
      if len(doc) > cfg.max_doc_tokens:
        name = (f"leading document {i} (the chat prefix or conversation)"
                if i < leading else f"document {i - leading}")
        raise CacheCapacityError(
            f"{name} has {len(doc)} tokens; the cache holds at most "
            f"{cfg.max_doc_tokens} per document (max_pages_per_doc * "
            f"page_size = {cfg.max_pages_per_doc} * {cfg.page_size})")

  def _check_capacity(self, request: TokenRequest):
    """What the request occupies in this mode against the whole cache."""
    cfg = self.cache_config
    if self.mode.has_document_step:  # documents are cached whole
      self._check_document_lengths(request.documents, request.leading)
    needs = self.mode.cache_needs(request)
    entries = needs.entries
    pages = needs.pages(cfg.page_size)
    if pages > cfg.num_pages:
      raise CacheCapacityError(
          f"request needs {pages} pages but the whole pool has "
          f"{cfg.num_pages}")
    if len(entries) > cfg.max_docs:
      raise CacheCapacityError(
          f"request has {self.mode.describe_entries(request, len(entries))}; "
          f"the cache holds at most {cfg.max_docs} entries "
          f"(CacheConfig.max_docs)")
