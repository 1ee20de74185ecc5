"""`ServerConfig`: the HTTP server's own settings (the engine has its own)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ServerConfig:
  """Settings of `lazyattn serve`, checked when made.

  Attributes:
    model_name: the name `/v1/models` lists and requests may give as
      `model` (a request naming another model gets 404).
    max_queue: requests waiting for admission beyond which new ones get
      429 (requests being generated do not count).
    default_max_tokens: `max_tokens` of a request that gives none (at most
      what its prompt leaves of the model's positions and the pool).
    drain_timeout_s: on shutdown, how long requests in flight may finish
      before they are cancelled (inf: as long as they take).
    max_registered_documents: documents `POST /v1/documents` remembers by
      id; the least recently used id is forgotten past this.
    retry_after_s: the `Retry-After` of a 429.
  """
  model_name: str = "lazyattn"
  max_queue: int = 256
  default_max_tokens: int = 256
  drain_timeout_s: float = 30.0
  max_registered_documents: int = 100_000
  retry_after_s: int = 1

  def __post_init__(self):
    if not isinstance(self.model_name, str) or not self.model_name:
      raise ValueError("model_name must be a non-empty string")
    for name in ("max_queue", "default_max_tokens",
                 "max_registered_documents", "retry_after_s"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not self.drain_timeout_s >= 0:
      raise ValueError(
          f"drain_timeout_s must be >= 0, got {self.drain_timeout_s!r}")
