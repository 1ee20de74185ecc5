"""Prometheus metrics of the server (`GET /metrics`).

Each server has its own registry, so several servers (or tests) in one
process do not share counters.  The engine loop updates them: results as
requests end, queue and running gauges after every round, pool gauges at
most every half second while busy (reading the pool statistics is a small
device computation).
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0,
                 5.0, 10.0, 20.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,
                 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
_LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0,
                    60.0, 120.0)


class ServerMetrics:
  """The server's counters, gauges and histograms."""

  def __init__(self):
    self.registry = CollectorRegistry()
    r = self.registry
    self.ttft = Histogram(
        "lazyattn_time_to_first_token_seconds",
        "Seconds from a request's arrival to its first token.",
        buckets=_TTFT_BUCKETS, registry=r)
    self.tpot = Histogram(
        "lazyattn_time_per_output_token_seconds",
        "Seconds per generated token after the first.",
        buckets=_TPOT_BUCKETS, registry=r)
    self.latency = Histogram(
        "lazyattn_request_latency_seconds",
        "Seconds from a request's arrival to its last token.",
        buckets=_LATENCY_BUCKETS, registry=r)
    self.requests = Counter(
        "lazyattn_requests", "Requests that ended, by finish reason.",
        ["finish_reason"], registry=r)
    self.rejected = Counter(
        "lazyattn_rejected_requests",
        "Requests refused before queueing, by HTTP status.", ["status"],
        registry=r)
    self.prompt_tokens = Counter(
        "lazyattn_prompt_tokens", "Prompt tokens of ended requests.",
        registry=r)
    self.cached_prompt_tokens = Counter(
        "lazyattn_cached_prompt_tokens",
        "Prompt tokens read from the cache instead of prefilled.", registry=r)
    self.generation_tokens = Counter(
        "lazyattn_generation_tokens", "Generated tokens.", registry=r)
    self.document_lookups = Counter(
        "lazyattn_document_lookups", "Documents requests listed.", registry=r)
    self.document_hits = Counter(
        "lazyattn_document_hits",
        "Documents found in the cache when their request was admitted.",
        registry=r)
    self.document_hit_rate = Gauge(
        "lazyattn_document_hit_rate",
        "Share of listed documents found in the cache, since start.",
        registry=r)
    self.waiting = Gauge("lazyattn_requests_waiting",
                         "Requests waiting for admission (queue depth).",
                         registry=r)
    self.running = Gauge("lazyattn_requests_running",
                         "Requests being generated.", registry=r)
    self.pages_used = Gauge("lazyattn_kv_pages_used",
                            "KV pool pages in use (documents and requests).",
                            registry=r)
    self.pages_free = Gauge("lazyattn_kv_pages_free", "Free KV pool pages.",
                            registry=r)
    self.cached_documents = Gauge("lazyattn_cached_documents",
                                  "Entries in the document cache: documents, "
                                  "and a shared preamble or chat prefix.",
                                  registry=r)
    self._lookups = 0
    self._hits = 0

  def observe_result(self, result):
    """One ended request (a `GenerationResult`)."""
    self.requests.labels(result.finish_reason).inc()
    self.generation_tokens.inc(len(result.token_ids))
    if result.finish_reason not in ("stop", "length"):
      return
    self.prompt_tokens.inc(result.prompt_tokens)
    self.cached_prompt_tokens.inc(result.cached_prompt_tokens)
    self.ttft.observe(result.ttft_s)
    self.latency.observe(result.latency_s)
    if len(result.token_ids) > 1:
      self.tpot.observe(result.decode_time_per_token_s)
    hits = sum(result.doc_hits)
    self.document_lookups.inc(len(result.doc_hits))
    self.document_hits.inc(hits)
    self._lookups += len(result.doc_hits)
    self._hits += hits
    if self._lookups:
      self.document_hit_rate.set(self._hits / self._lookups)

  def observe_cancelled_before_queue(self):
    self.requests.labels("cancelled").inc()

  def observe_failed(self):
    """A queued request the engine loop failed under (its step raised)."""
    self.requests.labels("error").inc()

  def observe_rejected(self, status: int):
    self.rejected.labels(str(status)).inc()

  def observe_queue(self, *, waiting: int, running: int):
    self.waiting.set(waiting)
    self.running.set(running)

  def observe_waiting(self, waiting: int):
    self.waiting.set(waiting)

  def observe_pool(self, stats: dict):
    """`PagedKVCache.stats` of the engine's pool."""
    self.pages_used.set(stats["used_pages"])
    self.pages_free.set(stats["free_pages"])
    self.cached_documents.set(stats["cached_docs"])

  def render(self) -> bytes:
    return generate_latest(self.registry)

