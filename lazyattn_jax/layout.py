"""A request's logical page layout, the tokens it prefills itself, and the
layout of encoding one cache entry.

A lazy request is laid out as [doc 0][doc 1]...[doc n-1][query][generated]:
document d (true length L_d) starts at logical position S_d = L_0 + ... + L_{d-1}
and its pages, stored from angle 0, carry shift S_d; the request's private
pages hold the query and generated tokens, stored at their logical positions
(shift 0).  Padding inside a document's last page is masked by page_len.
With a preamble of P tokens (QualityOptions), the request starts with the
preamble's pages, S_0 = P, and documents are stored from angle P, so their
pages carry shift S_d - P.
See docs/design.md, "Kernel contract", "Engine" and "Answer quality".
"""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.rope import MAX_ROPE_POSITION

# page_pos of logical pages past the end of a row: at or past any query
# position a model may have (below LlamaConfig.max_position, which is at
# most MAX_ROPE_POSITION // 2, the kernels' page_pos bound), so kernels skip
# them without reading; page_len is 0 as well.
UNUSED_PAGE_POS = MAX_ROPE_POSITION // 2 - 1


@dataclasses.dataclass
class PageRow:
  """Page metadata of one request row (lists of equal length)."""
  table: list[int] = dataclasses.field(default_factory=list)
  pos: list[int] = dataclasses.field(default_factory=list)
  shift: list[int] = dataclasses.field(default_factory=list)
  length: list[int] = dataclasses.field(default_factory=list)

  def add_run(self, pages, start_pos: int, shift: int, num_tokens: int,
              page_size: int):
    """Appends the pages of one contiguous run of `num_tokens` tokens that
    starts at logical position `start_pos`, stored shifted by `shift`."""
    starts = np.arange(len(pages)) * page_size
    self.table += [int(p) for p in pages]
    self.pos += (start_pos + starts).tolist()
    self.shift += [shift] * len(pages)
    self.length += np.clip(num_tokens - starts, 0, page_size).tolist()

  def __len__(self):
    return len(self.table)


@dataclasses.dataclass
class PrefillTokens:
  """Tokens a request prefills itself: each with its logical position and
  the page and slot its KV is written to."""
  tokens: list[int] = dataclasses.field(default_factory=list)
  q_pos: list[int] = dataclasses.field(default_factory=list)
  write_page: list[int] = dataclasses.field(default_factory=list)
  write_slot: list[int] = dataclasses.field(default_factory=list)

  def add(self, tokens, start_pos: int, pages, start_offset: int,
          page_size: int):
    """`tokens` at positions start_pos.., written into `pages` from token
    offset `start_offset` of those pages on."""
    offsets = start_offset + np.arange(len(tokens))
    self.tokens += [int(t) for t in tokens]
    self.q_pos += (offsets - start_offset + start_pos).tolist()
    self.write_page += np.asarray(pages, np.int64)[offsets // page_size].tolist()
    self.write_slot += (offsets % page_size).tolist()

  def __len__(self):
    return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class EncodeJob:
  """One cache entry to encode: `tokens` at positions `start`, ... into
  `pages`, attending to `context_pages` (the first `start` positions, read
  at shift 0) and causally to themselves.

  Attributes:
    slot: its document-table slot.
    tokens: its token ids (placeholders where `embeddings` is given).
    pages: its pages, in order.
    start: position of its first token (the preamble's length, or 0).
    context_pages: the preamble's pages, or () for an entry encoded alone.
    embeddings: float [len(tokens), D] input vectors instead of the token
      embeddings (a learned preamble), or None.
    is_preamble: it is the preamble itself (counted apart from documents).
  """
  slot: int
  tokens: tuple[int, ...]
  pages: list[int]
  start: int = 0
  context_pages: tuple[int, ...] = ()
  embeddings: object = None
  is_preamble: bool = False

  @property
  def phase(self) -> int:
    """Encode order: context-free entries (a preamble before the documents
    that read it) first; learned vectors in their own prefill calls."""
    if self.context_pages:
      return 2
    return 0 if self.embeddings is not None else 1

  def row_and_plan(self, page_size: int) -> tuple[PageRow, PrefillTokens]:
    row = PageRow()
    if self.context_pages:
      row.add_run(self.context_pages, 0, 0, self.start, page_size)
    row.add_run(self.pages, self.start, 0, len(self.tokens), page_size)
    plan = PrefillTokens()
    plan.add(self.tokens, self.start, self.pages, 0, page_size)
    return row, plan

  def chunk_rows_and_plans(self, page_size: int, chunk_tokens: int | None
                           ) -> list[tuple[PageRow, PrefillTokens]]:
    """`prefill_chunks` of this entry's row and plan."""
    return prefill_chunks(*self.row_and_plan(page_size), chunk_tokens)


def prefill_chunks(row: PageRow, plan: PrefillTokens,
                 chunk_tokens: int | None
                 ) -> list[tuple[PageRow, PrefillTokens]]:
  """(row, plan) of each chunk of at most `chunk_tokens` of `plan`'s
  tokens, to run in order in separate calls (one chunk, the inputs
  themselves, when None or not longer).  A chunk's row is `row` with every
  page the plan writes listed only through the slots written by then, so
  slots not yet written are never read; other pages are unchanged."""
  n = len(plan)
  if not chunk_tokens or n <= chunk_tokens:
    return [(row, plan)]
  written = set(plan.write_page)
  pieces = []
  for lo in range(0, n, chunk_tokens):
    hi = min(lo + chunk_tokens, n)
    filled: dict[int, int] = {}
    for page, slot in zip(plan.write_page[:hi], plan.write_slot[:hi]):
      filled[page] = max(filled.get(page, 0), slot + 1)
    lengths = [min(length, filled.get(page, 0)) if page in written
               else length for page, length in zip(row.table, row.length)]
    pieces.append((
        PageRow(list(row.table), list(row.pos), list(row.shift), lengths),
        PrefillTokens(plan.tokens[lo:hi], plan.q_pos[lo:hi],
                      plan.write_page[lo:hi], plan.write_slot[lo:hi])))
  return pieces


def pack_rows(rows, num_logical: int, batch: int):
  """Stacks PageRows into int32 [batch, num_logical] arrays (padding unused)."""
  table = np.zeros((batch, num_logical), np.int32)
  pos = np.full((batch, num_logical), UNUSED_PAGE_POS, np.int32)
  shift = np.zeros((batch, num_logical), np.int32)
  length = np.zeros((batch, num_logical), np.int32)
  for b, row in enumerate(rows):
    n = len(row)
    if n > num_logical:
      raise ValueError(f"row {b} has {n} logical pages > bucket {num_logical}")
    table[b, :n] = row.table
    pos[b, :n] = row.pos
    shift[b, :n] = row.shift
    length[b, :n] = row.length
  return table, pos, shift, length


def cached_prompt_tokens(row: PageRow, copies, doc_pages, doc_hit,
                         uncounted_entries=()) -> int:
  """Prompt tokens a request reads from cache entries it did not encode.

  Counted on the request's row as admitted (its prompt, before any
  generated token): a page's tokens are cached when the page, or the page
  it was copied from (`copies`, Block-Attention's re-rotated copies), is
  one of a cache entry that was a hit.  Recomputed first pages and the
  query live in private pages, so they never count; a missed entry's pages
  were written by this request's admission, at every place it is listed.

  Args:
    row: the request's PageRow; copies: (source, destination, shift).
    doc_pages: each cache entry's pages (Admission.doc_pages).
    doc_hit: whether each entry was cached before the admission
      (Admission.doc_hit: False at every place a missed key is listed).
    uncounted_entries: entries whose positions are not prompt tokens (a
      learned preamble's).
  """
  uncounted = set(uncounted_entries)
  hit_pages = {page for i, (pages, hit) in enumerate(zip(doc_pages, doc_hit))
               if hit and i not in uncounted for page in pages}
  source = {destination: origin for origin, destination, _ in copies}
  return sum(length for page, length in zip(row.table, row.length)
             if source.get(page, page) in hit_pages)
