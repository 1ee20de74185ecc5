"""Shared pieces of the server tests: engines on `text_model` (a tiny
random model that reads and writes real text with SmolLM2's tokenizer and
chat template; a session fixture in tests/hf_fixtures.py), and a server on
a background thread."""

from __future__ import annotations

import contextlib
import time

import pytest

from lazyattn_jax.cache_state import CacheConfig
from lazyattn_jax.config import split_settings
from lazyattn_jax.engine import LazyEngine
from tests.test_engine_faults import assert_pages_accounted_for  # noqa: F401

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")

CORPUS = [
    "Lake Varnis is a cold mountain lake where silver trout live.",
    "The Orrin Bridge was built by the engineer Ada Merrow in 1871.",
    "Kessel Hall hosts the winter music festival every January.",
    "The town of Bramley grows apples and presses them into cider.",
    "Mount Tarn is the highest peak of the eastern range.",
    "The Weld river floods the valley every spring.",
    "Old Harbour lighthouse was rebuilt after the storm of 1902.",
    "The library of Quell holds ten thousand maps of the coast.",
]
QUESTIONS = ["Who built the bridge?", "What lives in the lake?",
             "When is the festival?", "What does Bramley make?"]
MODEL_NAME = "tiny-text"


def make_engine(text_model, *, num_pages=96, max_batch=4, decode_steps=4,
                mode="lazy", quality=None, kv_dtype="float32",
                **settings) -> LazyEngine:
  config, model, tokenizer = text_model
  cache_config = CacheConfig(
      num_pages=num_pages, page_size=16, num_layers=config.num_layers,
      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
      dtype=kv_dtype, max_docs=32, max_pages_per_doc=16)
  scheduler, runner = split_settings(
      None, None, dict(impl="xla", max_batch=max_batch,
                       decode_steps=decode_steps, **settings))
  return LazyEngine(config, model, cache_config, mode=mode,
                    scheduler=scheduler, runner=runner, tokenizer=tokenizer,
                    model_id="tiny-text", quality=quality)


def slow_down(engine, seconds: float):
  """Makes every round take at least `seconds` longer (so a test can act
  while requests are queued or mid-generation)."""
  step = engine.step

  def slow_step(**kwargs):
    time.sleep(seconds)
    return step(**kwargs)
  engine.step = slow_step


def on_loop(app, fn):
  """Runs fn(engine) on the app's engine loop thread and returns its value."""
  return app.state.engine_loop.call(fn).result(timeout=60)


def pool_is_idle(app) -> bool:
  """Nothing in flight, and the only used pages are cached documents'."""
  def check(engine):
    stats = engine.cache.stats(engine.state)
    return (not engine.has_work() and stats["docs_in_use"] == 0 and
            stats["used_pages"] == stats["cached_doc_pages"])
  return on_loop(app, check)


def wait_until(condition, timeout_s: float = 30.0, what: str = "condition"):
  deadline = time.monotonic() + timeout_s
  while not condition():
    if time.monotonic() > deadline:
      raise AssertionError(f"timed out waiting for {what}")
    time.sleep(0.02)


@contextlib.contextmanager
def serving(engine, **config):
  """(app, base URL) of `engine` served on a background thread."""
  from lazyattn_jax.server import ServerConfig, create_app
  from lazyattn_jax.server.background import BackgroundServer
  app = create_app(engine, ServerConfig(model_name=MODEL_NAME, **config))
  server = BackgroundServer(app).start()
  try:
    yield app, server.url
  finally:
    server.stop()


def metric(text: str, name: str) -> float:
  """The value of one sample (`name` with its labels, as printed) in
  Prometheus text output; 0 if absent."""
  for line in text.splitlines():
    key, _, value = line.rpartition(" ")
    if key == name:
      return float(value)
  return 0.0
