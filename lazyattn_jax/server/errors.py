"""Errors the server answers with, in OpenAI's error format.

Every refusal is an `APIError` with an HTTP status and an OpenAI-style body
`{"error": {"message", "type", "param", "code"}}`, so an OpenAI client raises
its usual exception (BadRequestError, NotFoundError, RateLimitError, ...).
"""

from __future__ import annotations

import json

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


_ABSENT = object()
_KINDS = {str: "str", list: "list", dict: "dict", bool: "bool", int: "int",
          float: "float", type(None): "none"}


def _request_location(body, error: dict) -> tuple[tuple, bool]:
  """(the error's location in the request, whether every union branch it
  went through is the JSON type the client sent there).  pydantic puts a
  union's branch label ("str", "list[str]", "list[ContentPart]") in the
  location; it is no field, so it is dropped."""
  loc, where, value, matches = error["loc"], [], body, True
  for i, part in enumerate(loc):
    if isinstance(part, int) and isinstance(value, list):
      value = value[part] if part < len(value) else _ABSENT
      where.append(part)
    elif isinstance(value, dict) and part in value:
      value = value[part]
      where.append(part)
    elif i == len(loc) - 1 and error["type"] in ("missing",
                                                  "extra_forbidden"):
      where.append(part)  # the field that is missing or not allowed
    else:  # a union branch: does it take what was sent?
      label = str(part).split("[", 1)[0].lower()
      sent = _KINDS.get(type(value), "other")
      # A model's branch ("ContentPart") takes an object.
      matches &= label == sent or (sent == "dict" and
                                   label not in _KINDS.values())
  return tuple(where), matches


def from_validation_error(error: ValidationError, raw: bytes = b"") -> APIError:
  """The first problem pydantic found, naming its field.  Of a union's
  branches, the one of the JSON type sent speaks (a list of stop strings
  with a number in it is wrong at that entry, not for not being a string);
  where none is, the field's branches speak together."""
  errors = error.errors(include_url=False)
  if errors[0]["type"] == "json_invalid":
    return bad_request(f"the body is not valid JSON: {errors[0]['msg']}",
                       code="invalid_json")
  try:
    body = json.loads(raw) if raw else None
  except ValueError:
    body = None
  located = [(_request_location(body, e), e) for e in errors]
  chosen = [(loc, e) for (loc, ok), e in located if ok]
  if chosen:
    loc, first = chosen[0]
    message = first["msg"]
  else:  # no branch takes the JSON type sent: say what each wanted
    (loc, _), _ = located[0]
    message = "; or ".join(dict.fromkeys(
        e["msg"] for (other, _), e in located if other == loc))
  where = field_path(loc)
  message = f"{where}: {message}" if where else message
  return bad_request(message, param=where or None)
