"""Running requests decoding inside a round's prefill calls
(`SchedulerConfig.decode_during_prefill`, rounds.py with mixed_step.py):
the same greedy tokens as without, in every mode; riders really decode
there; a failed mixed step fails only the requests it was prefilling."""

from __future__ import annotations

import numpy as np
import pytest

from lazyattn_jax.config import SchedulerConfig
from tests.test_engine import greedy, make_engine, model_and_config  # noqa: F401
from tests.test_engine import random_tokens


def _scenario(engine, vocab, seed=11):
  """Staggered arrivals: A runs while B (new documents) and then C (B's
  documents plus one new) are prefilled.  Returns (results by name, A's
  token count after the second round)."""
  rng = np.random.default_rng(seed)
  docs = [random_tokens(rng, n, vocab) for n in (6, 9, 3, 7)]
  queries = [random_tokens(rng, n, vocab) for n in (5, 4, 6)]
  ids = {"A": engine.submit(queries[0], docs[:2], greedy(14))}
  results = {}

  def step():
    for r in engine.step():
      results[r.request_id] = r

  step()
  ids["B"] = engine.submit(queries[1], docs[2:], greedy(9))
  step()
  a_tokens = len(engine.tokens_so_far(ids["A"]))
  ids["C"] = engine.submit(queries[2], [docs[3], docs[1], docs[2]], greedy(6))
  while engine.has_work():
    step()
  return {name: results[i] for name, i in ids.items()}, a_tokens


@pytest.mark.parametrize("mode", ["lazy", "block", "prefix", "full"])
def test_riders_give_the_same_tokens_and_decode_during_prefill(
    model_and_config, mode):
  _, config, _ = model_and_config
  plain, plain_a = _scenario(make_engine(model_and_config, mode=mode),
                             config.vocab_size)
  mixed_engine = make_engine(model_and_config, mode=mode,
                             decode_during_prefill=True)
  mixed, mixed_a = _scenario(mixed_engine, config.vocab_size)
  for name in plain:
    assert mixed[name].finish_reason == plain[name].finish_reason == "length"
    assert mixed[name].token_ids == plain[name].token_ids, name
  # A rode B's prefill calls (one token each) on top of the decode loops.
  assert mixed_a > plain_a
  stats = mixed_engine.stats
  assert stats.generated_tokens == sum(len(r.token_ids) - 1
                                       for r in mixed.values())


def test_riders_steps_and_tokens_are_counted_apart_from_decode_loops(
    model_and_config):
  """decode_seconds times the decode loops alone: mixed steps counted as
  loop steps, and riders' tokens as loop tokens, made a loop step look
  shorter and the loops' tokens/s higher the more mixed steps ran."""
  _, config, _ = model_and_config
  engine = make_engine(model_and_config, decode_during_prefill=True)
  calls = {"loop_steps": 0, "mixed": 0}
  decode_async, mixed_async = (engine.runner.decode_async,
                               engine.runner.mixed_step_async)

  def counted_decode(state, decoding, batch, steps):
    calls["loop_steps"] += steps
    return decode_async(state, decoding, batch, steps)

  def counted_mixed(*args, **kwargs):
    calls["mixed"] += 1
    return mixed_async(*args, **kwargs)

  engine.runner.decode_async = counted_decode
  engine.runner.mixed_step_async = counted_mixed
  results, _ = _scenario(engine, config.vocab_size)
  stats = engine.stats
  assert (stats.decode_steps, stats.mixed_steps) == (calls["loop_steps"],
                                                     calls["mixed"])
  assert calls["mixed"] > 0
  riders = stats.generated_tokens - stats.decode_loop_tokens
  assert 0 < riders <= calls["mixed"] * engine.scheduler_config.max_batch
  plain = make_engine(model_and_config)
  _scenario(plain, config.vocab_size)
  assert plain.stats.decode_loop_tokens == plain.stats.generated_tokens
  assert plain.stats.mixed_steps == 0


def test_riders_that_change_within_a_round_stay_on_the_device(
    model_and_config, monkeypatch):
  """A round of four first-token groups while A runs: A rides from the
  first group's calls, each group's requests from the calls of the group
  after next, so the riders change twice within the round.  The new rows
  are made from the old ones on the device (no read-back), and every
  request gets the tokens it gets without riding."""
  from lazyattn_jax.mixed_step import DecodeRiders
  _, config, _ = model_and_config
  merges = []
  init = DecodeRiders.__init__

  def watched(self, requests, *args, previous=None, **kwargs):
    if previous is not None and previous.steps:
      merges.append((len(previous.requests), len(requests)))
    init(self, requests, *args, previous=previous, **kwargs)

  monkeypatch.setattr(DecodeRiders, "__init__", watched)

  def serve(riding):
    rng = np.random.default_rng(8)
    engine = make_engine(model_and_config, max_batch=8,
                         first_token_group_tokens=10,
                         decode_during_prefill=riding)
    a = engine.submit(random_tokens(rng, 5, config.vocab_size),
                      [random_tokens(rng, 10, config.vocab_size)],
                      greedy(20))
    engine.step()
    ids = [engine.submit(random_tokens(rng, 4, config.vocab_size),
                         [random_tokens(rng, 10, config.vocab_size)],
                         greedy(6)) for _ in range(4)]
    results = {}
    while engine.has_work():
      results.update({r.request_id: r for r in engine.step()})
    return [results[i].token_ids for i in [a] + ids]

  assert serve(True) == serve(False)
  assert merges == [(1, 2), (2, 3)]


def test_a_failed_mixed_step_fails_its_prefill_rows_only(model_and_config,
                                                         monkeypatch):
  _, config, _ = model_and_config
  rng = np.random.default_rng(3)
  engine = make_engine(model_and_config, decode_during_prefill=True)
  doc = random_tokens(rng, 8, config.vocab_size)
  query = random_tokens(rng, 5, config.vocab_size)
  first = engine.submit(query, [doc], greedy(10))
  engine.step()

  def broken(*args, **kwargs):
    raise ValueError("mixed step refused")

  monkeypatch.setattr(engine.runner, "mixed_step_async", broken)
  second = engine.submit(random_tokens(rng, 4, config.vocab_size),
                         [random_tokens(rng, 5, config.vocab_size)],
                         greedy(4))
  results = {r.request_id: r for r in engine.step()}
  assert results[second].finish_reason == "error"
  assert "mixed step refused" in results[second].error
  monkeypatch.undo()
  while engine.has_work():
    results.update({r.request_id: r for r in engine.step()})
  assert results[first].finish_reason == "length"
  alone = make_engine(model_and_config).generate(query, [doc], greedy(10))
  assert results[first].token_ids == alone.token_ids


def test_riders_whose_tokens_cannot_be_read_fail_alone(model_and_config,
                                                      monkeypatch):
  """If the riders' tokens cannot be read back at the end of a run of
  mixed steps, the riders fail with the error; the request being
  prefilled beside them goes on and gets the tokens it gets alone."""
  from lazyattn_jax.mixed_step import DecodeRiders
  _, config, _ = model_and_config
  rng = np.random.default_rng(4)
  engine = make_engine(model_and_config, decode_during_prefill=True)
  rider = engine.submit(random_tokens(rng, 5, config.vocab_size),
                        [random_tokens(rng, 8, config.vocab_size)],
                        greedy(10))
  engine.step()
  query = random_tokens(rng, 4, config.vocab_size)
  doc = random_tokens(rng, 6, config.vocab_size)

  def unreadable(self):
    raise RuntimeError("device lost the riders' tokens")

  monkeypatch.setattr(DecodeRiders, "collect", unreadable)
  second = engine.submit(query, [doc], greedy(4))
  results = {r.request_id: r for r in engine.step()}
  monkeypatch.undo()
  assert results[rider].finish_reason == "error"
  assert "lost the riders' tokens" in results[rider].error
  while engine.has_work():
    results.update({r.request_id: r for r in engine.step()})
  assert results[second].finish_reason == "length"
  alone = make_engine(model_and_config).generate(query, [doc], greedy(4))
  assert results[second].token_ids == alone.token_ids


def test_a_rider_done_before_the_pool_is_lost_ends_as_it_would_have(
    model_and_config, monkeypatch):
  """A mixed step that loses the pool fails every live request, but a
  rider whose last token an earlier mixed step of the round drew ends with
  its tokens (they are not in the pool): it used to fail with the rest."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(1)
  engine = make_engine(model_and_config, decode_during_prefill=True,
                       prefill_chunk_tokens=2, decode_steps=4)
  query, doc = (random_tokens(rng, 3, config.vocab_size),
                random_tokens(rng, 4, config.vocab_size))
  rider = engine.submit(query, [doc], greedy(6))
  engine.step()
  assert len(engine.tokens_so_far(rider)) == 5  # its last in the next call
  calls, original = [], engine.runner.mixed_step_async

  def loses_the_pool_at_the_fifth_call(state, *args, **kwargs):
    calls.append(1)
    if len(calls) == 5:
      state.k.delete()
      state.v.delete()
      raise RuntimeError("device fault after donation")
    return original(state, *args, **kwargs)

  monkeypatch.setattr(engine.runner, "mixed_step_async",
                      loses_the_pool_at_the_fifth_call)
  second = engine.submit(random_tokens(rng, 3, config.vocab_size),
                         [random_tokens(rng, 16, config.vocab_size)],
                         greedy(3))
  results = {}
  while engine.has_work():
    results.update({r.request_id: r for r in engine.step()})
  assert results[second].finish_reason == "error"
  assert results[rider].finish_reason == "length"
  alone = make_engine(model_and_config).generate(query, [doc], greedy(6))
  assert results[rider].token_ids == alone.token_ids


def test_the_option_must_be_a_bool():
  with pytest.raises(ValueError, match="decode_during_prefill must be a bool"):
    SchedulerConfig(decode_during_prefill="yes")
