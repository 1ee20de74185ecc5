"""`LazyEngine.encode_documents` batches by the pool's size: documents that
fit the pool one by one but not all at once are encoded (the later ones
evicting the earlier ones), never refused for the batch's own size."""

from __future__ import annotations

import numpy as np
import pytest

from lazyattn_jax.completion import batches_that_fit
from lazyattn_jax.errors import CacheCapacityError
from tests.test_engine import (PAGE, greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)


def _lengths(batches):
  return [[len(doc) for doc in batch] for batch in batches]


@pytest.mark.parametrize("case", [
    # (document lengths, batch_size, num_pages, max_docs, preamble, batches)
    ([8, 8, 8], 4, 8, 32, 0, [[8, 8], [8]]),      # 4 pages each, 8 pages
    ([8, 8, 8], 4, 12, 32, 0, [[8, 8, 8]]),
    ([8, 8, 8], 2, 99, 32, 0, [[8, 8], [8]]),     # batch_size
    ([1, 1, 1, 1], 8, 99, 3, 2, [[1, 1], [1, 1]]),  # slots beside the preamble
    ([8, 8], 4, 8, 32, 2, [[8], [8]]),            # the preamble's page counts
    ([30, 1], 4, 8, 32, 0, [[30], [1]]),          # a document of the whole pool
    ([], 4, 8, 32, 0, []),
])
def test_batches_that_fit(case):
  lengths, batch_size, num_pages, max_docs, preamble, want = case
  docs = [[1] * n for n in lengths]
  got = list(batches_that_fit(docs, batch_size, page_size=2,
                              num_pages=num_pages, max_docs=max_docs,
                              preamble_tokens=preamble))
  assert _lengths(got) == want
  assert [d for batch in got for d in batch] == docs


def test_documents_that_fit_only_one_at_a_time_are_encoded(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(7)
  # Three documents of 12 pages each in a pool of 30: any two fit, not three.
  docs = [random_tokens(rng, 12 * PAGE, config.vocab_size) for _ in range(3)]
  engine = make_engine(model_and_config, num_pages=30, max_batch=4)
  assert engine.encode_documents(docs) == [False, False, False]
  last = engine.generate([5, 6], [docs[2]], greedy(2))
  assert last.doc_hits == [True]


def test_a_refused_batch_names_the_documents_already_encoded(
    model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(8)
  engine = make_engine(model_and_config, num_pages=30, max_batch=4,
                       decode_steps=2)
  held = [random_tokens(rng, 10 * PAGE, config.vocab_size) for _ in range(2)]
  engine.submit([5, 6], held, greedy(9))
  engine.step()  # live: its 20 pages cannot be evicted
  small = random_tokens(rng, 2 * PAGE, config.vocab_size)
  big = random_tokens(rng, 12 * PAGE, config.vocab_size)
  with pytest.raises(CacheCapacityError,
                     match=r"documents 0-0 of the 2 given were encoded by "
                           r"earlier batches; from document 1 on, none was"):
    engine.encode_documents([small, big], batch_size=1)
  # The first batch's document is cached; a batch refused first says
  # nothing of earlier ones.
  assert engine.encode_documents([small]) == [True]
  with pytest.raises(CacheCapacityError) as refused:
    engine.encode_documents([big])
  assert "earlier batches" not in str(refused.value)


def test_encoding_documents_counts_toward_the_peak_pages(model_and_config):
  # Only step() noted the pages in use, so a pool filled by
  # encode_documents alone reported a peak of 0.
  _, config, _ = model_and_config
  rng = np.random.default_rng(9)
  engine = make_engine(model_and_config, num_pages=30)
  engine.encode_documents([random_tokens(rng, 12 * PAGE, config.vocab_size)])
  assert engine.stats.peak_pages_used == 12
