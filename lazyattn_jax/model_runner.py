"""The model runner: packs host-side requests into arrays and runs the
jit-compiled steps over the paged pool (prefill, a decode loop,
Block-Attention's page copies, and the mixed step of decode and prefill-chunk
rows, lazyattn_jax/mixed_step.py).  Packing is shared with the mixed step in
lazyattn_jax/step_packing.py.

The pool (K and V of every layer) is donated into each step and returned, so a
step updates it in place.  The steps are module-level jitted functions whose
static arguments are the model's graphdef and the runner settings, so every
engine built on the same model shares one set of compiled programs.  Shapes
are bucketed here (lazyattn_jax/buckets.py: prefill rows and logical pages to
powers of two, prompt lengths to powers of two then multiples of 1024; decode
always runs max_batch rows), so a steady workload compiles a bounded number
of programs; `compile_count` reports how many exist.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lazyattn_jax.block_copy import rerotate_pages
from lazyattn_jax.buckets import length_bucket
from lazyattn_jax.config import RunnerConfig
from lazyattn_jax.layout import PageRow, PrefillTokens
from lazyattn_jax.mixed_step import DecodeRiders, _mixed_step, run_mixed_step
from lazyattn_jax.sampling import (SamplingParams, sample_tokens,
                                   sampling_needs_sort)
from lazyattn_jax.step_jit import DECODE_GPU_OPTIONS, params_platform, step_jit
from lazyattn_jax.step_packing import (MIN_PREFILL_LEN, advance_carry,
                                       decode_step_inputs, pack_decode,
                                       pack_prefill)
from pallas_kernels.sizes import next_power_of_two


@step_jit(static_argnames=("graphdef", "impl", "pool_as_bits",
                           "tensor_parallel", "any_sampled", "vocab_limit"),
          donate_argnums=(1, 2))
def _prefill_step(params, k_cache, v_cache, tokens, inputs, logits_index,
                  sampling, embeddings=None, *, graphdef, impl,
                  pool_as_bits=False, tensor_parallel=None, any_sampled=True,
                  vocab_limit=None):
  model = nnx.merge(graphdef, params)
  logits, k_cache, v_cache = model(tokens, k_cache, v_cache, inputs,
                                   impl=impl, logits_index=logits_index,
                                   pool_as_bits=pool_as_bits,
                                   embeddings=embeddings,
                                   tensor_parallel=tensor_parallel)
  temperature, top_k, top_p, seed = sampling
  first = sample_tokens(logits, temperature, top_k, top_p, seed,
                        jnp.zeros_like(seed), any_sampled=any_sampled,
                        vocab_limit=vocab_limit)
  return logits, first, k_cache, v_cache


@step_jit(gpu_options=DECODE_GPU_OPTIONS,
          static_argnames=("graphdef", "impl", "num_steps", "pool_as_bits",
                           "layer_unroll", "tensor_parallel", "any_sampled",
                           "vocab_limit"),
          donate_argnums=(1, 2))
def _decode_loop(params, k_cache, v_cache, carry, pages, sampling, limits, *,
                 graphdef, impl, num_steps, pool_as_bits=False,
                 layer_unroll=1, tensor_parallel=None, any_sampled=True,
                 vocab_limit=None):
  """`num_steps` decode steps of B rows in one compiled loop.

  carry: (tokens i32[B] last token, pos i32[B] its logical position,
          written i32[B] tokens already in the request's query pages,
          generated i32[B] tokens generated so far, done bool[B]).
  pages: (page_table, page_pos, page_shift, doc_page_len i32[B, M],
          private_start i32[B] logical index of the first query page).
  limits: (max_new i32[B], stop_ids i32[B, S] padded with -1).
  any_sampled: False when no row samples (`sample_tokens`).
  vocab_limit: ids from it on are never drawn (`sample_tokens`).
  Returns (k, v, carry, tokens i32[B, num_steps], emitted bool[B, num_steps]).
  """
  model = nnx.merge(graphdef, params)
  temperature, top_k, top_p, seed = sampling
  num_pages, page_size = k_cache.shape[2], k_cache.shape[3]
  batch = pages[0].shape[0]

  def step(state, _):
    k_cache, v_cache, carry = state
    tokens, pos, written, generated, done = carry
    inputs = decode_step_inputs(pages, pos, written, ~done, num_pages,
                                page_size)
    logits, k_cache, v_cache = model(
        tokens[:, None], k_cache, v_cache, inputs, impl=impl,
        logits_index=jnp.zeros((batch,), jnp.int32),
        pool_as_bits=pool_as_bits, unroll=layer_unroll,
        tensor_parallel=tensor_parallel)
    nxt = sample_tokens(logits, temperature, top_k, top_p, seed, generated,
                        any_sampled=any_sampled, vocab_limit=vocab_limit)
    carry, live = advance_carry(carry, nxt, limits)
    return (k_cache, v_cache, carry), (nxt, live)

  (k_cache, v_cache, carry), (out_tokens, emitted) = jax.lax.scan(
      step, (k_cache, v_cache, tuple(carry)), None, length=num_steps)
  return k_cache, v_cache, carry, out_tokens.T, emitted.T


_rerotate = jax.jit(rerotate_pages, static_argnames=("rope", "tensor_parallel"),
                    donate_argnums=(0, 1))
_MIN_COPY_BUCKET = 8


class ModelRunner:
  """Runs the shared jitted steps of one model over an engine's pool.

  Args:
    model: a `models.llama.Llama` module.
    config: `RunnerConfig`.
    num_pages: pages in the pool (a write to page `num_pages` is dropped).
    page_size: tokens per page.
    tensor_parallel: a `models.sharding.TensorParallel` when the model's
      weights and the pool lie on a mesh (`lazyattn_jax.sharding`); the
      steps' small inputs are then put whole on every device.
    vocab_limit: token ids from it on are never drawn (those of a padded
      embedding that the tokenizer has no text for); None: every id.
  """

  def __init__(self, model, config: RunnerConfig, num_pages: int,
               page_size: int, tensor_parallel=None,
               vocab_limit: int | None = None):
    self.graphdef, self.params = nnx.split(model)
    self.tensor_parallel = tensor_parallel
    self.vocab_limit = vocab_limit
    self.config = config
    self.rope = model.config.rope
    self.num_pages = num_pages
    self.page_size = page_size
    self._programs: set = set()
    self.platform = params_platform(self.params)

  def compiled_form(self, step):
    """The form of a `step_jit` step this runner runs (step_jit.py; the
    step keeps its forms)."""
    return step.for_platform(self.platform, self.config.gpu_weights_in_place,
                             self.config.gpu_xla_options)

  @property
  def programs_used(self) -> int:
    """Distinct programs (static config x input shapes) this runner ran."""
    return len(self._programs)

  @staticmethod
  def compile_count() -> int:
    """Programs compiled so far by the shared steps (for every runner in
    this process: runners of one model share programs)."""
    return (_prefill_step._cache_size() + _decode_loop._cache_size() +
            _rerotate._cache_size() + _mixed_step._cache_size())

  def _replicated(self, *trees):
    """The steps' inputs as they were (one device), or put whole on every
    device of the mesh: committed global arrays, as jit needs them when the
    mesh spans several processes."""
    if self.tensor_parallel is None:
      return trees
    return jax.device_put(trees, self.tensor_parallel.replicated)

  def _note(self, kind, *arrays, **static):
    shapes = tuple((a.shape, str(a.dtype))
                   for a in jax.tree_util.tree_leaves(arrays))
    self._programs.add((kind, shapes, tuple(sorted(static.items()))))

  # --- prefill -----------------------------------------------------------------
  @staticmethod
  def prefill_batches(lengths: list[int], budget: int, keep_order: bool
                      ) -> list[list[int]]:
    """Splits items of these prefill lengths into calls within `budget`
    tokens (bucketed rows x bucketed length); returns index lists.

    Sorting by length packs rows of like length together; `keep_order`
    keeps the given order instead (a request may read pages that an earlier
    request of the same round writes, so it must not run first).
    """
    order = list(range(len(lengths)))
    if not keep_order:
      order.sort(key=lambda i: -lengths[i])
    batches, batch = [], []
    for i in order:
      rows = next_power_of_two(len(batch) + 1)
      width = length_bucket(max([lengths[j] for j in batch] + [lengths[i]]),
                            MIN_PREFILL_LEN)
      if batch and rows * width > budget:
        batches.append(batch)
        batch = []
      batch.append(i)
    if batch:
      batches.append(batch)
    return batches

  def prefill(self, state, rows: list[PageRow], plans: list[PrefillTokens],
              samplings, embeddings=None):
    """One batched prefill call: row b runs plans[b] against rows[b].

    `embeddings`, if given, holds float [len(plans[b]), D] input vectors per
    row that replace the token embeddings (a learned preamble).
    Returns (state, logits f32[rows, V], first tokens i32[rows]) on host.
    """
    state, fetch = self.prefill_async(state, rows, plans, samplings,
                                      embeddings)
    return (state, *fetch())

  def prefill_async(self, state, rows, plans, samplings, embeddings=None):
    """`prefill` without waiting for the device: returns (state, fetch),
    fetch() -> (logits, first tokens) on host, waiting for this call only
    (their copy to the host starts now)."""
    state, logits, first = self._run_prefill(state, rows, plans, samplings,
                                             embeddings)
    for array in (logits, first):
      array.copy_to_host_async()

    def fetch():
      host_logits, host_first = jax.device_get((logits, first))
      return (np.asarray(host_logits)[:len(rows)],
              np.asarray(host_first)[:len(rows)])
    return state, fetch

  def _run_prefill(self, state, rows, plans, samplings, embeddings=None):
    """`prefill` without waiting for it: (state, logits, first tokens) as
    device arrays of the padded batch."""
    tokens, inputs, logits_index, sampling = pack_prefill(
        rows, plans, samplings, self.num_pages)
    vectors = None
    if embeddings is not None:
      vectors = np.zeros(tokens.shape + (embeddings[0].shape[-1],),
                         np.float32)
      for b, rows_b in enumerate(embeddings):
        vectors[b, :len(rows_b)] = np.asarray(rows_b, np.float32)
    any_sampled = sampling_needs_sort(sampling[0])
    self._note("prefill", state.k, tokens, inputs, vectors,
               any_sampled=any_sampled)
    tokens, inputs, logits_index, sampling, vectors = self._replicated(
        tokens, inputs, logits_index, sampling, vectors)
    logits, first, k, v = self.compiled_form(_prefill_step)(
        self.params, state.k, state.v, tokens, inputs, logits_index,
        sampling, vectors, graphdef=self.graphdef,
        impl=self.config.impl, pool_as_bits=self.config.pool_as_bits,
        tensor_parallel=self.tensor_parallel, any_sampled=any_sampled,
        vocab_limit=self.vocab_limit)
    return state.replace(k=k, v=v), logits, first

  def encode_documents(self, state, jobs, *, pieces=None):
    """Prefills cache entries (layout.EncodeJob) in one call, each into its
    pages, alone or after its context pages.  `pieces`, if given, holds
    the (row, plan) to run for each job instead of the whole entry: one of
    its `chunk_rows_and_plans`, whose earlier chunks must have run.  Either
    every job has learned input vectors or none has; learned vectors are
    never chunked.  Returns the new state without waiting for the call (its
    outputs are the pool's pages, which later calls read in order)."""
    if pieces is None:
      pieces = [job.row_and_plan(self.page_size) for job in jobs]
    rows, plans = zip(*pieces)
    args = (state, list(rows), list(plans), [SamplingParams()] * len(jobs))
    vectors = [job.embeddings for job in jobs]
    if all(v is None for v in vectors):
      return self._run_prefill(*args)[0]
    if any(v is None for v in vectors):
      raise ValueError("one encode call mixes learned vectors and tokens")
    return self._run_prefill(*args, embeddings=vectors)[0]

  def copy_pages(self, state, copies: list[tuple[int, int, int]]):
    """Writes Block-Attention copies: (source, destination, shift) pages,
    keys re-rotated by the shift."""
    if not copies:
      return state
    n = next_power_of_two(len(copies), _MIN_COPY_BUCKET)
    src = np.zeros((n,), np.int32)
    dst = np.full((n,), self.num_pages, np.int32)
    shift = np.zeros((n,), np.int32)
    src[:len(copies)], dst[:len(copies)], shift[:len(copies)] = zip(*copies)
    k, v = _rerotate(state.k, state.v,
                     *self._replicated(jnp.asarray(src), jnp.asarray(dst),
                                       jnp.asarray(shift)), rope=self.rope,
                     tensor_parallel=self.tensor_parallel)
    return state.replace(k=k, v=v)

  # --- decode ------------------------------------------------------------------
  def decode(self, state, requests, batch: int, num_steps: int):
    """Runs `num_steps` decode steps for `requests` (scheduler.LiveRequest)
    in `batch` rows (always the same, so one program per page bucket; the
    step is memory-bound on the weights, so idle rows cost little).

    Returns (state, tokens i32[B, num_steps], emitted bool[B, num_steps],
    done bool[B]) on host, row b for requests[b].
    """
    state, fetch = self.decode_async(state, requests, batch, num_steps)
    return (state, *fetch())

  def decode_async(self, state, requests, batch: int, num_steps: int):
    """`decode` without waiting for the device: returns (state, fetch),
    fetch() -> (tokens, emitted, done) on host.  The caller keeps the new
    state before it waits, so an error or interrupt while waiting does not
    leave it holding the pool this call donated."""
    carry, pages, sampling, limits = pack_decode(requests, batch)
    any_sampled = sampling_needs_sort(sampling[0])
    self._note("decode", state.k, pages, limits, num_steps=num_steps,
               any_sampled=any_sampled)
    carry, pages, sampling, limits = self._replicated(carry, pages, sampling,
                                                      limits)
    k, v, carry, out, emitted = self.compiled_form(_decode_loop)(
        self.params, state.k, state.v, carry, pages, sampling, limits,
        graphdef=self.graphdef, impl=self.config.impl, num_steps=num_steps,
        pool_as_bits=self.config.pool_as_bits,
        layer_unroll=self.config.decode_layer_unroll,
        tensor_parallel=self.tensor_parallel, any_sampled=any_sampled,
        vocab_limit=self.vocab_limit)
    done = carry[4]
    return (state.replace(k=k, v=v),
            lambda: jax.device_get((out, emitted, done)))

  # --- mixed -------------------------------------------------------------------
  def decode_riders(self, requests, batch: int,
                    previous: DecodeRiders | None = None) -> DecodeRiders:
    """`requests` (scheduler.LiveRequest) as the decode rows of a run of
    mixed steps, in `batch` rows (the decode program's fixed batch); with
    `previous`, the riders before them, whose uncollected steps the new
    run takes over and whose rows that keep riding continue on the
    device."""
    put = ((lambda tree: self._replicated(tree)[0]) if self.tensor_parallel
           else jax.device_put)
    return DecodeRiders(requests, batch, self.num_pages, put=put,
                        previous=previous)

  def mixed_step_async(self, state, riders: DecodeRiders | None, rows, plans,
                       samplings, ends_query):
    """One step of decode rows and prefill-chunk rows together, without
    waiting (lazyattn_jax/mixed_step.py, `run_mixed_step`): the riders'
    carry advances on the device.  Returns (state, fetch), fetch() ->
    (prefill logits, first tokens, -1 where a chunk does not end its
    query) on host."""
    state, _, fetch = run_mixed_step(self, state, riders, rows, plans,
                                     samplings, ends_query)
    return state, fetch

  def mixed_step(self, state, decode_requests, batch: int, rows, plans,
                 samplings, ends_query):
    """One mixed step, waited for: `decode_requests` decode one token each
    (in `batch` rows) beside the chunk rows.

    Returns (state, decode logits, next tokens, done, prefill logits,
    first tokens, -1 where a chunk does not end its query), on host, the
    decode outputs row b for decode_requests[b].
    """
    riders = (self.decode_riders(decode_requests, batch) if decode_requests
              else None)
    state, decode_logits, fetch = run_mixed_step(
        self, state, riders, rows, plans, samplings, ends_query)
    n = len(decode_requests)
    nxt, done = np.zeros((0,), np.int32), np.zeros((0,), bool)
    if riders is not None:
      [(_, tokens, _, done)] = riders.collect()
      nxt = tokens[:, 0]
    prefill_logits, first = fetch()
    return (state, np.asarray(decode_logits)[:n], nxt, done, prefill_logits,
            first)
