"""The OpenAI-compatible HTTP app: routes, error bodies, start and stop.

`create_app(engine)` returns a FastAPI app whose lifespan starts the engine
loop and, at shutdown, lets requests in flight finish for
`ServerConfig.drain_timeout_s` before cancelling the rest.

Endpoints: `POST /v1/chat/completions`, `POST /v1/completions` (both take
the `documents` extension), `POST /v1/documents` (encode ahead of use,
returns ids), `GET /v1/models`, `GET /health`, `GET /metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
from lazyattn_jax.server.completions import CompletionService
from lazyattn_jax.server.config import ServerConfig
from lazyattn_jax.server.documents import DocumentRegistry, parse_documents
from lazyattn_jax.server.engine_loop import EngineLoop, LoopClosedError
from lazyattn_jax.server.errors import APIError, bad_request, unavailable
from lazyattn_jax.server.metrics import CONTENT_TYPE, ServerMetrics
from lazyattn_jax.server.schemas import (ChatCompletionRequest,
                                         CompletionRequest, DocumentsRequest,
                                         parse_body)

logger = logging.getLogger("lazyattn_jax.server")


def create_app(engine, config: ServerConfig | None = None, *,
               close_engine: bool = False) -> FastAPI:
  """An app serving `engine` (a `LazyEngine`).

  Once the app has started, only its engine loop may call the engine.
  `close_engine`: close the engine when the app shuts down.
  """
  config = config or ServerConfig()
  metrics = ServerMetrics()
  loop = EngineLoop(engine, max_queue=config.max_queue, metrics=metrics)
  registry = DocumentRegistry(config.max_registered_documents)
  service = CompletionService(engine, loop, registry, config, metrics)
  started = int(time.time())

  @contextlib.asynccontextmanager
  async def lifespan(_app):
    loop.start()
    try:
      yield
    finally:
      await anyio.to_thread.run_sync(loop.shutdown, config.drain_timeout_s)
      if close_engine:
        engine.close()

  app = FastAPI(title="lazyattn-jax", lifespan=lifespan,
                description="OpenAI-compatible serving with zero-copy, "
                            "position-agnostic document KV reuse.")
  app.state.engine = engine
  app.state.config = config
  app.state.engine_loop = loop
  app.state.metrics = metrics
  app.state.registry = registry

  def error_response(error: APIError, *, count: bool = True) -> JSONResponse:
    if count and not error.ended_request:
      metrics.observe_rejected(error.status)
    return JSONResponse(error.body(), status_code=error.status,
                        headers=error.headers)

  @app.exception_handler(APIError)
  async def api_error(_request, error: APIError):
    return error_response(error)

  @app.exception_handler(StarletteHTTPException)
  async def http_error(_request, error: StarletteHTTPException):
    # The router's answers (no such route, a wrong method): not requests of
    # the API refused, so not counted as rejected (a scanner's probes would
    # swamp the counter).
    kind = "not_found_error" if error.status_code == 404 else (
        "invalid_request_error")
    return error_response(APIError(error.status_code, str(error.detail),
                                   type=kind, headers=error.headers),
                          count=False)

  @app.exception_handler(ClientDisconnect)
  async def client_left(_request, _error):
    # The client left while sending its body: nobody reads this answer.
    return Response(status_code=499)

  @app.exception_handler(Exception)
  async def unexpected_error(_request, error: Exception):
    logger.exception("unexpected error while serving a request")
    return error_response(APIError(
        500, f"internal error: {type(error).__name__}: {error}",
        type="server_error", code="internal_error"))

  @app.post("/v1/chat/completions")
  async def chat_completions(request: Request):
    arrived = time.perf_counter()
    body = parse_body(ChatCompletionRequest, await request.body())
    return await service.complete(request, body, chat=True, arrived=arrived)

  @app.post("/v1/completions")
  async def completions(request: Request):
    arrived = time.perf_counter()
    body = parse_body(CompletionRequest, await request.body())
    return await service.complete(request, body, chat=False, arrived=arrived)

  @app.post("/v1/documents")
  async def encode_documents(request: Request):
    body = parse_body(DocumentsRequest, await request.body())
    if not loop.alive:  # as completions are, while draining
      raise unavailable("the server is shutting down")
    service.check_model(body.model)
    documents = registry.resolve(parse_documents(body.documents))
    try:
      tokens = await anyio.to_thread.run_sync(engine.validator.documents,
                                              documents)
    except (InvalidRequestError, CacheCapacityError) as error:
      raise bad_request(str(error), param="documents") from None
    distinct = len(set(tokens))  # token tuples, as the validator gives
    if distinct > registry.capacity:
      # Registered one by one, the first would be forgotten by the last.
      raise bad_request(
          f"{distinct} different documents in one call; "
          f"the server remembers at most {registry.capacity} "
          f"(--max-registered-documents)", param="documents")
    hits = [False] * len(tokens)
    if engine.mode in ("lazy", "block"):  # modes that cache whole documents
      try:
        hits = await asyncio.wrap_future(
            loop.call(lambda e: e.encode_documents(tokens), new_work=True))
      except LoopClosedError as error:
        raise unavailable(str(error)) from None
      except CacheCapacityError as error:
        raise APIError(429, f"the cache is busy: {error}",
                       type="rate_limit_error", code="cache_busy",
                       headers={"Retry-After": str(config.retry_after_s)}
                       ) from None
    ids = [registry.register(t) for t in tokens]  # once they are in
    return {"object": "list",
            "data": [{"id": doc_id, "object": "document", "tokens": len(t),
                      "cached": bool(hit)}
                     for doc_id, t, hit in zip(ids, tokens, hits)]}

  def model_card():
    return {"id": config.model_name, "object": "model", "created": started,
            "owned_by": "lazyattn-jax"}

  @app.get("/v1/models")
  async def models():
    return {"object": "list", "data": [model_card()]}

  @app.get("/v1/models/{model:path}")  # a name may hold "/"
  async def model(model: str):
    service.check_model(model)  # 404 model_not_found for any other
    return model_card()

  @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: probes
  async def health():
    if not loop.alive:
      return JSONResponse({"status": "unavailable"}, status_code=503)
    return {"status": "ok"}

  @app.get("/metrics")
  async def prometheus_metrics():
    # The queue as it is now: the loop publishes only after a round, and a
    # stalled round (a compile) is when the queue depth matters most.
    metrics.observe_waiting(loop.queue_depth())
    return Response(metrics.render(), media_type=CONTENT_TYPE)

  return app
