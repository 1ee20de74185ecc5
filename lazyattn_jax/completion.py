"""Driving requests to completion over the engine's public API: blocking
(`LazyEngine.generate`, `generate_batch`), streaming (`generate_stream`),
and documents encoded ahead of use in batches (`encode_documents`).

Each caller runs scheduling rounds until its own requests end; several
threads doing so share the rounds.  A caller that goes away (an exception,
a closed stream) cancels what it left running.
"""

from __future__ import annotations

from lazyattn_jax.errors import EngineClosedError, RequestFailedError


def run_to_completion(engine, requests) -> list:
  """Queues validated requests and returns their results, in order."""
  ids = [engine.submit_prepared(r) for r in requests]
  results = {}
  try:
    while True:
      for i in ids:
        if i not in results and (result := engine.pop_result(i)) is not None:
          results[i] = result
      if len(results) == len(ids):
        return [results[i] for i in ids]
      engine.step()
  except BaseException:
    _abandon(engine, [i for i in ids if i not in results])
    raise


def _abandon(engine, ids):
  """Cancels and forgets requests whose caller is gone."""
  for request_id in ids:
    try:
      engine.cancel(request_id)
      engine.pop_result(request_id)
    except EngineClosedError:
      return


def stream_text(engine, request_id: int):
  """Yields `request_id`'s text piece by piece; returns its result."""
  decoder = engine.tokenizer.incremental_decoder()
  sent = 0
  try:
    while (result := engine.pop_result(request_id)) is None:
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
  if result.finish_reason == "error":
    raise RequestFailedError(result.error, result)
  if len(result.token_ids) > sent:
    decoder.push(result.token_ids[sent:])
  tail = decoder.finish()
  if tail:
    yield tail
  return result


def encode_in_batches(engine, token_docs, batch_size: int,
                      progress: bool) -> list[bool]:
  """Encodes token documents `batch_size` at a time, each batch under the
  engine's lock (rounds may run in between); per document, whether it was
  cached already.  Returns once the device has written them (the encode
  calls themselves do not wait), so a caller timing it times the work."""
  import jax
  from tqdm.auto import tqdm
  hits: list[bool] = []
  with tqdm(total=len(token_docs), desc="Encoding documents", unit="doc",
            disable=not progress) as bar:
    for start in range(0, len(token_docs), batch_size):
      chunk = token_docs[start:start + batch_size]
      with engine._lock:
        engine._check_open()
        hits += engine.rounds.encode_documents(chunk)
      bar.update(len(chunk))
  with engine._lock:
    jax.block_until_ready(engine.rounds.state)
  return hits
