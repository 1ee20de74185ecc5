"""Errors the server answers with, in OpenAI's error format.

Every refusal is an `APIError` with an HTTP status and an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`, so an OpenAI client raises
its usual exception (BadRequestError, NotFoundError, RateLimitError, ...).
"""

from __future__ import annotations

from pydantic import ValidationError


class APIError(Exception):
  """A request the server refuses or failed.

  Args:
    status: HTTP status.
    message: what went wrong, for a person.
    type: OpenAI's error type ("invalid_request_error", ...).
    param: the request field at fault, if one is.
    code: a short machine-readable reason.
    headers: extra response headers (Retry-After on 429).
    ended_request: the answer to a request that was queued (or cancelled
      before it ran): the metrics count it by its finish reason, not as a
      rejection.
  """

  def __init__(self, status: int, message: str, *,
               type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict | None = None,
               ended_request: bool = False):
    super().__init__(message)
    self.ended_request = ended_request
    self.status = status
    self.message = message
    self.type = type
    self.param = param
    self.code = code
    self.headers = headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.type,
                      "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None,
                code: str | None = None) -> APIError:
  return APIError(400, message, param=param, code=code)


def not_found(message: str, param: str | None, code: str) -> APIError:
  return APIError(404, message, type="not_found_error", param=param,
                  code=code)


def queue_full(retry_after_s: int) -> APIError:
  return APIError(429, "the server's queue is full; retry later",
                  type="rate_limit_error", code="queue_full",
                  headers={"Retry-After": str(retry_after_s)})


def unavailable(message: str, ended_request: bool = False) -> APIError:
  return APIError(503, message, type="service_unavailable",
                  code="shutting_down", ended_request=ended_request)


def server_error(message: str, ended_request: bool = False) -> APIError:
  return APIError(500, message, type="server_error", code="engine_error",
                  ended_request=ended_request)


def field_path(location) -> str:
  """`("documents", 2, "id")` -> "documents[2].id"."""
  path = ""
  for part in location:
    if isinstance(part, int):
      path += f"[{part}]"
    else:
      path += f".{part}" if path else str(part)
  return path


def from_validation_error(error: ValidationError) -> APIError:
  """The first problem pydantic found, naming its field."""
  first = error.errors(include_url=False)[0]
  where = field_path(first["loc"])
  if first["type"] == "json_invalid":
    return bad_request(f"the body is not valid JSON: {first['msg']}",
                       code="invalid_json")
  message = f"{where}: {first['msg']}" if where else first["msg"]
  return bad_request(message, param=where or None)
