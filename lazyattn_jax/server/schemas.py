"""Request bodies of the OpenAI-compatible endpoints, validated by pydantic.

Bodies are parsed from raw JSON in strict mode (`parse_body`): a number
where text belongs, a float where an integer belongs, or a field the server
does not know is a 400 that names the field.  The `documents` field (this
server's extension) and `prompt` take several shapes and are checked by
`documents.py` and `prompts.py`, which say which entry is at fault.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError,
                      model_validator)

from lazyattn_jax.server.errors import from_validation_error

_INT64 = 2**63


class _Body(BaseModel):
  model_config = ConfigDict(strict=True, extra="forbid")

  @model_validator(mode="before")
  @classmethod
  def _null_is_the_default(cls, data):
    """OpenAI's schema lets a client send null for an optional field (the
    openai client does for an argument given as None): it means the
    field's default."""
    if not isinstance(data, dict):
      return data
    fields = cls.model_fields
    return {name: value for name, value in data.items()
            if not (value is None and name in fields
                    and not fields[name].is_required())}


class StreamOptions(_Body):
  include_usage: bool = False


class SamplingFields(_Body):
  """What both completion endpoints share.

  OpenAI fields this server does not implement (penalties, logprobs, logit
  bias) are accepted only at their neutral values (`prompts.py` checks);
  anything else is refused rather than ignored.
  """
  model: str | None = None
  max_tokens: int | None = Field(None, ge=1)
  temperature: float | None = Field(None, ge=0, le=2)
  top_p: float | None = Field(None, gt=0, le=1)
  top_k: int | None = Field(None, ge=0)  # extension, as in vLLM
  seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
  stop: str | list[str] | None = None
  n: int = 1
  stream: bool = False
  stream_options: StreamOptions | None = None
  user: str | None = None
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: dict[str, float] | None = None
  # Extensions: retrieved documents (strings, or {"text"}, {"id"} or
  # {"token_ids"} objects), and the generated token ids in each choice.
  documents: list[Any] = Field(default_factory=list)
  return_token_ids: bool = False


class ContentPart(_Body):
  type: Literal["text"]
  text: str


class ChatMessage(_Body):
  role: Literal["system", "developer", "user", "assistant"]
  content: str | list[ContentPart] | None = None
  name: str | None = None


class ChatCompletionRequest(SamplingFields):
  messages: list[ChatMessage] = Field(min_length=1)
  max_completion_tokens: int | None = Field(None, ge=1)
  logprobs: bool | None = None
  top_logprobs: int | None = None
  response_format: dict[str, Any] | None = None
  tools: list[Any] | None = None
  tool_choice: Any = None
  parallel_tool_calls: bool | None = None
  store: bool | None = None
  metadata: dict[str, str] | None = None
  service_tier: str | None = None


class CompletionRequest(SamplingFields):
  prompt: Any
  logprobs: int | None = None
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None


class DocumentsRequest(_Body):
  """`POST /v1/documents`: documents to encode ahead of use."""
  documents: list[Any] = Field(min_length=1)
  model: str | None = None


def parse_body(schema: type[BaseModel], raw: bytes) -> BaseModel:
  """Validates a raw JSON body; raises `APIError` 400 naming the field."""
  try:
    return schema.model_validate_json(raw or b"null")
  except ValidationError as error:
    raise from_validation_error(error, raw) from None
