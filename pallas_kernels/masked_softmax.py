"""Softmax pieces computed in XLA, shared by the attention paths: a softmax
over visible entries only, and the merge of partial softmax states that the
decode kernels' KV splits return."""

from __future__ import annotations

import jax.numpy as jnp


def masked_softmax(scores, visible):
  """Softmax of `scores` over the last axis, keeping only `visible` entries.

  Hidden entries may hold anything (even NaN): they are replaced, never
  multiplied.  A row with nothing visible gets all-zero weights, not NaN.
  """
  scores = jnp.where(visible, scores, -jnp.inf)
  row_max = jnp.max(scores, axis=-1, keepdims=True)
  row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
  weights = jnp.where(visible, jnp.exp(scores - row_max), 0.0)
  denom = jnp.sum(weights, axis=-1, keepdims=True)
  return weights / jnp.where(denom > 0, denom, 1.0)


def merge_splits(acc, m, l, *, axis: int, exp=jnp.exp):
  """Normalised output from per-split partial softmax states.

  Each split of a row's KV returns acc (unnormalised sum of p * v), its
  running max m and sum l.  acc: f32 [..., S, ..., H] with the splits on
  `axis`; m, l: acc's shape without H.  `exp` is the kernel's exponential
  (jnp.exp2 where scores are in base 2).  A split that saw no key has l = 0
  and m either -inf or a finite start value: either way its weight is 0, and
  a row that no split saw comes out as zeros, never NaN.
  """
  m_total = jnp.max(m, axis=axis, keepdims=True)
  m_total = jnp.where(m_total == -jnp.inf, 0.0, m_total)
  weight = exp(m - m_total)
  l_total = jnp.sum(weight * l, axis=axis)[..., None]
  acc_total = jnp.sum(weight[..., None] * acc, axis=axis)
  return jnp.where(l_total > 0,
                   acc_total / jnp.where(l_total > 0, l_total, 1.0), 0.0)
