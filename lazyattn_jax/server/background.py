"""`BackgroundServer`: the app served by uvicorn on a thread of this
process, for benchmarks and tests that drive it over real HTTP."""

from __future__ import annotations

import threading
import time


class BackgroundServer:
  """Serves `app` on `host`:`port` (0 picks a free port) until `stop()`.

  Use as a context manager; `url` is the base URL once started.
  """

  def __init__(self, app, host: str = "127.0.0.1", port: int = 0):
    from lazyattn_jax.server.draining import DrainingServer
    self._server = DrainingServer(app, host=host, port=port,
                                  log_level="warning")
    self._thread = threading.Thread(target=self._server.run,
                                    name="lazyattn-http", daemon=True)
    self.url = ""

  def start(self, timeout_s: float = 60.0) -> "BackgroundServer":
    self._thread.start()
    deadline = time.monotonic() + timeout_s
    while not self._server.started:
      if not self._thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError("the HTTP server did not start")
      time.sleep(0.01)
    host, port = self._server.servers[0].sockets[0].getsockname()[:2]
    self.url = f"http://{host}:{port}"
    return self

  def stop(self, timeout_s: float = 120.0):
    """Graceful shutdown: uvicorn stops accepting while the engine loop
    drains or cancels what is in flight (`DrainingServer`)."""
    self._server.should_exit = True
    self._thread.join(timeout_s)

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.stop()
