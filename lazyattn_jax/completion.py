"""Driving requests to completion over the engine's public API: blocking
(`LazyEngine.generate`, `generate_batch`), streaming (`generate_stream`),
and documents encoded ahead of use in batches (`encode_documents`).

Each caller runs scheduling rounds until its own requests end; several
threads doing so share the rounds.  A caller that goes away (an exception,
a closed stream) cancels what it left running.
"""

from __future__ import annotations

from lazyattn_jax.errors import (CacheCapacityError, EngineClosedError,
                                 InvalidRequestError, RequestFailedError,
                                 ResultTakenError)
from pallas_kernels.sizes import ceil_div


def run_to_completion(engine, requests) -> list:
  """Queues validated requests and returns their results, in order."""
  ids = [engine.submit_prepared(r) for r in requests]
  results = {}
  try:
    while True:
      for i in ids:
        if i not in results and (result := _result_if_ended(engine,
                                                            i)) is not None:
          results[i] = result
      if len(results) == len(ids):
        return [results[i] for i in ids]
      engine.step()
  except BaseException:
    _abandon(engine, [i for i in ids if i not in results])
    raise


def _result_if_ended(engine, request_id):
  """The request's result once it has ended; None while it is in flight.

  Raises:
    ResultTakenError: it ended and another caller popped its result (the
      wait would otherwise step an idle engine for ever).
  """
  with engine._lock:
    result = engine.pop_result(request_id)
    if result is None and not engine.scheduler.result_pending(request_id):
      raise ResultTakenError(
          f"request {request_id} ended and its result was taken by another "
          "caller's pop_result")
    return result


def run_one(engine, request):
  """The result of one validated request; RequestFailedError if the
  engine failed while serving it."""
  (result,) = run_to_completion(engine, [request])
  return _unless_failed(result)


def _unless_failed(result):
  """`result`, or RequestFailedError if the engine failed serving it."""
  if result.finish_reason == "error":
    raise RequestFailedError(result.error, result)
  return result


def _abandon(engine, ids):
  """Cancels and forgets requests whose caller is gone.

  A dropped stream's cleanup runs where Python's garbage collector runs
  it: on whatever thread allocates, maybe one inside this engine's call,
  in the middle of a round (which would then overwrite the state the
  cancel released pages in), or one that must not wait for the lock.  So
  unless the lock is free, the ids wait for the engine's next step
  (`cancel_abandoned`)."""
  lock = engine._lock
  if lock._is_owned() or not lock.acquire(blocking=False):
    engine._abandoned.extend(ids)
    return
  try:
    _cancel_and_forget(engine, ids)
  finally:
    lock.release()


def cancel_abandoned(engine):
  """Cancels the requests `_abandon` left for later; the engine runs it,
  under its lock, between rounds."""
  ids = []
  while engine._abandoned:
    ids.append(engine._abandoned.popleft())
  _cancel_and_forget(engine, ids)


def _cancel_and_forget(engine, ids):
  for request_id in ids:
    try:
      engine.cancel(request_id)
      engine.pop_result(request_id)
    except EngineClosedError:
      return


def stream_text(engine, request, arrival: float):
  """Yields the text of `request` (a prepared TokenRequest that arrived at
  `arrival`) piece by piece; returns its result.  It is queued at the
  first `next()`, inside the generator, so a stream closed or dropped
  before then leaves nothing queued and no result behind."""
  decoder = engine.tokenizer.incremental_decoder()
  request_id = engine.submit_prepared(request, arrival_time=arrival)
  sent = 0
  try:
    while (result := _result_if_ended(engine, request_id)) is None:
      engine.step()
      tokens = engine.tokens_so_far(request_id)
      if len(tokens) > sent:
        piece = decoder.push(tokens[sent:])
        sent = len(tokens)
        if piece:
          yield piece
  except BaseException:
    _abandon(engine, [request_id])
    raise
  _unless_failed(result)
  # Tokens the last round gave (another caller's step may have ended it).
  tail = decoder.push(result.token_ids[sent:]) + decoder.finish()
  if tail:
    yield tail
  return result


def encode_in_batches(engine, documents, batch_size: int | None,
                      progress: bool) -> list[bool]:
  """Checks and encodes documents at most `batch_size` at a time (None:
  the engine's max_batch), each batch under the engine's lock (rounds may
  run in between); per document, whether it was cached already when its
  batch was encoded (another caller may cache it while earlier batches
  are; a repeat says what its first occurrence says, whichever batches
  they fall in).  Returns once the device has written them (the
  encode calls themselves do not wait), so a caller timing it times the
  work."""
  import jax
  from lazyattn_jax.progress import progress_bar_class
  tqdm = progress_bar_class()
  if batch_size is None:
    batch_size = engine.scheduler_config.max_batch
  elif (isinstance(batch_size, bool) or not isinstance(batch_size, int)
        or batch_size < 1):
    raise InvalidRequestError(
        f"batch_size must be an int >= 1 or None, got {batch_size!r}")
  token_docs = engine.validator.documents(documents)
  hits: list[bool] = []
  cfg = engine.cache_config
  batches = batches_that_fit(
      token_docs, batch_size, page_size=cfg.page_size,
      num_pages=cfg.num_pages, max_docs=cfg.max_docs,
      preamble_tokens=engine._mode.preamble_tokens)
  with tqdm(total=len(token_docs), desc="Encoding documents", unit="doc",
            disable=not progress) as bar:
    for chunk in batches:
      with engine._lock:
        engine._check_open()
        try:
          hits += engine.rounds.encode_documents(chunk)
        except CacheCapacityError as e:
          if not hits:
            raise
          # Earlier batches are in the cache: say which, so a caller can
          # retry the rest alone.
          raise CacheCapacityError(
              f"{e} (documents 0-{len(hits) - 1} of the {len(token_docs)} "
              f"given were encoded by earlier batches; from document "
              f"{len(hits)} on, none was)") from e
      bar.update(len(chunk))
  with engine._lock:
    jax.block_until_ready(engine.rounds.state)
  first = {}
  for doc, hit in zip(token_docs, hits):
    first.setdefault(doc, hit)
  return [first[doc] for doc in token_docs]


def batches_that_fit(token_docs, batch_size: int, *, page_size: int,
                     num_pages: int, max_docs: int, preamble_tokens: int):
  """Consecutive runs of at most `batch_size` documents whose pages and
  cache slots (with the preamble's) fit the whole pool, so a batch is only
  ever refused for what live requests hold, never for its own size.  Each
  document fits alone (the validator checked its length)."""
  preamble_pages = ceil_div(preamble_tokens, page_size)
  slots = max_docs - (preamble_tokens > 0)
  chunk, pages = [], preamble_pages
  for doc in token_docs:
    doc_pages = ceil_div(len(doc), page_size)
    if chunk and (len(chunk) in (batch_size, slots)
                  or pages + doc_pages > num_pages):
      yield chunk
      chunk, pages = [], preamble_pages
    chunk.append(doc)
    pages += doc_pages
  if chunk:
    yield chunk
