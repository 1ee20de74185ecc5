"""The engine's attention layout as one dense masked sequence.

The engine computes a request in pieces: each document encoded once (alone,
or after a shared preamble), later read in place at its request position,
some pages recomputed per request.  Because RoPE is relative, every piece is
equal to a run of tokens at its request positions that sees a chosen set of
earlier runs.  This module writes that down as segments, and turns segments
into the positions and mask of one dense forward pass
(`models.dense_reference.dense_forward`).  Parity tests compare the engine
with it, and training uses it to see exactly what the engine computes.

A token of segment i sees every token of the segments in `sees` and the
tokens of segment i up to itself (causal).  A segment may repeat tokens of
another (a document's preamble, or a recomputed first page) at other
positions or with other context: the copy is computed separately and only
the segments that name it see it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PREAMBLE, DOCUMENT, QUERY = "preamble", "document", "query"


@dataclasses.dataclass(frozen=True)
class Segment:
  """A run of tokens of the dense sequence.

  Attributes:
    source: where its tokens come from: (PREAMBLE, 0), (DOCUMENT, d) or
      (QUERY, 0).
    offset: index of its first token in the source.
    length: number of tokens.
    start: RoPE position of its first token.
    sees: indices of earlier segments each of its tokens sees whole.
  """
  source: tuple[str, int]
  offset: int
  length: int
  start: int
  sees: tuple[int, ...] = ()


def request_segments(preamble_len: int, doc_lens, query_len: int, *,
                     recompute_tokens: int = 0) -> list[Segment]:
  """Segments of one request as the engine lays it out.

  The request reads [preamble][doc 0]...[doc n-1][query] at contiguous
  positions.  Each document is encoded attending only to the preamble (if
  any) placed right before it, then to itself.  With `recompute_tokens` k,
  each document after the first also has its first min(k, L) tokens
  recomputed attending to everything before them in the request; the request
  then reads those instead of the encoded ones.  The query (and what is
  generated after it) sees every segment the request reads; it is the last
  segment, present even when `query_len` is 0.

  Args:
    preamble_len: tokens of the shared preamble (0: none).
    doc_lens: token count of each document, in prompt order.
    query_len: tokens of the query (and any continuation scored with it).
    recompute_tokens: k (0: none).
  """
  if preamble_len < 0 or query_len < 0 or recompute_tokens < 0:
    raise ValueError("lengths must be non-negative, got preamble "
                     f"{preamble_len}, query {query_len}, recompute "
                     f"{recompute_tokens}")
  segments: list[Segment] = []

  def add(source, offset, length, start, sees=()):
    segments.append(Segment(source, offset, length, start, tuple(sees)))
    return len(segments) - 1

  read: list[int] = []  # what later parts of the request see
  if preamble_len:
    read.append(add((PREAMBLE, 0), 0, preamble_len, 0))
  position = preamble_len
  for d, length in enumerate(doc_lens):
    if length <= 0:
      raise ValueError(f"document {d} has length {length}; must be positive")
    context = []
    if preamble_len:
      # Document 0's preamble copy would sit where the preamble itself is.
      context = [read[0]] if position == preamble_len else [
          add((PREAMBLE, 0), 0, preamble_len, position - preamble_len)]
    head = min(recompute_tokens, length) if d > 0 else 0
    if head:
      encoded_head = add((DOCUMENT, d), 0, head, position, context)
      recomputed = add((DOCUMENT, d), 0, head, position, read)
      read.append(recomputed)
      if length > head:
        read.append(add((DOCUMENT, d), head, length - head, position + head,
                        context + [encoded_head]))
    else:
      read.append(add((DOCUMENT, d), 0, length, position, context))
    position += length
  add((QUERY, 0), 0, query_len, position, read)  # last, even when empty
  return segments


def dense_inputs(segments: list[Segment], pad_to: int | None = None):
  """Positions and mask of the dense sequence that concatenates `segments`.

  Args:
    segments: from `request_segments` (or written by hand).
    pad_to: total length to pad to (padding sees nothing, position 0).

  Returns:
    (positions int32[T], mask bool[T, T], starts): `starts[i]` is the index
    of segment i's first token in the sequence.
  """
  starts = np.cumsum([0] + [s.length for s in segments])
  total = int(starts[-1])
  length = total if pad_to is None else pad_to
  if length < total:
    raise ValueError(f"pad_to={pad_to} is shorter than the {total} tokens")
  positions = np.zeros(length, np.int32)
  mask = np.zeros((length, length), bool)
  for i, seg in enumerate(segments):
    lo, hi = int(starts[i]), int(starts[i + 1])
    positions[lo:hi] = seg.start + np.arange(seg.length)
    mask[lo:hi, lo:hi] = np.tril(np.ones((seg.length, seg.length), bool))
    for j in seg.sees:
      if not 0 <= j < i:
        raise ValueError(f"segment {i} sees {j}; only earlier segments")
      mask[lo:hi, starts[j]:starts[j + 1]] = True
  return positions, mask, [int(s) for s in starts[:-1]]


def gather_sources(segments: list[Segment], sources: dict[str, list]):
  """Concatenates each segment's tokens (or any per-token values).

  Args:
    segments: the segments.
    sources: PREAMBLE -> [preamble], DOCUMENT -> list of documents,
      QUERY -> [query]; each item a sequence indexable by token.

  Returns:
    a list with one entry per token of the dense sequence.
  """
  out = []
  for seg in segments:
    kind, index = seg.source
    item = sources[kind][index]
    out.extend(item[seg.offset:seg.offset + seg.length])
  return out


def preamble_rows(segments: list[Segment]) -> tuple[np.ndarray, np.ndarray]:
  """(rows, index): the dense rows that hold preamble tokens and which
  preamble token each is, to write a learned preamble's vectors in."""
  rows, index, start = [], [], 0
  for seg in segments:
    if seg.source[0] == PREAMBLE:
      rows += range(start, start + seg.length)
      index += range(seg.offset, seg.offset + seg.length)
    start += seg.length
  return np.asarray(rows, np.int32), np.asarray(index, np.int32)
