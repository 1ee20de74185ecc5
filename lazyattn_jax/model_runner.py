"""Jit-compiled model steps over the paged pool: prefill and a decode loop.

The pool (K and V of every layer) is donated into each step and returned, so a
step updates it in place.  The steps are module-level jitted functions whose
static arguments are the model's graphdef and the attention impl, so every
engine built on the same model shares one set of compiled programs.  Shapes
reaching them are bucketed by the engine; `compile_count` reports how many
distinct programs exist.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lazyattn_jax.sampling import sample_tokens
from models.paged_inputs import PagedAttentionInputs

# The cache pool is heads first ([K, L, N, P, H], CacheConfig.pool_shape), so
# the model hands the kernels the whole pool in place instead of a per-layer
# slice that XLA would copy every step.
KV_LAYOUT = "heads_first"


@functools.partial(jax.jit, static_argnames=("graphdef", "impl", "pool_as_bits"),
                   donate_argnums=(1, 2))
def _prefill_step(params, k_cache, v_cache, tokens, inputs, logits_index,
                  sampling, *, graphdef, impl, pool_as_bits=False):
  model = nnx.merge(graphdef, params)
  logits, k_cache, v_cache = model(tokens, k_cache, v_cache, inputs,
                                   impl=impl, logits_index=logits_index,
                                   kv_layout=KV_LAYOUT,
                                   pool_as_bits=pool_as_bits)
  temperature, top_k, top_p, seed = sampling
  first = sample_tokens(logits, temperature, top_k, top_p, seed,
                        jnp.zeros_like(seed))
  return logits, first, k_cache, v_cache


@functools.partial(jax.jit,
                   static_argnames=("graphdef", "impl", "num_steps",
                                    "pool_as_bits", "layer_unroll"),
                   donate_argnums=(1, 2))
def _decode_loop(params, k_cache, v_cache, carry, pages, sampling, limits, *,
                 graphdef, impl, num_steps, pool_as_bits=False,
                 layer_unroll=1):
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
        logits_index=jnp.zeros((batch,), jnp.int32), kv_layout=KV_LAYOUT,
        pool_as_bits=pool_as_bits, unroll=layer_unroll)
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


class ModelRunner:
  """Holds a split Flax model and runs the shared jitted steps on it.

  Args:
    model: a `models.llama.Llama` module.
    impl: attention implementation passed to `pallas_kernels.lazy_attention`.
    pool_as_bits: carry 16-bit pools through the layer scan as uint16.
    decode_layer_unroll: unroll factor of the layer loop in decode steps
      (True = fully unrolled: measured 2x faster 8B decode steps on an H200,
      at a much longer compile).
  """

  def __init__(self, model, impl: str, pool_as_bits: bool = False,
               decode_layer_unroll: int | bool = 1):
    self.graphdef, self.params = nnx.split(model)
    self.impl = impl
    self.pool_as_bits = pool_as_bits
    self.decode_layer_unroll = decode_layer_unroll
    self._programs: set = set()

  @property
  def programs_used(self) -> int:
    """Distinct programs (static config x input shapes) this runner ran."""
    return len(self._programs)

  @staticmethod
  def compile_count() -> int:
    """Programs compiled so far by the shared prefill and decode steps (for
    every runner in this process: runners of one model share programs)."""
    return _prefill_step._cache_size() + _decode_loop._cache_size()

  def _note(self, kind, *arrays, **static):
    shapes = tuple((a.shape, str(a.dtype))
                   for a in jax.tree_util.tree_leaves(arrays))
    self._programs.add((kind, shapes, tuple(sorted(static.items()))))

  def prefill(self, k_cache, v_cache, tokens, inputs: PagedAttentionInputs,
              logits_index, sampling):
    """Runs one prefill step; returns (logits [B, V], first tokens [B], k, v).

    `sampling` is (temperature f32[B], top_k i32[B], top_p f32[B], seed i32[B]).
    """
    self._note("prefill", k_cache, tokens, inputs)
    return _prefill_step(self.params, k_cache, v_cache, tokens, inputs,
                         logits_index, sampling, graphdef=self.graphdef,
                         impl=self.impl, pool_as_bits=self.pool_as_bits)

  def decode(self, k_cache, v_cache, carry, pages, sampling, limits,
             num_steps: int):
    """Runs `num_steps` decode steps in one compiled loop.

    carry: (tokens i32[B] last token, pos i32[B] its logical position,
            written i32[B] tokens already in the request's query pages,
            generated i32[B] tokens generated so far, done bool[B]).
    pages: (page_table, page_pos, page_shift, doc_page_len [B, M],
            private_start i32[B] logical index of the first query page).
    limits: (max_new i32[B], stop_ids i32[B, S] padded with -1).
    Returns (k, v, carry, tokens i32[B, num_steps], emitted bool[B, num_steps]).
    """
    self._note("decode", k_cache, pages, limits, num_steps=num_steps)
    return _decode_loop(self.params, k_cache, v_cache, carry, pages, sampling,
                        limits, graphdef=self.graphdef, impl=self.impl,
                        num_steps=num_steps, pool_as_bits=self.pool_as_bits,
                        layer_unroll=self.decode_layer_unroll)
