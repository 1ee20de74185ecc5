"""Softmax over visible entries only, shared by the jnp attention paths."""

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
