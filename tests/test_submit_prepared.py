"""`LazyEngine.submit_prepared` with a request it did not make: one made by
hand, sent over a wire (lists for tuples), or by another engine's `prepare`
(another vocabulary, a longer context, a larger pool) is checked against
this engine as `prepare` checks its own: a typed error, nothing queued."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
from tests.test_engine import (greedy, make_engine,  # noqa: F401
                               model_and_config, random_tokens)
from tests.test_engine_faults import assert_pages_accounted_for


@pytest.fixture(scope="module")
def request_parts(model_and_config):
  _, config, _ = model_and_config
  rng = np.random.default_rng(7)
  docs = [random_tokens(rng, n, config.vocab_size) for n in (9, 11)]
  return random_tokens(rng, 5, config.vocab_size), docs


@pytest.mark.parametrize("change,message", [
    (lambda r: {"query": (10**6,)}, r"query has token ids outside \[0, "),
    (lambda r: {"query": (1.5,)}, "query must hold integer token ids"),
    # A prepared request holds ids only (the message offered text).
    (lambda r: {"query": "hello"},
     "^query must be a sequence of token ids, got str$"),
    (lambda r: {"documents": ((1, 2), ())}, "document 1 is empty"),
    (lambda r: {"documents": "abc"}, "documents must be a sequence"),
    (lambda r: {"stop_ids": (-1,)}, "stop_ids has token ids outside"),
    (lambda r: {"leading": 3}, r"leading must count documents in \[0, 2\]"),
    (lambda r: {"sampling": None}, "sampling must be a SamplingParams"),
    (lambda r: {"query": r.query * 200}, "positions"),
    (lambda r: {"documents": tuple((i + 1,) * 8 for i in range(40))},
     "pages but the whole pool has"),
], ids=["vocab", "float", "text-query", "empty-doc", "text-docs", "stop-ids", "leading",
        "sampling", "context", "pool"])
def test_a_bad_request_made_elsewhere_is_refused(model_and_config,
                                                 request_parts, change,
                                                 message):
  query, docs = request_parts
  engine = make_engine(model_and_config, num_pages=12)
  prepared = engine.prepare(query, docs, greedy(6))
  bad = dataclasses.replace(prepared, **change(prepared))
  with pytest.raises((InvalidRequestError, CacheCapacityError),
                     match=message):
    engine.submit_prepared(bad)
  assert not engine.has_work()
  assert engine.request_counts() == {"waiting": 0, "running": 0}


def test_a_request_sent_as_lists_is_served(model_and_config, request_parts):
  """Lists where prepare makes tuples (a request that went over a wire)
  give the same tokens as submit."""
  query, docs = request_parts
  engine = make_engine(model_and_config, num_pages=12)
  prepared = engine.prepare(query, docs, greedy(6))
  as_lists = dataclasses.replace(
      prepared, query=list(prepared.query),
      documents=[list(d) for d in prepared.documents],
      stop_ids=list(prepared.stop_ids))
  request_id = engine.submit_prepared(as_lists)
  while engine.has_work():
    engine.step()
  want = make_engine(model_and_config).generate(query, docs, greedy(6))
  assert engine.pop_result(request_id).token_ids == want.token_ids
  assert_pages_accounted_for(engine)


def test_a_request_prepared_for_the_chat_preamble_is_refused_without_it(
    model_and_config, request_parts):
  """Prepared where the chat prefix is the preamble, a request holds no
  chat prefix: an engine without that preamble would serve it without one
  (it did: 45 prompt tokens where its own prepare gives 70), so it refuses
  it and queues nothing."""
  from lazyattn_jax.quality_options import QualityOptions
  from tests.engine_quality_helpers import CHAT, quality_engine
  _, docs = request_parts
  plain = quality_engine(model_and_config, None, tokenizer=CHAT)
  chat = quality_engine(model_and_config, QualityOptions(preamble="chat"),
                        tokenizer=CHAT)
  prepared = chat.prepare("Who wrote it?", docs, greedy(4))
  with pytest.raises(InvalidRequestError,
                     match="prepared for an engine whose preamble is the "
                           "chat prefix"):
    plain.submit_prepared(prepared)
  assert not plain.has_work()
  chat.submit_prepared(dataclasses.replace(prepared))  # its own kind: served
  assert chat.has_work()


def test_a_text_request_prepared_without_the_chat_preamble_is_served_with_it(
    model_and_config, request_parts):
  """Prepared on an engine without a preamble, a text query brings the chat
  prefix as a leading document; queued on an engine whose preamble is that
  prefix, it is served as that engine's own prepare would serve it (the
  prefix once, as the preamble), not with the prefix twice."""
  from lazyattn_jax.quality_options import QualityOptions
  from tests.engine_quality_helpers import CHAT, quality_engine
  _, docs = request_parts
  plain = quality_engine(model_and_config, None, tokenizer=CHAT)
  chat = quality_engine(model_and_config, QualityOptions(preamble="chat"),
                        tokenizer=CHAT)
  prepared = plain.prepare("Who wrote it?", docs, greedy(4))
  assert prepared.leading == 1
  rid = chat.submit_prepared(prepared)
  while chat.has_work():
    chat.step()
  got = chat.pop_result(rid)
  want = chat.generate("Who wrote it?", docs, greedy(4))
  assert got.prompt_tokens == want.prompt_tokens
  assert got.token_ids == want.token_ids
  np.testing.assert_allclose(got.first_logits, want.first_logits,
                             rtol=1e-5, atol=1e-5)
  assert_pages_accounted_for(chat)


def test_fit_max_new_tokens_lowers_it_to_the_positions_the_prompt_leaves(
    model_and_config):
  """`prepare(fit_max_new_tokens=True)` (the server's default max_tokens):
  a bound, lowered to what the prompt leaves of max_position; a prompt
  with no room is still refused, naming the prompt."""
  _, config, _ = model_and_config
  engine = make_engine(model_and_config, num_pages=160)
  room = config.max_position - 300
  query = tuple(1 + i % 200 for i in range(300))
  fitted = engine.prepare(query, (), greedy(room + 50),
                          fit_max_new_tokens=True)
  assert fitted.sampling.max_new_tokens == room
  assert engine.prepare(query, (), greedy(room - 1), fit_max_new_tokens=True
                        ).sampling.max_new_tokens == room - 1
  with pytest.raises(InvalidRequestError, match="request needs"):
    engine.prepare(query, (), greedy(room + 50))
  with pytest.raises(InvalidRequestError, match="^prompt needs"):
    engine.prepare((7,) * config.max_position, (), greedy(8),
                   fit_max_new_tokens=True)
  rid = engine.submit_prepared(fitted)
  while engine.has_work():
    engine.step()
  assert len(engine.pop_result(rid).token_ids) <= room
  assert_pages_accounted_for(engine)


def test_a_conversation_is_served_once_on_a_chat_preamble_engine(
    model_and_config, request_parts):
  """A server passes a conversation, rendered from the chat template's
  start, as a leading document (`leading_documents=1`).  Where the
  preamble is the chat prefix, the conversation's copy of it goes (the
  preamble holds it) and the rest stays: the prompt counts each token
  once, as on an engine without a preamble, and that holds again when the
  request is queued elsewhere (`check`)."""
  from lazyattn_jax.quality_options import QualityOptions
  from tests.engine_quality_helpers import CHAT, PREFIX, quality_engine
  _, docs = request_parts
  plain = quality_engine(model_and_config, None, tokenizer=CHAT)
  chat = quality_engine(model_and_config, QualityOptions(preamble="chat"),
                        tokenizer=CHAT)
  conversation = CHAT.encode("<sys>be brief</sys><user>Who?</user><bot>A.")
  assert conversation[:len(PREFIX)] == PREFIX
  query = CHAT.encode("And when?</user><bot>")
  on_plain = plain.prepare(query, [conversation] + docs, greedy(4),
                           leading_documents=1)
  on_chat = chat.prepare(query, [conversation] + docs, greedy(4),
                         leading_documents=1)
  assert on_plain.documents[0] == tuple(conversation)
  assert on_chat.documents[0] == tuple(conversation[len(PREFIX):])
  assert (on_plain.leading, on_chat.leading) == (1, 1)
  # Checked again (a copy: another process, Lockstep's followers), the
  # prefix is not removed twice, even where the rest starts with it too.
  twice = chat.prepare(query, [PREFIX + conversation] + docs, greedy(4),
                       leading_documents=1)
  assert twice.documents[0] == tuple(conversation)
  for prepared in (on_chat, twice):
    copy = dataclasses.replace(prepared)
    assert chat.validator.check(copy).documents == prepared.documents
  # Queued on the chat engine from the plain one, it is served the same.
  for prepared in (on_chat, on_plain):
    rid = chat.submit_prepared(prepared)
    while chat.has_work():
      chat.step()
    got = chat.pop_result(rid)
    plain_rid = plain.submit_prepared(on_plain)
    while plain.has_work():
      plain.step()
    want = plain.pop_result(plain_rid)
    assert got.prompt_tokens == want.prompt_tokens
    assert got.token_ids == chat.generate(
        query, [conversation[len(PREFIX):]] + docs, greedy(4)).token_ids
  # A bad count is refused.
  with pytest.raises(InvalidRequestError, match="leading_documents must"):
    chat.prepare(query, docs, greedy(4), leading_documents=3)
  assert_pages_accounted_for(chat)


def test_a_hidden_leading_conversation_is_kept_on_a_chat_preamble_engine(
    model_and_config, request_parts):
  """The server passes a conversation as a leading document it hides
  (`leading` + 1); on an engine whose preamble is the chat prefix, only
  that prefix is ever dropped, never the conversation."""
  import dataclasses
  from lazyattn_jax.quality_options import QualityOptions
  from tests.engine_quality_helpers import CHAT, quality_engine
  _, docs = request_parts
  chat = quality_engine(model_and_config, QualityOptions(preamble="chat"),
                        tokenizer=CHAT)
  conversation = CHAT.encode("<user>Who wrote it?</user><bot>Ada.</bot>")
  prepared = chat.prepare("And when?", [conversation] + docs, greedy(4))
  hidden = dataclasses.replace(prepared, leading=prepared.leading + 1)
  rid = chat.submit_prepared(hidden)
  while chat.has_work():
    chat.step()
  got = chat.pop_result(rid)
  want = chat.generate("And when?", [conversation] + docs, greedy(4))
  assert got.prompt_tokens == want.prompt_tokens
  assert got.token_ids == want.token_ids
  np.testing.assert_allclose(got.first_logits, want.first_logits,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["lazy", "block", "prefix", "full"])
def test_fit_max_new_tokens_also_fits_the_whole_pool(model_and_config, mode):
  """A pool smaller than the model's positions bounds the default too:
  the largest max_new_tokens whose pages fit, so one more is refused; a
  prompt that alone overflows the pool is still refused, as the pool's
  fault, for the pages of one new token (not of the positions its default
  would have taken)."""
  _, config, _ = model_and_config
  engine = make_engine(model_and_config, num_pages=40, mode=mode)
  query = tuple(1 + i % 200 for i in range(40))
  docs = [tuple(1 + (i * 7) % 200 for i in range(9))]
  fitted = engine.prepare(query, docs, greedy(256), fit_max_new_tokens=True)
  most = fitted.sampling.max_new_tokens
  assert 1 <= most < 256 and most < config.max_position - len(query)
  engine.prepare(query, docs, greedy(most))  # fits as it is
  with pytest.raises(CacheCapacityError, match="whole pool has 40"):
    engine.prepare(query, docs, greedy(most + 1))
  # 400 + 256 positions would pass the model's 512 only after the fit.
  # The pages it names are the prompt's with one new token (they counted
  # the 112 tokens the positions left).
  long_query = tuple(1 + i % 200 for i in range(400))
  with pytest.raises(CacheCapacityError, match="whole pool has 40") as fit:
    engine.prepare(long_query, docs, greedy(256), fit_max_new_tokens=True)
  with pytest.raises(CacheCapacityError) as one_token:
    engine.prepare(long_query, docs, greedy(1))
  assert str(fit.value) == str(one_token.value)
  rid = engine.submit_prepared(fitted)
  while engine.has_work():
    engine.step()
  assert len(engine.pop_result(rid).token_ids) <= most
  assert_pages_accounted_for(engine)
