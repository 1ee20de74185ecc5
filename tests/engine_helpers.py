"""Shared pieces of the engine tests: a tiny model and the dense reference."""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp


def block_diagonal_mask(doc_lengths, total_len):
  """Causal mask where document tokens see only their own document."""
  n = total_len
  doc_id = np.full((n,), -1)
  start = 0
  for d, length in enumerate(doc_lengths):
    doc_id[start:start + length] = d
    start += length
  i = np.arange(n)[:, None]
  j = np.arange(n)[None, :]
  causal = j <= i
  in_docs = doc_id[:, None] >= 0
  same_doc = doc_id[:, None] == doc_id[None, :]
  return causal & (~in_docs | same_doc)


def dense_lazy_logits(model, documents, tokens_after, pad_to=None, *,
                      preamble=(), recompute_tokens=0,
                      preamble_embeddings=None):
  """Dense forward over [preamble][docs][tokens_after] as the engine lays a
  lazy request out (models/dense_layout.py): contiguous positions, each
  document seeing only the preamble and itself, optional first-page
  recompute.  Returns float32[T, V] logits of the tokens after the
  documents, then of nothing else.  Padding to `pad_to` keeps one compiled
  shape across calls.  `preamble_embeddings` [P, D] replaces the preamble's
  token embeddings (a learned preamble; `preamble` then gives P)."""
  from models.dense_layout import (DOCUMENT, PREAMBLE, QUERY, dense_inputs,
                                   gather_sources, preamble_rows,
                                   request_segments)
  from models.dense_reference import dense_forward
  if preamble_embeddings is not None and not len(preamble):
    preamble = [0] * len(preamble_embeddings)
  segments = request_segments(len(preamble), [len(d) for d in documents],
                              len(tokens_after),
                              recompute_tokens=recompute_tokens)
  seq = gather_sources(segments, {PREAMBLE: [list(preamble)],
                                  DOCUMENT: [list(d) for d in documents],
                                  QUERY: [list(tokens_after)]})
  total = max(len(seq), pad_to or 0)
  positions, mask, starts = dense_inputs(segments, total)
  tokens = jnp.asarray([seq + [0] * (total - len(seq))], jnp.int32)
  embeddings = None
  if preamble_embeddings is not None:
    rows, index = preamble_rows(segments)
    embeddings = model.embed(tokens).at[0, rows].set(
        jnp.asarray(preamble_embeddings, model.dtype)[index])
  logits = dense_forward(model, tokens, jnp.asarray(positions)[None],
                         jnp.asarray(mask)[None], embeddings=embeddings)
  # Every token the request reads, in prompt order, then the query.
  query = len(segments) - 1
  rows = [r for i in segments[query].sees + (query,)
          for r in range(starts[i], starts[i] + segments[i].length)]
  return np.asarray(logits[0, np.asarray(rows, np.int32)], np.float32)


def dense_greedy(model, documents, query, steps, *, pad_to=None, **layout):
  """Greedy tokens and first logits from the dense reference (`layout`:
  dense_lazy_logits's preamble options).  Every step pads to the whole
  layout's length, or to `pad_to` if longer (one compiled shape for many
  calls)."""
  generated = []
  first_logits = None
  from models.dense_layout import request_segments
  preamble = layout.get("preamble") or ()
  if layout.get("preamble_embeddings") is not None:
    preamble = layout["preamble_embeddings"]
  pad_to = max(pad_to or 0, sum(s.length for s in request_segments(
      len(preamble), [len(d) for d in documents], len(query) + steps,
      recompute_tokens=layout.get("recompute_tokens", 0))))
  for _ in range(steps):
    logits = dense_lazy_logits(model, documents, list(query) + generated,
                               pad_to=pad_to, **layout)
    if first_logits is None:
      first_logits = logits[-1]
    generated.append(int(np.argmax(logits[-1])))
  return generated, first_logits
