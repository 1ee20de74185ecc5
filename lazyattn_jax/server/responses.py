"""Response bodies in OpenAI's format: whole completions, stream chunks and
usage (with this server's `cached_documents` and `cached_tokens`)."""

from __future__ import annotations

import json
import time
import uuid

DONE = b"data: [DONE]\n\n"


def usage(result) -> dict:
  """Token counts of a result.  `cached_tokens` are prompt tokens read from
  the cache (documents, the chat prefix) rather than prefilled;
  `cached_documents` counts the request's documents that were cache hits."""
  cached = result.cached_prompt_tokens
  completion = len(result.token_ids)
  return {"prompt_tokens": result.prompt_tokens,
          "completion_tokens": completion,
          "total_tokens": result.prompt_tokens + completion,
          "cached_documents": int(sum(result.doc_hits)),
          "cached_tokens": cached,
          "prompt_tokens_details": {"cached_tokens": cached}}


def sse(payload: dict) -> bytes:
  """One Server-Sent Event carrying `payload` as JSON."""
  return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ResponseBuilder:
  """Bodies of one request's response.

  Args:
    chat: chat completion (else text completion).
    model: the served model name.
    return_token_ids: add each choice's generated token ids (extension).
    include_usage: a stream that ends with a usage chunk; as OpenAI's, its
      other chunks then carry `"usage": null`.
  """

  def __init__(self, chat: bool, model: str, return_token_ids: bool,
               include_usage: bool = False):
    self.chat = chat
    self.model = model
    self.return_token_ids = return_token_ids
    self.include_usage = include_usage
    prefix = "chatcmpl-" if chat else "cmpl-"
    self.id = prefix + uuid.uuid4().hex
    self.created = int(time.time())

  def _envelope(self, choices: list, chunk: bool) -> dict:
    if self.chat:
      kind = "chat.completion.chunk" if chunk else "chat.completion"
    else:
      kind = "text_completion"
    body = {"id": self.id, "object": kind, "created": self.created,
            "model": self.model, "choices": choices}
    if chunk and self.include_usage:
      body["usage"] = None  # the usage chunk sets it
    return body

  def _choice(self, text: str | None, finish_reason, token_ids, chunk: bool,
              role: bool = False) -> dict:
    choice: dict = {"index": 0}
    if self.chat:
      if chunk:
        delta = {"role": "assistant"} if role else {}
        if text is not None:
          delta["content"] = text
        choice["delta"] = delta
      else:
        choice["message"] = {"role": "assistant", "content": text}
    else:
      choice["text"] = text or ""
    choice["logprobs"] = None
    choice["finish_reason"] = finish_reason
    if self.return_token_ids and token_ids is not None:
      choice["token_ids"] = list(token_ids)
    return choice

  def completion(self, text: str, finish_reason: str, result) -> dict:
    body = self._envelope([self._choice(text, finish_reason, result.token_ids,
                                        chunk=False)], chunk=False)
    body["usage"] = usage(result)
    return body

  def first_chunk(self) -> bytes:
    """Chat streams open with the assistant's role (text streams with
    nothing)."""
    return sse(self._envelope([self._choice("", None, None, chunk=True,
                                            role=True)], chunk=True))

  def chunk(self, text: str, token_ids=None, finish_reason=None) -> bytes:
    text = None if (self.chat and not text and finish_reason) else text
    return sse(self._envelope([self._choice(text, finish_reason, token_ids,
                                            chunk=True)], chunk=True))

  def usage_chunk(self, result) -> bytes:
    body = self._envelope([], chunk=True)
    body["usage"] = usage(result)
    return sse(body)
