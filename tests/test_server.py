"""The HTTP server through the real `openai` client: sync, async and
streaming; 32 concurrent clients get exactly the engine's greedy tokens;
documents by text, token ids and registered id; usage, models, health and
metrics."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from lazyattn_jax.engine import Request
from lazyattn_jax.sampling import SamplingParams
from tests.server_helpers import (CORPUS, MODEL_NAME, QUESTIONS,  # noqa: F401
                                  make_engine, metric, on_loop, pool_is_idle,
                                  serving)

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def server(text_model):
  engine = make_engine(text_model)
  with serving(engine) as (app, url):
    yield app, url


def client(url) -> "openai.OpenAI":
  return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def direct(text_model, jobs):
  """Greedy tokens and text of (question, documents, max_tokens) jobs run
  directly through a fresh LazyEngine."""
  engine = make_engine(text_model)
  results = engine.generate_batch([
      Request(q, docs, SamplingParams(max_new_tokens=n, temperature=0.0))
      for q, docs, n in jobs])
  return [(r.token_ids, r.text) for r in results]


def chat(c, question, documents, max_tokens, **extra):
  return c.chat.completions.create(
      model=MODEL_NAME, messages=[{"role": "user", "content": question}],
      max_tokens=max_tokens, temperature=0,
      extra_body={"documents": documents, "return_token_ids": True, **extra})


def test_sync_chat_with_documents_reuses_them_and_reports_usage(server,
                                                                text_model):
  _, url = server
  c = client(url)
  docs = CORPUS[:2]
  first = chat(c, QUESTIONS[0], docs, 6)
  (want_tokens, want_text), = direct(text_model, [(QUESTIONS[0], docs, 6)])
  choice = first.choices[0]
  assert choice.token_ids == want_tokens
  assert choice.message.content == want_text
  assert choice.message.role == "assistant"
  assert choice.finish_reason in ("stop", "length")
  assert first.object == "chat.completion" and first.model == MODEL_NAME
  assert first.usage.completion_tokens == len(want_tokens)
  # The same documents from another client, in another order: hits, read in
  # place; cached_tokens counts them and the chat prefix.
  again = chat(client(url), QUESTIONS[1], [{"text": docs[1]},
                                           {"text": docs[0]}], 4)
  assert again.usage.cached_documents == 2
  assert again.usage.prompt_tokens_details.cached_tokens == (
      again.usage.cached_tokens)
  assert 0 < again.usage.cached_tokens < again.usage.prompt_tokens
  assert again.usage.total_tokens == (again.usage.prompt_tokens +
                                      again.usage.completion_tokens)


def test_text_completion_with_token_id_documents(server, text_model):
  _, url = server
  _, _, tokenizer = text_model
  doc = tokenizer.encode(CORPUS[3])
  out = client(url).completions.create(
      model=MODEL_NAME, prompt="Bramley makes", max_tokens=5, temperature=0,
      extra_body={"documents": [{"token_ids": doc}],
                  "return_token_ids": True})
  engine = make_engine(text_model)
  want = engine.generate(tokenizer.encode("Bramley makes"), [doc],
                         max_new_tokens=5, temperature=0.0)
  assert out.object == "text_completion"
  assert out.choices[0].token_ids == want.token_ids
  assert out.choices[0].text == want.text
  assert out.usage.prompt_tokens == len(doc) + len(
      tokenizer.encode("Bramley makes"))


def test_streaming_chunks_join_to_the_whole_answer(server, text_model):
  _, url = server
  stream = client(url).chat.completions.create(
      model=MODEL_NAME, messages=[{"role": "user", "content": QUESTIONS[2]}],
      max_tokens=12, temperature=0, stream=True,
      stream_options={"include_usage": True},
      extra_body={"documents": CORPUS[2:4]})
  chunks = list(stream)
  (want_tokens, want_text), = direct(text_model,
                                     [(QUESTIONS[2], CORPUS[2:4], 12)])
  assert chunks[0].choices[0].delta.role == "assistant"
  assert all(c.object == "chat.completion.chunk" for c in chunks)
  text = "".join(c.choices[0].delta.content or "" for c in chunks
                 if c.choices)
  assert text == want_text
  finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
  assert finishes[-1] in ("stop", "length") and not any(finishes[:-1])
  assert not chunks[-1].choices  # the usage chunk comes last
  assert chunks[-1].usage.completion_tokens == len(want_tokens)


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_ends_with_done(server, include_usage):
  # With include_usage, OpenAI's chunks before the usage chunk carry
  # "usage": null; they had no usage key.
  import json
  _, url = server
  body = {"model": MODEL_NAME, "prompt": "The bridge", "max_tokens": 3,
          "temperature": 0, "stream": True}
  if include_usage:
    body["stream_options"] = {"include_usage": True}
  with httpx.stream("POST", url + "/v1/completions", json=body,
                    timeout=60) as response:
    assert response.headers["content-type"].startswith("text/event-stream")
    lines = [line for line in response.iter_lines() if line]
  assert lines[-1] == "data: [DONE]"
  assert all(line.startswith("data: ") for line in lines)
  chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
  if include_usage:
    assert all(c["usage"] is None for c in chunks[:-1])
    assert 1 <= chunks[-1]["usage"]["completion_tokens"] <= 3
  else:
    assert not any("usage" in c for c in chunks)


def test_32_concurrent_async_clients_get_the_engines_greedy_tokens(
    server, text_model):
  """Each job: its own question, documents and length, from its own
  client; together they batch, queue and evict in the server."""
  app, url = server
  jobs = []
  for i in range(32):
    docs = [CORPUS[(i + k) % len(CORPUS)] for k in range(1 + i % 3)]
    jobs.append((QUESTIONS[i % len(QUESTIONS)] + f" ({i})", docs, 3 + i % 6))
  want = direct(text_model, jobs)

  async def one(question, docs, n):
    c = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused",
                           max_retries=0)
    async with c:
      out = await c.chat.completions.create(
          model=MODEL_NAME, messages=[{"role": "user", "content": question}],
          max_tokens=n, temperature=0,
          extra_body={"documents": docs, "return_token_ids": True})
    return out.choices[0].token_ids, out.choices[0].message.content

  async def run_all():
    return await asyncio.gather(*(one(*job) for job in jobs))
  got = asyncio.run(run_all())
  assert got == want
  assert pool_is_idle(app)


def test_registered_documents_are_used_by_id(server, text_model):
  app, url = server
  response = httpx.post(url + "/v1/documents",
                        json={"documents": [CORPUS[5], {"text": CORPUS[6]}]},
                        timeout=60)
  assert response.status_code == 200
  data = response.json()["data"]
  assert [d["object"] for d in data] == ["document", "document"]
  ids = [d["id"] for d in data]
  # Registering the same text again gives the same id, now cached.
  again = httpx.post(url + "/v1/documents", json={"documents": [CORPUS[5]]},
                     timeout=60).json()["data"]
  assert again[0]["id"] == ids[0] and again[0]["cached"]
  out = chat(client(url), QUESTIONS[0], [{"id": ids[1]}, {"id": ids[0]}], 5)
  assert out.usage.cached_documents == 2
  (want_tokens, _), = direct(text_model,
                             [(QUESTIONS[0], [CORPUS[6], CORPUS[5]], 5)])
  assert out.choices[0].token_ids == want_tokens
  assert on_loop(app, lambda e: e.cache.stats(e.state)["cached_docs"]) >= 2


def test_models_health_and_metrics(server):
  _, url = server
  models = client(url).models.list()
  assert [m.id for m in models.data] == [MODEL_NAME]
  assert httpx.get(url + "/health").json() == {"status": "ok"}
  chat(client(url), QUESTIONS[3], CORPUS[:1], 4)
  chat(client(url), QUESTIONS[3], CORPUS[:1], 4)
  text = httpx.get(url + "/metrics").text
  for name in ("lazyattn_time_to_first_token_seconds_count",
               "lazyattn_time_per_output_token_seconds_count",
               "lazyattn_generation_tokens_total",
               "lazyattn_prompt_tokens_total",
               "lazyattn_document_hits_total",
               "lazyattn_document_lookups_total"):
    assert metric(text, name) > 0, name
  assert 0 < metric(text, "lazyattn_document_hit_rate") <= 1
  assert metric(text, "lazyattn_kv_pages_used") > 0
  assert metric(text, "lazyattn_kv_pages_free") > 0
  for gauge in ("lazyattn_requests_waiting", "lazyattn_requests_running"):
    assert f"# TYPE {gauge} gauge" in text


def test_a_conversation_and_stop_strings(server, text_model):
  _, url = server
  _, _, tokenizer = text_model
  c = client(url)
  document = "The Fenwick mill grinds barley for the whole valley."
  messages = [{"role": "system", "content": "Answer briefly."},
              {"role": "user", "content": "Hello"},
              {"role": "assistant", "content": "Hi."},
              {"role": "user", "content": QUESTIONS[0]}]
  full = c.chat.completions.create(
      model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
      extra_body={"documents": [document], "return_token_ids": True})
  text = full.choices[0].message.content
  assert full.usage.cached_documents == 0  # the conversation is not counted
  # The same conversation with a stop string taken from its own answer.
  cut = len(text) // 2
  stop = text[cut:cut + 3]
  assert stop and stop in text
  # Token ids and usage end at the token that completed the stop string,
  # not at the end of the round that produced it.
  ids = full.choices[0].token_ids
  kept = next(k for k in range(1, len(ids) + 1)
              if stop in tokenizer.decode(ids[:k]))
  stops_before = metric(httpx.get(url + "/metrics").text,
                        'lazyattn_requests_total{finish_reason="stop"}')
  stopped = c.chat.completions.create(
      model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
      stop=[stop], extra_body={"documents": [document],
                               "return_token_ids": True})
  assert stopped.choices[0].finish_reason == "stop"
  assert stopped.choices[0].message.content == text[:text.index(stop)]
  assert stopped.usage.cached_documents == 1
  assert stopped.choices[0].token_ids == ids[:kept]
  assert stopped.usage.completion_tokens == kept
  streamed = c.chat.completions.create(
      model=MODEL_NAME, messages=messages, max_tokens=10, temperature=0,
      stop=stop, stream=True, stream_options={"include_usage": True},
      extra_body={"documents": [document], "return_token_ids": True})
  chunks = list(streamed)
  choices = [ch.choices[0] for ch in chunks if ch.choices]
  assert "".join(ch.delta.content or "" for ch in choices) == (
      text[:text.index(stop)])
  assert choices[-1].finish_reason == "stop"
  assert [t for ch in choices for t in getattr(ch, "token_ids", None) or []
          ] == ids[:kept]
  assert chunks[-1].usage.completion_tokens == kept
  assert tokenizer.decode(ids) == text
  assert metric(httpx.get(url + "/metrics").text,
                'lazyattn_requests_total{finish_reason="stop"}') == (
                    stops_before + 2)


def test_pool_gauges_are_set_before_the_first_request(text_model):
  engine = make_engine(text_model, num_pages=48)
  with serving(engine) as (_, url):
    text = httpx.get(url + "/metrics").text
  assert metric(text, "lazyattn_kv_pages_free") == 48
  assert metric(text, "lazyattn_kv_pages_used") == 0


def test_a_request_without_max_tokens_gets_what_its_prompt_leaves(server,
                                                                 text_model):
  """The server's default max_tokens (256) is a bound: a prompt that
  leaves fewer positions is served to the end of the context, not refused
  for a max_tokens the client never sent (as OpenAI and vLLM do)."""
  config, _, _ = text_model
  prompt_len = config.max_position - 100
  response = httpx.post(f"{server[1]}/v1/completions", json={
      "model": MODEL_NAME, "prompt": [1] * prompt_len, "temperature": 0},
      timeout=120)
  assert response.status_code == 200, response.text
  body = response.json()
  assert body["usage"]["prompt_tokens"] == prompt_len
  assert 1 <= body["usage"]["completion_tokens"] <= 100
  if body["choices"][0]["finish_reason"] == "length":
    assert body["usage"]["completion_tokens"] == 100


def test_a_conversation_on_a_chat_preamble_server_counts_each_token_once(
    text_model):
  """Where the engine's preamble is the chat prefix, a conversation
  rendered from the template's start holds that prefix too: the server
  serves it once (the preamble's), so the prompt is as long as on a server
  without a preamble, and a long prompt's fitted default max_tokens is
  the same."""
  from lazyattn_jax.quality_options import QualityOptions
  messages = [{"role": "user", "content": "Hello"},
              {"role": "assistant", "content": "Hi."},
              {"role": "user", "content": QUESTIONS[0]}]
  usage = {}
  for name, quality in (("plain", None),
                        ("chat", QualityOptions(preamble="chat"))):
    with serving(make_engine(text_model, quality=quality)) as (app, url):
      out = client(url).chat.completions.create(
          model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
          extra_body={"documents": CORPUS[:2]})
      usage[name] = out.usage.prompt_tokens
      assert pool_is_idle(app)
  assert usage["chat"] == usage["plain"]


def test_a_prompt_larger_than_the_pool_names_the_prompt(text_model):
  """Without documents, a prompt the whole pool cannot hold is the
  prompt's fault (400 naming `prompt`), not the documents'."""
  with serving(make_engine(text_model, num_pages=40)) as (app, url):
    # 900 + the default 256 would also pass the model's 1024 positions.
    for length in (700, 900):
      response = httpx.post(f"{url}/v1/completions", json={
          "model": MODEL_NAME, "prompt": [1] * length, "temperature": 0},
          timeout=120)
      assert response.status_code == 400, response.text
      error = response.json()["error"]
      assert (error["param"], error["code"]) == ("prompt",
                                                 "cache_capacity_exceeded")
    assert pool_is_idle(app)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_past_the_pool_names_max_tokens(text_model, field):
  """A prompt that fits the pool with fewer new tokens: the limit the
  client asked for is at fault (400 naming the field it came in:
  `max_completion_tokens` was named `max_tokens`)."""
  with serving(make_engine(text_model, num_pages=40)) as (app, url):
    for documents in ([], CORPUS[:1]):
      response = httpx.post(f"{url}/v1/chat/completions", json={
          "model": MODEL_NAME, "temperature": 0, field: 700,
          "messages": [{"role": "user", "content": "Hello"}],
          "documents": documents}, timeout=120)
      assert response.status_code == 400, response.text
      error = response.json()["error"]
      assert (error["param"], error["code"]) == (field,
                                                 "cache_capacity_exceeded")
    assert pool_is_idle(app)


@pytest.mark.parametrize("options", ["chat", "chat+recompute",
                                     "sink+recompute",
                                     "sink+recompute, float8 pages"])
def test_servers_with_quality_options_serve_what_the_engine_serves(
    text_model, options):
  """The server on engines with a preamble and recompute (and on float8
  pages): a one-turn chat gets the engine's own greedy tokens and prompt
  count, and a conversation's prompt counts each token once (as long as on
  a server without a preamble, but for a learned sink's positions, not
  tokens)."""
  import numpy as np
  from lazyattn_jax.quality_options import QualityOptions
  config = text_model[0]
  sink = np.random.default_rng(5).standard_normal(
      (4, config.hidden_size)).astype(np.float32)
  options, _, pages = options.partition(", ")
  kv_dtype = "float8_e4m3fn" if pages == "float8 pages" else "float32"
  quality = {"chat": QualityOptions(preamble="chat"),
             "chat+recompute": QualityOptions(preamble="chat",
                                              recompute=True),
             "sink+recompute": QualityOptions(preamble="sink", sink=sink,
                                              recompute=True)}[options]
  one_turn = [{"role": "user", "content": QUESTIONS[1]}]
  conversation = [{"role": "user", "content": "Hello"},
                  {"role": "assistant", "content": "Hi."},
                  {"role": "user", "content": QUESTIONS[1]}]
  prompts = {}
  for name, engine_quality in (("plain", None), ("options", quality)):
    with serving(make_engine(text_model, quality=engine_quality,
                             kv_dtype=kv_dtype)) as (app, url):
      c = client(url)
      for turns in ("one", "conversation"):
        out = c.chat.completions.create(
            model=MODEL_NAME, max_tokens=4, temperature=0,
            messages=one_turn if turns == "one" else conversation,
            extra_body={"documents": CORPUS[:2], "return_token_ids": True})
        prompts[name, turns] = out.usage.prompt_tokens
        if name == "options" and turns == "one":
          served = out.choices[0].token_ids
      assert pool_is_idle(app)
  direct_engine = make_engine(text_model, quality=quality, kv_dtype=kv_dtype)
  assert direct_engine.cache_config.quantized == (pages == "float8 pages")
  direct = direct_engine.generate(QUESTIONS[1], CORPUS[:2], max_new_tokens=4,
                                  temperature=0.0)
  assert served == direct.token_ids
  assert prompts["options", "one"] == direct.prompt_tokens
  for turns in ("one", "conversation"):
    assert prompts["options", turns] == prompts["plain", turns]
