"""How a text query becomes the shared chat prefix and the query's ids
(lazyattn_jax/requests.py, chat_parts and split_at_user_text): the
template's filters apply to the user's words, BOS leads where a model
without a template expects it, and a template's refusal is the caller's
error (InvalidRequestError; HTTP 400 naming `messages`)."""

import dataclasses

import pytest

from lazyattn_jax.errors import InvalidRequestError
from lazyattn_jax.requests import chat_parts, encode_request
from models.tokenizer import LlamaTokenizer
from tests.training_helpers import VOCAB, tiny_tokenizer

# Llama 3's template trims each message's content.
TRIMMING = ("<|im_start|>{% for m in messages %}{{ m['role'] }}\n"
            "{{ m['content'] | trim }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}assistant\n{% endif %}")
ALTERNATING = ("{% for m in messages %}{% if (m['role'] == 'user') != "
               "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation "
               "roles must alternate user/assistant') }}{% endif %}"
               "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")


def _tokenizer(template=None, *, bos=None, add_bos=False):
  base = tiny_tokenizer()
  return LlamaTokenizer(base.backend, bos_token_id=bos,
                        eos_token_id=base.eos_token_id,
                        chat_template=template, add_bos_token=add_bos)


def test_the_templates_filters_apply_to_the_users_words():
  tokenizer = _tokenizer(TRIMMING)
  plain = chat_parts(tokenizer, "Who built the bridge?")
  assert chat_parts(tokenizer, "  Who built the bridge?\n") == plain
  prefix, query = plain
  assert prefix == tokenizer.encode("<|im_start|>user\n")
  assert query == tokenizer.encode("Who built the bridge?<|im_end|>"
                                   "assistant\n")


def test_without_a_template_bos_leads_where_the_model_expects_it():
  words = "Who built the bridge?"
  assert chat_parts(_tokenizer(bos=1, add_bos=True), words) == (
      [1], _tokenizer().encode(words))
  assert chat_parts(_tokenizer(bos=1, add_bos=False), words)[0] == []
  assert chat_parts(_tokenizer(bos=None, add_bos=True), words)[0] == []
  # The prefix is the request's first document, ahead of the caller's.
  query, docs, leading = encode_request(_tokenizer(bos=1, add_bos=True),
                                        words, [[7, 8]], VOCAB)
  assert (docs[0], leading) == ((1,), 1)


def test_a_template_that_refuses_the_query_is_an_invalid_request():
  # The first message must be the user's: a one-turn chat always is, so
  # make the template refuse every user turn.
  refusing = ALTERNATING.replace("== 'user'", "== 'nobody'")
  with pytest.raises(InvalidRequestError, match="chat template refuses this "
                     "conversation: Conversation roles must alternate"):
    encode_request(_tokenizer(refusing), "Who?", [], VOCAB)


def test_the_server_answers_400_when_the_template_refuses_a_conversation():
  from lazyattn_jax.server.errors import APIError
  from lazyattn_jax.server.prompts import chat_query
  from lazyattn_jax.server.schemas import ChatMessage
  tokenizer = _tokenizer(ALTERNATING)
  ok = chat_query([ChatMessage(role="user", content="Hi"),
                   ChatMessage(role="assistant", content="Hello"),
                   ChatMessage(role="user", content="Who?")], tokenizer)
  assert ok.conversation
  with pytest.raises(APIError) as err:
    chat_query([ChatMessage(role="system", content="Be brief."),
                ChatMessage(role="user", content="Who?")], tokenizer)
  assert err.value.status == 400 and err.value.param == "messages"
  assert "roles must alternate" in str(err.value)
