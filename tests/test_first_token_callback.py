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
