"""`LazyEngine.step(on_first_tokens=...)`: first tokens are out before the
round's decode loop is waited for, and the server streams them then.  A
caller of `step()` saw a first token only after that loop: one loop later
than the result's `ttft_s` says (decode_steps of them)."""

from __future__ import annotations

import logging
import time

import httpx
import numpy as np

from tests.server_helpers import make_engine as make_text_engine
from tests.server_helpers import serving
from tests.test_engine import greedy, make_engine, model_and_config  # noqa: F401
from tests.test_engine import random_tokens
from tests.test_server_faults import completion_body


def _log_fetches(engine, log, seconds: float = 0.0):
  """Wraps the runner's decode loops: `log` gets "fetched" once each loop
  has been waited for (after `seconds` more)."""
  decode_async = engine.runner.decode_async

  def logged(*args, **kwargs):
    state, fetch = decode_async(*args, **kwargs)

    def slow_fetch():
      time.sleep(seconds)
      out = fetch()
      log.append(("fetched", time.perf_counter()))
      return out
    return state, slow_fetch
  engine.runner.decode_async = logged


def test_first_tokens_come_before_the_decode_loop_is_waited_for(
    model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(2)
  engine = make_engine(model_and_config, decode_steps=4)
  log = []
  _log_fetches(engine, log)
  docs = [random_tokens(rng, 6, config.vocab_size) for _ in range(2)]
  first = engine.submit(random_tokens(rng, 3, config.vocab_size), docs,
                        greedy(20))

  def seen():
    log.append(("first tokens", {r: len(engine.tokens_so_far(r))
                                 for r in (first, second)}))
  second = None
  engine.step(on_first_tokens=seen)
  second = engine.submit(random_tokens(rng, 4, config.vocab_size), docs[:1],
                         greedy(10))
  engine.step(on_first_tokens=seen)
  engine.step(on_first_tokens=seen)  # no new request: not called
  assert [entry[0] for entry in log] == ["first tokens", "fetched",
                                         "first tokens", "fetched",
                                         "fetched"]
  assert log[0][1] == {first: 1, None: 0}
  assert log[2][1] == {first: 5, second: 1}


def test_a_callback_that_raises_is_logged_and_the_round_goes_on(
    model_and_config, caplog):
  _, config, _ = model_and_config
  rng = np.random.default_rng(3)
  query, doc = (random_tokens(rng, 3, config.vocab_size),
                random_tokens(rng, 5, config.vocab_size))
  want = make_engine(model_and_config).generate(query, [doc], greedy(6))
  engine = make_engine(model_and_config)
  request = engine.submit(query, [doc], greedy(6))

  def broken():
    raise RuntimeError("callback bug")
  results = []
  with caplog.at_level(logging.ERROR, logger="lazyattn_jax"):
    while engine.has_work():
      results += engine.step(on_first_tokens=broken)
  assert "on_first_tokens raised" in caplog.text
  assert [r.request_id for r in results] == [request]
  assert results[0].token_ids == want.token_ids


def test_the_server_streams_the_first_token_during_the_decode_loop(
    text_model):
  engine = make_text_engine(text_model, decode_steps=64)
  log = []
  _log_fetches(engine, log, seconds=2.0)
  with serving(engine) as (_app, url):
    body = completion_body(max_tokens=40, stream=True)
    with httpx.stream("POST", url + "/v1/completions", json=body,
                      timeout=60) as response:
      first_chunk = None
      for line in response.iter_lines():
        if first_chunk is None and line.startswith("data: {"):
          first_chunk = time.perf_counter()
  fetched = [at for what, at in log if what == "fetched"]
  assert fetched and first_chunk < fetched[0]


def test_a_step_inside_the_callback_is_refused_and_its_time_not_loop_time(
    model_and_config, caplog):
  # The engine's lock is reentrant, so a nested step() ran: it decoded the
  # running requests again from the state before the loop in flight, and
  # the outer loop then recorded its tokens on top (duplicated tokens,
  # max_new_tokens overrun).
  _, config, _ = model_and_config
  rng = np.random.default_rng(5)
  docs = [random_tokens(rng, 6, config.vocab_size) for _ in range(2)]
  queries = [random_tokens(rng, n, config.vocab_size) for n in (3, 4)]
  want = [make_engine(model_and_config).generate(q, d, greedy(12)).token_ids
          for q, d in ((queries[0], docs), (queries[1], docs[:1]))]
  engine = make_engine(model_and_config, decode_steps=4)
  first = engine.submit(queries[0], docs, greedy(12))
  engine.step()
  second = engine.submit(queries[1], docs[:1], greedy(12))

  def nested_step_and_a_slow_host():
    time.sleep(0.3)
    engine.step()
  results, before = {}, engine.stats.decode_seconds
  with caplog.at_level(logging.ERROR, logger="lazyattn_jax"):
    results.update({r.request_id: r for r in engine.step(
        on_first_tokens=nested_step_and_a_slow_host)})
  assert "step() inside a step" in caplog.text
  seconds = engine.stats.decode_seconds - before
  while engine.has_work():
    results.update({r.request_id: r for r in engine.step()})
  assert [results[first].token_ids, results[second].token_ids] == want
  # The callback's 0.3 s are not decode-loop time.
  assert seconds < 0.3


def test_a_request_that_ended_on_its_first_token_is_not_cancelled_by_the_callback(
    model_and_config):
  """A request whose first token is its last has ended when the callback
  runs; cancel() returned True there and its result said "cancelled"
  instead of "length" (or "stop")."""
  _, config, _ = model_and_config
  rng = np.random.default_rng(7)
  doc = random_tokens(rng, 6, config.vocab_size)
  query = random_tokens(rng, 3, config.vocab_size)
  engine = make_engine(model_and_config)
  ended = engine.submit(query, [doc], greedy(1))
  running = engine.submit(query, [doc], greedy(5))
  cancelled = {}

  def cancel_both():
    cancelled.update({rid: engine.cancel(rid) for rid in (ended, running)})
  results = {r.request_id: r for r in engine.step(on_first_tokens=cancel_both)}
  assert cancelled == {ended: False, running: True}
  assert results[ended].finish_reason == "length"
  assert len(results[ended].token_ids) == 1
  assert results[running].finish_reason == "cancelled"
