"""OpenAI request fields -> what the engine takes: query, sampling, stops.

Chat: one user message is a text query, which the engine wraps in the
model's chat template (its shared chat prefix becomes a cached document).
A conversation (system or earlier turns) is rendered with the template up
to the last user message; that part becomes the request's first document,
so it too is encoded once and reused by the conversation's next turns, and
the retrieved documents follow inside the last user turn as usual.

Completions: the prompt is used as given after the documents (text is
tokenized without a BOS; special-token spellings in it are parsed).
"""

from __future__ import annotations

import dataclasses
import secrets

from lazyattn_jax.errors import InvalidRequestError
from lazyattn_jax.requests import split_at_user_text
from lazyattn_jax.sampling import SamplingParams
from lazyattn_jax.server.errors import bad_request

MAX_STOP_STRINGS = 16


@dataclasses.dataclass(frozen=True)
class Query:
  """The engine's query, and token ids of a conversation rendered before it
  (the request's first document), if any."""
  query: str | list[int]
  conversation: list[int] | None = None


def check_unsupported(body, chat: bool):
  """OpenAI fields this server does not implement are accepted only at
  their neutral values."""
  neutral = [("n", body.n == 1, "only n=1 is supported"),
             ("presence_penalty", body.presence_penalty == 0,
              "penalties are not supported"),
             ("frequency_penalty", body.frequency_penalty == 0,
              "penalties are not supported"),
             ("logit_bias", not body.logit_bias, "logit_bias is not supported"),
             ("stream_options", body.stream or body.stream_options is None,
              "stream_options needs stream: true")]
  if chat:
    neutral += [
        ("logprobs", not body.logprobs, "logprobs are not supported"),
        ("top_logprobs", body.top_logprobs is None,
         "logprobs are not supported"),
        ("tools", not body.tools, "tools are not supported"),
        ("tool_choice", body.tool_choice in (None, "none"),
         "tools are not supported"),
        ("response_format", body.response_format is None or
         body.response_format.get("type") == "text",
         "only the text response format is supported")]
  else:
    # logprobs=0 still asks for the sampled tokens' own logprobs.
    neutral += [("logprobs", body.logprobs is None,
                 "logprobs are not supported"),
                ("echo", not body.echo, "echo is not supported"),
                ("suffix", body.suffix is None, "suffix is not supported"),
                ("best_of", body.best_of in (None, 1),
                 "only best_of=1 is supported")]
  for field, ok, message in neutral:
    if not ok:
      raise bad_request(message, param=field, code="unsupported")


def max_tokens_field(body) -> str:
  """The field a request's token limit came in, for errors that blame it:
  max_completion_tokens where the request gives it (it wins), else
  max_tokens (also where the server's default is used)."""
  if getattr(body, "max_completion_tokens", None):
    return "max_completion_tokens"
  return "max_tokens"


def requested_max_tokens(body) -> int | None:
  """The request's `max_completion_tokens` or `max_tokens`; None if it
  gives neither (the schema refuses 0)."""
  return getattr(body, "max_completion_tokens", None) or body.max_tokens


def sampling_params(body, default_max_tokens: int) -> SamplingParams:
  """SamplingParams of a request (OpenAI's defaults: temperature 1, top_p 1;
  a sampled request without a seed gets a random one)."""
  max_tokens = requested_max_tokens(body) or default_max_tokens
  temperature = 1.0 if body.temperature is None else body.temperature
  seed = body.seed
  if seed is None:
    seed = secrets.randbelow(2**31) if temperature > 0 else 0
  try:
    return SamplingParams(
        max_new_tokens=max_tokens, temperature=temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=body.top_k or 0, seed=seed)
  except InvalidRequestError as error:
    field, _, rest = str(error).partition(" ")
    if field == "max_new_tokens":  # the engine's name for the client's
      field = max_tokens_field(body)
      error = f"{field} {rest}"
    raise bad_request(str(error), param=field) from None


def stop_strings(body, tokenizer) -> tuple[str, ...]:
  stop = body.stop
  if stop is None:
    return ()
  stops = (stop,) if isinstance(stop, str) else tuple(stop)
  if len(stops) > MAX_STOP_STRINGS:
    raise bad_request(f"stop takes at most {MAX_STOP_STRINGS} strings",
                      param="stop")
  for i, text in enumerate(stops):
    if not text:
      raise bad_request(f"stop[{i}] is empty", param="stop")
  if stops and tokenizer is None:
    raise bad_request("stop strings need a model with a tokenizer",
                      param="stop")
  return stops


def _message_text(message, index: int) -> str:
  content = message.content
  if content is None:
    if message.role != "assistant":
      raise bad_request(f"messages[{index}].content is missing",
                        param=f"messages[{index}].content")
    return ""
  if isinstance(content, str):
    return content
  return "".join(part.text for part in content)


def chat_query(messages, tokenizer) -> Query:
  """The query of a chat request (see the module docstring)."""
  if messages[-1].role != "user":
    raise bad_request("the last message must be the user's",
                      param=f"messages[{len(messages) - 1}].role")
  for i, message in enumerate(messages):
    if message.name is not None:  # would be dropped: it may change answers
      raise bad_request(
          f"messages[{i}].name is not supported: the prompt is rendered "
          f"without names", param=f"messages[{i}].name", code="unsupported")
  texts = [_message_text(m, i) for i, m in enumerate(messages)]
  if tokenizer is None:
    raise bad_request("this model has no tokenizer: use /v1/completions "
                      "with token ids", param="messages")
  if len(messages) == 1:
    return Query(texts[0])
  if tokenizer.chat_template is None:
    raise bad_request("this model has no chat template: send one user "
                      "message", param="messages")
  conversation = [{"role": "system" if m.role == "developer" else m.role,
                   "content": text}
                  for m, text in zip(messages[:-1], texts[:-1])]
  if not texts[-1].strip():
    raise bad_request(f"messages[{len(messages) - 1}].content is empty",
                      param=f"messages[{len(messages) - 1}].content")
  try:
    parts = split_at_user_text(tokenizer, conversation, texts[-1])
  except ValueError as e:  # the template's raise_exception
    raise bad_request(str(e), param="messages") from None
  if parts is None:
    raise bad_request("this model's chat template cannot place documents in "
                      "a conversation: send one user message",
                      param="messages")
  before, rest = parts
  return Query(tokenizer.encode(rest), tokenizer.encode(before) or None)


def completion_query(prompt, tokenizer) -> Query:
  """The query of a completions request: text, or token ids as given."""
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(
      prompt[0], (str, list)):
    prompt = prompt[0]  # a batch of one prompt
  if isinstance(prompt, str):
    if not prompt:
      raise bad_request("prompt is empty", param="prompt")
    if tokenizer is None:
      raise bad_request("this model has no tokenizer: send the prompt as "
                        "token ids", param="prompt")
    return Query(tokenizer.encode(prompt))
  if (isinstance(prompt, list) and prompt and
      all(type(t) is int for t in prompt)):
    return Query(list(prompt))
  if isinstance(prompt, list) and len(prompt) > 1:
    if all(isinstance(p, (str, list)) for p in prompt):
      raise bad_request("one prompt per request is supported",
                        param="prompt")
    bad = next(i for i, t in enumerate(prompt) if type(t) is not int)
    raise bad_request(f"prompt[{bad}] is not a token id (an integer), got "
                      f"{prompt[bad]!r}", param=f"prompt[{bad}]")
  raise bad_request("prompt must be text or a non-empty list of token ids",
                    param="prompt")
