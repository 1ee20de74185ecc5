"""The mixed step (decode rows and prefill-chunk rows in one forward pass)
against today's separate steps, on CPU (XLA attention path).

Every case starts from a live engine (requests decoding, documents cached)
whose free pages are NaN, so a stray read or write shows as NaN.  The
reference runs the chunk rows through `ModelRunner.prefill` (`_prefill_step`)
and then one step of `ModelRunner.decode` (`_decode_loop`) on a copy of the
same state; the mixed step must give the same logits, tokens and pool.

Tolerance: the dense parts run on [B_d + B_p * T, D] rows instead of
[B_p * T, D] and [B_d, D], so XLA's CPU matmuls may block the rows
differently and round differently; attention and everything else per token
is the same computation.  The float32 matmuls run at HIGHEST precision, so
the difference is float32 rounding.  Measured (jax 0.10.2, CPU): a step of
one part only is bit-identical to today's step; with both parts the largest
difference stayed below 2.5e-6 on logits of magnitude up to 3.6 (about 10
ulps there) and below 1.5e-6 in the pool, over the states these tests
build.  RTOL = ATOL = 2e-5 is 8x that, far below a wrong page or position
(differences of order 1; the engine's paged-vs-dense tests allow 1e-3).
"""

from __future__ import annotations

import functools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.layout import PageRow, PrefillTokens
from lazyattn_jax.sampling import SamplingParams
from lazyattn_jax.step_packing import decode_step_inputs, pack_decode
from models import paged_pool
from models.llama import forward, kv_cache_shape
from models.mixed_batch import mixed_forward
from tests.hf_fixtures import contiguous_paged_inputs
from tests.jaxpr_helpers import KERNEL_PRIMITIVES, primitives
from tests.test_engine import (PAGE, greedy, make_engine, model_and_config,
                               random_tokens)

RTOL = ATOL = 2e-5
MAX_BATCH = 4


@pytest.fixture(scope="module")
def live(model_and_config):
  """(engine, decoding requests) after one round: three requests with
  documents are decoding, each with two tokens; the third may draw one more
  (max_new_tokens 3); a fourth row of the decode batch is padding."""
  _, config, _ = model_and_config
  engine = make_engine(model_and_config, max_batch=MAX_BATCH, decode_steps=1)
  rng = np.random.default_rng(7)
  docs = [random_tokens(rng, n, config.vocab_size) for n in (6, 9, 3)]
  for d, sampling in ((docs[:2], greedy(12)), (docs[1:], greedy(12)),
                      (docs[2:], SamplingParams(max_new_tokens=3,
                                                temperature=0.8, seed=5,
                                                stop_token_ids=()))):
    engine.submit(random_tokens(rng, 5, config.vocab_size), d, sampling)
  engine.step()
  decoding = engine.scheduler.decoding()
  assert len(decoding) == 3
  return engine, decoding


def _nan_free_state(engine):
  """A copy of the engine's state with every free page NaN."""
  state = engine.rounds.state
  free = np.flatnonzero(np.asarray(state.page_refcount) == 0)
  k = jnp.array(state.k).at[:, :, free].set(jnp.nan)
  v = jnp.array(state.v).at[:, :, free].set(jnp.nan)
  return state.replace(k=k, v=v), [int(p) for p in free]


def _copy(state):
  return state.replace(k=jnp.array(state.k, copy=True),
                       v=jnp.array(state.v, copy=True))


def _causal_chunk(pages, tokens, start, end):
  """(PageRow, PrefillTokens) of tokens[start:end] of a sequence encoded
  alone from position 0 into `pages` (a document, or a query with no
  documents), its earlier tokens already in the pages."""
  row = PageRow()
  row.add_run(pages[:math.ceil(end / PAGE)], 0, 0, end, PAGE)
  plan = PrefillTokens()
  plan.add(tokens[start:end], start, pages, start, PAGE)
  return row, plan


def _query_after_documents(reader, pages, tokens):
  """A new request's query over the cached documents `reader` (a live
  request) reads, in its own `pages`: a row that shares read-only pages
  with a decode row, as a cache hit does."""
  layout = reader.layout
  n = layout.private_start
  row = PageRow(layout.row.table[:n], layout.row.pos[:n],
                layout.row.shift[:n], layout.row.length[:n])
  row.add_run(pages, layout.query_start, 0, len(tokens), PAGE)
  plan = PrefillTokens()
  plan.add(tokens, layout.query_start, pages, 0, PAGE)
  return row, plan


def _decode_logits(engine, state, decoding):
  """Logits of one decode step of `decoding` through `Llama.__call__`, with
  the metadata `_decode_loop`'s step builds (it returns no logits)."""
  runner = engine.runner
  (tokens, pos, written, _, done), pages, _, _ = pack_decode(decoding,
                                                             MAX_BATCH)
  inputs = decode_step_inputs(pages, pos, written, ~done, runner.num_pages,
                              PAGE)
  logits, _, _ = forward(runner.graphdef, runner.params, tokens[:, None],
                         state.k, state.v, inputs, impl="xla",
                         logits_index=jnp.zeros((MAX_BATCH,), jnp.int32))
  return np.asarray(logits)[:len(decoding)]


def _separate(engine, state, decoding, rows, plans, samplings):
  """Today's path: the chunk rows in one prefill, then one decode step."""
  runner = engine.runner
  logits, first = None, None
  if rows:
    state, logits, first = runner.prefill(state, rows, plans, samplings)
  nxt = done = None
  if decoding:
    state, out, emitted, done = runner.decode(state, decoding, MAX_BATCH, 1)
    assert emitted[:len(decoding), 0].all()
    nxt, done = out[:len(decoding), 0], done[:len(decoding)]
  return state, logits, first, nxt, done


def _assert_pools_equal(a, b):
  for x, y in ((a.k, b.k), (a.v, b.v)):
    x, y = np.asarray(x), np.asarray(y)
    np.testing.assert_array_equal(np.isnan(x), np.isnan(y))
    np.testing.assert_allclose(x, y, rtol=RTOL, atol=ATOL)


def _run_both(engine, decoding, rows, plans, ends_query):
  state, free = _nan_free_state(engine)
  samplings = [greedy(1)] * len(rows)
  expected = _separate(engine, _copy(state), decoding, rows, plans,
                       samplings)
  decode_ref = (_decode_logits(engine, state, decoding) if decoding
                else None)
  got = engine.runner.mixed_step(_copy(state), decoding, MAX_BATCH, rows,
                                 plans, samplings, ends_query)
  return state, expected, decode_ref, got


def test_decode_rows_only(live):
  engine, decoding = live
  before, (ref_state, _, _, ref_next, ref_done), decode_ref, got = _run_both(
      engine, decoding, [], [], [])
  state, decode_logits, nxt, done, prefill_logits, first = got
  assert prefill_logits.shape == (0, engine.config.vocab_size)
  assert first.shape == (0,)
  np.testing.assert_allclose(decode_logits, decode_ref, rtol=RTOL, atol=ATOL)
  np.testing.assert_array_equal(nxt, ref_next)
  # The third request reaches its max_new_tokens with this token.
  np.testing.assert_array_equal(done, ref_done)
  assert done.tolist() == [r.request.sampling.max_new_tokens == 3
                           for r in decoding]
  _assert_pools_equal(state, ref_state)
  # The step wrote something: each decode row's token, in every layer.
  assert not np.array_equal(np.asarray(state.k), np.asarray(before.k))


def _prefill_rows(engine, decoding, free, rng):
  """A document chunk shorter than a page, and a new request's whole query
  over the documents of decoding[0]."""
  vocab = engine.config.vocab_size
  doc = random_tokens(rng, PAGE - 1, vocab)
  short = _causal_chunk(free[:1], doc, 0, len(doc))
  query = _query_after_documents(decoding[0], free[1:3],
                                 random_tokens(rng, 6, vocab))
  return [short[0], query[0]], [short[1], query[1]], [False, True]


def _check_against_separate(expected, decode_ref, got, ends_query):
  ref_state, ref_logits, ref_first, ref_next, ref_done = expected
  state, decode_logits, nxt, done, prefill_logits, first = got
  np.testing.assert_allclose(prefill_logits, ref_logits, rtol=RTOL,
                             atol=ATOL)
  np.testing.assert_array_equal(first, np.where(ends_query, ref_first, -1))
  if decode_ref is not None:
    np.testing.assert_allclose(decode_logits, decode_ref, rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_array_equal(nxt, ref_next)
    np.testing.assert_array_equal(done, ref_done)
  _assert_pools_equal(state, ref_state)


def test_prefill_rows_only(live):
  engine, decoding = live
  _, free = _nan_free_state(engine)
  rows, plans, ends = _prefill_rows(engine, decoding, free,
                                    np.random.default_rng(1))
  before, expected, _, got = _run_both(engine, [], rows, plans, ends)
  assert got[1].shape == (0, engine.config.vocab_size)
  assert got[3].shape == (0,)
  _check_against_separate(expected, None, got, ends)
  # The chunk pages were NaN and are now written (the check can fail).
  assert np.isnan(np.asarray(before.k)[:, :, free[0], :PAGE - 1]).all()
  assert np.isfinite(np.asarray(got[0].k)[:, :, free[0], :PAGE - 1]).all()
  assert np.isnan(np.asarray(got[0].k)[:, :, free[0], PAGE - 1]).all()


def test_decode_and_prefill_rows(live):
  engine, decoding = live
  _, free = _nan_free_state(engine)
  rows, plans, ends = _prefill_rows(engine, decoding, free,
                                    np.random.default_rng(2))
  # A third row: the first chunk of a long query with no documents.
  long_query = random_tokens(np.random.default_rng(3), 11,
                             engine.config.vocab_size)
  row, plan = _causal_chunk(free[3:6], long_query, 0, 6)
  rows, plans, ends = rows + [row], plans + [plan], ends + [False]
  _, expected, decode_ref, got = _run_both(engine, decoding, rows, plans,
                                           ends)
  _check_against_separate(expected, decode_ref, got, ends)


def _state_and_query(engine, seed: int):
  """(state with NaN free pages, an 11-token query, three free pages for
  it)."""
  state, free = _nan_free_state(engine)
  query = random_tokens(np.random.default_rng(seed), 11,
                        engine.config.vocab_size)
  return state, query, free[:3]


def test_query_in_two_chunks_equals_one_prefill(live):
  """Chunked prefill of one query over two steps (the first beside the
  decode rows) equals one prefill of the whole query."""
  engine, decoding = live
  runner = engine.runner
  state, query, pages = _state_and_query(engine, seed=4)
  whole_row, whole_plan = _causal_chunk(pages, query, 0, len(query))
  ref_state, ref_logits, ref_first = runner.prefill(
      _copy(state), [whole_row], [whole_plan], [greedy(1)])

  first_row, first_plan = _causal_chunk(pages, query, 0, 6)
  mixed, _, _, _, logits_1, first_1 = runner.mixed_step(
      _copy(state), decoding, MAX_BATCH, [first_row], [first_plan],
      [greedy(1)], [False])
  assert first_1.tolist() == [-1]
  second_row, second_plan = _causal_chunk(pages, query, 6, len(query))
  mixed, _, _, _, logits_2, first_2 = runner.mixed_step(
      mixed, [], MAX_BATCH, [second_row], [second_plan], [greedy(1)], [True])
  np.testing.assert_allclose(logits_2, ref_logits, rtol=RTOL, atol=ATOL)
  np.testing.assert_array_equal(first_2, ref_first)
  got_pages = np.asarray(mixed.k)[:, :, pages], np.asarray(mixed.v)[:, :,
                                                                    pages]
  ref_pages = (np.asarray(ref_state.k)[:, :, pages],
               np.asarray(ref_state.v)[:, :, pages])
  for got, ref in zip(got_pages, ref_pages):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
  # The first chunk's logits are its own last token's, not the query's.
  assert not np.allclose(logits_1, ref_logits, rtol=1e-2, atol=1e-2)


def test_riders_carry_their_state_on_device_across_steps(live, monkeypatch):
  """Two mixed steps with the same riders (a query in two chunks beside
  them) read nothing back between the steps, and `collect` then gives the
  tokens, emitted flags and done of a two-step decode loop after the
  query's prefill; the pools agree."""
  engine, decoding = live
  runner = engine.runner
  state, query, pages = _state_and_query(engine, seed=6)
  ref_state, _, _ = runner.prefill(
      _copy(state), *[[x] for x in _causal_chunk(pages, query, 0, 11)],
      [greedy(1)])
  ref_state, ref_out, ref_emitted, ref_done = runner.decode(
      ref_state, decoding, MAX_BATCH, 2)

  riders = runner.decode_riders(decoding, MAX_BATCH)

  def no_reads(*args, **kwargs):
    raise AssertionError("a mixed step waited for the device")

  monkeypatch.setattr(jax, "device_get", no_reads)
  mixed = _copy(state)
  for start, end, ends in ((0, 6, False), (6, 11, True)):
    row, plan = _causal_chunk(pages, query, start, end)
    mixed, _ = runner.mixed_step_async(mixed, riders, [row], [plan],
                                       [greedy(1)], [ends])
  monkeypatch.undo()
  assert riders.steps == 2
  [(requests, tokens, emitted, done)] = riders.collect()
  assert requests == decoding
  n = len(decoding)
  np.testing.assert_array_equal(emitted, ref_emitted[:n])
  # The request of max_new_tokens 3 reaches it in the first step: padding
  # in the second.
  assert emitted.tolist() == [
      [True, r.request.sampling.max_new_tokens != 3] for r in decoding]
  np.testing.assert_array_equal(np.where(emitted, tokens, -1),
                                np.where(ref_emitted[:n], ref_out[:n], -1))
  np.testing.assert_array_equal(done, ref_done[:n])
  assert riders.steps == 0
  _assert_pools_equal(mixed, ref_state)


def test_rows_sharing_pages_are_refused(live):
  """A chunk row may not write a page a decode row reads or writes, nor
  read a page a decode row writes; refused before the pool is donated."""
  engine, decoding = live
  state, free = _nan_free_state(engine)
  vocab = engine.config.vocab_size
  tokens = random_tokens(np.random.default_rng(5), 3, vocab)
  layout = decoding[0].layout
  private = layout.query_pages[0]  # read by decode row 0
  document = layout.row.table[0]  # read by decode row 0
  # The page decode row 0 writes its next token into.
  writing = layout.row.table[layout.private_start +
                             decoding[0].written // PAGE]
  write_private = _causal_chunk([private], tokens, 0, 3)
  write_document = _causal_chunk([document], tokens, 0, 3)
  row, plan = _causal_chunk(free[:1], tokens, 0, 3)
  read_writing = (PageRow([writing], [0], [0], [1]), plan)
  for bad_row, bad_plan in (write_private, write_document, read_writing):
    with pytest.raises(ValueError, match="must not share pages"):
      engine.runner.mixed_step(state, decoding, MAX_BATCH, [row, bad_row],
                               [plan, bad_plan], [greedy(1)] * 2,
                               [False, False])
  assert not state.k.is_deleted()


def test_mixed_forward_gpu_kernels_interpret(model_and_config, monkeypatch):
  """The Pallas GPU kernels (Triton lowering, interpret mode on CPU) in a
  mixed forward pass equal the same kernels in separate calls: the decode
  kernel sees [B_d, 1] queries and the prefill kernel [B_p, T], as alone."""
  model = model_and_config[0]
  config = model.config
  monkeypatch.setattr(paged_pool, "lazy_attention",
                      functools.partial(paged_pool.lazy_attention,
                                        interpret=True))
  rng = np.random.default_rng(6)
  pool = jnp.full(kv_cache_shape(config, 12, PAGE), jnp.nan, jnp.float32)
  # Two sequences of 6 and 3 tokens already in their pages.
  table = np.array([[3, 5], [7, 8]], np.int32)
  earlier = jnp.asarray(rng.integers(0, config.vocab_size, (2, 6)), jnp.int32)
  _, k, v = model(earlier, pool, pool,
                  contiguous_paged_inputs(table, [6, 3], [0, 0], 6, PAGE),
                  impl="xla")
  decode_tokens = jnp.asarray(rng.integers(0, config.vocab_size, 2),
                              jnp.int32)
  decode_inputs = contiguous_paged_inputs(table, [7, 4], [6, 3], 1, PAGE)
  chunk = jnp.asarray(rng.integers(0, config.vocab_size, (1, 8)), jnp.int32)
  chunk_inputs = contiguous_paged_inputs([[10, 11]], [5], [0], 8, PAGE)
  last = jnp.asarray([4], jnp.int32)

  ref_chunk, k_ref, v_ref = model(chunk, k, v, chunk_inputs, impl="gpu",
                                  logits_index=last)
  ref_decode, k_ref, v_ref = model(decode_tokens[:, None], k_ref, v_ref,
                                   decode_inputs, impl="gpu",
                                   logits_index=jnp.zeros((2,), jnp.int32))
  got_decode, got_chunk, k_got, v_got = mixed_forward(
      model, decode_tokens, decode_inputs, chunk, chunk_inputs, k, v,
      impl="gpu", prefill_logits_index=last)
  np.testing.assert_allclose(got_decode, ref_decode, rtol=RTOL, atol=ATOL)
  np.testing.assert_allclose(got_chunk, ref_chunk, rtol=RTOL, atol=ATOL)
  for got, ref in ((k_got, k_ref), (v_got, v_ref)):
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
  # Both parts wrote: slot 2 of page 5 (decode row 0), page 10 (the chunk).
  assert np.isfinite(np.asarray(k_got)[:, :, 5, 2]).all()
  assert np.isfinite(np.asarray(k_got)[:, :, 10]).all()


def test_mixed_forward_refuses_shared_pages_and_empty_steps(
    model_and_config):
  model = model_and_config[0]
  pool = jnp.zeros(kv_cache_shape(model.config, 12, PAGE), jnp.float32)
  table = np.array([[3, 5]], np.int32)
  decode_inputs = contiguous_paged_inputs(table, [7], [6], 1, PAGE)
  tokens = jnp.zeros((1, 4), jnp.int32)
  last = jnp.asarray([3], jnp.int32)
  # The chunk writes page 3, which the decode row reads.
  chunk_inputs = contiguous_paged_inputs([[3]], [4], [0], 4, PAGE)
  with pytest.raises(ValueError, match="decode rows read pages \\[3\\]"):
    mixed_forward(model, jnp.zeros((1,), jnp.int32), decode_inputs, tokens,
                  chunk_inputs, pool, pool, impl="xla",
                  prefill_logits_index=last)
  none = contiguous_paged_inputs(np.zeros((0, 1), np.int32), [], [], 1, PAGE)
  with pytest.raises(ValueError, match="needs decode rows or chunk rows"):
    mixed_forward(model, jnp.zeros((0,), jnp.int32), none,
                  jnp.zeros((0, 1), jnp.int32), none, pool, pool,
                  impl="xla", prefill_logits_index=jnp.zeros((0,), jnp.int32))


def _mixed_step_args(impl: str = "gpu"):
  """(step, args) of a bf16 model's (H 128) mixed step on the `impl`
  kernels, as abstract shapes: 4 decode rows and 2 chunk rows of 64
  tokens."""
  from flax import nnx
  from lazyattn_jax.mixed_step import _mixed_step
  from lazyattn_jax.sharding import random_model
  from models.config import LlamaConfig
  from models.paged_inputs import PagedAttentionInputs
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, head_dim=128,
                            max_position=512)
  model = nnx.eval_shape(lambda: random_model(config, None,
                                              dtype=jnp.bfloat16))
  graphdef, params = nnx.split(model)
  pool = jax.ShapeDtypeStruct(kv_cache_shape(config, 64, 16), jnp.bfloat16)
  spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype)
  rows, chunks, length, pages = 4, 2, 64, 8
  sampling = lambda b: (spec((b,), jnp.float32), spec((b,)),
                        spec((b,), jnp.float32), spec((b,)))
  decode = ((spec((rows,)),) * 4 + (spec((rows,), bool),),
            (spec((rows, pages)),) * 4 + (spec((rows,)),), sampling(rows),
            (spec((rows,)), spec((rows, 4))))
  prefill = (spec((chunks, length)),
             PagedAttentionInputs(*(spec((chunks, pages)),) * 4,
                                  *(spec((chunks, length)),) * 3),
             spec((chunks,)), sampling(chunks))
  step = functools.partial(_mixed_step, graphdef=graphdef, impl=impl)
  return step, (params, pool, pool, decode, prefill)


def test_mixed_step_lowers_for_cuda():
  """The mixed step of a bf16 model (H 128) exports for CUDA from CPU: the
  decode part through the Mosaic GPU decode kernel, the chunk part through
  the Mosaic GPU prefill kernel, each with its plan, in one program with no
  Triton call (so no disabled safety check)."""
  from jax import export
  step, args = _mixed_step_args()
  text = export.export(jax.jit(step), platforms=["cuda"])(
      *args).mlir_module()
  assert "xla.gpu.triton" not in text
  assert text.count("custom_call @mosaic_gpu") >= 2  # decode and prefill


def test_mixed_step_lowers_for_tpu():
  """The same step on the Pallas TPU kernels exports for TPU from CPU:
  the decode and the prefill kernel in one program."""
  from jax import export
  step, args = _mixed_step_args("tpu")
  exported = export.export(jax.jit(step), platforms=["tpu"])(*args)
  assert exported.platforms == ("tpu",)
  kernels = re.findall(r'kernel_name = "([^"]+)"', exported.mlir_module())
  assert {"_decode_kernel", "_prefill_kernel"} <= set(kernels)


@pytest.mark.parametrize("sampled", [False, True])
def test_the_gpu_mixed_step_has_no_host_side_control_flow(sampled):
  """No XLA conditional and no while loop outside the kernels: on GPU
  each reads its predicate on the host, so the host would wait for the
  device in every call (the sampler's old conditional did;
  benchmarks/RESULTS.md, "The mixed step").  The layer loop is a scan of
  known length."""
  step, args = _mixed_step_args()
  closed = jax.make_jaxpr(functools.partial(
      step, decode_sampled=sampled, prefill_sampled=sampled))(*args)
  names = primitives(closed.jaxpr, opaque=KERNEL_PRIMITIVES)
  assert KERNEL_PRIMITIVES & names and "scan" in names
  assert not {"cond", "while"} & names, names & {"cond", "while"}
