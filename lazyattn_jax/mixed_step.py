"""The mixed step: one jitted forward pass over the running decode rows and
chunks of new prompts together (issue #16 part 2; models/mixed_batch.py).

Chunked prefill mixed with decode: `run_mixed_step` packs the
decode rows as `ModelRunner.decode` does (one step, `batch` rows) and the
chunk rows as `ModelRunner.prefill` does (a row is a `layout.PageRow` and
the `layout.PrefillTokens` of this chunk: its pages list everything written
so far plus this chunk, with page_len counting this chunk), runs `_mixed_step`
with the pool donated, and samples the next token of every decode row and
the first token of every chunk row that ends its query.  The rounds run
it for every prefill call when `SchedulerConfig.decode_during_prefill` is
on (docs/design.md, "Mixed steps (in progress)").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lazyattn_jax.sampling import sample_tokens
from lazyattn_jax.step_jit import step_jit
from lazyattn_jax.step_packing import (advance_decode, decode_step_inputs,
                                       pack_decode, pack_prefill)
from models.mixed_batch import check_disjoint_parts, mixed_forward
from models.paged_inputs import PagedAttentionInputs


@step_jit(static_argnames=("graphdef", "impl", "pool_as_bits", "layer_unroll",
                           "tensor_parallel"),
          donate_argnums=(1, 2))
def _mixed_step(params, k_cache, v_cache, decode, prefill, *, graphdef, impl,
                pool_as_bits=False, layer_unroll=1, tensor_parallel=None):
  """One mixed step.

  decode: (carry, pages, sampling, limits) of B_d decode rows as
    `_decode_loop` takes them (carry: tokens, pos, written, generated,
    done [B_d]).
  prefill: (tokens i32[B_p, T], inputs, logits_index i32[B_p], sampling).
  Returns (decode logits f32[B_d, V], next tokens i32[B_d], done bool[B_d]
  after this token (stop id or max_new_tokens, as the decode loop decides),
  prefill logits f32[B_p, V], first tokens i32[B_p], k_cache, v_cache).  A
  row done before the step is padding: it writes nothing and its token
  means nothing.
  """
  model = nnx.merge(graphdef, params)
  (tokens, pos, written, generated, done), pages, decode_sampling, limits = (
      decode)
  prefill_tokens, prefill_inputs, logits_index, prefill_sampling = prefill
  num_pages, page_size = k_cache.shape[2], k_cache.shape[3]
  # The same metadata one step of `_decode_loop` builds for these rows.
  decode_inputs = decode_step_inputs(pages, pos, written, ~done, num_pages,
                                     page_size)
  decode_logits, prefill_logits, k_cache, v_cache = mixed_forward(
      model, tokens, decode_inputs, prefill_tokens, prefill_inputs, k_cache,
      v_cache, impl=impl, prefill_logits_index=logits_index,
      unroll=layer_unroll, pool_as_bits=pool_as_bits,
      tensor_parallel=tensor_parallel)
  # Decode rows draw token number `generated` of their stream, as in the
  # decode loop; a first token is draw 0, as in `_prefill_step`.
  nxt = sample_tokens(decode_logits, *decode_sampling, generated)
  _, done_after = advance_decode(nxt, ~done, generated, done, limits)
  first = sample_tokens(prefill_logits, *prefill_sampling,
                        jnp.zeros_like(logits_index))
  return (decode_logits, nxt, done_after, prefill_logits, first, k_cache,
          v_cache)


def _empty_decode():
  """(carry, pages, sampling, limits) of no decode rows."""
  i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
  carry = (i32(0), i32(0), i32(0), i32(0), jnp.ones((0,), bool))
  pages = (i32(0, 1), i32(0, 1), i32(0, 1), i32(0, 1), i32(0))
  sampling = (jnp.zeros((0,), jnp.float32), i32(0),
              jnp.ones((0,), jnp.float32), i32(0))
  limits = (i32(0), i32(0, 1))
  return carry, pages, sampling, limits


def _empty_prefill():
  """(tokens, inputs, logits_index, sampling) of no chunk rows."""
  i32 = lambda *shape: jnp.zeros(shape, jnp.int32)
  inputs = PagedAttentionInputs(*(i32(0, 1) for _ in range(7)))
  sampling = (jnp.zeros((0,), jnp.float32), i32(0),
              jnp.ones((0,), jnp.float32), i32(0))
  return i32(0, 1), inputs, i32(0), sampling


def _check_parts(runner, decode, prefill):
  """`check_disjoint_parts` on the packed rows, before the jitted step (in
  it the metadata is traced): the decode rows' metadata is made here, by
  the same function the step uses, on the concrete arrays."""
  (_, pos, written, _, done), pages, _, _ = decode
  if not done.shape[0] or not prefill[0].shape[0]:
    return
  decode_inputs = decode_step_inputs(pages, pos, written, ~done,
                                     runner.num_pages, runner.page_size)
  check_disjoint_parts(decode_inputs, prefill[1], runner.num_pages)


def run_mixed_step(runner, state, decode_requests, batch: int, rows, plans,
                   samplings, ends_query):
  """One mixed step of `runner` (a `ModelRunner`) over `state`.

  Args:
    decode_requests: live requests (scheduler.LiveRequest) to decode one
      token each, in `batch` rows (as `ModelRunner.decode`); [] for none.
    batch: decode rows (the decode program's fixed batch).
    rows, plans: the chunk rows (layout.PageRow, layout.PrefillTokens);
      [] for none.
    samplings: SamplingParams per chunk row.
    ends_query: per chunk row, whether its chunk ends the request's query,
      so its last token's sample is the request's first token.

  Returns:
    (state, decode logits f32[len(decode_requests), V], next tokens
    i32[len(decode_requests)], done bool[len(decode_requests)] (the next
    token stops the request or reaches its max_new_tokens), prefill logits
    f32[len(rows), V], first tokens i32[len(rows)] with -1 where the chunk
    does not end its query), on host.

  Raises:
    ValueError: decode and chunk rows share pages (the precondition of
      `models.mixed_batch`), or there is nothing to run.
  """
  if not decode_requests and not rows:
    raise ValueError("mixed step with neither decode nor chunk rows")
  if len(ends_query) != len(rows) or len(samplings) != len(rows):
    raise ValueError("rows, plans, samplings and ends_query must match")
  decode = (pack_decode(decode_requests, batch) if decode_requests else
            _empty_decode())
  prefill = (pack_prefill(rows, plans, samplings, runner.num_pages)
             if rows else _empty_prefill())
  _check_parts(runner, decode, prefill)
  runner._note("mixed", state.k, decode, prefill)
  decode, prefill = runner._replicated(decode, prefill)
  decode_logits, nxt, done, prefill_logits, first, k, v = runner.compiled_form(
      _mixed_step)(
      runner.params, state.k, state.v, decode, prefill,
      graphdef=runner.graphdef, impl=runner.config.impl,
      pool_as_bits=runner.config.pool_as_bits,
      # Decode rows ride in every mixed step, so the layer scan unrolls as
      # the decode loop's does.
      layer_unroll=runner.config.decode_layer_unroll,
      tensor_parallel=runner.tensor_parallel)
  state = state.replace(k=k, v=v)
  decode_logits, nxt, done, prefill_logits, first = jax.device_get(
      (decode_logits, nxt, done, prefill_logits, first))
  n_d, n_p = len(decode_requests), len(rows)
  first = np.where(np.asarray(ends_query, bool), np.asarray(first)[:n_p], -1)
  return (state, np.asarray(decode_logits)[:n_d], np.asarray(nxt)[:n_d],
          np.asarray(done)[:n_d], np.asarray(prefill_logits)[:n_p], first)
