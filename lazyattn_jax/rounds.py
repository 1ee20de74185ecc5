"""One scheduling round: the order of work between the scheduler and the
model runner, and the round's rollback (the counters it fills are
`engine_stats.EngineStats`).

`RoundExecutor.step` admits waiting requests, serves them in first-token
groups (encode the group's missing documents, write its Block-Attention
copies, prefill its queries and take first tokens), decodes every live
request, and retires the finished ones.  With `decode_during_prefill` the
running requests also decode one token inside each prefill call (a mixed
step) rather than wait for the round's prefill.  A failure inside any of it takes
the affected requests out with an error result (`Scheduler.fail`); if a
donated step lost the pool, the cache is rebuilt empty and every live
request fails with it.
"""

from __future__ import annotations

import logging
import time

from lazyattn_jax.cache_state import init_cache_state
from lazyattn_jax.engine_stats import EngineStats
from lazyattn_jax.layout import prefill_chunks
from lazyattn_jax.sampling import SamplingParams

logger = logging.getLogger("lazyattn_jax")


class RoundExecutor:
  """Runs rounds over the cache state it holds.

  `state` is replaced after every step that returns a new one, so when
  something fails midway it is the state as far as the work got: the pool
  passed to a donated step is gone once the step has run.

  Args:
    scheduler: the engine's `Scheduler` (and through it the cache and mode).
    runner: the engine's `ModelRunner`.
    cache_config: the pool's `CacheConfig`.
  """

  def __init__(self, scheduler, runner, cache_config):
    self.scheduler = scheduler
    self.runner = runner
    self.cache_config = cache_config
    self.state = init_cache_state(cache_config)
    self.stats = EngineStats()
    self._riders_run = None  # DecodeRiders of the current run of mixed steps

  @property
  def _budget(self) -> int:
    return self.scheduler.config.max_prefill_tokens

  def step(self, on_first_tokens=None):
    """One round; returns the results of the requests that ended in it.
    `on_first_tokens()` runs once the round's new requests have their first
    tokens, while its decode loop runs on the device (`LazyEngine.step`)."""
    self.state, new = self.scheduler.admit(self.state)
    if new:
      self._prefill_round(new)
    self.note_pages_used()
    notify = on_first_tokens if new else None
    decoding = self.scheduler.decoding()
    if decoding:
      self._decode(decoding, notify)
    elif notify is not None:
      _call_logged(notify)
    self.state, results = self.scheduler.retire(self.state)
    return results

  def reset(self):
    """An empty cache and zeroed counters; the old pool is freed first (two
    pools may not fit)."""
    self.free_pool()
    self.state = init_cache_state(self.cache_config)
    self.stats = EngineStats()
    self._riders_run = None

  def free_pool(self):
    """Deletes the pool's buffers now (the state is gone after this)."""
    state, self.state = self.state, None
    if state is not None:
      for buffer in (state.k, state.v):
        if buffer is not None and not buffer.is_deleted():
          buffer.delete()

  def note_pages_used(self):
    used = (self.cache_config.num_pages -
            self.scheduler.cache.free_page_count(self.state))
    self.stats.peak_pages_used = max(self.stats.peak_pages_used, used)

  def _prefill_round(self, new):
    """Serves the round's first-token groups in order; a failure takes the
    failing group and every later one back out.

    A group's first tokens are fetched only once the next group's calls
    are on the device, so the device never waits while the host prepares
    the next group (the calls run in order, so the fetch waits only for
    its own group's).  With decode during prefill a group's requests
    start riding then, in the calls of the group after next; the riders'
    state stays on the device throughout (`_prefill_call`)."""
    try:
      self._serve_groups(new)
    finally:
      self._collect_riders()

  def _serve_groups(self, new):
    groups = self.scheduler.first_token_groups(new)
    round_tokens, waiting = 0, None  # served group whose tokens are unread
    for index, group in enumerate(groups):
      try:
        round_tokens, fetches = self._serve_group(group, round_tokens)
      except BaseException as error:
        # The group before this one was served whole: it still finishes.
        if waiting is None or self._finish_group(groups, *waiting):
          self._fail_groups(groups, index, error)
        elif not isinstance(error, Exception):
          raise
        return
      if waiting is not None and not self._finish_group(groups, *waiting):
        return
      waiting = (index, fetches)
    if waiting is not None:
      self._finish_group(groups, *waiting)

  def _finish_group(self, groups, index: int, fetches) -> bool:
    """Waits for a served group's first tokens, records them and starts
    its requests; on failure takes it and every later group out.  Returns
    whether it finished."""
    try:
      for requests, rows, fetch, round_tokens in fetches:
        logits, first = fetch()
        self.scheduler.record_first_tokens(
            requests, first[rows], logits[rows], round_tokens,
            time.perf_counter())
    except BaseException as error:
      self._fail_groups(groups, index, error)
      return False
    self.scheduler.start(groups[index].requests)
    return True

  def _fail_groups(self, groups, index: int, error: BaseException):
    self._fail([r for g in groups[index:] for r in g.requests], error)
    if not isinstance(error, Exception):
      raise error

  def _serve_group(self, group, round_tokens: int):
    """Encodes the group's documents, writes its copies and prefills its
    queries, without waiting for the device.  Returns the round's prefill
    work so far and the group's first-token fetches: (requests, their rows
    in the call, fetch() -> (logits, first tokens) of the call, the round's
    work before them)."""
    if group.documents:
      self._encode(group.documents)
      round_tokens += sum(len(job.tokens) for job in group.documents)
    copies = [c for r in group.requests for c in r.layout.copies]
    self.state = self.runner.copy_pages(self.state, copies)
    self.stats.kv_pages_written_for_cached_docs += len(copies)
    requests = group.requests
    keep_order = self.scheduler.mode.keeps_query_order
    # A request may read pages an earlier one of the round writes when the
    # order is kept (prefix mode), so those prefills are never cut.
    chunk_tokens = (None if keep_order else
                    self.scheduler.config.chunk_tokens)
    pieces = [prefill_chunks(r.layout.row, r.layout.prefill, chunk_tokens)
              for r in requests]
    fetches = []
    for wave, rows, tokens in self._chunk_calls(pieces, keep_order):
      ends = [wave == len(pieces[i]) - 1 for i in rows]
      fetch = self._prefill_call(
          [pieces[i][wave][0] for i in rows],
          [pieces[i][wave][1] for i in rows],
          [requests[i].request.sampling for i in rows], ends_query=ends)
      round_tokens += tokens
      self.stats.prefill_tokens_computed += tokens
      done = [k for k, end in enumerate(ends) if end]
      if done:  # the requests whose last chunk ran: their first tokens
        fetches.append(([requests[rows[k]] for k in done], done, fetch,
                        round_tokens))
    return round_tokens, fetches

  def _chunk_calls(self, pieces, keep_order: bool):
    """The prefill calls of items cut into chunks (`pieces[i]`: item i's
    (row, plan) per chunk): every item's first chunk, then every second
    chunk, and so on, each wave split into calls within the budget.
    Yields (wave, the items of one call, its token count)."""
    for wave in range(max(map(len, pieces), default=0)):
      members = [i for i, p in enumerate(pieces) if wave < len(p)]
      lengths = [len(pieces[i][wave][1]) for i in members]
      for batch in self.runner.prefill_batches(lengths, self._budget,
                                               keep_order):
        yield (wave, [members[j] for j in batch],
               sum(lengths[j] for j in batch))

  def _encode(self, jobs, riders: bool = True):
    """Prefills cache entries (layout.EncodeJob), each alone or after the
    preamble: a preamble first, then the documents that read it.  Entries
    longer than the chunk size (`SchedulerConfig.chunk_tokens`) go in
    chunks: every entry's first chunk, then every second chunk, and so on,
    each wave in its own calls.  `riders=False` keeps running requests from
    decoding alongside (the encoding between rounds)."""
    chunk_tokens = self.scheduler.config.chunk_tokens
    page_size = self.cache_config.page_size
    for phase in sorted({job.phase for job in jobs}):
      phase_jobs = [job for job in jobs if job.phase == phase]
      learned = [job for job in phase_jobs if job.embeddings is not None]
      if learned:  # learned vectors: whole, in plain prefill calls
        lengths = [len(job.tokens) for job in learned]
        for batch in self.runner.prefill_batches(lengths, self._budget,
                                                 keep_order=False):
          self.state = self.runner.encode_documents(
              self.state, [learned[i] for i in batch])
          self.stats.prefill_tokens_computed += sum(lengths[i] for i in batch)
      plain = [job for job in phase_jobs if job.embeddings is None]
      pieces = [job.chunk_rows_and_plans(page_size, chunk_tokens)
                for job in plain]
      for wave, chosen, tokens in self._chunk_calls(pieces, False):
        wave_pieces = [pieces[i][wave] for i in chosen]
        if riders and self._riders():
          rows, plans = zip(*wave_pieces)
          self._prefill_call(list(rows), list(plans),
                             [SamplingParams()] * len(chosen),
                             ends_query=[False] * len(chosen))
        else:
          self.state = self.runner.encode_documents(
              self.state, [plain[i] for i in chosen], pieces=wave_pieces)
        self.stats.prefill_tokens_computed += tokens
      preambles = sum(job.is_preamble for job in phase_jobs)
      self.stats.preambles_prefilled += preambles
      self.stats.documents_prefilled += len(phase_jobs) - preambles

  def _riders(self):
    """The running requests that decode inside prefill calls ([] unless
    `decode_during_prefill`)."""
    if not self.scheduler.config.decode_during_prefill:
      return []
    return self.scheduler.decoding()

  def _prefill_call(self, rows, plans, samplings, *, ends_query):
    """One prefill call (`ends_query`: per row, whether its chunk ends a
    request's prompt; documents end none); with riders, one mixed step in
    which each running request also decodes its next token.  Returns
    fetch() -> (logits, first tokens) of the rows, on host.

    Successive mixed steps carry the riders' decode state on the device
    (`DecodeRiders`, also when requests start riding), so none waits for
    the one before; the riders' tokens are recorded at the end of the
    round (`_collect_riders`)."""
    riders = self._riders()
    if not riders:
      self._collect_riders()
      self.state, fetch = self.runner.prefill_async(self.state, rows, plans,
                                                    samplings)
      return fetch
    run = self._riders_run
    if run is None or not run.same_requests(riders):
      run = self._riders_run = self.runner.decode_riders(
          riders, self.scheduler.config.max_batch, previous=run)
    self.state, fetch = self.runner.mixed_step_async(
        self.state, run, rows, plans, samplings, ends_query)
    self.stats.mixed_steps += 1
    return fetch

  def _collect_riders(self):
    """Records the tokens the riders drew in mixed steps so far (waits for
    them), for the riders still live; a failure to read them fails the
    riders."""
    run, self._riders_run = self._riders_run, None
    try:
      self._record_riders(run)
    except BaseException as error:
      self._fail([run.requests[b] for b in self._live_rows(run.requests)],
                 error, prefilled=True)
      if not isinstance(error, Exception):
        raise

  def _record_riders(self, run):
    """Records the tokens `run`'s riders drew, for those still live; raises
    what reading them raises, having recorded nothing."""
    if run is None or not run.steps:
      return
    collected = run.collect()
    now = time.perf_counter()
    for requests, tokens, emitted, done in collected:
      rows = self._live_rows(requests)
      self.stats.generated_tokens += self.scheduler.record_decode(
          [requests[b] for b in rows], tokens[rows], emitted[rows],
          done[rows], now)

  def _live_rows(self, requests) -> list[int]:
    """Indices of those of `requests` still live (a callback may have
    cancelled some since they were gathered: they have their result)."""
    live = {id(r) for r in self.scheduler.live}
    return [b for b, r in enumerate(requests) if id(r) in live]

  def _decode(self, decoding, before_wait=None):
    cfg = self.scheduler.config
    steps = cfg.loop_steps(min(
        r.request.sampling.max_new_tokens - len(r.tokens) for r in decoding))
    started = time.perf_counter()
    try:
      self.state, fetch = self.runner.decode_async(
          self.state, decoding, cfg.max_batch, steps)
      if before_wait is not None:  # the host is free while the loop runs
        callback_started = time.perf_counter()
        _call_logged(before_wait)
        started += time.perf_counter() - callback_started  # not loop time
      out, emitted, done = fetch()
    except BaseException as error:
      self._fail([decoding[b] for b in self._live_rows(decoding)], error,
                 prefilled=True)
      if not isinstance(error, Exception):
        raise
      return
    now = time.perf_counter()
    self.stats.decode_seconds += now - started
    self.stats.decode_steps += steps
    rows = self._live_rows(decoding)
    tokens = self.scheduler.record_decode(
        [decoding[b] for b in rows], out[rows], emitted[rows], done[rows],
        now)
    self.stats.generated_tokens += tokens
    self.stats.decode_loop_tokens += tokens

  def _fail(self, requests, error: BaseException, prefilled: bool = False):
    """Takes failed requests out; rebuilds the cache if its pool was lost
    (a donated step failed after consuming it: every request's KV is gone)."""
    logger.error("%d request(s) failed: %s: %s", len(requests),
                 type(error).__name__, error)
    if pool_lost(self.state):
      run, self._riders_run = self._riders_run, None
      try:  # the riders' tokens so far are not in the pool
        self._record_riders(run)
      except Exception as unreadable:  # then the riders fail below too
        logger.error("riders' tokens unreadable: %s", unreadable)
      # Finished live requests need no KV: they end as they would have.  A
      # request of a failing group may be done without being live yet: it
      # fails with its group.
      live = {id(r) for r in self.scheduler.live}
      self.scheduler.take_finished(self.state, release=False)
      failed = {id(r) for r in requests}
      everyone = [r for r in requests if not (r.done and id(r) in live)] + [
          r for r in self.scheduler.live if id(r) not in failed]
      self.scheduler.fail(self.state, everyone, error, release=False)
      self.state = init_cache_state(self.cache_config)
      return
    self.state = self.scheduler.fail(self.state, requests, error,
                                     prefilled=prefilled)

  def encode_documents(self, documents) -> list[bool]:
    """Admits and encodes documents (and the preamble they are encoded
    after, if missing) with no request reading them; returns per document
    whether it was cached already.  On failure the error propagates and
    nothing stays cached that was not encoded: the tables are as before the
    call, unless its admission evicted documents, whose pages may hold its
    writes; then those stay evicted and the entries it admitted leave."""
    cache, mode = self.scheduler.cache, self.scheduler.mode
    keys, lengths = mode.entries(documents)
    before = self.state
    self.state, admission = cache.admit(self.state, keys, lengths, 0)
    try:
      self._encode(mode.encode_jobs(documents, admission), riders=False)
    except BaseException as error:
      if pool_lost(self.state):
        self._fail([], error)  # every live request's KV went with it
        raise
      if admission.evicted:  # their pages may hold its writes: keep them out
        self.state = cache.drop_documents(
            cache.finish(self.state, admission),
            [admission.doc_slots[i] for i in admission.missing_docs])
      else:  # the tables as they were (the pages it wrote are free there)
        self.state = before.replace(k=self.state.k, v=self.state.v)
      raise
    self.state = cache.finish(self.state, admission)
    self.note_pages_used()
    return mode.doc_hits(None, admission)


def pool_lost(state) -> bool:
  """Whether a donated step consumed the pool without returning a new one."""
  return state.k.is_deleted() or state.v.is_deleted()


def _call_logged(callback):
  """Runs a caller's callback inside a round: what it raises is logged,
  never raised, since the round must still record its work."""
  try:
    callback()
  except Exception:  # noqa: BLE001
    logger.exception("on_first_tokens raised; the round goes on")
