"""benchmarks/fp8_error_probe: the error of a float8 round trip per vector,
and the page kinds it groups by."""

import types

import numpy as np

from benchmarks.fp8_error_probe import page_kinds, relative_errors


def test_power_of_two_scales_give_the_same_relative_error_per_page_or_token():
  rng = np.random.default_rng(0)
  x = rng.normal(size=(2, 16, 64)) * np.array([1.0, 8.0])[:, None, None]
  page = relative_errors(x, per_token=False)
  token = relative_errors(x, per_token=True)
  assert page.shape == (2, 16)
  np.testing.assert_allclose(page, token)
  assert 0.005 < page.mean() < 0.06  # e4m3: 3 mantissa bits


def test_a_tiny_vector_beside_a_huge_one_needs_its_own_scale():
  x = np.ones((2, 32), np.float32)
  x[1] *= 2.0 ** -20  # below e4m3's range under the page's scale
  page = relative_errors(x, per_token=False)
  token = relative_errors(x, per_token=True)
  assert page[1] == 1.0 and token[1] == 0.0  # flushed to zero vs exact
  assert page[0] == token[0] == 0.0


def test_zero_vectors_report_no_error():
  assert relative_errors(np.zeros((1, 3, 8)), per_token=True).sum() == 0.0


def test_page_kinds_name_the_sink_and_each_documents_first_page():
  state = types.SimpleNamespace(
      doc_key=np.array([[7, 7], [1, 2], [3, 4]]),
      doc_valid=np.array([True, True, False]),
      doc_pages=np.array([[5, -1, -1], [0, 3, 9], [1, 2, 4]]),
      doc_num_pages=np.array([1, 3, 3]), doc_len=np.array([16, 40, 48]),
      k=np.zeros((1, 1, 10, 16, 4)))
  assert page_kinds(state, (7, 7)) == [
      ("sink", 5, 16), ("doc first page", 0, 16),
      ("doc other pages", 3, 16), ("doc other pages", 9, 8)]
  assert page_kinds(state, None)[0] == ("doc first page", 5, 16)
