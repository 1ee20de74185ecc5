"""`DrainingServer`: uvicorn's server, which drains the app's engine loop
before it waits for the connections.

Left to itself, uvicorn stops in this order: stop listening, wait up to
`timeout_graceful_shutdown` for the connections, cancel the handler tasks
still running (their clients get a bare 500 or a cut-off stream), and only
then run the app's lifespan shutdown, where the engine loop drained.  So
the loop's drain never reached a client.  Here the loop drains first:
requests in flight get `drain_timeout_s` to finish, those still running
then are cancelled between two rounds (a round that is compiling may take
longer), and their handlers answer 503 "shutting_down" (an error event on
a stream).  Requests that arrive meanwhile get the same 503.  Only then
does uvicorn stop listening and give the handlers `ANSWER_GRACE_S` to write
those answers.
"""

from __future__ import annotations

import asyncio

import uvicorn

# How long after the drain the handlers get to write their answers.
ANSWER_GRACE_S = 5.0


class DrainingServer(uvicorn.Server):
  """A `uvicorn.Server` for an app of `create_app`.

  Args:
    app: the app (its `state.engine_loop` and `state.config` are used).
    on_listening: called with the port the server listens on once it
      does (the OS picks one for port 0), or None.
    **config: other `uvicorn.Config` arguments (host, port, log_level...).
  """

  def __init__(self, app, on_listening=None, **config):
    self._engine_loop = app.state.engine_loop
    self._drain_timeout_s = app.state.config.drain_timeout_s
    self._on_listening = on_listening
    super().__init__(uvicorn.Config(
        app, timeout_graceful_shutdown=ANSWER_GRACE_S, **config))

  async def startup(self, sockets=None):
    await super().startup(sockets)
    if self.started and self._on_listening is not None:
      self._on_listening(self.servers[0].sockets[0].getsockname()[1])

  async def shutdown(self, sockets=None):
    drain = asyncio.ensure_future(asyncio.to_thread(
        self._engine_loop.shutdown, self._drain_timeout_s))
    while not (drain.done() or self.force_exit):  # a second Ctrl+C
      await asyncio.wait({drain}, timeout=0.1)
    await super().shutdown(sockets)
    if drain.done():
      drain.result()
