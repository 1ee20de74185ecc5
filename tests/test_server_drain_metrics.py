"""The server's drain and metrics against what requests did: a drain
waits for requests in their first round and for ever when asked to; a
request that ran is counted once, by its finish reason, never also as a
rejection; a stop string does not inflate TPOT."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server_helpers import (MODEL_NAME, make_engine, metric, serving,
                                  wait_until)
from tests.test_server_faults import (_block_loop, _post_in_background,
                                     completion_body)


def _slow_first_round(engine, seconds: float) -> threading.Event:
  """The engine's first round takes `seconds` longer (as a first compile
  does); the event is set when it starts."""
  started, step = threading.Event(), engine.step
  rounds = []

  def step_slowly_once(**kwargs):
    if not rounds:
      rounds.append(1)
      started.set()
      time.sleep(seconds)
    return step(**kwargs)
  engine.step = step_slowly_once
  return started


@pytest.mark.parametrize("drain_timeout_s", [30.0, float("inf")])
def test_a_drain_waits_for_a_request_in_its_first_round(text_model,
                                                        drain_timeout_s):
  """Before: the loop counted a request in flight only after the round
  that took it, so a drain begun during a long first round cancelled it
  at once (503); an infinite drain raised OverflowError (a bare 500)."""
  from lazyattn_jax.server import ServerConfig, create_app
  from lazyattn_jax.server.background import BackgroundServer
  engine = make_engine(text_model)
  started = _slow_first_round(engine, 2.0)
  app = create_app(engine, ServerConfig(model_name=MODEL_NAME,
                                        drain_timeout_s=drain_timeout_s))
  server = BackgroundServer(app).start()
  thread, outcome = _post_in_background(server.url, "completions",
                                        completion_body(max_tokens=6))
  assert started.wait(60)
  server.stop()
  thread.join()
  assert outcome["response"].status_code == 200
  assert outcome["response"].json()["usage"]["completion_tokens"] == 6


def test_documents_are_refused_while_draining(text_model):
  """draining.py: requests that arrive during the drain get 503.  Before,
  POST /v1/documents was still served (200): it encoded on the stopping
  loop and registered ids the server then forgot."""
  from lazyattn_jax.server import ServerConfig, create_app
  from lazyattn_jax.server.background import BackgroundServer
  from lazyattn_jax.server.engine_loop import LoopClosedError
  engine = make_engine(text_model)
  started = _slow_first_round(engine, 3.0)
  app = create_app(engine, ServerConfig(model_name=MODEL_NAME,
                                        drain_timeout_s=30.0))
  server = BackgroundServer(app).start()
  url = server.url
  thread, outcome = _post_in_background(url, "completions",
                                        completion_body(max_tokens=4))
  assert started.wait(60)
  stopping = threading.Thread(target=server.stop)
  stopping.start()
  loop = app.state.engine_loop
  wait_until(lambda: not loop.alive, 30, "the drain to begin")
  response = httpx.post(url + "/v1/documents", timeout=30,
                        json={"documents": ["Sent while draining."]})
  assert response.status_code == 503, response.text
  assert response.json()["error"]["code"] == "shutting_down"
  # The loop refuses a client's new work even past that check (a call
  # already on its way when the drain began); its own calls still run.
  refused = loop.call(lambda e: e.encode_documents([(5, 6)]), new_work=True)
  with pytest.raises(LoopClosedError, match="shutting down"):
    refused.result(timeout=30)
  assert loop.call(lambda e: "ran").result(timeout=30) == "ran"
  stopping.join()
  thread.join()
  assert outcome["response"].status_code == 200


def _counts(url):
  text = httpx.get(url + "/metrics", timeout=30).text
  return {name: metric(text, name) for name in (
      'lazyattn_requests_total{finish_reason="error"}',
      'lazyattn_rejected_requests_total{status="500"}')}


def test_a_request_that_failed_in_the_engine_is_no_rejection(text_model):
  """A request the engine failed (its layout raised, then its whole step)
  counts once among ended requests with reason "error", not also as a
  rejected one; before, the first counted twice and the second never in
  requests_total."""
  engine = make_engine(text_model)
  layout, step = engine._mode.layout, engine.step
  faults = {"layout": True, "step": False}

  def failing_layout(request, admission):
    if faults["layout"]:
      raise RuntimeError("injected layout fault")
    return layout(request, admission)

  def failing_step(**kwargs):
    if faults["step"]:
      raise RuntimeError("injected step fault")
    return step(**kwargs)
  engine._mode.layout, engine.step = failing_layout, failing_step
  with serving(engine) as (_app, url):
    before = _counts(url)
    response = httpx.post(url + "/v1/completions", json=completion_body(),
                          timeout=60)
    assert response.status_code == 500
    faults.update(layout=False, step=True)
    response = httpx.post(url + "/v1/completions", json=completion_body(),
                          timeout=60)
    assert response.status_code == 500
    assert "injected step fault" in response.json()["error"]["message"]
    after = _counts(url)
  error, rejected = after.keys()
  assert after[error] - before[error] == 2
  assert after[rejected] == before[rejected]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_the_engine_refused_to_queue_is_a_rejection(text_model,
                                                               stream):
  """A request the loop could not queue (`submit_prepared` raised) is a
  rejected one with status 500, streamed or not; streamed, it was in
  neither requests_total nor rejected."""
  engine = make_engine(text_model)

  def refuse(*_args, **_kwargs):
    raise RuntimeError("injected submit fault")
  engine.submit_prepared = refuse
  with serving(engine) as (_app, url):
    before = _counts(url)
    response = httpx.post(url + "/v1/completions", timeout=60,
                          json=completion_body(stream=stream))
    assert "injected submit fault" in response.text
    assert response.status_code == (200 if stream else 500)
    after = _counts(url)
  error, rejected = after.keys()
  assert after[rejected] - before[rejected] == 1
  assert after[error] == before[error]


class _StoppedOutput:
  """A TextOutput that met its stop string after `tokens` tokens."""
  stopped, text = True, "cut"

  def __init__(self, tokens):
    self.tokens = tokens

  def finish(self):
    return ""


def test_a_stop_string_does_not_inflate_tpot():
  """The engine made 17 tokens (its first at 1 s, its last at 3 s, in one
  round) before the loop saw the stop string after the 10th: the result
  keeps 10, and its last token's time is the round's rate per token
  (2 s / 16) after the first, not the round's end.  Before, TPOT was
  2 s / 9."""
  import asyncio
  from lazyattn_jax.requests import GenerationResult
  from lazyattn_jax.server.engine_loop import EngineLoop, RequestHandle
  from lazyattn_jax.server.metrics import ServerMetrics

  async def finish():
    metrics = ServerMetrics()
    loop = EngineLoop(None, max_queue=4, metrics=metrics)
    handle = RequestHandle(None, 0.0, wants_tokens=False,
                           output=_StoppedOutput(10))
    loop._finish(handle, GenerationResult(
        request_id=0, token_ids=list(range(17)), doc_hits=[], ttft_s=1.0,
        latency_s=3.0, finish_reason="cancelled", prompt_tokens=5,
        prefill_tokens_computed=5))
    return (await handle.events.get()).result, metrics.render().decode()
  result, text = asyncio.run(finish())
  assert (len(result.token_ids), result.finish_reason) == (10, "stop")
  assert result.latency_s == pytest.approx(1.0 + 9 * 2.0 / 16)
  assert result.decode_time_per_token_s == pytest.approx(2.0 / 16)
  assert metric(text, "lazyattn_time_per_output_token_seconds_sum") == (
      pytest.approx(2.0 / 16))


def test_the_queue_gauge_is_read_when_scraped(text_model):
  """Requests waiting while the loop is held (as by a long compile) show in
  the queue gauge; before, it moved only after a round."""
  with serving(make_engine(text_model)) as (app, url):
    release = _block_loop(app)
    jobs = [_post_in_background(url, "completions", completion_body())
            for _ in range(2)]
    try:
      wait_until(lambda: app.state.engine_loop.queue_depth() == 2, 30,
                 "two queued requests")
      text = httpx.get(url + "/metrics", timeout=30).text
    finally:
      release.set()
    for thread, _ in jobs:
      thread.join()
  assert metric(text, "lazyattn_requests_waiting") == 2


def test_health_answers_head(text_model):
  with serving(make_engine(text_model)) as (_app, url):
    assert httpx.head(url + "/health", timeout=30).status_code == 200
