"""The mixed step: one jitted forward pass over the running decode rows and
chunks of new prompts together (issue #16 part 2; models/mixed_batch.py).

Chunked prefill mixed with decode.  The decode rows are `DecodeRiders`:
packed once as `ModelRunner.decode` packs them (`batch` rows), then carried
on the device from one mixed step to the next, so a run of mixed steps never
waits for a step's tokens before dispatching the next, also when requests
start riding; the tokens are read back once, by `DecodeRiders.collect`.
The chunk rows are packed as `ModelRunner.prefill` packs them (a row is a
`layout.PageRow` and the `layout.PrefillTokens` of this chunk: its pages
list everything written so far plus this chunk, with page_len counting
this chunk).  `_mixed_step` runs
with the pool donated and samples the next token of every decode row and the
first token of every chunk row that ends its query.  The rounds run it for
every prefill call when `SchedulerConfig.decode_during_prefill` is on
(docs/design.md, "Mixed steps").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lazyattn_jax.sampling import sample_tokens, sampling_needs_sort
from lazyattn_jax.step_jit import step_jit
from lazyattn_jax.step_packing import (advance_carry, decode_step_inputs,
                                       pack_decode, pack_prefill)
from models.mixed_batch import mixed_forward
from models.paged_inputs import PagedAttentionInputs


@step_jit(static_argnames=("graphdef", "impl", "pool_as_bits", "layer_unroll",
                           "tensor_parallel", "decode_sampled",
                           "prefill_sampled", "vocab_limit"),
          donate_argnums=(1, 2))
def _mixed_step(params, k_cache, v_cache, decode, prefill, *, graphdef, impl,
                pool_as_bits=False, layer_unroll=1, tensor_parallel=None,
                decode_sampled=True, prefill_sampled=True, vocab_limit=None):
  """One mixed step.

  decode: (carry, pages, sampling, limits) of B_d decode rows as
    `_decode_loop` takes them (carry: tokens, pos, written, generated,
    done [B_d]).
  prefill: (tokens i32[B_p, T], inputs, logits_index i32[B_p], sampling).
  decode_sampled, prefill_sampled: whether any row of the part samples
    (`sample_tokens`' any_sampled).
  vocab_limit: ids from it on are never drawn (`sample_tokens`).
  Returns (decode logits f32[B_d, V], next tokens i32[B_d], live bool[B_d]
  (the rows that decoded in this step), the decode carry after the step
  (as `_decode_loop` returns it), prefill logits f32[B_p, V], first tokens
  i32[B_p], k_cache, v_cache).  A row done before the step is padding: it
  writes nothing and its token means nothing.
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
  nxt = sample_tokens(decode_logits, *decode_sampling, generated,
                      any_sampled=decode_sampled, vocab_limit=vocab_limit)
  carry, live = advance_carry((tokens, pos, written, generated, done), nxt,
                              limits)
  first = sample_tokens(prefill_logits, *prefill_sampling,
                        jnp.zeros_like(logits_index),
                        any_sampled=prefill_sampled, vocab_limit=vocab_limit)
  return (decode_logits, nxt, live, carry, prefill_logits, first, k_cache,
          v_cache)


def _empty_decode():
  """(carry, pages, sampling, limits) of no decode rows."""
  i32 = lambda *shape: np.zeros(shape, np.int32)
  carry = (i32(0), i32(0), i32(0), i32(0), np.ones((0,), bool))
  pages = (i32(0, 1), i32(0, 1), i32(0, 1), i32(0, 1), i32(0))
  sampling = (np.zeros((0,), np.float32), i32(0),
              np.ones((0,), np.float32), i32(0))
  limits = (i32(0), i32(0, 1))
  return carry, pages, sampling, limits


def _empty_prefill():
  """(tokens, inputs, logits_index, sampling) of no chunk rows."""
  i32 = lambda *shape: np.zeros(shape, np.int32)
  inputs = PagedAttentionInputs(*(i32(0, 1) for _ in range(7)))
  sampling = (np.zeros((0,), np.float32), i32(0),
              np.ones((0,), np.float32), i32(0))
  return i32(0, 1), inputs, i32(0), sampling


@jax.jit
def _merge_carry(previous, packed, index):
  """Decode carry whose row b is row index[b] of `previous` where
  index[b] >= 0 (a rider that keeps riding) and row b of `packed` (packed
  from the host) elsewhere."""
  keep = index >= 0
  row = jnp.maximum(index, 0)
  return tuple(jnp.where(keep, old[row], new)
               for old, new in zip(previous, packed))


class DecodeRiders:
  """Running requests that decode one token in each of a run of mixed
  steps, with their decode carry on the device between steps.

  The requests' host state (`LiveRequest.tokens`) is not touched until
  `collect`, which reads every step's tokens back at once; until then a row
  that finished (stop id or max_new_tokens) stays in the batch as padding.
  When the riders change (requests start riding), `previous=` makes the
  new rows from the old ones on the device, so nothing is read back; the
  old rows' steps stay pending until `collect`.  Made by
  `ModelRunner.decode_riders`.

  Attributes:
    requests: the scheduler.LiveRequest of rows 0..n-1.
    steps: mixed steps run since the last `collect`, over every set of
      riders.
  """

  def __init__(self, requests, batch: int, num_pages: int,
               put=lambda tree: tree, previous: DecodeRiders | None = None):
    self.requests = list(requests)
    carry, pages, sampling, limits = pack_decode(self.requests, batch)
    # The pages the step's precondition checks chunk rows against (host
    # sets, once per run): every page a row lists, and its private pages.
    table, private_start = pages[0], pages[4]
    listed, private = set(), set()
    for b, live in enumerate(self.requests):
      row = table[b, :len(live.layout.row)]
      listed.update(row.tolist())
      private.update(row[private_start[b]:].tolist())
    self.listed_pages, self.private_pages = listed, private
    self.num_pages = num_pages
    self.any_sampled = sampling_needs_sort(sampling[0])
    self.pages, self.sampling, self.limits = put((pages, sampling, limits))
    # Pending steps of earlier riders: (requests, outputs, done) each.
    self._segments = []
    if previous is not None:
      self._segments = previous._pending()
      if previous.steps:
        # Riders that keep riding continue from their state on the device
        # (the host's copy is behind by the pending steps).
        rows = {id(r): b for b, r in enumerate(previous.requests)}
        index = np.full((batch,), -1, np.int32)
        for b, live in enumerate(self.requests):
          index[b] = rows.get(id(live), -1)
        carry = _merge_carry(previous.carry, carry, index)
    self.carry = carry
    self._outputs = []  # (next tokens, live) device arrays per step

  def same_requests(self, requests) -> bool:
    """Whether `requests` are these rows, in this order."""
    return (len(requests) == len(self.requests) and
            all(a is b for a, b in zip(requests, self.requests)))

  @property
  def steps(self) -> int:
    return len(self._outputs) + sum(len(o) for _, o, _ in self._segments)

  def advanced(self, carry, nxt, live):
    """Records one step's outputs (device arrays, not waited for)."""
    self.carry = carry
    self._outputs.append((nxt, live))

  def _pending(self):
    """The segments not yet collected, this one's last."""
    mine = [(self.requests, self._outputs, self.carry[4])]
    return [s for s in self._segments + mine if s[1]]

  def collect(self):
    """The steps since the last collect, on host (waits for them): a list
    of (requests, tokens i32[n, steps], emitted bool[n, steps], done
    bool[n]), one per set of riders in the order they rode, each as
    `ModelRunner.decode` returns a decode loop's (n = len(requests))."""
    segments = self._pending()
    self._segments, self._outputs = [], []
    host = jax.device_get([(outputs, done) for _, outputs, done in segments])
    collected = []
    for (requests, _, _), (outputs, done) in zip(segments, host):
      n = len(requests)
      tokens = np.stack([np.asarray(t)[:n] for t, _ in outputs], axis=1)
      emitted = np.stack([np.asarray(e)[:n] for _, e in outputs], axis=1)
      collected.append((requests, tokens, emitted, np.asarray(done)[:n]))
    return collected

  def check_chunk_rows(self, inputs: PagedAttentionInputs):
    """Raises ValueError if chunk rows with page metadata `inputs` (host
    arrays) could see or touch these rows' pages: they may write no page a
    decode row lists, and read none of the decode rows' private pages
    (where their tokens are written).  Reading cached documents the decode
    rows also read is fine."""
    page = np.asarray(inputs.write_page).reshape(-1)
    writes = set(page[(page >= 0) & (page < self.num_pages)].tolist())
    table = np.asarray(inputs.page_table)
    reads = set(table[np.asarray(inputs.page_len) > 0].tolist())
    for what, pages in (("write", writes & self.listed_pages),
                        ("read", reads & self.private_pages)):
      if pages:
        raise ValueError(
            f"mixed step: decode and prefill rows must not share pages, but "
            f"chunk rows {what} pages {sorted(pages)[:8]} of the decode rows")


def run_mixed_step(runner, state, riders: DecodeRiders | None, rows, plans,
                   samplings, ends_query):
  """One mixed step of `runner` (a `ModelRunner`) over `state`, without
  waiting for it.

  Args:
    riders: the decode rows (`DecodeRiders`), each decoding one token, or
      None; their carry advances on the device.
    rows, plans: the chunk rows (layout.PageRow, layout.PrefillTokens);
      [] for none.
    samplings: SamplingParams per chunk row.
    ends_query: per chunk row, whether its chunk ends the request's query,
      so its last token's sample is the request's first token.

  Returns:
    (state, decode logits f32[B_d, V] (device), fetch) with fetch() ->
    (prefill logits f32[len(rows), V], first tokens i32[len(rows)], -1
    where the chunk does not end its query) on host.

  Raises:
    ValueError: decode and chunk rows share pages (the precondition of
      `models.mixed_batch`), or there is nothing to run; the pool is
      untouched then.
  """
  if riders is None and not rows:
    raise ValueError("mixed step with neither decode nor chunk rows")
  if len(ends_query) != len(rows) or len(samplings) != len(rows):
    raise ValueError("rows, plans, samplings and ends_query must match")
  prefill = (pack_prefill(rows, plans, samplings, runner.num_pages)
             if rows else _empty_prefill())
  if riders is not None and rows:
    riders.check_chunk_rows(prefill[1])
  decode = (_empty_decode() if riders is None else
            (riders.carry, riders.pages, riders.sampling, riders.limits))
  sampled = dict(
      decode_sampled=riders is not None and riders.any_sampled,
      prefill_sampled=sampling_needs_sort(prefill[3][0]))
  runner._note("mixed", state.k, decode, prefill, **sampled)
  decode, prefill = runner._replicated(decode, prefill)
  decode_logits, nxt, live, carry, prefill_logits, first, k, v = (
      runner.compiled_form(_mixed_step)(
          runner.params, state.k, state.v, decode, prefill,
          graphdef=runner.graphdef, impl=runner.config.impl,
          pool_as_bits=runner.config.pool_as_bits,
          # Decode rows ride in every mixed step, so the layer scan unrolls
          # as the decode loop's does.
          layer_unroll=runner.config.decode_layer_unroll,
          tensor_parallel=runner.tensor_parallel,
          vocab_limit=runner.vocab_limit, **sampled))
  if riders is not None:
    riders.advanced(carry, nxt, live)
  if any(ends_query):  # only a query's last chunk has a token to read
    for array in (prefill_logits, first):
      array.copy_to_host_async()
  n_p = len(rows)

  def fetch():
    host_logits, host_first = jax.device_get((prefill_logits, first))
    host_first = np.where(np.asarray(ends_query, bool),
                          np.asarray(host_first)[:n_p], -1)
    return np.asarray(host_logits)[:n_p], host_first
  return state.replace(k=k, v=v), decode_logits, fetch
