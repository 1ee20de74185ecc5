"""`EngineLoop`: the one thread that drives the engine for every HTTP request.

HTTP handlers never touch the engine's lock.  They validate and tokenize on
worker threads (`LazyEngine.prepare`, which takes no lock), then hand the
prepared request to the loop, which queues it (`submit_prepared`), runs
`step()` while anything is in flight, and posts each request's new tokens
and its result back to the asyncio event loop of its handler.  Stop strings
are watched here too (the handle's `TextOutput`): a request whose text
reached one ends before the next round, and its result (token ids, text,
"stop") ends at the token that completed the string.  Cancels and
other engine calls (`encode_documents`, pool statistics) run on the same
thread between rounds, so the engine's lock is never contended: a thread
waiting for a lock that a busy loop keeps retaking could wait for many
rounds.

The queue depth (`max_queue`'s 429s, the waiting gauge) counts the
requests in the loop's inbox and in the engine's waiting queue: the
latter's length is read without the engine's lock, from any thread, so a
request stops counting as soon as a round admits it, not when that round
ends.  The loop moves its inbox into the engine under its own lock, so a
request is counted once on the way.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time

from lazyattn_jax.requests import GenerationResult

logger = logging.getLogger("lazyattn_jax.server")


class QueueFullError(Exception):
  """More requests are waiting for admission than the server allows."""


class LoopClosedError(Exception):
  """The loop is shutting down and takes no new work."""


@dataclasses.dataclass
class Tokens:
  """Tokens a request generated since its last event, and the text that
  may be sent now (always "" for a handle without a `TextOutput`)."""
  token_ids: list[int]
  text: str = ""


@dataclasses.dataclass
class Finished:
  """The request ended (any finish reason)."""
  result: GenerationResult


@dataclasses.dataclass
class Failed:
  """The request could not be queued or the loop failed under it.
  `counted`: the loop's metrics already count it among ended requests (it
  was queued, or cancelled before it ran), so its answer is no rejection."""
  error: BaseException
  counted: bool = False


class RequestHandle:
  """One HTTP request's link to the engine loop.  Make it on the event loop
  that will read its `events`.

  Args:
    prepared: the `TokenRequest` of `LazyEngine.prepare`.
    arrival: `time.perf_counter()` when the HTTP request arrived (TTFT
      counts from it).
    wants_tokens: post a `Tokens` event after every round that produced
      some (streaming); otherwise only the ending is posted.
    output: a `TextOutput` to feed the generated tokens (the text of
      `Tokens` events, stop strings), or None.  Only the loop's thread
      touches it until the `Finished` event is posted.
  """

  def __init__(self, prepared, arrival: float, *, wants_tokens: bool,
               output=None):
    self.prepared = prepared
    self.arrival = arrival
    self.wants_tokens = wants_tokens
    self.output = output
    self.request_id: int | None = None
    self.cancelled = False
    self.sent = 0  # tokens already taken in (and posted, if wanted)
    self.events: asyncio.Queue = asyncio.Queue()
    self._event_loop = asyncio.get_running_loop()

  def post(self, event):
    """Thread-safe; a closed event loop means nobody is listening."""
    try:
      self._event_loop.call_soon_threadsafe(self.events.put_nowait, event)
    except RuntimeError:
      pass


class EngineLoop:
  """Drives `engine.step()` on a background thread for all requests.

  Args:
    engine: a `LazyEngine`; only this loop's thread calls it once started.
    max_queue: requests waiting for admission beyond which `submit`
      raises `QueueFullError`.
    metrics: a `ServerMetrics` to update, or None.
    pool_stats_every_s: how often to refresh the pool gauges while busy.
  """

  def __init__(self, engine, *, max_queue: int, metrics=None,
               pool_stats_every_s: float = 0.5):
    self.engine = engine
    self.max_queue = max_queue
    self.metrics = metrics
    self.pool_stats_every_s = pool_stats_every_s
    self._cond = threading.Condition()
    self._inbox: list[RequestHandle] = []
    self._cancels: list[RequestHandle] = []
    self._calls: list[tuple] = []
    self._active: dict[int, RequestHandle] = {}
    self._in_flight = 0
    self._accepting = True
    self._stop = False
    self._pool_stats_at = 0.0
    self._thread = threading.Thread(target=self._run, name="lazyattn-engine",
                                    daemon=True)

  # --- any thread ------------------------------------------------------------
  def start(self):
    self._publish()  # the gauges show the idle pool before any request
    self._thread.start()

  @property
  def alive(self) -> bool:
    return self._thread.is_alive() and self._accepting

  def queue_depth(self) -> int:
    """Requests waiting for admission (in the inbox or the engine's queue)."""
    with self._cond:
      return self._waiting()

  def _waiting(self) -> int:
    """`queue_depth`, under `_cond` (which the hand-over to the engine
    holds).  The engine's queue is the scheduler's deque of requests not yet
    admitted, read without the engine's lock (the loop holds it for whole
    rounds): its length is one atomic read, at worst a moment old."""
    return len(self._inbox) + len(self.engine.scheduler.waiting)

  def submit(self, handle: RequestHandle):
    """Hands a prepared request to the loop; never blocks on the engine."""
    with self._cond:
      if not self._accepting:
        raise LoopClosedError("the server is shutting down")
      if self._waiting() >= self.max_queue:
        raise QueueFullError(f"{self.max_queue} requests are already waiting")
      self._inbox.append(handle)
      self._cond.notify_all()

  def cancel(self, handle: RequestHandle):
    """Ends the request before the next round (its pages and document
    references are released then); a `Finished` event follows if it was
    running."""
    with self._cond:
      if handle.cancelled:
        return
      handle.cancelled = True
      self._cancels.append(handle)
      self._cond.notify_all()

  def call(self, fn, *, new_work: bool = False) -> concurrent.futures.Future:
    """Runs `fn(engine)` on the loop's thread between rounds.  `new_work`
    (a client's call, such as encoding documents) is refused, as requests
    are, once the server stops taking them; the loop's own calls run until
    it stops."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    with self._cond:
      if self._stop or (new_work and not self._accepting):
        future.set_exception(LoopClosedError(
            "the engine loop has stopped" if self._stop else
            "the server is shutting down"))
        return future
      self._calls.append((fn, future))
      self._cond.notify_all()
    return future

  def shutdown(self, drain_timeout_s: float):
    """Stops taking requests, lets those in flight finish for up to
    `drain_timeout_s`, cancels the rest, and stops the thread."""
    deadline = time.monotonic() + drain_timeout_s
    with self._cond:
      self._accepting = False
      while self._busy() and self._thread.is_alive():
        left = deadline - time.monotonic()
        if left <= 0:
          break
        # (an infinite drain waits in the longest steps a wait can take)
        self._cond.wait(min(left, threading.TIMEOUT_MAX))
      for handle in self._inbox + list(self._active.values()):
        if not handle.cancelled:
          handle.cancelled = True
          self._cancels.append(handle)
      self._stop = True
      self._cond.notify_all()
    if self._thread.is_alive():
      self._thread.join()

  def _busy(self) -> bool:
    return bool(self._inbox or self._in_flight)

  # --- the loop's thread -------------------------------------------------------
  def _run(self):
    try:
      while self._iteration():
        pass
    except BaseException:  # a bug here must not leave handlers waiting
      logger.exception("the engine loop stopped")
      self._fail_all(RuntimeError("the engine loop stopped"))
      with self._cond:
        self._accepting = False
        self._cond.notify_all()
      raise

  def _iteration(self) -> bool:
    with self._cond:
      while not (self._inbox or self._cancels or self._calls or self._active
                 or self._stop):
        self._cond.wait()
      if self._stop and not (self._inbox or self._cancels or self._calls or
                             self._active):
        return False
      inbox, self._inbox = self._inbox, []
      cancels, self._cancels = self._cancels, []
      calls, self._calls = self._calls, []
      # In flight from now, not from the round's end: a drain that starts
      # during the round (a first one may compile for seconds) waits for them.
      self._in_flight += len(inbox)
      # Into the engine's queue under `_cond`, so `queue_depth` never sees a
      # request in neither place (nor in both); queueing is quick (the
      # engine's lock is free between rounds, `prepare`'s checks are done).
      for handle in inbox:
        self._queue(handle)
    for handle in cancels:
      self._cancel_now(handle)
    for fn, future in calls:
      if future.set_running_or_notify_cancel():
        try:
          future.set_result(fn(self.engine))
        except BaseException as error:  # noqa: BLE001 - the caller gets it
          future.set_exception(error)
    if self._active:
      self._step()
    self._publish()
    return True

  def _queue(self, handle: RequestHandle):
    if handle.cancelled:  # its client left, or the server is shutting down
      if self.metrics is not None:
        self.metrics.observe_cancelled_before_queue()
      handle.post(Failed(LoopClosedError(
          "the request was cancelled before it ran: the server is shutting "
          "down"), counted=True))
      return
    try:
      handle.request_id = self.engine.submit_prepared(
          handle.prepared, arrival_time=handle.arrival)
    except Exception as error:  # noqa: BLE001 - e.g. the engine was closed
      handle.post(Failed(error))
      return
    self._active[handle.request_id] = handle

  def _cancel_now(self, handle: RequestHandle):
    request_id = handle.request_id
    if request_id is None or request_id not in self._active:
      return  # not queued yet (`_queue` drops it) or already ended
    self._end_now(request_id)

  def _end_now(self, request_id: int):
    handle = self._active.pop(request_id)
    self.engine.cancel(request_id)
    result = self.engine.pop_result(request_id)
    if result is not None:
      self._finish(handle, result)

  def _step(self):
    try:
      # First tokens go out while the round's decode loop runs, not after.
      results = self.engine.step(on_first_tokens=self._post_new_tokens)
    except Exception as error:  # noqa: BLE001 - step handles request faults
      logger.exception("engine.step() failed")
      self._fail_all(error)
      return
    for result in results:
      self.engine.pop_result(result.request_id)
      handle = self._active.pop(result.request_id, None)
      if handle is not None:
        self._finish(handle, result)
    for request_id in self._post_new_tokens():
      self._end_now(request_id)

  def _post_new_tokens(self) -> list[int]:
    """Posts every active request's tokens not yet sent; returns the ids of
    those whose stop string has come (to end once the round is over)."""
    stopped = []
    for request_id, handle in self._active.items():
      if handle.wants_tokens or handle.output is not None:
        self._take_tokens(handle, self.engine.tokens_so_far(request_id))
        if handle.output is not None and handle.output.stopped:
          stopped.append(request_id)
    return stopped

  def _take_tokens(self, handle: RequestHandle, tokens, final: bool = False):
    """Feeds the handle the tokens past `handle.sent` (up to a stop
    string's) and posts them if it wants them; `final`: the request ended,
    so the text held back comes out too."""
    new = list(tokens[handle.sent:])
    handle.sent = len(tokens)
    text = ""
    output = handle.output
    if output is not None and not output.stopped:
      before = output.tokens
      text = output.push(new)
      if output.stopped:
        new = new[:output.tokens - before]
    elif output is not None:
      new = []  # past the stop string
    if final and output is not None:
      text += output.finish()
    if handle.wants_tokens and (new or text):
      handle.post(Tokens(new, text))

  def _finish(self, handle: RequestHandle, result: GenerationResult):
    if handle.wants_tokens or handle.output is not None:
      self._take_tokens(handle, result.token_ids, final=True)
    output = handle.output
    if output is not None and output.stopped:
      # The tokens past the stop string came out in the same round: the
      # last kept token's time is estimated at the round's rate per token;
      # the round's end would charge the dropped tokens' time to the kept.
      kept = output.tokens
      latency = result.latency_s
      if 1 <= kept < len(result.token_ids):
        latency = result.ttft_s + (kept - 1) * result.decode_time_per_token_s
      result = dataclasses.replace(
          result, token_ids=result.token_ids[:kept], latency_s=latency,
          text=output.text, finish_reason="stop")
    if self.metrics is not None:
      self.metrics.observe_result(result)
    handle.post(Finished(result))

  def _fail_all(self, error: BaseException):
    active, self._active = self._active, {}
    for request_id, handle in active.items():
      try:
        self.engine.cancel(request_id)
        self.engine.pop_result(request_id)
      except Exception:  # noqa: BLE001 - the engine itself may be gone
        pass
      if self.metrics is not None:
        self.metrics.observe_failed()
      handle.post(Failed(error, counted=True))
    with self._cond:
      inbox, self._inbox = self._inbox, []
    for handle in inbox:
      handle.post(Failed(error))

  def _publish(self):
    try:
      counts = self.engine.request_counts()
    except Exception:  # noqa: BLE001 - a closed engine has nothing in flight
      counts = {"waiting": 0, "running": 0}
    with self._cond:
      self._in_flight = len(self._active)
      self._cond.notify_all()
    if self.metrics is None:
      return
    self.metrics.observe_queue(waiting=self.queue_depth(),
                               running=counts["running"])
    now = time.monotonic()
    if not self._active or now - self._pool_stats_at >= self.pool_stats_every_s:
      self._pool_stats_at = now
      try:
        self.metrics.observe_pool(self.engine.cache.stats(self.engine.state))
      except Exception:  # noqa: BLE001 - a closed engine has no pool
        pass
