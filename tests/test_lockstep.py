"""`Lockstep` in one process: the leader checks before it sends, reads an
iterator of documents once and refuses calls after close(); a follower,
fed the leader's messages, survives an error every process meets alike
and keeps no results.  (Two real processes: tests/test_tensor_parallel.py,
slow tier.)"""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from lazyattn_jax import multihost
from lazyattn_jax.errors import (CacheCapacityError, EngineClosedError,
                                 InvalidRequestError)
from lazyattn_jax.multihost import Lockstep
from tests.test_engine import (greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)


@pytest.fixture
def leader(model_and_config, monkeypatch):
  """(Lockstep, the messages it sent)."""
  sent = []
  monkeypatch.setattr(Lockstep, "_send",
                      lambda self, message: sent.append(message))
  return Lockstep(make_engine(model_and_config, num_pages=24)), sent


def _docs(model_and_config, *lengths):
  rng = np.random.default_rng(3)
  return [random_tokens(rng, n, model_and_config[1].vocab_size)
          for n in lengths]


def test_bad_documents_raise_before_anything_is_sent(leader):
  lock, sent = leader
  with pytest.raises(InvalidRequestError, match="outside"):
    lock.encode_documents([[10**7]])
  with pytest.raises(CacheCapacityError, match="tokens; the cache holds"):
    lock.encode_documents([[1] * 10**4])
  assert sent == []


def test_calls_the_leaders_engine_refuses_are_not_sent(model_and_config,
                                                      monkeypatch):
  """encode_documents in a mode without a document step, a step inside the
  round's on_first_tokens, and a step or cancel on a closed engine: the
  leader's engine refuses each, so none may reach the followers.  Before:
  each was sent first, and the followers then ran a call the leader never
  made (encode_documents in full mode hung both processes)."""
  sent = []
  monkeypatch.setattr(Lockstep, "_send",
                      lambda self, message: sent.append(message))
  full = Lockstep(make_engine(model_and_config, num_pages=24, mode="full"))
  with pytest.raises(InvalidRequestError, match="document step"):
    full.encode_documents(_docs(model_and_config, 9))
  assert sent == []

  lock = Lockstep(make_engine(model_and_config, num_pages=24))
  query, doc = _docs(model_and_config, 5, 9)
  lock.submit(query, [doc], greedy(4))
  nested = []

  def step_inside():
    try:
      lock.step()
    except RuntimeError as error:
      nested.append(error)
  lock.step(on_first_tokens=step_inside)
  assert len(nested) == 1 and "inside a step" in str(nested[0])
  assert len(sent) == 1  # the outer round only
  lock.engine.close()
  with pytest.raises(EngineClosedError):
    lock.step()
  with pytest.raises(EngineClosedError):
    lock.cancel(0)
  with pytest.raises(EngineClosedError):
    lock.encode_documents(_docs(model_and_config, 9))
  assert len(sent) == 1 and lock._calls == []


def test_an_iterator_of_documents_is_read_once(leader, model_and_config):
  """Before: the followers got the documents and the leader's engine an
  exhausted generator."""
  lock, sent = leader
  docs = _docs(model_and_config, 9, 5)
  assert lock.encode_documents(iter(docs)) == [False, False]
  assert sent == [[("encode_documents", [tuple(d) for d in docs])]]
  assert lock.engine.encode_documents(docs) == [True, True]


def test_calls_after_close_raise(leader, model_and_config):
  lock, sent = leader
  lock.close()
  with pytest.raises(RuntimeError, match="after close"):
    lock.submit(_docs(model_and_config, 4)[0], [], greedy(2))
  with pytest.raises(RuntimeError, match="after close"):
    lock.close()
  assert sent == [multihost._STOP]


def test_a_follower_goes_on_after_a_full_pool_and_keeps_no_results(
    model_and_config, monkeypatch):
  """The leader's messages: a request, rounds until it ends, documents the
  pool cannot take while it runs (the leader raised CacheCapacityError),
  more rounds, then close.  Before: the follower raised and died (the
  leader's next collective failed), and kept every result."""
  engine = make_engine(model_and_config, num_pages=24)
  query, doc, big_a, big_b = _docs(model_and_config, 5, 30, 40, 40)
  request = engine.prepare(query, [doc], greedy(12))
  messages = ([[("submit_prepared", request)]] +
              [[("encode_documents", [tuple(big_a), tuple(big_b)])]] +
              [[]] * 8 + [multihost._STOP])
  feed = iter(pickle.dumps(m) for m in messages)
  monkeypatch.setattr(multihost, "_broadcast_bytes", lambda _: next(feed))
  raised, encode = [], engine.encode_documents

  def encode_recorded(documents):
    try:
      return encode(documents)
    except CacheCapacityError as error:
      raised.append(error)
      raise
  engine.encode_documents = encode_recorded
  lock = Lockstep(engine)
  lock.leader = False
  assert lock.follow() == 9
  assert len(raised) == 1  # the pool was full, as on the leader
  assert not engine.has_work()
  assert engine.pop_result(0) is None  # dropped, not held
  assert not engine.scheduler.finished
