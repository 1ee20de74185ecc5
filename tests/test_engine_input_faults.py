"""Bad input the engine's public API once let through: each is refused with
a typed error naming it, and the engine goes on unchanged."""

from __future__ import annotations

import dataclasses
import gc
import math

import numpy as np
import pytest

from lazyattn_jax.engine import Request
from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
from lazyattn_jax.step_packing import seed_int32
from tests.test_engine import (greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)
from tests.test_engine_faults import assert_pages_accounted_for


@pytest.mark.parametrize("arrival", ["yesterday", object(), True,
                                     math.nan, math.inf, [1.0], "future",
                                     "epoch"])
def test_a_bad_arrival_time_is_refused_and_changes_nothing(model_and_config,
                                                           arrival):
  import time
  # Later than now: TTFT came out negative (by 1.8e9 s for a time.time()).
  arrival = {"future": time.perf_counter() + 100,
             "epoch": time.time()}.get(arrival, arrival) if isinstance(
                 arrival, str) else arrival
  engine = make_engine(model_and_config)
  want = engine.generate([5, 6], [[1, 2, 3]], greedy(3)).token_ids
  with pytest.raises(InvalidRequestError, match="arrival_time"):
    engine.submit([5, 6], [[1, 2, 3]], greedy(3), arrival_time=arrival)
  assert not engine.has_work()
  assert engine.generate([5, 6], [[1, 2, 3]], greedy(3)).token_ids == want
  assert_pages_accounted_for(engine)


def test_an_earlier_arrival_time_counts_in_ttft(model_and_config):
  import time
  engine = make_engine(model_and_config)
  request_id = engine.submit([5, 6], [[1, 2, 3]], greedy(2),
                             arrival_time=time.perf_counter() - 5)
  while (result := engine.pop_result(request_id)) is None:
    engine.step()
  assert result.ttft_s >= 5


@pytest.mark.parametrize("item", ["a question", ([5, 6], [[1]]),
                                  {"query": [5]}])
def test_generate_batch_refuses_items_that_are_not_requests(model_and_config,
                                                            item):
  engine = make_engine(model_and_config)
  good = Request([5, 6], [[1, 2, 3]], greedy(2))
  with pytest.raises(InvalidRequestError, match="item 1 is"):
    engine.generate_batch([good, item])
  assert not engine.has_work()
  assert_pages_accounted_for(engine)


def test_generate_batch_names_the_bad_item(model_and_config):
  # The message was the item's alone ("query is empty"): which of many?
  engine = make_engine(model_and_config, num_pages=8)
  good = Request([5, 6], [[1, 2, 3]], greedy(2))
  with pytest.raises(InvalidRequestError, match=r"^item 1: query is empty"):
    engine.generate_batch([good, Request([], [[1, 2]], greedy(2)), good])
  with pytest.raises(CacheCapacityError, match=r"^item 2: "):
    engine.generate_batch([good, good, Request([5, 6], [[3] * 300],
                                               greedy(2))])
  assert not engine.has_work()
  assert_pages_accounted_for(engine)


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, "2"])
def test_encode_documents_refuses_a_bad_batch_size(model_and_config,
                                                   batch_size):
  engine = make_engine(model_and_config)
  with pytest.raises(InvalidRequestError, match="batch_size"):
    engine.encode_documents([[1, 2, 3]], batch_size=batch_size)
  assert engine.cache.stats(engine.state)["cached_docs"] == 0
  assert engine.encode_documents([[1, 2, 3]], batch_size=1) == [False]


def test_a_stream_dropped_before_its_first_piece_leaves_nothing(text_model):
  from tests.server_helpers import make_engine as make_text_engine
  engine = make_text_engine(text_model)
  closed = engine.generate_stream("Who built the bridge?", max_new_tokens=4)
  closed.close()
  dropped = engine.generate_stream("What lives in the lake?",
                                   max_new_tokens=4)
  del dropped
  gc.collect()
  assert not engine.has_work()
  engine.generate("When?", max_new_tokens=2)
  assert not engine.scheduler.finished  # no result nobody will pop
  with pytest.raises(InvalidRequestError):  # bad input still raises at once
    engine.generate_stream("x", max_new_tokens=0)
  pieces = engine.generate_stream("Who built the bridge?", max_new_tokens=4)
  assert "".join(pieces) == engine.generate("Who built the bridge?",
                                            max_new_tokens=4).text


def test_a_stream_ended_by_another_callers_step_yields_its_whole_text(
    text_model):
  """Another caller's step (a thread's generate(), a server loop, a second
  stream) may end the request: the tokens of that last round were dropped
  from the stream."""
  from tests.server_helpers import make_engine as make_text_engine
  engine = make_text_engine(text_model)
  stream = engine.generate_stream("Tell me a story.", max_new_tokens=12,
                                  stop_token_ids=())
  pieces = [next(stream)]
  while engine.has_work():
    engine.step()
  try:
    while True:
      pieces.append(next(stream))
  except StopIteration as stop:
    result = stop.value
  assert len(result.token_ids) == 12
  assert "".join(pieces) == result.text


def test_a_padded_embedding_never_generates_ids_without_text(text_model):
  """A model with more embedding rows than its tokenizer has tokens (Qwen2's
  checkpoints) drew a padding id: every text result then raised ValueError,
  and the engine, failing in each round, wedged with pages held."""
  from flax import nnx
  from models.llama import Llama
  from tests.server_helpers import make_engine as make_text_engine
  config, _, tokenizer = text_model
  padded = dataclasses.replace(config, vocab_size=tokenizer.vocab_size + 64)
  model = Llama(padded, rngs=nnx.Rngs(0))
  head = np.asarray(model.lm_head[...]).copy()
  head[:, tokenizer.vocab_size + 10] = 50.0  # the largest logit, always
  model.lm_head[...] = head
  engine = make_text_engine((padded, model, tokenizer))
  for sampling in (dict(), dict(temperature=1.0, seed=3)):
    result = engine.generate("Who built the bridge?", max_new_tokens=6,
                             stop_token_ids=(), **sampling)
    assert len(result.token_ids) == 6
    assert max(result.token_ids) < tokenizer.vocab_size
    assert result.text == tokenizer.decode(result.token_ids)
  assert_pages_accounted_for(engine)


def test_seeds_that_differ_only_in_high_bits_draw_different_streams(
    model_and_config):
  for seed in (0, 5, -1, 2**31 - 1, -2**31):
    assert seed_int32(seed) == seed  # int32 seeds are the PRNG seed itself
  seeds = [5, 5 + 2**31, 5 + 2**32, 2**63 - 1, -2**63, 2**31 - 1, -1]
  assert len({seed_int32(s) for s in seeds}) == len(seeds)
  _, config, _ = model_and_config
  engine = make_engine(model_and_config)
  doc = random_tokens(np.random.default_rng(3), 8, config.vocab_size)
  drawn = {s: tuple(engine.generate([5, 6], [doc], max_new_tokens=12,
                                    temperature=5.0, seed=s,
                                    stop_token_ids=()).token_ids)
           for s in (5, 5 + 2**31, 5 + 2**32)}
  assert len(set(drawn.values())) == 3, drawn
