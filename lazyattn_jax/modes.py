"""KV reuse modes: what a request occupies in the cache, and how it reads it.

All four share the scheduler, the model and the kernels, so a benchmark
isolates the reuse mechanism:
  "lazy"   - documents cached once from position 0 and read in place at any
             position; the kernels apply the position shift (zero copy);
  "block"  - Block-Attention: documents cached once from position 0; at use
             each is re-rotated into a fresh copy at its position (freed when
             the request ends), then attended with shift 0;
  "prefix" - position-aware prefix caching: full pages of the prompt are
             keyed by their whole token prefix and reused only as an exact
             prefix (documents attend causally to earlier ones, as in a
             plain prompt);
  "full"   - no reuse: the whole prompt is prefilled causally.

A mode is one class: its cache needs, its page layout, its document step and
its hit accounting.  Nothing outside this module tests a mode's name.
"""

from __future__ import annotations

import abc
import dataclasses

from lazyattn_jax.doc_key import document_key
from lazyattn_jax.layout import PageRow, PrefillTokens
from lazyattn_jax.requests import TokenRequest
from pallas_kernels.sizes import ceil_div


@dataclasses.dataclass(frozen=True)
class CacheNeeds:
  """What the cache must hold for a request: entries to look up or insert
  (keys with their token lengths) and tokens of request-private pages."""
  keys: list[tuple[int, int]]
  lengths: list[int]
  private_tokens: int


@dataclasses.dataclass
class RequestLayout:
  """How an admitted request reads and writes the pool.

  Attributes:
    row: the logical pages its query and decode steps attend to.
    query_start: logical position of the first query token.
    private_start: logical index of the first page holding the query.
    query_pages: pages holding the query and generated tokens.
    query_page_offset: tokens in `query_pages` before the query.
    prefill: the tokens it prefills itself, with positions and KV slots.
    copies: (source page, destination page, shift) to write before its
      query runs (Block-Attention's re-rotated document copies).
  """
  row: PageRow
  query_start: int
  private_start: int
  query_pages: list[int]
  query_page_offset: int
  prefill: PrefillTokens
  copies: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)


class ReuseMode(abc.ABC):
  """Base of the reuse modes.

  Attributes:
    name: the mode's name, as `LazyEngine(mode=...)` takes it.
    has_document_step: documents are cached as units, each encoded alone
      from position 0 (`documents_to_encode`), before the queries run.
    keeps_query_order: queries of a round must prefill in admission order
      (a request may read pages an earlier one of the round writes).
  """
  name = ""
  has_document_step = False
  keeps_query_order = False

  def __init__(self, page_size: int, model_id: str):
    self.page_size = page_size
    self.model_id = model_id

  @abc.abstractmethod
  def cache_needs(self, request: TokenRequest) -> CacheNeeds:
    """What admitting `request` asks of the cache."""

  @abc.abstractmethod
  def layout(self, request: TokenRequest, admission) -> RequestLayout:
    """The admitted request's pages, positions and own prefill tokens."""

  @abc.abstractmethod
  def doc_hits(self, request: TokenRequest, admission) -> list[bool]:
    """Per document of the request: was its KV reused, not computed?"""

  def describe_entries(self, request: TokenRequest, count: int) -> str:
    """Words for `count` cache entries of `request`, for error messages."""
    return f"{count} cache entries"

  def documents_to_encode(self, request: TokenRequest, admission
                          ) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """(slot, tokens, pages) of each document this request's admission
    inserted and that must be encoded before anything reads it."""
    return []

  def _private_run(self, request: TokenRequest, admission, row: PageRow,
                   start_pos: int, before: list[int],
                   plan: PrefillTokens | None = None) -> RequestLayout:
    """Adds the private pages (tokens `before`, then the query) to `row`
    and their tokens to `plan`."""
    page_size = self.page_size
    pages = list(admission.private_pages)
    private_start = len(row)
    row.add_run(pages, start_pos, 0, len(before) + len(request.query),
                page_size)
    plan = PrefillTokens() if plan is None else plan
    plan.add(before, start_pos, pages, 0, page_size)
    query_start = start_pos + len(before)
    plan.add(request.query, query_start, pages, len(before), page_size)
    return RequestLayout(row, query_start, private_start, pages, len(before),
                         plan)


class LazyMode(ReuseMode):
  """Documents read in place at any position (this project's mode)."""
  name = "lazy"
  has_document_step = True

  def document_keys(self, documents) -> list[tuple[int, int]]:
    return [document_key(d, self.model_id) for d in documents]

  def cache_needs(self, request):
    docs = request.documents
    return CacheNeeds(self.document_keys(docs), [len(d) for d in docs],
                      len(request.query) + request.sampling.max_new_tokens)

  def describe_entries(self, request, count):
    user = len(set(request.documents[request.leading:]))
    extra = " plus the shared chat prefix" if request.leading else ""
    return f"{user} distinct documents{extra} ({count} cache entries)"

  def documents_to_encode(self, request, admission):
    return [(admission.doc_slots[i], request.documents[i],
             admission.doc_pages[i]) for i in admission.missing_docs]

  def doc_hits(self, request, admission):
    return list(admission.doc_hit)

  def _document_runs(self, request, admission):
    """(pages, start position, tokens) of each document, in prompt order."""
    position = 0
    for pages, doc in zip(admission.doc_pages, request.documents):
      yield pages, position, len(doc)
      position += len(doc)

  def layout(self, request, admission):
    row = PageRow()
    end = 0
    for pages, start, length in self._document_runs(request, admission):
      row.add_run(pages, start, start, length, self.page_size)
      end = start + length
    return self._private_run(request, admission, row, end, [])


class BlockMode(LazyMode):
  """Block-Attention: a re-rotated private copy of each document per use."""
  name = "block"

  def cache_needs(self, request):
    needs = super().cache_needs(request)
    copy_pages = sum(ceil_div(len(d), self.page_size)
                     for d in request.documents)
    return dataclasses.replace(
        needs, private_tokens=needs.private_tokens + copy_pages * self.page_size)

  def layout(self, request, admission):
    row = PageRow()
    private = list(admission.private_pages)
    copies, used, end = [], 0, 0
    for pages, start, length in self._document_runs(request, admission):
      copy = private[used:used + len(pages)]
      used += len(pages)
      copies += [(src, dst, start) for src, dst in zip(pages, copy)]
      row.add_run(copy, start, 0, length, self.page_size)
      end = start + length
    own = dataclasses.replace(admission, private_pages=private[used:])
    layout = self._private_run(request, own, row, end, [])
    layout.copies = copies
    return layout


class PrefixMode(ReuseMode):
  """Exact-prefix caching of full prompt pages."""
  name = "prefix"
  keeps_query_order = True

  def _prompt(self, request):
    return [t for d in request.documents for t in d]

  def cache_needs(self, request):
    # One entry per full page, keyed by the whole prefix up to it.
    prompt = self._prompt(request)
    page_size = self.page_size
    full_pages = len(prompt) // page_size
    keys = [document_key(prompt[:(j + 1) * page_size], self.model_id + ":prefix")
            for j in range(full_pages)]
    private = (len(prompt) - full_pages * page_size + len(request.query) +
               request.sampling.max_new_tokens)
    return CacheNeeds(keys, [page_size] * full_pages, private)

  def describe_entries(self, request, count):
    return f"a prompt of {count} full pages (one cache entry each)"

  def layout(self, request, admission):
    prompt = self._prompt(request)
    page_size = self.page_size
    row = PageRow()
    plan = PrefillTokens()  # missed pages first, then the private tokens
    for j, (pages, hit) in enumerate(zip(admission.doc_pages,
                                         admission.doc_hit)):
      row.add_run(pages, j * page_size, 0, page_size, page_size)
      if not hit:
        plan.add(prompt[j * page_size:(j + 1) * page_size], j * page_size,
                 pages, 0, page_size)
    cached = len(admission.doc_pages) * page_size
    return self._private_run(request, admission, row, cached, prompt[cached:],
                             plan)

  def doc_hits(self, request, admission):
    # A document is a hit when every page it touches was a cached page.
    hits, start, page_size = [], 0, self.page_size
    page_hits = list(admission.doc_hit)
    for doc in request.documents:
      end = start + len(doc)
      pages = range(start // page_size, ceil_div(end, page_size))
      hits.append(end <= len(page_hits) * page_size and
                  all(page_hits[j] for j in pages))
      start = end
    return hits


class FullMode(ReuseMode):
  """No reuse: the whole prompt is the request's own."""
  name = "full"

  def cache_needs(self, request):
    prompt_tokens = sum(map(len, request.documents))
    return CacheNeeds([], [], prompt_tokens + len(request.query) +
                      request.sampling.max_new_tokens)

  def layout(self, request, admission):
    prompt = [t for d in request.documents for t in d]
    return self._private_run(request, admission, PageRow(), 0, prompt)

  def doc_hits(self, request, admission):
    return [False] * len(request.documents)


MODES = {mode.name: mode for mode in (LazyMode, BlockMode, PrefixMode, FullMode)}


def make_mode(name: str, page_size: int, model_id: str) -> ReuseMode:
  """The reuse mode called `name` (one of MODES)."""
  if name not in MODES:
    raise ValueError(f"mode must be one of {tuple(MODES)}, got {name!r}")
  return MODES[name](page_size, model_id)
