"""`GenerationResult.cached_prompt_tokens` and the server's usage
`cached_tokens`: prompt tokens read from cache entries the request did not
encode, in every mode.  It was prompt_tokens - prefill_tokens_computed,
which counted a missed later document's recomputed first page twice."""

from __future__ import annotations

import numpy as np
import pytest

from lazyattn_jax.quality_options import QualityOptions
from lazyattn_jax.server.responses import usage
from tests.test_engine import (PAGE, greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)


@pytest.fixture(scope="module")
def parts(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(11)
  a, b, c = (random_tokens(rng, n, config.vocab_size) for n in (12, 8, 8))
  return a, b, c, random_tokens(rng, 5, config.vocab_size)


@pytest.mark.parametrize("mode", ["lazy", "block"])
def test_recompute_counts_only_what_came_from_the_cache(model_and_config,
                                                        parts, mode):
  a, b, c, query = parts
  engine = make_engine(model_and_config, mode=mode,
                       quality=QualityOptions(recompute=True))
  # (documents, what was read from the cache): a later document's first
  # page is recomputed by the request, hit or missed.
  cases = [([a, b], 0),
           ([a, c], len(a)),  # c missed: its head recomputed and encoded
           ([c, a], len(c) + len(a) - PAGE)]
  for documents, cached in cases:
    result = engine.generate(query, documents, greedy(2))
    assert result.cached_prompt_tokens == cached, (documents, result)
    body = usage(result)
    assert body["cached_tokens"] == cached
    assert body["prompt_tokens_details"]["cached_tokens"] == cached


@pytest.mark.parametrize("mode", ["lazy", "block"])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_missed_document_listed_twice_is_not_cached(model_and_config,
                                                      parts, mode, recompute):
  a, b, _, query = parts
  engine = make_engine(model_and_config, mode=mode,
                       quality=QualityOptions(recompute=recompute))
  # The second place reads the pages the admission wrote for the first.
  result = engine.generate(query, [a, a], greedy(1))
  assert result.doc_hits == [False, False]
  assert result.cached_prompt_tokens == 0
  again = engine.generate(query, [b, a, a], greedy(1))
  head = PAGE if recompute else 0
  assert again.cached_prompt_tokens == 2 * (len(a) - head)


def test_a_learned_preamble_is_no_cached_prompt_token(model_and_config,
                                                      parts):
  a, b, _, query = parts
  sink = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
  engine = make_engine(model_and_config,
                       quality=QualityOptions(preamble="sink", sink=sink))
  engine.generate(query, [a], greedy(1))
  result = engine.generate(query, [a, b], greedy(1))
  assert result.cached_prompt_tokens == len(a)


def test_prefix_and_full_modes(model_and_config, parts):
  a, b, c, query = parts
  prefix = make_engine(model_and_config, mode="prefix")
  prefix.generate(query, [a, b], greedy(1))
  # a (three whole pages) is the cached prefix; c after it is new.
  assert prefix.generate(query, [a, c], greedy(1)).cached_prompt_tokens == (
      len(a))
  full = make_engine(model_and_config, mode="full")
  full.generate(query, [a, b], greedy(1))
  assert full.generate(query, [a, b], greedy(1)).cached_prompt_tokens == 0
