"""Prefill in chunks (`SchedulerConfig.prefill_chunk_tokens`): documents
and requests' own tokens cut into calls of at most that many tokens; each
chunk's row and plan, and the engine's tokens unchanged in every mode,
with and without decode during prefill."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.config import SchedulerConfig
from lazyattn_jax.layout import (EncodeJob, PageRow, PrefillTokens,
                                 prefill_chunks)
from lazyattn_jax.quality_options import QualityOptions
from tests.test_engine import greedy, make_engine, model_and_config  # noqa: F401
from tests.test_engine import random_tokens

PAGE = 4


def test_chunks_write_in_order_and_read_only_what_is_written():
  job = EncodeJob(slot=0, tokens=tuple(range(100, 110)), pages=[7, 8, 9],
                  start=3, context_pages=(5,))
  pieces = job.chunk_rows_and_plans(PAGE, 4)
  assert [len(plan) for _, plan in pieces] == [4, 4, 2]
  whole_row, whole_plan = job.row_and_plan(PAGE)
  assert sum((plan.tokens for _, plan in pieces), []) == whole_plan.tokens
  assert sum((plan.q_pos for _, plan in pieces), []) == whole_plan.q_pos
  assert sum((plan.write_page for _, plan in pieces), []) == (
      whole_plan.write_page)
  assert sum((plan.write_slot for _, plan in pieces), []) == (
      whole_plan.write_slot)
  for (row, _), written in zip(pieces, (4, 8, 10)):
    assert row.table == whole_row.table and row.pos == whole_row.pos
    # The context page (3 tokens), then the entry through this chunk only.
    assert row.length == [3] + [min(max(written - 4 * i, 0), 4)
                                for i in range(3)]
  assert pieces[-1][0].length == whole_row.length
  # No chunking, or chunks no shorter than the entry: the whole entry.
  for chunk in (None, 10, 64):
    (row, plan), = job.chunk_rows_and_plans(PAGE, chunk)
    assert (row, plan) == (whole_row, whole_plan)


def test_request_chunks_list_their_own_pages_through_what_is_written():
  # Two cached document pages (read, never written), then two private
  # pages holding 6 tokens the request prefills itself.
  row = PageRow([3, 4, 10, 11], [0, 4, 6, 10], [0, 0, 0, 0], [4, 2, 4, 2])
  plan = PrefillTokens()
  plan.add(list(range(6)), 6, [10, 11], 0, PAGE)
  first, second = prefill_chunks(row, plan, 4)
  assert first[0].length == [4, 2, 4, 0] and second[0].length == row.length
  assert first[1].q_pos == [6, 7, 8, 9] and second[1].q_pos == [10, 11]
  assert prefill_chunks(row, plan, 6) == [(row, plan)]


def test_recomputed_first_pages_in_chunks_give_the_same_tokens(
    model_and_config):
  _, config, _ = model_and_config
  quality = QualityOptions(recompute=True)
  want = _run(make_engine(model_and_config, quality=quality),
              config.vocab_size)
  engine = make_engine(model_and_config, quality=quality,
                       prefill_chunk_tokens=3, decode_during_prefill=True)
  assert _run(engine, config.vocab_size) == want


def _run(engine, vocab, seed=4):
  # Every page starts NaN: a read of a slot no chunk has written yet shows.
  state = engine.rounds.state
  engine.rounds.state = state.replace(k=jnp.full_like(state.k, jnp.nan),
                                      v=jnp.full_like(state.v, jnp.nan))
  rng = np.random.default_rng(seed)
  docs = [random_tokens(rng, n, vocab) for n in (13, 9, 3, 18)]
  queries = [random_tokens(rng, n, vocab) for n in (5, 7)]
  first = engine.submit(queries[0], docs[:2], greedy(12))
  results = {r.request_id: r for r in engine.step()}
  second = engine.submit(queries[1], docs[1:], greedy(8))
  while engine.has_work():
    results.update({r.request_id: r for r in engine.step()})
  return [results[first].token_ids, results[second].token_ids]


@pytest.mark.parametrize("mode", ["lazy", "block", "full", "prefix"])
@pytest.mark.parametrize("riding", [False, True])
def test_chunked_prefill_gives_the_same_tokens(model_and_config, mode,
                                               riding, monkeypatch):
  _, config, _ = model_and_config
  want = _run(make_engine(model_and_config, mode=mode), config.vocab_size)
  engine = make_engine(model_and_config, mode=mode, prefill_chunk_tokens=4,
                       decode_during_prefill=riding)
  widths = []
  for name in ("_run_prefill", "mixed_step"):
    original = getattr(engine.runner, name)

    def recorded(state, *args, _original=original, _name=name, **kwargs):
      plans = args[1] if _name == "_run_prefill" else args[3]
      widths.append(max((len(p) for p in plans), default=0))
      return _original(state, *args, **kwargs)

    monkeypatch.setattr(engine.runner, name, recorded)
  assert _run(engine, config.vocab_size) == want
  if mode == "prefix":
    # A request may read what an earlier one of its round writes, so its
    # prefill is never cut: the whole uncached prompt in one row.
    assert max(widths) > 4
  else:  # documents and queries (5 and 7 tokens) in chunks of 4 at most
    assert max(widths) == 4
  assert engine.stats.documents_prefilled == (
      4 if mode in ("lazy", "block") else 0)


@pytest.mark.parametrize("riding", [False, True])
def test_a_chunk_larger_than_the_call_budget_is_cut_to_it(model_and_config,
                                                         riding, monkeypatch):
  # Chunks of 12 under a budget of 4 tokens a call ran whole, so lowering
  # max_prefill_tokens (as `interactive(max_prefill_tokens=...)` and
  # `lazyattn serve --max-prefill-tokens` do) did not shorten the calls.
  _, config, _ = model_and_config
  want = _run(make_engine(model_and_config), config.vocab_size)
  engine = make_engine(model_and_config, prefill_chunk_tokens=12,
                       max_prefill_tokens=4, decode_during_prefill=riding)
  call_tokens = []
  for name in ("_run_prefill", "mixed_step"):
    original = getattr(engine.runner, name)

    def recorded(state, *args, _original=original, _name=name, **kwargs):
      plans = args[1] if _name == "_run_prefill" else args[3]
      call_tokens.append(sum(len(p) for p in plans))
      return _original(state, *args, **kwargs)

    monkeypatch.setattr(engine.runner, name, recorded)
  assert _run(engine, config.vocab_size) == want
  assert max(call_tokens) == 4
  assert SchedulerConfig.interactive(max_prefill_tokens=64).chunk_tokens == 64
  assert SchedulerConfig(prefill_chunk_tokens=8).chunk_tokens == 8
  assert SchedulerConfig().chunk_tokens is None


def test_the_chunk_size_must_be_positive():
  with pytest.raises(ValueError, match="prefill_chunk_tokens must be an int"):
    SchedulerConfig(prefill_chunk_tokens=0)
