"""Logical page layout of a request, as page metadata rows (DESIGN.md section 1).

A lazy request is laid out as [doc 0][doc 1]...[doc n-1][query][generated]:
document d (true length L_d) starts at logical position S_d = L_0 + ... + L_{d-1}
and its pages, stored from angle 0, carry shift S_d; the request's private
pages hold the query and generated tokens, stored at their logical positions
(shift 0).  Padding inside a document's last page is masked by page_len.
"""

from __future__ import annotations

import dataclasses

import numpy as np

# page_pos of logical pages past the end of a row: far beyond any query
# position, so kernels skip them without reading; page_len is 0 as well.
UNUSED_PAGE_POS = 1 << 21


@dataclasses.dataclass
class PageRow:
  """Page metadata of one request row (lists of equal length)."""
  table: list[int] = dataclasses.field(default_factory=list)
  pos: list[int] = dataclasses.field(default_factory=list)
  shift: list[int] = dataclasses.field(default_factory=list)
  length: list[int] = dataclasses.field(default_factory=list)

  def add_run(self, pages, start_pos: int, shift: int, num_tokens: int,
              page_size: int):
    """Appends the pages of one contiguous run of `num_tokens` tokens."""
    for j, page in enumerate(pages):
      self.table.append(int(page))
      self.pos.append(start_pos + j * page_size)
      self.shift.append(shift)
      self.length.append(int(np.clip(num_tokens - j * page_size, 0, page_size)))

  def __len__(self):
    return len(self.table)


def lazy_request_row(doc_pages, doc_lengths, private_pages, private_written,
                     page_size: int) -> tuple[PageRow, int, int]:
  """Page row of a lazy request.

  Returns (row, query_start, private_start_index): the logical position of the
  first query token and the logical page index of the first private page.
  """
  row = PageRow()
  position = 0
  for pages, length in zip(doc_pages, doc_lengths):
    row.add_run(pages, position, position, length, page_size)
    position += length
  private_start = len(row)
  row.add_run(private_pages, position, 0, private_written, page_size)
  return row, position, private_start


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
