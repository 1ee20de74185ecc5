"""The server under bad input, disconnects, a full queue, a failing request
and shutdown: every refusal is an OpenAI error naming the field, a client
that leaves frees its pages at once, and nobody else is harmed."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server_helpers import (CORPUS, MODEL_NAME, QUESTIONS,  # noqa: F401
                                  assert_pages_accounted_for, make_engine,
                                  metric, on_loop, pool_is_idle, serving,
                                  slow_down, wait_until)

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(text_model):
  with serving(make_engine(text_model, max_batch=2)) as (app, url):
    yield app, url


def chat_body(**fields):
  body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0,
          "messages": [{"role": "user", "content": QUESTIONS[0]}]}
  body.update(fields)
  return body


def completion_body(**fields):
  body = {"model": MODEL_NAME, "max_tokens": 4, "temperature": 0,
          "prompt": "The bridge"}
  body.update(fields)
  return body


BAD_REQUESTS = {
    # name: (endpoint, body, status, param the error names)
    "max_tokens as text": ("chat/completions", chat_body(max_tokens="5"), 400,
                           "max_tokens"),
    "temperature too high": ("chat/completions", chat_body(temperature=3), 400,
                             "temperature"),
    "n of 2": ("chat/completions", chat_body(n=2), 400, "n"),
    "no messages": ("chat/completions", chat_body(messages=[]), 400, "messages"),
    "unknown role": ("chat/completions", chat_body(messages=[{"role": "robot",
                                                  "content": "x"}]), 400,
                     "messages[0].role"),
    "ends with the assistant": ("chat/completions", chat_body(messages=[
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "y"}]), 400, "messages[1].role"),
    "unknown field": ("chat/completions", chat_body(frobnicate=1), 400, "frobnicate"),
    "document of a number": ("chat/completions", chat_body(documents=["ok", 5]), 400,
                             "documents[1]"),
    "empty document": ("chat/completions", chat_body(documents=[{"text": " "}]), 400,
                       "documents[0].text"),
    "unknown document id": ("chat/completions", chat_body(documents=[
        {"id": "doc-0123456789abcdef01234567"}]), 404, "documents[0].id"),
    "unknown model": ("chat/completions", chat_body(model="gpt-9"), 404, "model"),
    "penalty": ("chat/completions", chat_body(presence_penalty=0.5), 400,
                "presence_penalty"),
    "too many positions": ("chat/completions", chat_body(max_tokens=5000), 400,
                           "max_tokens"),
    # The limit's errors named max_tokens, a field the client did not send.
    "max_completion_tokens past the positions": (
        "chat/completions", chat_body(max_tokens=None,
                                      max_completion_tokens=5000), 400,
        "max_completion_tokens"),
    "max_completion_tokens past int32": (
        "chat/completions", chat_body(max_tokens=None,
                                      max_completion_tokens=2**40), 400,
        "max_completion_tokens"),
    "a prompt longer than the context": (
        "completions", completion_body(prompt=[1] * 5000, max_tokens=None),
        400, "prompt"),
    "empty prompt": ("completions", completion_body(prompt=""), 400,
                     "prompt"),
    "token id outside the vocabulary": (
        "completions", completion_body(prompt=[1, 10**7]), 400, "prompt"),
    "two prompts": ("completions", completion_body(prompt=["a", "b"]), 400,
                    "prompt"),
    # It was "one prompt per request is supported".
    "a token list with a float": ("completions",
                                  completion_body(prompt=[1, 2.5]), 400,
                                  "prompt[1]"),
    "too many stop strings": ("completions",
                              completion_body(stop=["x"] * 17), 400, "stop"),
    "echo": ("completions", completion_body(echo=True), 400, "echo"),
    # Accepted and dropped: the answer was the same for any name.
    "a message name": ("chat/completions", chat_body(messages=[
        {"role": "user", "content": "Hi", "name": "alice"}]), 400,
        "messages[0].name"),
    # A union's branch label was the param ("stop.str", "messages[0].
    # content.str"), with the first branch's message.
    "stop list with a number": ("completions",
                                completion_body(stop=["end", 1]), 400,
                                "stop[1]"),
    "stop of a number": ("completions", completion_body(stop=5), 400,
                         "stop"),
    "an image part": ("chat/completions", chat_body(messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
        400, "messages[0].content[1].type"),
    # 0 still asks for the sampled tokens' own logprobs.
    "logprobs of 0": ("completions", completion_body(logprobs=0), 400,
                      "logprobs"),
}


@pytest.mark.parametrize("name", sorted(BAD_REQUESTS))
def test_bad_requests_get_openai_errors_naming_the_field(server, name):
  _, url = server
  endpoint, body, status, param = BAD_REQUESTS[name]
  response = httpx.post(f"{url}/v1/{endpoint}", json=body, timeout=60)
  assert response.status_code == status, response.text
  error = response.json()["error"]
  assert error["param"] == param, error
  assert error["message"] and error["type"]
  if "positions" in error["message"]:
    assert error["code"] == "context_length_exceeded", error


def test_openai_client_raises_its_own_errors_and_the_server_goes_on(server):
  app, url = server
  c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
  with pytest.raises(openai.BadRequestError, match="temperature"):
    c.chat.completions.create(model=MODEL_NAME, temperature=-1,
                              messages=[{"role": "user", "content": "x"}])
  with pytest.raises(openai.NotFoundError, match="doc-missing"):
    c.chat.completions.create(model=MODEL_NAME, max_tokens=2, messages=[
        {"role": "user", "content": "x"}], extra_body={"documents": [
            {"id": "doc-missing"}]})
  response = httpx.post(url + "/v1/completions", content=b"{not json",
                        headers={"content-type": "application/json"})
  assert response.status_code == 400
  assert response.json()["error"]["code"] == "invalid_json"
  assert httpx.get(url + "/v1/nothing").status_code == 404
  out = c.completions.create(model=MODEL_NAME, prompt="The bridge",
                             max_tokens=3, temperature=0)
  assert out.usage.completion_tokens == 3
  assert pool_is_idle(app)


def test_a_disconnect_mid_stream_frees_the_pages_at_once(text_model):
  engine = make_engine(text_model, max_batch=2)
  slow_down(engine, 0.02)
  with serving(engine) as (app, url):
    body = chat_body(max_tokens=600, stream=True, documents=CORPUS[:3])
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      timeout=60) as response:
      lines = response.iter_lines()
      assert '"role":"assistant"' in next(lines)
      assert '"content"' in next(line for line in lines if line)  # a token
      assert on_loop(app, lambda e: e.request_counts()["running"]) == 1
      used = on_loop(app, lambda e: e.cache.stats(e.state))
      assert used["docs_in_use"] == 4  # three documents and the chat prefix
    # The client is gone: the request ends long before its 600 tokens.
    wait_until(lambda: pool_is_idle(app), 60, "the pages to be released")
    text = httpx.get(url + "/metrics").text
    assert metric(text,
                  'lazyattn_requests_total{finish_reason="cancelled"}') == 1
    on_loop(app, assert_pages_accounted_for)


def _block_loop(app):
  """Holds the engine loop's thread until the returned event is set."""
  release, held = threading.Event(), threading.Event()

  def hold(_engine):
    held.set()
    release.wait(60)
  app.state.engine_loop.call(hold)
  held.wait(60)
  return release


def _post_in_background(url, endpoint, body, timeout=60.0):
  outcome = {}

  def run():
    try:
      outcome["response"] = httpx.post(f"{url}/v1/{endpoint}", json=body,
                                       timeout=timeout)
    except httpx.HTTPError as error:
      outcome["error"] = error
  thread = threading.Thread(target=run)
  thread.start()
  return thread, outcome


def test_a_client_that_leaves_while_queued_is_cancelled(text_model):
  engine = make_engine(text_model, max_batch=2, num_pages=256)
  slow_down(engine, 0.02)
  with serving(engine) as (app, url):
    # Compiled first, so the rounds below take milliseconds.
    assert httpx.post(url + "/v1/chat/completions", json=chat_body(),
                      timeout=60).status_code == 200
    release = _block_loop(app)
    # Two long answers take both rows (max_batch 2); the third waits.  A
    # stream's headers come at once, so each client holds its connection.
    streams = [httpx.stream("POST", url + "/v1/chat/completions", timeout=60,
                            json=chat_body(max_tokens=600, stream=True))
               for _ in range(3)]
    for count, stream in enumerate(streams, 1):  # in this order
      stream.__enter__()
      wait_until(lambda: app.state.engine_loop.queue_depth() == count, 60,
                 "the request to reach the loop")
    release.set()
    wait_until(lambda: on_loop(app, lambda e: e.request_counts()) ==
               {"waiting": 1, "running": 2}, 60, "the third to queue")
    streams[2].__exit__(None, None, None)  # its client leaves
    wait_until(lambda: on_loop(app, lambda e: e.request_counts()) ==
               {"waiting": 0, "running": 2}, 60, "the cancel")
    text = httpx.get(url + "/metrics").text
    assert metric(text,
                  'lazyattn_requests_total{finish_reason="cancelled"}') == 1
    for stream in streams[:2]:
      stream.__exit__(None, None, None)
    wait_until(lambda: pool_is_idle(app), 60, "the pages to be released")


def test_a_full_queue_gets_429_with_retry_after(text_model):
  with serving(make_engine(text_model, max_batch=2), max_queue=2) as (app,
                                                                      url):
    release = _block_loop(app)
    waiting = [_post_in_background(url, "completions", completion_body())
               for _ in range(2)]
    wait_until(lambda: app.state.engine_loop.queue_depth() == 2, 10,
               "two queued requests")
    c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.RateLimitError) as refused:
      c.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2)
    assert refused.value.response.headers["retry-after"] == "1"
    assert refused.value.body["code"] == "queue_full"
    release.set()
    for thread, outcome in waiting:
      thread.join()
      assert outcome["response"].status_code == 200
    assert pool_is_idle(app)
    text = httpx.get(url + "/metrics").text
    assert metric(text, 'lazyattn_rejected_requests_total{status="429"}') == 1


def _hold_first_admission(engine) -> tuple[threading.Event, threading.Event]:
  """The first round that admits a request stops right after admitting it
  (mid-round, the engine's lock held, as during a long prefill or decode)
  until `release` is set; `held` is set when it stops."""
  held, release, admit = threading.Event(), threading.Event(), (
      engine.scheduler.admit)

  def admit_and_hold(state):
    state, new = admit(state)
    if new and not held.is_set():
      held.set()
      release.wait(60)
    return state, new
  engine.scheduler.admit = admit_and_hold
  return held, release


def test_a_request_being_generated_does_not_count_as_waiting(text_model):
  """max_batch 1, max_queue 1: while A is generated and nothing waits, B
  queues (200 once A is done) and the gauge shows it alone; C, arriving
  while B waits, gets 429.  Before, A counted as waiting until the end of
  the round that admitted it: the gauge read 1 with nothing waiting, and B
  got 429 queue_full."""
  engine = make_engine(text_model, max_batch=1)
  held, release = _hold_first_admission(engine)
  with serving(engine, max_queue=1) as (app, url):
    loop = app.state.engine_loop
    try:
      a = _post_in_background(url, "completions", completion_body())
      assert held.wait(60), "A was not admitted"
      # A is being generated (its round holds); nothing waits.
      assert loop.queue_depth() == 0
      text = httpx.get(url + "/metrics", timeout=30).text
      assert metric(text, "lazyattn_requests_waiting") == 0
      b = _post_in_background(url, "completions", completion_body())
      wait_until(lambda: loop.queue_depth() == 1 or "response" in b[1], 30,
                 "B to queue")
      assert "response" not in b[1], b[1]["response"].json()
      text = httpx.get(url + "/metrics", timeout=30).text
      assert metric(text, "lazyattn_requests_waiting") == 1
      c = httpx.post(url + "/v1/completions", json=completion_body(),
                     timeout=30)
      assert c.status_code == 429
      assert c.json()["error"]["code"] == "queue_full"
    finally:
      release.set()
    for thread, outcome in (a, b):
      thread.join()
      assert outcome["response"].status_code == 200
    assert pool_is_idle(app)
    text = httpx.get(url + "/metrics", timeout=30).text
    assert metric(text, "lazyattn_requests_waiting") == 0
    assert metric(text, 'lazyattn_rejected_requests_total{status="429"}') == 1


def test_a_request_the_engine_fails_does_not_harm_the_others(text_model):
  engine = make_engine(text_model, max_batch=4)
  doomed = 4242  # a token id only the failing request's prompt holds
  layout = engine._mode.layout

  def failing_layout(request, admission):
    if doomed in request.query:
      raise RuntimeError("injected fault")
    return layout(request, admission)
  engine._mode.layout = failing_layout
  with serving(engine) as (app, url):
    release = _block_loop(app)  # all four reach the same round
    jobs = [_post_in_background(url, "completions", completion_body(
        prompt=[11, 12, 13 + i] + ([doomed] if i == 2 else []),
        documents=CORPUS[i:i + 2], return_token_ids=True))
        for i in range(4)]
    wait_until(lambda: app.state.engine_loop.queue_depth() == 4, 10,
               "four queued requests")
    release.set()
    responses = []
    for thread, outcome in jobs:
      thread.join()
      responses.append(outcome["response"])
    assert [r.status_code for r in responses] == [200, 200, 500, 200]
    assert "injected fault" in responses[2].json()["error"]["message"]
    assert pool_is_idle(app)
  direct = make_engine(text_model)
  for i in (0, 1, 3):
    want = direct.generate([11, 12, 13 + i], CORPUS[i:i + 2],
                           max_new_tokens=4, temperature=0.0)
    assert responses[i].json()["choices"][0]["token_ids"] == want.token_ids


def _stream_in_background(url, body, timeout=60.0):
  outcome = {}

  def run():
    try:
      with httpx.stream("POST", f"{url}/v1/completions",
                        json={**body, "stream": True},
                        timeout=timeout) as response:
        outcome["status"] = response.status_code
        outcome["body"] = response.read().decode()
    except httpx.HTTPError as error:
      outcome["error"] = error
  thread = threading.Thread(target=run)
  thread.start()
  return thread, outcome


def test_shutdown_drains_short_requests_and_cancels_long_ones(text_model):
  """What runs past the drain is cancelled by the engine loop, so its
  client gets a 503 "shutting_down" (an error event and [DONE] on a
  stream), not uvicorn's bare 500 or a cut-off stream."""
  from lazyattn_jax.server import ServerConfig, create_app
  from lazyattn_jax.server.background import BackgroundServer
  engine = make_engine(text_model, max_batch=3, num_pages=256)
  slow_down(engine, 0.05)  # the long ones need 11 s and more
  app = create_app(engine, ServerConfig(model_name=MODEL_NAME,
                                        drain_timeout_s=3.0))
  server = BackgroundServer(app).start()
  url = server.url
  assert httpx.post(url + "/v1/completions", json=completion_body(),
                    timeout=60).status_code == 200  # compiled first
  release = _block_loop(app)  # all three start in the same round
  short = _post_in_background(url, "completions",
                              completion_body(max_tokens=16))
  long = _post_in_background(url, "completions",
                             completion_body(max_tokens=900))
  streamed = _stream_in_background(url, completion_body(max_tokens=900))
  wait_until(lambda: app.state.engine_loop.queue_depth() == 3, 60,
             "all three to reach the loop")
  release.set()
  wait_until(lambda: on_loop(app, lambda e: e.request_counts()["running"])
             == 3, 60, "all three to run")
  started = time.monotonic()
  server.stop()
  assert time.monotonic() - started < 11
  for thread, _ in (short, long, streamed):
    thread.join()
  assert short[1]["response"].status_code == 200
  assert short[1]["response"].json()["usage"]["completion_tokens"] == 16
  assert long[1]["response"].status_code == 503
  assert long[1]["response"].json()["error"]["code"] == "shutting_down"
  assert streamed[1]["status"] == 200
  events = [line[len("data: "):] for line in streamed[1]["body"].splitlines()
            if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  assert json.loads(events[-2])["error"]["code"] == "shutting_down"
  assert not engine.has_work()
  assert_pages_accounted_for(engine)


def test_requests_still_queued_at_shutdown_get_503(text_model):
  """Requests the loop had not yet taken when the drain ended (here it is
  held, as by a long compile) are answered 503 "shutting_down" too."""
  from lazyattn_jax.server import ServerConfig, create_app
  from lazyattn_jax.server.background import BackgroundServer
  engine = make_engine(text_model)
  app = create_app(engine, ServerConfig(model_name=MODEL_NAME,
                                        drain_timeout_s=0.5))
  server = BackgroundServer(app).start()
  release = _block_loop(app)
  plain = _post_in_background(server.url, "completions", completion_body())
  streamed = _stream_in_background(server.url, completion_body())
  wait_until(lambda: app.state.engine_loop.queue_depth() == 2, 60,
             "both to reach the loop")
  stopping = threading.Thread(target=server.stop)
  stopping.start()
  time.sleep(1.5)  # past the drain: both are marked cancelled
  release.set()
  stopping.join()
  for thread, _ in (plain, streamed):
    thread.join()
  assert plain[1]["response"].status_code == 503
  assert plain[1]["response"].json()["error"]["code"] == "shutting_down"
  events = [line[len("data: "):] for line in streamed[1]["body"].splitlines()
            if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  assert json.loads(events[-2])["error"]["code"] == "shutting_down"
  assert not engine.has_work()


def test_documents_post_fits_the_pool_and_registers_only_what_it_encoded(
    text_model, monkeypatch):
  """Documents that fit the pool one by one but not together are encoded
  (200); a busy cache's 429 leaves no id registered."""
  from lazyattn_jax.errors import CacheCapacityError
  engine = make_engine(text_model, num_pages=40)
  docs = [{"token_ids": [100 + i] * (15 * 16)} for i in range(3)]  # 15 pages
  with serving(engine) as (app, url):
    response = httpx.post(url + "/v1/documents", json={"documents": docs},
                          timeout=120)
    assert response.status_code == 200, response.text
    assert [d["tokens"] for d in response.json()["data"]] == [240] * 3
    registered = len(app.state.registry)

    def busy(*_args, **_kwargs):
      raise CacheCapacityError("live requests hold the pool")
    monkeypatch.setattr(engine, "encode_documents", busy)
    response = httpx.post(url + "/v1/documents",
                          json={"documents": ["A new document."]}, timeout=60)
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "cache_busy"
    assert len(app.state.registry) == registered


def test_a_wrong_method_is_405_with_allow(server):
  _, url = server
  response = httpx.delete(url + "/v1/documents", timeout=30)
  assert response.status_code == 405
  assert response.headers.get("allow") == "POST"
  assert response.json()["error"]["message"] == "Method Not Allowed"


def test_unknown_routes_are_not_counted_as_rejected_requests(server):
  """404 / 405 from the router are not API requests refused; a request of
  the API refused is."""
  _, url = server
  rejected = lambda status: metric(
      httpx.get(url + "/metrics", timeout=30).text,
      f'lazyattn_rejected_requests_total{{status="{status}"}}')
  before = rejected(404), rejected(405), rejected(400)
  assert httpx.get(url + "/wp-admin", timeout=30).status_code == 404
  assert httpx.delete(url + "/v1/documents", timeout=30).status_code == 405
  assert httpx.post(url + "/v1/completions", json={"prompt": 3},
                    timeout=30).status_code == 400
  assert (rejected(404), rejected(405), rejected(400)) == (
      before[0], before[1], before[2] + 1)


def test_documents_post_refuses_more_documents_than_it_remembers(text_model):
  """Registered one by one, the first ids would be forgotten by the last:
  the call is refused before anything is encoded or registered."""
  with serving(make_engine(text_model, num_pages=64),
               max_registered_documents=3) as (app, url):
    docs = [f"Document number {i} about bridges." for i in range(5)]
    response = httpx.post(url + "/v1/documents", json={"documents": docs},
                          timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "documents"
    assert "5 different documents in one call; the server remembers at " \
        "most 3" in error["message"]
    assert len(app.state.registry) == 0
    # Repeats count once; three different documents fit.
    response = httpx.post(url + "/v1/documents",
                          json={"documents": docs[:3] + docs[:2]}, timeout=60)
    assert response.status_code == 200, response.text
    for entry in response.json()["data"]:
      used = httpx.post(url + "/v1/completions", json=completion_body(
          documents=[{"id": entry["id"]}], max_tokens=1), timeout=60)
      assert used.status_code == 200, used.text


def test_null_means_the_default(server):
  """OpenAI's schema allows null for optional fields (the openai client
  sends it for an argument given as None): the answer is the default's."""
  _, url = server
  nulls = dict(n=None, stream=None, presence_penalty=None,
               frequency_penalty=None, documents=None, echo=None,
               return_token_ids=None, top_p=None, stop=None)
  plain = httpx.post(url + "/v1/completions", json=completion_body(),
                     timeout=60)
  with_nulls = httpx.post(url + "/v1/completions",
                          json=completion_body(**nulls), timeout=60)
  assert with_nulls.status_code == 200, with_nulls.text
  assert (with_nulls.json()["choices"][0]["text"] ==
          plain.json()["choices"][0]["text"])
  c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
  out = c.chat.completions.create(
      model=MODEL_NAME, messages=[{"role": "user", "content": "x"}],
      max_tokens=2, n=None, presence_penalty=None, stream=None)
  assert out.choices[0].finish_reason in ("stop", "length")


def test_a_server_whose_engine_was_closed_answers_503(text_model):
  # It was a 500 internal error naming EngineClosedError.
  with serving(make_engine(text_model)) as (app, url):
    on_loop(app, lambda engine: engine.close())
    response = httpx.post(f"{url}/v1/completions", json={
        "model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2},
        timeout=60)
  assert response.status_code == 503, response.text
  assert response.json()["error"]["code"] == "shutting_down"


def test_models_retrieve_finds_the_served_model_only(server):
  # The route was missing: the openai client's models.retrieve raised
  # NotFoundError without a code for the served model too.
  _, url = server
  models = openai.OpenAI(base_url=f"{url}/v1", api_key="none").models
  assert models.retrieve(MODEL_NAME).id == MODEL_NAME
  response = httpx.get(f"{url}/v1/models/gpt-9", timeout=60)
  assert response.status_code == 404
  error = response.json()["error"]
  assert (error["param"], error["code"]) == ("model", "model_not_found")
