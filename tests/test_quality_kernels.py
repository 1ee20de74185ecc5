"""The kernels on the page metadata of the answer-quality layouts.

A request with a preamble and recomputed first pages reads pages of
alternating shifts (a document's private recomputed pages at shift 0, its
shared pages at S_d - P), and prefills query rows whose positions have
gaps (each recomputed head, then the query).  No kernel change was needed
for that: this checks it on every implementation that runs on CPU (the jnp
reference, XLA, the GPU kernels in Pallas' interpreter, the TPU kernels in
the TPU interpreter, and the Mosaic GPU prefill kernel in its interpreter
where this jax has one) against the float64 truth, with NaN in every slot
the layout must not read.
"""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.layout import pack_rows
from lazyattn_jax.modes import BlockMode, LazyMode
from lazyattn_jax.paged_cache import Admission
from lazyattn_jax.preamble import Preamble
from lazyattn_jax.requests import TokenRequest
from lazyattn_jax.sampling import SamplingParams
from pallas_kernels import lazy_attention, lazy_attention_reference
from pallas_kernels.sizes import ceil_div
from pallas_kernels.testing import LazyCase, numpy_truth, relative_error
from tests.mgpu_prefill_helpers import _has_interpreter
from tests.rope_configs import PLAIN as ROPE

PAGE = 8
DOC_LENS = (5, 12, 3)  # the third is shorter than k: recomputed whole
PREAMBLE_LEN, QUERY_LEN, RECOMPUTE = 5, 4, PAGE


def test_padding_pages_sit_past_every_query_position():
  # Kernels skip a row's padding pages by their page_pos: it must exceed
  # the query positions of the longest model LlamaConfig accepts.
  import dataclasses
  from lazyattn_jax.layout import UNUSED_PAGE_POS
  from tests.training_helpers import tiny_config
  longest = tiny_config(max_position=UNUSED_PAGE_POS + 1)
  with pytest.raises(ValueError, match=r"max_position must be at most \d+ \(positions below it"):
    dataclasses.replace(longest, max_position=UNUSED_PAGE_POS + 2)
  _, pos, _, _ = pack_rows([], 1, 1)
  assert pos[0, 0] >= longest.max_position - 1  # the last query position


def _layout(mode_cls):
  """The layout of one request, on shuffled physical pages."""
  rng = np.random.default_rng(0)
  preamble = Preamble((1, 2), (7,) * PREAMBLE_LEN)
  mode = mode_cls(PAGE, "m", preamble, RECOMPUTE)
  docs = tuple(tuple(range(1, n + 1)) for n in DOC_LENS)
  request = TokenRequest(tuple(range(1, QUERY_LEN + 1)), docs,
                         SamplingParams(max_new_tokens=3))
  needs = mode.cache_needs(request)
  counts = [ceil_div(n, PAGE) for n in needs.lengths]
  private = ceil_div(needs.private_tokens, PAGE)
  pages = rng.permutation(sum(counts) + private + 3)[3:].tolist()
  doc_pages = []
  for n in counts:
    doc_pages.append(pages[:n])
    pages = pages[n:]
  admission = Admission(list(range(len(counts))), doc_pages,
                        [True] * len(counts), [], pages[:private])
  return mode.layout(request, admission), sum(counts) + private + 3


def _case(layout, num_pages, q_rows, dtype, seed=1) -> LazyCase:
  """Random K/V in the slots `layout` makes valid, NaN everywhere else;
  queries at the plan's positions (the rows `q_rows` of the plan)."""
  rng = np.random.default_rng(seed)
  heads, kv_heads, head_dim = 2, 1, 64
  table, pos, shift, length = pack_rows([layout.row], len(layout.row) + 2, 1)
  k = np.full((kv_heads, num_pages, PAGE, head_dim), np.nan, np.float32)
  v = np.full_like(k, np.nan)
  for page, n in zip(table[0], length[0]):
    if n:
      k[:, page, :n] = rng.standard_normal((kv_heads, n, head_dim))
      v[:, page, :n] = rng.standard_normal((kv_heads, n, head_dim))
  q_pos = np.asarray(layout.prefill.q_pos, np.int32)[q_rows][None]
  q = rng.standard_normal((1, q_pos.shape[1], heads, head_dim))
  cast = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
  # The truth sees exactly the rounded inputs the implementations see.
  return LazyCase(cast(q), cast(k), cast(v), table, pos, shift, length,
                  q_pos)


def _run(impl, args, dtype):
  args = [jnp.asarray(a) for a in args]
  args[:3] = [a.astype(dtype) for a in args[:3]]
  if impl == "reference":
    return lazy_attention_reference(*args, rope=ROPE)
  if impl == "mgpu":
    from pallas_kernels.gpu_prefill_mgpu import lazy_prefill_mgpu
    return lazy_prefill_mgpu(*args, rope=ROPE,
                             sm_scale=jnp.float32(args[0].shape[-1] ** -0.5),
                             interpret=True)
  if impl == "xla":
    return lazy_attention(*args, rope=ROPE, impl="xla")
  return lazy_attention(*args, rope=ROPE, impl=impl, interpret=True)


IMPLS = ["reference", "xla", "gpu", "tpu"]


@pytest.mark.parametrize("mode_cls", [LazyMode, BlockMode],
                         ids=["lazy", "block"])
def test_layout_metadata_has_the_shapes_this_file_is_about(mode_cls):
  layout, _ = _layout(mode_cls)
  row = layout.row
  # Pages: preamble, document 0, document 1's recomputed first page and its
  # shared tail, document 2 (shorter than k) recomputed whole, the query.
  # Lazy reads the tail at shift S_1 - P; block reads its copy.
  tail_shift = DOC_LENS[0] if mode_cls is LazyMode else 0
  assert row.shift == [0, 0, 0, tail_shift, 0, 0]
  assert row.length == [5, 5, 8, 4, 3, 4]
  assert row.pos == [0, 5, 10, 18, 22, 25]
  q_pos = layout.prefill.q_pos
  assert np.any(np.diff(q_pos) > 1)  # gaps between the recomputed heads
  heads = min(RECOMPUTE, DOC_LENS[1]) + DOC_LENS[2]
  assert len(q_pos) == heads + QUERY_LEN


@pytest.mark.parametrize("impl", IMPLS + [
    pytest.param("mgpu", marks=pytest.mark.slow)])
@pytest.mark.parametrize("q_len", ["prefill", "decode"])
def test_kernels_on_the_recompute_layout(impl, q_len):
  if impl == "mgpu" and (q_len == "decode" or not _has_interpreter()):
    pytest.skip("the Mosaic GPU kernel is prefill only and needs its "
                "interpreter")
  dtype = jnp.bfloat16 if impl == "mgpu" else jnp.float32
  layout, num_pages = _layout(LazyMode)
  rows = (slice(None) if q_len == "prefill" else
          slice(len(layout.prefill) - 1, None))  # the last query token
  case = _case(layout, num_pages, rows, dtype)
  out = np.asarray(jnp.asarray(_run(impl, case.args(), dtype)).astype(
      jnp.float32))
  assert not np.isnan(out).any(), "a slot the layout must not read leaked"
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
  assert relative_error(out, numpy_truth(case, ROPE)) <= tol
