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


def dense_lazy_logits(model, documents, tokens_after, pad_to=None):
  """Dense forward over [docs][tokens_after] with contiguous positions and a
  block-diagonal document mask; returns float32[T, V] logits of the real
  tokens.  Padding to `pad_to` (after the real tokens, so the causal mask
  hides it) keeps one compiled shape across calls."""
  from models.dense_reference import dense_forward
  seq = [t for d in documents for t in d] + list(tokens_after)
  n = len(seq)
  total = max(n, pad_to or 0)
  mask = block_diagonal_mask([len(d) for d in documents], total)
  padded = seq + [0] * (total - n)
  logits = dense_forward(model, jnp.asarray([padded], jnp.int32),
                         jnp.arange(total, dtype=jnp.int32)[None],
                         jnp.asarray(mask)[None])
  return np.asarray(logits[0, :n], np.float32)


def dense_greedy(model, documents, query, steps):
  """Greedy tokens and first logits from the dense reference."""
  generated = []
  first_logits = None
  pad_to = sum(map(len, documents)) + len(query) + steps
  for _ in range(steps):
    logits = dense_lazy_logits(model, documents, list(query) + generated,
                               pad_to=pad_to)
    if first_logits is None:
      first_logits = logits[-1]
    generated.append(int(np.argmax(logits[-1])))
  return generated, first_logits
