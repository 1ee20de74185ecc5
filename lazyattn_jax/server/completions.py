"""`CompletionService`: one chat or text completion, from parsed body to
response, for both endpoints.

The steps: refuse unsupported fields, an unknown model or a full queue;
resolve the documents; build the query and sampling; tokenize and validate
on a worker thread (`LazyEngine.prepare`); hand the request to the engine
loop; then wait for its ending, or stream its tokens, while listening for
the client going away (which cancels the request at once).
"""

from __future__ import annotations

import asyncio

import anyio
from fastapi.responses import JSONResponse, Response

from lazyattn_jax.errors import (CacheCapacityError, EngineClosedError,
                                 InvalidRequestError)
from lazyattn_jax.server import prompts
from lazyattn_jax.server.disconnects import (ClientDisconnected,
                                             EventStreamResponse,
                                             wait_for_disconnect)
from lazyattn_jax.server.documents import parse_documents
from lazyattn_jax.server.engine_loop import (Failed, Finished, LoopClosedError,
                                             QueueFullError, RequestHandle,
                                             Tokens)
from lazyattn_jax.server.errors import (APIError, bad_request, not_found,
                                        queue_full, server_error, unavailable)
from lazyattn_jax.server.responses import DONE, ResponseBuilder, sse
from lazyattn_jax.server.text_output import TextOutput

# Words that start the engine's InvalidRequestError messages -> the request
# field at fault (None: the query's, messages or prompt; MAX_TOKENS: the
# field the token limit came in) and the error code.
MAX_TOKENS = object()
_ENGINE_FIELDS = (("document", "documents", None),
                  ("chat prefix", "messages", None),
                  ("prompt needs", None, "context_length_exceeded"),
                  ("request needs", MAX_TOKENS, "context_length_exceeded"),
                  ("stop", "stop", None))


class CompletionService:
  """Serves completions through one engine loop.

  Args:
    engine: the `LazyEngine` (only `prepare` and its tokenizer are used
      here; the loop drives everything else).
    loop: the `EngineLoop`.
    registry: the `DocumentRegistry` for document ids.
    config: `ServerConfig`.
    metrics: `ServerMetrics`.
  """

  def __init__(self, engine, loop, registry, config, metrics):
    self.engine = engine
    self.loop = loop
    self.registry = registry
    self.config = config
    self.metrics = metrics

  def check_model(self, model: str | None):
    if model is not None and model != self.config.model_name:
      raise not_found(f"model {model!r} is not served here (this server "
                      f"serves {self.config.model_name!r})", param="model",
                      code="model_not_found")

  async def complete(self, request, body, *, chat: bool, arrived: float):
    """The response to a parsed chat or text completion body."""
    prompts.check_unsupported(body, chat)
    self.check_model(body.model)
    if self.loop.queue_depth() >= self.config.max_queue:
      raise queue_full(self.config.retry_after_s)  # before tokenizing
    documents = self.registry.resolve(parse_documents(body.documents))
    sampling = prompts.sampling_params(body, self.config.default_max_tokens)
    stops = prompts.stop_strings(body, self.engine.tokenizer)
    prepared = await anyio.to_thread.run_sync(
        self._prepare, body, chat, documents, sampling)
    # Text is assembled as it grows only where it is needed (streaming, stop
    # strings), by the engine loop; a plain answer takes the engine's own
    # detokenized text.
    output = (TextOutput(self.engine.tokenizer, stops)
              if self.engine.tokenizer is not None and (body.stream or stops)
              else None)
    handle = RequestHandle(prepared, arrived, wants_tokens=body.stream,
                           output=output)
    try:
      self.loop.submit(handle)
    except QueueFullError:
      raise queue_full(self.config.retry_after_s) from None
    except LoopClosedError as error:
      raise unavailable(str(error)) from None
    include_usage = bool(body.stream and body.stream_options and
                         body.stream_options.include_usage)
    builder = ResponseBuilder(chat, self.config.model_name,
                              body.return_token_ids, include_usage)
    if body.stream:
      return EventStreamResponse(
          self._stream(handle, builder, include_usage))
    try:
      result = await self._wait(handle, request)
    except ClientDisconnected:
      return Response(status_code=499)  # nobody reads it
    text = output.text if output is not None else result.text or ""
    return JSONResponse(builder.completion(text, result.finish_reason,
                                           result))

  # --- tokenizing and validating (worker thread) --------------------------------
  def _prepare(self, body, chat: bool, documents, sampling):
    tokenizer = self.engine.tokenizer
    query = (prompts.chat_query(body.messages, tokenizer) if chat else
             prompts.completion_query(body.prompt, tokenizer))
    leading = [query.conversation] if query.conversation else []
    given = prompts.requested_max_tokens(body) is not None
    limit_field = prompts.max_tokens_field(body)

    def prepare(fit: bool):
      # A request that names no max_tokens gets the server's default,
      # at most what the prompt leaves of the positions and the pool.
      # The conversation is ours, not one of the caller's documents.
      return self.engine.prepare(query.query, leading + documents, sampling,
                                 fit_max_new_tokens=fit,
                                 leading_documents=len(leading))
    try:
      return prepare(fit=not given)
    except InvalidRequestError as error:
      param, code = _engine_field(str(error),
                                  "messages" if chat else "prompt",
                                  limit_field)
      raise bad_request(str(error), param=param, code=code) from None
    except CacheCapacityError as error:
      raise bad_request(str(error), param=self._capacity_field(
          error, prepare, limit_field if given else None, chat, documents),
          code="cache_capacity_exceeded") from None
    except EngineClosedError:  # a handler still tokenizing at shutdown
      raise unavailable("the server is shutting down") from None

  @staticmethod
  def _capacity_field(error, prepare, limit_field, chat: bool, documents):
    """The field a CacheCapacityError blames: the token limit's field
    (`limit_field`, falsy where the request gave none) where the prompt
    alone fits (tried with a fitted limit); else the caller's documents,
    unless there are none or the conversation (a leading document) is what
    does not fit: then the prompt."""
    if limit_field:
      try:
        prepare(fit=True)
        return limit_field
      except (InvalidRequestError, CacheCapacityError):
        pass
    if documents and not str(error).startswith("leading document"):
      return "documents"
    return "messages" if chat else "prompt"

  # --- waiting ----------------------------------------------------------------------
  async def _events(self, handle, request=None):
    """The handle's events up to its ending.  With `request`, raises
    ClientDisconnected as soon as the client goes away.  A request left
    before its ending (disconnect, cancelled handler) is cancelled."""
    watcher = (asyncio.ensure_future(wait_for_disconnect(request.receive))
               if request is not None else None)
    getter = None
    ended = False
    try:
      while not ended:
        getter = asyncio.ensure_future(handle.events.get())
        waiting = {getter} if watcher is None else {getter, watcher}
        done, _ = await asyncio.wait(waiting,
                                     return_when=asyncio.FIRST_COMPLETED)
        if getter not in done:
          raise ClientDisconnected()
        event = getter.result()
        ended = isinstance(event, (Finished, Failed))
        yield event
    finally:
      for task in (watcher, getter):
        if task is not None:
          task.cancel()
      if not ended:
        self.loop.cancel(handle)

  async def _wait(self, handle, request):
    """The request's result (cut at a stop string by the engine loop)."""
    events = self._events(handle, request)
    try:
      async for event in events:
        if isinstance(event, Failed):
          raise _failure(event)
        if isinstance(event, Finished):
          _check_ended_well(event.result)
          return event.result
    finally:
      await events.aclose()
    raise server_error("the request ended without a result")

  async def _stream(self, handle, builder, include_usage: bool):
    """SSE chunks: text as it is generated, then the finish reason, usage
    if asked for, and [DONE]."""
    if builder.chat:
      yield builder.first_chunk()
    events = self._events(handle)
    try:
      async for event in events:
        if isinstance(event, Tokens):
          if event.text or (builder.return_token_ids and event.token_ids):
            yield builder.chunk(event.text, event.token_ids)
          continue
        if isinstance(event, Failed):
          error = _failure(event)
          if not error.ended_request:  # as app.error_response counts it
            self.metrics.observe_rejected(error.status)
          yield sse(error.body())
          break
        result = event.result
        try:
          _check_ended_well(result)
        except APIError as error:
          yield sse(error.body())
          break
        yield builder.chunk("", finish_reason=result.finish_reason)
        if include_usage:
          yield builder.usage_chunk(result)
    finally:
      await events.aclose()
    yield DONE


def _check_ended_well(result):
  # The metrics counted the result by its finish reason already.
  if result.finish_reason == "error":
    raise server_error(f"the engine failed while serving the request: "
                       f"{result.error}", ended_request=True)
  if result.finish_reason == "cancelled":
    raise unavailable("the request was cancelled: the server is shutting "
                      "down", ended_request=True)


def _failure(event) -> APIError:
  """The answer to a request the loop could not serve (a `Failed`)."""
  if isinstance(event.error, LoopClosedError):
    return unavailable(str(event.error), ended_request=event.counted)
  return server_error(f"the request failed: {event.error}",
                      ended_request=event.counted)


def _engine_field(message: str, query_field: str, max_tokens_field: str):
  """(param, code) of an engine InvalidRequestError's message."""
  for start, field, code in _ENGINE_FIELDS:
    if message.startswith(start):
      if field is MAX_TOKENS:
        return max_tokens_field, code
      return field or query_field, code
  return query_field, None
