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

"lazy" and "block" take answer-quality options (QualityOptions: a shared
preamble documents are encoded after, first-page recompute); "prefix" and
"full" refuse them, as their documents already see their neighbours.
"""

from __future__ import annotations

import abc
import dataclasses

from lazyattn_jax.doc_key import document_key
from lazyattn_jax.errors import InvalidOptionError
from lazyattn_jax.layout import EncodeJob, PageRow, PrefillTokens
from lazyattn_jax.preamble import make_preamble
from lazyattn_jax.quality_options import QualityOptions
from lazyattn_jax.requests import TokenRequest
from pallas_kernels.sizes import ceil_div


@dataclasses.dataclass(frozen=True)
class CacheNeeds:
  """What the cache must hold for a request: entries to look up or insert
  (keys with their token lengths) and tokens of request-private pages."""
  keys: list[tuple[int, int]]
  lengths: list[int]
  private_tokens: int

  @property
  def entries(self) -> dict:
    """Length of each distinct entry (a repeated key is stored once)."""
    return dict(zip(self.keys, self.lengths))

  def pages(self, page_size: int) -> int:
    """Pool pages the request takes at most: every entry, then its own."""
    return (sum(ceil_div(n, page_size) for n in self.entries.values()) +
            ceil_div(self.private_tokens, page_size))


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
    takes_quality_options: `QualityOptions` apply (documents are encoded
      without their neighbours, so there is something to recover).
    preamble: the `preamble.Preamble` every request starts with, or None.
  """
  name = ""
  has_document_step = False
  keeps_query_order = False
  takes_quality_options = False
  preamble = None

  def __init__(self, page_size: int, model_id: str):
    self.page_size = page_size
    self.model_id = model_id

  @abc.abstractmethod
  def cache_needs(self, request: TokenRequest) -> CacheNeeds:
    """What admitting `request` asks of the cache.  Its max_new_tokens
    only add to `private_tokens`, one each (the validator's fit of a
    default max_new_tokens solves for it from one call)."""

  @abc.abstractmethod
  def layout(self, request: TokenRequest, admission) -> RequestLayout:
    """The admitted request's pages, positions and own prefill tokens."""

  @abc.abstractmethod
  def doc_hits(self, request: TokenRequest, admission) -> list[bool]:
    """Per document of the request: was its KV reused, not computed?"""

  def describe_entries(self, request: TokenRequest, count: int) -> str:
    """Words for `count` cache entries of `request`, for error messages."""
    return f"{count} cache entries"

  @property
  def preamble_tokens(self) -> int:
    """Positions the preamble takes at the start of every request."""
    return 0 if self.preamble is None else len(self.preamble)

  @property
  def learned_preamble_positions(self) -> int:
    """Positions of a learned preamble (input vectors, not tokens: not
    counted among a request's prompt tokens); 0 for a chat preamble."""
    learned = self.preamble is not None and self.preamble.embeddings is not None
    return len(self.preamble) if learned else 0

  def documents_to_encode(self, request: TokenRequest, admission
                          ) -> list[EncodeJob]:
    """The cache entries this request's admission inserted and that must be
    encoded before anything reads them (a preamble before the documents
    encoded after it)."""
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
  """Documents read in place at any position (this project's mode).

  With a preamble (QualityOptions.preamble), the preamble is the request's
  first cache entry: every document is encoded after it (positions P..)
  and read with shift S_d - P; the query reads the preamble once.  With
  first-page recompute, the first k tokens of each document after the
  request's first cache entry are prefilled by the request itself into
  private pages at their request positions (attending to everything before
  them: causal masking by position hides the document's own later pages),
  and the request reads those instead of the shared first pages.
  """
  name = "lazy"
  has_document_step = True
  takes_quality_options = True

  def __init__(self, page_size: int, model_id: str, preamble=None,
               recompute_tokens: int = 0):
    super().__init__(page_size, model_id)
    self.preamble = preamble
    self.recompute_tokens = recompute_tokens

  @property
  def _first_document(self) -> int:
    """Index of the first document among a request's cache entries."""
    return 0 if self.preamble is None else 1

  def document_keys(self, documents) -> list[tuple[int, int]]:
    context = None if self.preamble is None else self.preamble.key
    return [document_key(d, self.model_id, context) for d in documents]

  def entries(self, documents) -> tuple[list[tuple[int, int]], list[int]]:
    """(keys, lengths) of the cache entries `documents` need, the preamble
    (if any) first."""
    keys, lengths = self.document_keys(documents), [len(d) for d in documents]
    if self.preamble is not None:
      keys, lengths = [self.preamble.key] + keys, [len(self.preamble)] + lengths
    return keys, lengths

  def _head_lengths(self, documents) -> list[int]:
    """Tokens of each document recomputed per request (0: none)."""
    k = self.recompute_tokens
    return [min(k, len(doc)) if d and k else 0
            for d, doc in enumerate(documents)]

  def _own_pages(self, request) -> int:
    """Private pages besides the query's: the recomputed first pages."""
    return sum(ceil_div(h, self.page_size)
               for h in self._head_lengths(request.documents))

  def cache_needs(self, request):
    keys, lengths = self.entries(request.documents)
    return CacheNeeds(keys, lengths,
                      self._own_pages(request) * self.page_size +
                      len(request.query) + request.sampling.max_new_tokens)

  def describe_entries(self, request, count):
    user = len(set(request.documents[request.leading:]))
    extra = (f" plus {request.leading} leading (the chat prefix or a "
             f"conversation)" if request.leading else "")
    if self.preamble is not None:
      extra += " plus the shared preamble"
    return f"{user} distinct documents{extra} ({count} cache entries)"

  def encode_jobs(self, documents, admission) -> list[EncodeJob]:
    """The entries `admission` (of `entries(documents)`) found missing."""
    first, preamble = self._first_document, self.preamble
    jobs = []
    for i in admission.missing_docs:
      slot, pages = admission.doc_slots[i], admission.doc_pages[i]
      if i < first:
        jobs.append(EncodeJob(slot, preamble.tokens, pages,
                              embeddings=preamble.embeddings,
                              is_preamble=True))
      elif preamble is None:
        jobs.append(EncodeJob(slot, documents[i], pages))
      else:
        jobs.append(EncodeJob(slot, documents[i - first], pages,
                              start=len(preamble),
                              context_pages=tuple(admission.doc_pages[0])))
    return jobs

  def documents_to_encode(self, request, admission):
    return self.encode_jobs(request.documents, admission)

  def doc_hits(self, request, admission):
    return list(admission.doc_hit)[self._first_document:]

  def layout(self, request, admission):
    page_size, first = self.page_size, self._first_document
    row, plan, copies = PageRow(), PrefillTokens(), []
    private = list(admission.private_pages)
    start = self.preamble_tokens  # where documents are stored from
    if self.preamble is not None:
      row.add_run(admission.doc_pages[0], 0, 0, start, page_size)
    position = start
    for doc, pages, head in zip(request.documents, admission.doc_pages[first:],
                                self._head_lengths(request.documents)):
      if head:  # recomputed into private pages at its request positions
        count = ceil_div(head, page_size)
        own, private = private[:count], private[count:]
        row.add_run(own, position, 0, head, page_size)
        plan.add(doc[:head], position, own, 0, page_size)
      if len(doc) > head:  # head is 0 or a whole number of pages here
        private = self._read_shared(row, pages[head // page_size:],
                                    position + head, position - start,
                                    len(doc) - head, private, copies)
      position += len(doc)
    own = dataclasses.replace(admission, private_pages=private)
    layout = self._private_run(request, own, row, position, [], plan)
    layout.copies = copies
    return layout

  def _read_shared(self, row: PageRow, pages, position: int, shift: int,
                   num_tokens: int, private: list[int], copies: list
                   ) -> list[int]:
    """Adds a run of a document's shared pages to `row`, read in place with
    `shift`; returns the private pages still unused."""
    row.add_run(pages, position, shift, num_tokens, self.page_size)
    return private


class BlockMode(LazyMode):
  """Block-Attention: a re-rotated private copy of each document per use.

  The preamble is read in place (its shift is 0: a copy would equal it);
  recomputed first pages replace their copies, so only the rest is copied.
  """
  name = "block"

  def cache_needs(self, request):
    needs = super().cache_needs(request)
    copy_pages = sum(
        ceil_div(len(d), self.page_size) - ceil_div(h, self.page_size)
        for d, h in zip(request.documents,
                        self._head_lengths(request.documents)))
    return dataclasses.replace(
        needs, private_tokens=needs.private_tokens + copy_pages * self.page_size)

  def _read_shared(self, row, pages, position, shift, num_tokens, private,
                   copies):
    copy, private = private[:len(pages)], private[len(pages):]
    copies += [(src, dst, shift) for src, dst in zip(pages, copy)]
    row.add_run(copy, position, 0, num_tokens, self.page_size)
    return private


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


def make_mode(name: str, page_size: int, model_id: str,
              quality: QualityOptions | None = None, *, tokenizer=None,
              hidden_size: int | None = None,
              max_doc_tokens: int | None = None) -> ReuseMode:
  """The reuse mode called `name` (one of MODES), with answer-quality
  options where they apply.

  Raises:
    ValueError: an unknown mode.
    InvalidOptionError: options in a mode they do not apply to ("prefix"
      and "full" prefill plain causal prompts: documents already see their
      neighbours), or options this model, tokenizer or page size cannot
      take.
  """
  check_quality(name, page_size, quality)
  mode = MODES[name]
  if quality is None or not quality.enabled:
    return mode(page_size, model_id)
  preamble = make_preamble(quality, model_id=model_id, tokenizer=tokenizer,
                           hidden_size=hidden_size,
                           max_doc_tokens=max_doc_tokens)
  return mode(page_size, model_id, preamble,
              quality.tokens_to_recompute(page_size))


def check_quality(name: str, page_size: int,
                  quality: QualityOptions | None):
  """What can be checked of a mode and its options before a model loads."""
  if name not in MODES:
    raise ValueError(f"mode must be one of {tuple(MODES)}, got {name!r}")
  if quality is None or not quality.enabled:
    return
  if not MODES[name].takes_quality_options:
    applies = tuple(n for n, m in MODES.items() if m.takes_quality_options)
    raise InvalidOptionError(
        f"QualityOptions apply to modes {applies}, not {name!r}: it "
        f"prefills plain causal prompts, where documents see their "
        f"neighbours already")
  quality.tokens_to_recompute(page_size)
