"""Noticing that a client went away, while streaming or while it waits.

A server may keep sending into a closed connection without an error (the
ASGI spec lets it drop the bytes), so both paths listen for the ASGI
`http.disconnect` message themselves, next to the work they do.
"""

from __future__ import annotations

import anyio
from starlette.responses import Response


class ClientDisconnected(Exception):
  """The client closed the connection before its response was complete."""


async def wait_for_disconnect(receive):
  """Returns when the ASGI `receive` reports that the client is gone (call it
  only once the request body has been read)."""
  while True:
    message = await receive()
    if message["type"] == "http.disconnect":
      return


class EventStreamResponse(Response):
  """A `text/event-stream` response that stops at once when the client
  disconnects: the chunk iterator is cancelled where it waits, so its
  `finally` runs then (it cancels the engine request)."""

  media_type = "text/event-stream"

  def __init__(self, chunks):
    self.chunks = chunks
    self.status_code = 200
    self.background = None
    self.init_headers({"Cache-Control": "no-cache",
                       "X-Accel-Buffering": "no"})

  async def __call__(self, scope, receive, send):
    await send({"type": "http.response.start", "status": self.status_code,
                "headers": self.raw_headers})
    try:
      async with anyio.create_task_group() as group:

        async def stream():
          try:
            async for chunk in self.chunks:
              await send({"type": "http.response.body", "body": chunk,
                          "more_body": True})
            await send({"type": "http.response.body", "body": b"",
                        "more_body": False})
          except OSError:  # servers of ASGI spec 2.4 raise on a closed socket
            pass
          group.cancel_scope.cancel()

        async def watch():
          await wait_for_disconnect(receive)
          group.cancel_scope.cancel()

        group.start_soon(stream)
        group.start_soon(watch)
    finally:
      await self.chunks.aclose()
