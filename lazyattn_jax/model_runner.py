"""The model runner: packs host-side requests into arrays and runs the
jit-compiled steps over the paged pool (prefill, a decode loop, and
Block-Attention's page copies).

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

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lazyattn_jax.block_copy import rerotate_pages
from lazyattn_jax.buckets import length_bucket
from lazyattn_jax.config import RunnerConfig
from lazyattn_jax.layout import PageRow, PrefillTokens, pack_rows
from lazyattn_jax.sampling import SamplingParams, sample_tokens
from models.paged_inputs import PagedAttentionInputs
from pallas_kernels.sizes import next_power_of_two


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "pool_as_bits",
                                             "tensor_parallel"),
                   donate_argnums=(1, 2))
def _prefill_step(params, k_cache, v_cache, tokens, inputs, logits_index,
                  sampling, embeddings=None, *, graphdef, impl,
                  pool_as_bits=False, tensor_parallel=None):
  model = nnx.merge(graphdef, params)
  logits, k_cache, v_cache = model(tokens, k_cache, v_cache, inputs,
                                   impl=impl, logits_index=logits_index,
                                   pool_as_bits=pool_as_bits,
                                   embeddings=embeddings,
                                   tensor_parallel=tensor_parallel)
  temperature, top_k, top_p, seed = sampling
  first = sample_tokens(logits, temperature, top_k, top_p, seed,
                        jnp.zeros_like(seed))
  return logits, first, k_cache, v_cache


@functools.partial(jax.jit,
                   static_argnames=("graphdef", "impl", "num_steps",
                                    "pool_as_bits", "layer_unroll",
                                    "tensor_parallel"),
                   donate_argnums=(1, 2))
def _decode_loop(params, k_cache, v_cache, carry, pages, sampling, limits, *,
                 graphdef, impl, num_steps, pool_as_bits=False,
                 layer_unroll=1, tensor_parallel=None):
  """`num_steps` decode steps of B rows in one compiled loop.

  carry: (tokens i32[B] last token, pos i32[B] its logical position,
          written i32[B] tokens already in the request's query pages,
          generated i32[B] tokens generated so far, done bool[B]).
  pages: (page_table, page_pos, page_shift, doc_page_len i32[B, M],
          private_start i32[B] logical index of the first query page).
  limits: (max_new i32[B], stop_ids i32[B, S] padded with -1).
  Returns (k, v, carry, tokens i32[B, num_steps], emitted bool[B, num_steps]).
  """
  model = nnx.merge(graphdef, params)
  page_table, page_pos, page_shift, doc_page_len, private_start = pages
  temperature, top_k, top_p, seed = sampling
  max_new, stop_ids = limits
  num_pages, page_size = k_cache.shape[2], k_cache.shape[3]
  logical = jnp.arange(page_table.shape[1], dtype=jnp.int32)[None, :]
  private_index = logical - private_start[:, None]  # >= 0 on private pages
  batch = page_table.shape[0]
  rows = jnp.arange(batch)

  def step(state, _):
    k_cache, v_cache, tokens, pos, written, generated, done = state
    live = ~done
    step_live = live.astype(jnp.int32)
    written_after = written + step_live
    private_len = jnp.clip(written_after[:, None] - private_index * page_size,
                           0, page_size)
    page_len = jnp.where(private_index >= 0, private_len, doc_page_len)
    target = jnp.clip(private_start + written // page_size, 0,
                      page_table.shape[1] - 1)
    write_page = jnp.where(live, page_table[rows, target], num_pages)
    inputs = PagedAttentionInputs(
        page_table=page_table, page_pos=page_pos, page_shift=page_shift,
        page_len=page_len, q_pos=jnp.where(live, pos, -1)[:, None],
        write_page=write_page[:, None],
        write_slot=(written % page_size)[:, None])
    logits, k_cache, v_cache = model(
        tokens[:, None], k_cache, v_cache, inputs, impl=impl,
        logits_index=jnp.zeros((batch,), jnp.int32),
        pool_as_bits=pool_as_bits, unroll=layer_unroll,
        tensor_parallel=tensor_parallel)
    nxt = sample_tokens(logits, temperature, top_k, top_p, seed, generated)
    stopped = jnp.any(nxt[:, None] == stop_ids, axis=-1)
    generated_after = generated + step_live
    done_after = done | (live & (stopped | (generated_after >= max_new)))
    state = (k_cache, v_cache, jnp.where(live, nxt, tokens), pos + step_live,
             written_after, generated_after, done_after)
    return state, (nxt, live)

  tokens, pos, written, generated, done = carry
  state = (k_cache, v_cache, tokens, pos, written, generated, done)
  state, (out_tokens, emitted) = jax.lax.scan(step, state, None,
                                              length=num_steps)
  k_cache, v_cache, tokens, pos, written, generated, done = state
  return (k_cache, v_cache, (tokens, pos, written, generated, done),
          out_tokens.T, emitted.T)


_rerotate = jax.jit(rerotate_pages, static_argnames=("rope", "tensor_parallel"),
                    donate_argnums=(0, 1))
_MIN_PREFILL_LEN = 16
_MIN_COPY_BUCKET = 8
_MIN_STOP_BUCKET = 4


def sampling_arrays(samplings, batch: int):
  """(temperature f32[B], top_k i32[B], top_p f32[B], seed i32[B]) of
  `samplings`, padded to `batch` rows with greedy defaults."""
  temperature = np.zeros((batch,), np.float32)
  top_k = np.zeros((batch,), np.int32)
  top_p = np.ones((batch,), np.float32)
  seed = np.zeros((batch,), np.int32)
  for b, s in enumerate(samplings):
    temperature[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
    seed[b] = np.int64(s.seed) & 0x7FFFFFFF
  return temperature, top_k, top_p, seed


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
  """

  def __init__(self, model, config: RunnerConfig, num_pages: int,
               page_size: int, tensor_parallel=None):
    self.graphdef, self.params = nnx.split(model)
    self.tensor_parallel = tensor_parallel
    self.config = config
    self.rope = model.config.rope
    self.num_pages = num_pages
    self.page_size = page_size
    self._programs: set = set()

  @property
  def programs_used(self) -> int:
    """Distinct programs (static config x input shapes) this runner ran."""
    return len(self._programs)

  @staticmethod
  def compile_count() -> int:
    """Programs compiled so far by the shared steps (for every runner in
    this process: runners of one model share programs)."""
    return (_prefill_step._cache_size() + _decode_loop._cache_size() +
            _rerotate._cache_size())

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
                            _MIN_PREFILL_LEN)
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
    batch = next_power_of_two(len(rows))
    length = length_bucket(max(len(p) for p in plans), _MIN_PREFILL_LEN)
    num_logical = next_power_of_two(max(map(len, rows)))
    tokens = np.zeros((batch, length), np.int32)
    q_pos = np.full((batch, length), -1, np.int32)
    write_page = np.full((batch, length), self.num_pages, np.int32)
    write_slot = np.zeros((batch, length), np.int32)
    logits_index = np.zeros((batch,), np.int32)
    for b, plan in enumerate(plans):
      n = len(plan)
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
    sampling = tuple(jnp.asarray(a) for a in sampling_arrays(samplings, batch))
    tokens = jnp.asarray(tokens)
    vectors = None
    if embeddings is not None:
      vectors = np.zeros(tokens.shape + (embeddings[0].shape[-1],),
                         np.float32)
      for b, rows_b in enumerate(embeddings):
        vectors[b, :len(rows_b)] = np.asarray(rows_b, np.float32)
      vectors = jnp.asarray(vectors)
    self._note("prefill", state.k, tokens, inputs, vectors)
    tokens, inputs, logits_index, sampling, vectors = self._replicated(
        tokens, inputs, logits_index, sampling, vectors)
    logits, first, k, v = _prefill_step(
        self.params, state.k, state.v, tokens, inputs,
        jnp.asarray(logits_index), sampling, vectors, graphdef=self.graphdef,
        impl=self.config.impl, pool_as_bits=self.config.pool_as_bits,
        tensor_parallel=self.tensor_parallel)
    state = state.replace(k=k, v=v)
    logits, first = jax.device_get((logits, first))
    return state, np.asarray(logits)[:len(rows)], np.asarray(first)[:len(rows)]

  def encode_documents(self, state, jobs):
    """Prefills cache entries (layout.EncodeJob) in one call, each into its
    pages, alone or after its context pages.  Either every job has learned
    input vectors or none has.  Returns the new state."""
    rows, plans = zip(*(job.row_and_plan(self.page_size) for job in jobs))
    args = (state, list(rows), list(plans), [SamplingParams()] * len(jobs))
    vectors = [job.embeddings for job in jobs]
    if all(v is None for v in vectors):
      return self.prefill(*args)[0]
    if any(v is None for v in vectors):
      raise ValueError("one encode call mixes learned vectors and tokens")
    return self.prefill(*args, embeddings=vectors)[0]

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
    num_logical = next_power_of_two(max(len(r.layout.row) for r in requests))
    table, pos, shift, plen = pack_rows([r.layout.row for r in requests],
                                        num_logical, batch)
    private_start = np.zeros((batch,), np.int32)
    tokens = np.zeros((batch,), np.int32)
    position = np.zeros((batch,), np.int32)
    written = np.zeros((batch,), np.int32)
    generated = np.zeros((batch,), np.int32)
    done = np.ones((batch,), bool)
    max_new = np.ones((batch,), np.int32)
    stop_width = next_power_of_two(
        max(len(r.request.stop_ids) for r in requests), _MIN_STOP_BUCKET)
    stop_ids = np.full((batch, stop_width), -1, np.int32)
    for b, r in enumerate(requests):
      private_start[b] = r.layout.private_start
      tokens[b] = r.tokens[-1]
      position[b] = r.decode_position
      written[b] = r.written
      generated[b] = len(r.tokens)
      done[b] = False
      max_new[b] = r.request.sampling.max_new_tokens
      stop_ids[b, :len(r.request.stop_ids)] = r.request.stop_ids
    sampling = sampling_arrays([r.request.sampling for r in requests], batch)
    carry = tuple(jnp.asarray(a) for a in (tokens, position, written,
                                           generated, done))
    pages = tuple(jnp.asarray(a) for a in (table, pos, shift, plen,
                                           private_start))
    limits = (jnp.asarray(max_new), jnp.asarray(stop_ids))
    self._note("decode", state.k, pages, limits, num_steps=num_steps)
    carry, pages, sampling, limits = self._replicated(carry, pages, sampling,
                                                      limits)
    k, v, carry, out, emitted = _decode_loop(
        self.params, state.k, state.v, carry, pages,
        tuple(jnp.asarray(a) for a in sampling), limits,
        graphdef=self.graphdef, impl=self.config.impl, num_steps=num_steps,
        pool_as_bits=self.config.pool_as_bits,
        layer_unroll=self.config.decode_layer_unroll,
        tensor_parallel=self.tensor_parallel)
    state = state.replace(k=k, v=v)
    out, emitted, done = jax.device_get((out, emitted, carry[4]))
    return state, out, emitted, done
