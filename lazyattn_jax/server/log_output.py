"""Where `lazyattn serve` sends the library's own log records."""

from __future__ import annotations

import logging


def show_server_logs(level: str):
  """The library's own log records (a failed step, a request's error) on
  stderr at `level`, formatted as uvicorn's; without a handler Python
  printed only warnings and worse, bare."""
  logger = logging.getLogger("lazyattn_jax")
  if not any(getattr(h, "lazyattn_serve", False) for h in logger.handlers):
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s:     %(name)s: "
                                           "%(message)s"))
    handler.lazyattn_serve = True
    logger.addHandler(handler)
  logger.setLevel(level.upper())
