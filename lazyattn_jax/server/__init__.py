"""An OpenAI-compatible HTTP server for `LazyEngine` (`lazyattn serve`).

Retrieved documents are a first-class request field, so the engine reuses
their KV across requests from any client.  See docs/design.md, "HTTP
server".  `ServerConfig` imports without the server's dependencies;
`create_app` needs the `serve` extra (fastapi, uvicorn, prometheus-client).
"""

from lazyattn_jax.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]


def __getattr__(name):
  if name == "create_app":
    from lazyattn_jax.server.app import create_app
    return create_app
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
