"""The scheduler: queues, admission, first-token groups, retirement, rollback.

Host-only: it decides which requests run and what the cache holds for them
(through `PagedKVCache`, on the functional `CacheState` it is handed), and
records what the model runner produced.  It never runs the model, so its
logic is testable with a cache and no model.

A round (one `LazyEngine.step`) admits waiting requests while decode slots,
the prefill budget and cache pages allow; serves them in first-token groups;
then decodes every live request.  If anything fails inside a round,
`fail` takes the affected requests back out: their pages and document
references are released, cache entries they admitted but may not have
written leave the table (so no later request reads unwritten KV as a hit),
and each finishes with `finish_reason="error"`.
"""

from __future__ import annotations

import collections
import dataclasses
import numbers
import time

import numpy as np

from lazyattn_jax.config import SchedulerConfig
from lazyattn_jax.errors import CacheCapacityError
from lazyattn_jax.layout import cached_prompt_tokens
from lazyattn_jax.requests import GenerationResult, TokenRequest


@dataclasses.dataclass
class LiveRequest:
  """An admitted request and what it has produced so far."""
  request_id: int
  request: TokenRequest
  admission: object  # paged_cache.Admission
  layout: object  # modes.RequestLayout
  submitted_at: float
  prefill_tokens: int  # its own prefill plus the documents it encodes (a
  #                      learned preamble's positions not counted)
  cached_tokens: int  # prompt tokens read from cache entries it did not encode
  tokens: list[int] = dataclasses.field(default_factory=list)
  first_token_at: float = 0.0
  prefill_tokens_before_first: int = 0  # the round's work before its first token
  first_logits: np.ndarray | None = None
  finished_at: float = 0.0
  done: bool = False

  @property
  def decode_position(self) -> int:
    """Logical position of its last token (the next decode step's input)."""
    return self.layout.query_start + len(self.request.query) + len(self.tokens) - 1

  @property
  def written(self) -> int:
    """Tokens already in its query pages, before the last token's."""
    return (self.layout.query_page_offset + len(self.request.query) +
            len(self.tokens) - 1)


@dataclasses.dataclass
class FirstTokenGroup:
  """Requests that get their first tokens together, after the cache entries
  `documents` (layout.EncodeJob) of the round are encoded."""
  requests: list[LiveRequest]
  documents: list  # layout.EncodeJob


class Scheduler:
  """Owns the waiting queue, the live requests and the finished results.

  Args:
    config: `SchedulerConfig`.
    mode: the engine's `modes.ReuseMode`.
    cache: `PagedKVCache` whose transitions admit and release requests.
    detokenize: token ids -> text for results, or None.
  """

  def __init__(self, config: SchedulerConfig, mode, cache, detokenize=None):
    self.config = config
    self.mode = mode
    self.cache = cache
    self.detokenize = detokenize
    self.waiting: collections.deque = collections.deque()
    self.live: list[LiveRequest] = []
    self.finished: dict[int, GenerationResult] = {}
    self._unreported: list[GenerationResult] = []

  # --- queues ----------------------------------------------------------------
  def add(self, request_id: int, request: TokenRequest, arrived: float):
    self.waiting.append((request_id, request, arrived))

  def pop_result(self, request_id: int) -> GenerationResult | None:
    if not _can_name_a_request(request_id):
      return None
    result = self.finished.pop(request_id, None)
    if result is not None:  # taken: the next retire does not report it
      self._unreported = [r for r in self._unreported if r is not result]
    return result

  def result_pending(self, request_id: int) -> bool:
    """Whether the request is waiting or live, so its result is still to
    come (a live request that has ended gets it when retired)."""
    return (any(entry[0] == request_id for entry in self.waiting) or
            any(live.request_id == request_id for live in self.live))

  def has_work(self) -> bool:
    return bool(self.waiting or self.live)

  def decoding(self) -> list[LiveRequest]:
    return [live for live in self.live if not live.done]

  def tokens_so_far(self, request_id: int) -> list[int]:
    if not _can_name_a_request(request_id):
      return []
    if request_id in self.finished:
      return self.finished[request_id].token_ids
    for live in self.live:
      if live.request_id == request_id:
        return live.tokens
    return []

  # --- admission ---------------------------------------------------------------
  def admit(self, state):
    """Admits waiting requests in order while they fit.

    Returns (state, new requests).  A request that does not fit waits for
    live requests to free pages; one that cannot be admitted even with
    nothing live, or whose admission fails, finishes with an error.
    """
    new: list[LiveRequest] = []
    try:
      state = self._admit_into(state, new)
    except BaseException:
      # Interrupted (KeyboardInterrupt, say): the caller keeps its old
      # state, so the requests admitted into the new one go back in front.
      self.waiting.extendleft(reversed(
          [(r.request_id, r.request, r.submitted_at) for r in new]))
      raise
    return state, new

  def _admit_into(self, state, new: list[LiveRequest]):
    round_tokens = 0
    budget = self.config.prefill_tokens_per_step
    while self.waiting and len(self.live) + len(new) < self.config.max_batch:
      if budget is not None and new and round_tokens >= budget:
        break  # the rest waits for the next step; decode keeps flowing
      request_id, request, submitted = self.waiting[0]
      needs = self.mode.cache_needs(request)
      try:
        admitted, admission = self.cache.admit(
            state, needs.keys, needs.lengths, needs.private_tokens)
      except CacheCapacityError as error:
        if self.live or new:
          break  # wait for live requests to free pages
        self.waiting.popleft()
        self._finish_failed(request_id, request, submitted, _describe(error))
        continue
      except Exception as error:  # noqa: BLE001 - the request fails, not the engine
        self.waiting.popleft()
        self._finish_failed(request_id, request, submitted, _describe(error))
        continue
      try:
        layout = self.mode.layout(request, admission)
        to_encode = self.mode.documents_to_encode(request, admission)
      except Exception as error:  # noqa: BLE001
        self.waiting.popleft()
        state = self.cache.drop_documents(
            self.cache.finish(admitted, admission),
            [admission.doc_slots[i] for i in admission.missing_docs])
        self._finish_failed(request_id, request, submitted, _describe(error))
        continue
      state = admitted
      own = sum(len(job.tokens) for job in to_encode) + len(layout.prefill)
      # A learned preamble's positions are work, not the request's tokens.
      learned = sum(len(job.tokens) for job in to_encode
                    if job.embeddings is not None)
      cached = cached_prompt_tokens(
          layout.row, layout.copies, admission.doc_pages,
          admission.doc_hit, [0] if self.mode.learned_preamble_positions
          else [])
      self.waiting.popleft()
      new.append(LiveRequest(request_id, request, admission, layout,
                             submitted, own - learned, cached))
      round_tokens += own
    return state

  def first_token_groups(self, new: list[LiveRequest]) -> list[FirstTokenGroup]:
    """Splits a round's requests into groups that prefill one after another.

    Encoding every missing document of the round before any query would
    hold every first token back until the last document is in, even for a
    request whose documents were all cached.  Instead requests go cheapest
    first (fewest document tokens of this round still to encode; a document
    an earlier group encodes is free), in groups of about
    `config.group_tokens` new document tokens.  Each group's documents are
    encoded, then its queries run and its first tokens are out.  The work is
    the same; first tokens come sooner.  A document slot admitted as
    missing is a hit for every later admission, even in the same round, so
    the slot, not the request, is the unit of work: each is encoded once,
    in the first group that reads it.  Modes without a document step form
    one group.
    """
    todo = {}
    for live in new:
      for job in self.mode.documents_to_encode(live.request, live.admission):
        todo.setdefault(job.slot, job)
    if not todo:
      return [FirstTokenGroup(list(new), [])]
    needs = [{slot for slot in live.admission.doc_slots if slot in todo}
             for live in new]
    planned: set[int] = set()
    order = list(range(len(new)))
    groups = []
    group, group_slots, group_tokens = [], set(), 0

    def close():
      groups.append(FirstTokenGroup(
          group, [todo[slot] for slot in sorted(group_slots)]))

    while order:
      costs = [sum(len(todo[slot].tokens) for slot in needs[i] - planned)
               for i in order]
      pick = int(np.argmin(costs))  # first of the cheapest: admission order
      if group and group_tokens + costs[pick] > self.config.group_tokens:
        close()
        group, group_slots, group_tokens = [], set(), 0
      i = order.pop(pick)
      group.append(new[i])
      group_tokens += costs[pick]
      group_slots |= needs[i] - planned
      planned |= needs[i]
    close()
    return groups

  def start(self, requests: list[LiveRequest]):
    """Requests whose prefill is done join the live set."""
    self.live.extend(requests)

  # --- what the model produced ------------------------------------------------
  def record_first_tokens(self, requests, first, logits, round_tokens: int,
                          now: float):
    """First tokens of `requests` (one prefill call), after `round_tokens`
    tokens of the round's prefill work."""
    for b, live in enumerate(requests):
      token = int(first[b])
      live.tokens.append(token)
      live.first_token_at = now
      live.prefill_tokens_before_first = round_tokens
      live.first_logits = logits[b]
      live.done = (token in live.request.stop_ids or
                   live.request.sampling.max_new_tokens <= 1)
      if live.done:
        live.finished_at = now

  def record_decode(self, requests, out, emitted, done, now: float) -> int:
    """Tokens of one decode loop, row b for requests[b]; returns how many."""
    count = 0
    for b, live in enumerate(requests):
      new_tokens = [int(t) for t, e in zip(out[b], emitted[b]) if e]
      live.tokens.extend(new_tokens)
      count += len(new_tokens)
      if done[b]:
        live.done = True
        live.finished_at = now
    return count

  # --- endings ------------------------------------------------------------------
  def retire(self, state):
    """Releases finished requests; returns (state, results of this step)."""
    state = self.take_finished(state)
    finished, self._unreported = self._unreported, []
    return state, finished

  def take_finished(self, state, *, release: bool = True):
    """Takes finished requests out of `live`, their results kept for the
    next `retire`; returns the new state.  `release=False` when the cache
    is being rebuilt (its pool was lost): their tokens are all out, so they
    end as they would have, with nothing left to release."""
    finished = [live for live in self.live if live.done]
    # The results first: if making one fails, nothing was released.
    results = [self._result(live, "stop" if live.tokens and live.tokens[-1]
                            in live.request.stop_ids else "length")
               for live in finished]
    if release:
      for live in finished:
        state = self.cache.finish(state, live.admission)
    self.live = [live for live in self.live if not live.done]
    self._unreported += results
    return state

  def fail(self, state, requests: list[LiveRequest], error: BaseException, *,
           prefilled: bool = False, release: bool = True):
    """Takes `requests` out with an error result; returns the new state.

    Unless they were `prefilled`, the cache entries they admitted as missing
    may never have been written (a document step or, in prefix mode, their
    own prefill writes them): those leave the table once no remaining
    request reads them, so no later request takes unwritten KV for a hit.
    `release=False` when the cache is being rebuilt anyway (its pool was
    lost).
    """
    failed = {id(live) for live in requests}
    self.live = [live for live in self.live if id(live) not in failed]
    for live in requests:
      if release:
        state = self.cache.finish(state, live.admission)
      self._unreported.append(self._result(live, "error", _describe(error)))
    admitted = sorted({live.admission.doc_slots[i] for live in requests
                       for i in live.admission.missing_docs})
    if release and not prefilled and admitted:
      state = self.cache.drop_documents(state, admitted)
    return state

  def cancel(self, state, request_id: int):
    """Ends a waiting or live request now; returns (state, found)."""
    if not _can_name_a_request(request_id):
      return state, False
    for entry in self.waiting:
      if entry[0] == request_id:
        self.waiting.remove(entry)
        self._finish_failed(*entry, None, reason="cancelled")
        return state, True
    for live in self.live:
      if live.request_id == request_id:
        if live.done:  # ended (stop, length) and awaiting retirement
          return state, False
        result = self._result(live, "cancelled")  # first, as take_finished
        self.live.remove(live)
        state = self.cache.finish(state, live.admission)
        self._unreported.append(result)
        return state, True
    return state, False

  def _finish_failed(self, request_id, request, submitted, error,
                     reason: str = "error"):
    """A result for a request that never ran."""
    now = time.perf_counter()
    result = GenerationResult(
        request_id=request_id, token_ids=[], doc_hits=[False] * (
            len(request.documents) - request.leading),
        ttft_s=0.0, latency_s=now - submitted, finish_reason=reason,
        prompt_tokens=(self.mode.preamble_tokens -
                       self.mode.learned_preamble_positions +
                       sum(map(len, request.documents)) + len(request.query)),
        prefill_tokens_computed=0, error=error,
        text="" if self.detokenize is not None else None)
    self.finished[request_id] = result
    self._unreported.append(result)

  def _result(self, live: LiveRequest, reason: str,
              error: str | None = None) -> GenerationResult:
    now = time.perf_counter()
    end = live.finished_at or now
    request = live.request
    result = GenerationResult(
        request_id=live.request_id, token_ids=list(live.tokens),
        doc_hits=self.mode.doc_hits(request, live.admission)[request.leading:],
        ttft_s=(live.first_token_at - live.submitted_at
                if live.first_token_at else 0.0),
        latency_s=end - live.submitted_at, finish_reason=reason,
        prompt_tokens=(live.layout.query_start + len(request.query) -
                       self.mode.learned_preamble_positions),
        prefill_tokens_computed=live.prefill_tokens,
        cached_prompt_tokens=live.cached_tokens,
        prefill_tokens_before_first_token=live.prefill_tokens_before_first,
        first_logits=live.first_logits,
        text=(self.detokenize(live.tokens) if self.detokenize is not None
              else None),
        error=error)
    self.finished[live.request_id] = result
    return result


def _describe(error: BaseException) -> str:
  return f"{type(error).__name__}: {error}"


def _can_name_a_request(request_id) -> bool:
  """Whether `request_id` is an integer, as every id is: True or 1.0
  compare equal to 1 but name no request, and an unhashable id would make
  a lookup raise TypeError."""
  return (isinstance(request_id, numbers.Integral) and
          not isinstance(request_id, bool))
