"""The dense form of the engine's layout (models/dense_layout.py)."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import LlamaConfig
from models.dense_layout import (DOCUMENT, PREAMBLE, QUERY, Segment,
                                 dense_inputs, gather_sources, preamble_rows,
                                 request_segments)
from models.dense_reference import causal_mask, dense_forward
from models.llama import Llama
from tests.engine_helpers import block_diagonal_mask, dense_lazy_logits


@pytest.fixture(scope="module")
def model():
  return Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(3))


def _tokens(rng, n):
  return [int(t) for t in rng.integers(1, 250, n)]


def test_plain_layout_is_block_diagonal_with_contiguous_positions():
  segments = request_segments(0, [3, 5, 2], 4)
  positions, mask, starts = dense_inputs(segments)
  assert positions.tolist() == list(range(14))
  assert starts == [0, 3, 8, 10]
  assert (mask == block_diagonal_mask([3, 5, 2], 14)).all()
  empty_query = request_segments(0, [3], 0)[-1]
  assert (empty_query.length, empty_query.sees) == (0, (0,))


def test_preamble_is_copied_before_each_later_document_only():
  segments = request_segments(2, [3, 4], 1)
  assert [s.source for s in segments] == [
      (PREAMBLE, 0), (DOCUMENT, 0), (PREAMBLE, 0), (DOCUMENT, 1), (QUERY, 0)]
  assert [s.start for s in segments] == [0, 2, 3, 5, 9]
  assert segments[1].sees == (0,) and segments[3].sees == (2,)
  assert segments[4].sees == (0, 1, 3)  # the copy is not read by the query
  _, mask, _ = dense_inputs(segments)
  query_row = mask[-1]
  assert query_row.tolist() == [True] * 5 + [False] * 2 + [True] * 5


def test_recompute_reads_the_recomputed_head_and_the_encoded_tail():
  segments = request_segments(0, [4, 6], 2, recompute_tokens=4)
  assert [(s.source, s.offset, s.length, s.start, s.sees)
          for s in segments] == [
      ((DOCUMENT, 0), 0, 4, 0, ()),
      ((DOCUMENT, 1), 0, 4, 4, ()),        # as encoded
      ((DOCUMENT, 1), 0, 4, 4, (0,)),      # recomputed, sees doc 0
      ((DOCUMENT, 1), 4, 2, 8, (1,)),      # tail, encoded after its head
      ((QUERY, 0), 0, 2, 10, (0, 2, 3))]
  tokens = gather_sources(segments, {DOCUMENT: ["abcd", "efghij"],
                                     QUERY: ["xy"]})
  assert "".join(tokens) == "abcd" + "efgh" + "efgh" + "ij" + "xy"


def test_short_document_is_recomputed_whole():
  segments = request_segments(0, [4, 3], 1, recompute_tokens=8)
  assert [(s.offset, s.length) for s in segments[1:3]] == [(0, 3), (0, 3)]
  assert segments[-1].sees == (0, 2)


def test_bad_layouts_are_refused():
  with pytest.raises(ValueError, match="document 1 has length 0"):
    request_segments(0, [3, 0], 1)
  with pytest.raises(ValueError, match="non-negative"):
    request_segments(-1, [3], 1)
  with pytest.raises(ValueError, match="only earlier segments"):
    dense_inputs([Segment((QUERY, 0), 0, 2, 0, (0,))])
  with pytest.raises(ValueError, match="shorter"):
    dense_inputs(request_segments(0, [3], 1), pad_to=2)


def test_preamble_rows_name_every_copy():
  segments = request_segments(2, [3, 4, 1], 1)
  rows, index = preamble_rows(segments)
  assert rows.tolist() == [0, 1, 5, 6, 11, 12]
  assert index.tolist() == [0, 1] * 3


def test_document_after_preamble_equals_encoding_it_alone(model):
  """RoPE is relative: a later document computed after its preamble copy
  gives the logits of [preamble, document] run alone from position 0, which
  is what the engine caches and reads shifted."""
  rng = np.random.default_rng(0)
  preamble, docs = _tokens(rng, 3), [_tokens(rng, 5), _tokens(rng, 7)]
  got = dense_lazy_logits(model, docs, [], preamble=preamble)
  alone = preamble + docs[1]
  want = dense_forward(model, jnp.asarray([alone]),
                       jnp.arange(len(alone))[None], causal_mask(1, len(alone)))
  np.testing.assert_allclose(got[-7:], np.asarray(want[0, 3:]), atol=2e-5,
                             rtol=2e-5)


def test_recomputing_whole_documents_is_full_attention(model):
  rng = np.random.default_rng(1)
  docs, query = [_tokens(rng, n) for n in (4, 6, 3)], _tokens(rng, 2)
  got = dense_lazy_logits(model, docs, query, recompute_tokens=8)
  prompt = [t for d in docs for t in d] + query
  want = dense_forward(model, jnp.asarray([prompt]),
                       jnp.arange(len(prompt))[None],
                       causal_mask(1, len(prompt)))
  np.testing.assert_allclose(got, np.asarray(want[0]), atol=2e-5, rtol=2e-5)
  independent = dense_lazy_logits(model, docs, query)
  assert not np.allclose(independent[-1], got[-1], atol=1e-3)


def test_learned_preamble_vectors_replace_its_token_embeddings(model):
  rng = np.random.default_rng(2)
  docs, query = [_tokens(rng, 4), _tokens(rng, 3)], _tokens(rng, 2)
  preamble = _tokens(rng, 3)
  vectors = np.asarray(model.embed(jnp.asarray(preamble)))
  same = dense_lazy_logits(model, docs, query, preamble_embeddings=vectors)
  want = dense_lazy_logits(model, docs, query, preamble=preamble)
  np.testing.assert_allclose(same, want, atol=1e-6)
  other = dense_lazy_logits(model, docs, query,
                            preamble_embeddings=vectors + 0.5)
  assert not np.allclose(other[-1], want[-1], atol=1e-3)
