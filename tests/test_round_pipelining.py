"""A round keeps the device fed: document encodes never wait for the
device, and a first-token group's tokens are fetched only after the next
group's calls are dispatched.  Tokens are the same as served one by one."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from lazyattn_jax.engine import Request
from tests.test_engine import (greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)


def _three_group_round(config):
  rng = np.random.default_rng(5)
  return [Request(tuple(random_tokens(rng, 5, config.vocab_size)),
                  (tuple(random_tokens(rng, 10, config.vocab_size)),),
                  greedy(3)) for _ in range(3)]


def test_encoding_documents_does_not_wait_for_the_device(model_and_config,
                                                         monkeypatch):
  _, config, _ = model_and_config
  engine = make_engine(model_and_config)
  inside, fetched_inside, encodes = [False], [], []
  original_get = jax.device_get
  monkeypatch.setattr(jax, "device_get", lambda x: (
      fetched_inside.append(inside[0]), original_get(x))[1])
  encode = engine.runner.encode_documents

  def watched(*args, **kwargs):
    inside[0] = True
    encodes.append(1)
    try:
      return encode(*args, **kwargs)
    finally:
      inside[0] = False

  monkeypatch.setattr(engine.runner, "encode_documents", watched)
  rng = np.random.default_rng(0)
  engine.encode_documents([random_tokens(rng, 9, config.vocab_size)
                           for _ in range(2)])
  assert encodes and fetched_inside  # admission reads its plan back
  assert not any(fetched_inside)


def test_the_public_encode_returns_once_the_pool_is_written(model_and_config,
                                                           monkeypatch):
  _, config, _ = model_and_config
  engine = make_engine(model_and_config)
  waited = []
  original = jax.block_until_ready
  monkeypatch.setattr(jax, "block_until_ready",
                      lambda x: (waited.append(x), original(x))[1])
  rng = np.random.default_rng(1)
  engine.encode_documents([random_tokens(rng, 9, config.vocab_size)])
  assert waited and waited[-1] is engine.rounds.state


@pytest.mark.parametrize("riding", [False, True])
def test_the_next_group_is_dispatched_before_the_first_tokens_are_read(
    model_and_config, monkeypatch, riding):
  """...also when running requests decode inside prefill calls: a group's
  requests then ride in the calls of the group after next (mixed steps),
  and nothing waits for their tokens within the round."""
  _, config, _ = model_and_config
  requests = _three_group_round(config)
  engine = make_engine(model_and_config, first_token_group_tokens=10,
                       decode_during_prefill=riding)
  events = []
  runner = engine.runner
  encode, prefill_async = runner.encode_documents, runner.prefill_async
  mixed_step_async = runner.mixed_step_async

  def logged_encode(state, jobs, **kwargs):
    events.append("encode")
    return encode(state, jobs, **kwargs)

  def logged(call, prefix):
    def run(*args):
      state, fetch = call(*args)
      if prefix and not any(args[-1]):  # a mixed step's ends_query
        events.append(f"{prefix}encode")
        return state, fetch
      n = sum("query" in e for e in events)
      events.append(f"{prefix}query {n}")
      return state, lambda: events.append(f"fetch {n}") or fetch()
    return run

  monkeypatch.setattr(runner, "encode_documents", logged_encode)
  monkeypatch.setattr(runner, "prefill_async", logged(prefill_async, ""))
  monkeypatch.setattr(runner, "mixed_step_async",
                      logged(mixed_step_async, "mixed "))
  results = engine.generate_batch(requests)
  monkeypatch.undo()
  third = ["mixed encode", "mixed query 2"] if riding else ["encode",
                                                           "query 2"]
  assert events == ["encode", "query 0", "encode", "query 1", "fetch 0",
                    *third, "fetch 1", "fetch 2"]
  # The first group's requests still get their first tokens first.
  assert results[0].ttft_s <= results[1].ttft_s <= results[2].ttft_s
  for request, result in zip(requests, results):
    alone = make_engine(model_and_config).generate(
        request.query, request.documents, request.sampling)
    assert result.token_ids == alone.token_ids
    np.testing.assert_allclose(result.first_logits, alone.first_logits,
                               rtol=1e-5, atol=1e-5)
