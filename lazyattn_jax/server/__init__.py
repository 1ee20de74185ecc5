"""An OpenAI-compatible HTTP server for `LazyEngine` (`lazyattn serve`).

Retrieved documents are a first-class request field, so the engine reuses
their KV across requests from any client.  See docs/design.md, "HTTP
server".
"""

from lazyattn_jax.server.app import create_app
from lazyattn_jax.server.config import ServerConfig

__all__ = ["ServerConfig", "create_app"]
