"""The baseline modes share the engine: block == lazy, prefix == full."""

from __future__ import annotations

import numpy as np
import pytest

from tests.engine_helpers import block_diagonal_mask
from tests.test_engine import greedy, make_engine, model_and_config, random_tokens  # noqa: F401


def _run(model_and_config, mode, requests, **kw):
  engine = make_engine(model_and_config, mode=mode, num_pages=160, **kw)
  results = [engine.generate(q, d, greedy(n)) for q, d, n in requests]
  return engine, results


@pytest.fixture(scope="module")
def workload(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(21)
  a, b, c = (random_tokens(rng, n, config.vocab_size) for n in (9, 14, 6))
  q1, q2, q3 = (random_tokens(rng, n, config.vocab_size) for n in (5, 7, 4))
  # Request 2 reuses a and b in a new order; request 3 repeats request 1's
  # prompt prefix exactly (a, b) with another query.
  return [(q1, [a, b], 6), (q2, [c, b, a], 6), (q3, [a, b], 6)]


def test_block_matches_lazy_and_copies_pages(model_and_config, workload):
  lazy_engine, lazy = _run(model_and_config, "lazy", workload)
  block_engine, block = _run(model_and_config, "block", workload)
  for x, y in zip(lazy, block):
    assert x.token_ids == y.token_ids
    np.testing.assert_allclose(x.first_logits, y.first_logits, rtol=2e-5,
                               atol=2e-5)
    assert x.doc_hits == y.doc_hits
  assert lazy_engine.stats.kv_pages_written_for_cached_docs == 0
  assert block_engine.stats.kv_pages_written_for_cached_docs > 0
  assert (block_engine.stats.prefill_tokens_computed ==
          lazy_engine.stats.prefill_tokens_computed)


def test_prefix_matches_full_and_reuses_exact_prefixes(model_and_config,
                                                       workload):
  full_engine, full = _run(model_and_config, "full", workload)
  prefix_engine, prefix = _run(model_and_config, "prefix", workload)
  for x, y in zip(full, prefix):
    assert x.token_ids == y.token_ids
    np.testing.assert_allclose(x.first_logits, y.first_logits, rtol=2e-5,
                               atol=2e-5)
  assert all(not any(r.doc_hits) for r in full)
  # Request 2 starts with another document: nothing is an exact prefix.
  assert prefix[1].doc_hits == [False, False, False]
  # Request 3 repeats request 1's prompt: document a (9 tokens) lies in
  # cached full pages; b ends in a partial page, which is never cached.
  assert prefix[2].doc_hits == [True, False]
  assert (prefix_engine.stats.prefill_tokens_computed <
          full_engine.stats.prefill_tokens_computed)


def test_full_mode_is_plain_causal_attention(model_and_config, workload):
  """full differs from lazy exactly by the block-diagonal document mask."""
  from models.dense_reference import dense_forward
  import jax.numpy as jnp
  model, _, _ = model_and_config
  q, docs, _ = workload[0]
  _, (result,) = _run(model_and_config, "full", [(q, docs, 1)])
  seq = [t for d in docs for t in d] + q
  n = len(seq)
  causal = np.tril(np.ones((n, n), bool))
  logits = dense_forward(model, jnp.asarray([seq], jnp.int32),
                         jnp.arange(n, dtype=jnp.int32)[None],
                         jnp.asarray(causal)[None])
  want = np.asarray(logits[0, -1])
  rel = np.linalg.norm(result.first_logits - want) / np.linalg.norm(want)
  assert rel < 1e-4
  block_mask = block_diagonal_mask([len(d) for d in docs], n)
  assert not np.array_equal(block_mask, causal)
