"""Host-side packing of a step's rows into arrays, and the page metadata of
one decode step, shared by the model runner's steps (prefill, the decode
loop) and the mixed step (lazyattn_jax/mixed_step.py).

Packing returns numpy arrays: a jitted step copies them to the device in
its own dispatch, where a `jnp.asarray` per array is one eager op each,
slow on the host (benchmarks/RESULTS.md, "The mixed step").
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lazyattn_jax.buckets import length_bucket
from lazyattn_jax.layout import pack_rows
from models.paged_inputs import PagedAttentionInputs
from pallas_kernels.sizes import next_power_of_two

MIN_PREFILL_LEN = 16
MIN_STOP_BUCKET = 4


def sampling_arrays(samplings, batch: int):
  """(temperature f32[B], top_k i32[B], top_p f32[B], seed i32[B]) of
  `samplings`, padded to `batch` rows with greedy defaults."""
  temperature = np.zeros((batch,), np.float32)
  top_k = np.zeros((batch,), np.int32)
  top_p = np.ones((batch,), np.float32)
  seed = np.zeros((batch,), np.int32)
  for b, s in enumerate(samplings):
    temperature[b], top_k[b], top_p[b] = s.temperature, s.top_k, s.top_p
    seed[b] = seed_int32(s.seed)
  return temperature, top_k, top_p, seed


def seed_int32(seed: int) -> int:
  """The int32 a request's seed reaches the device as: itself inside the
  int32 range; outside it, a mix of all 64 bits (splitmix64's finalizer),
  so seeds that differ only in high bits (5 and 5 + 2**32) draw different
  streams.  The steps take int32 seeds to stay free of x64."""
  if -2**31 <= seed < 2**31:
    return int(seed)
  x = seed % 2**64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
  x ^= x >> 31
  return int(np.uint32(x & 0xFFFFFFFF).view(np.int32))


def pack_prefill(rows, plans, samplings, num_pages: int):
  """Prefill rows (layout.PageRow) running plans (layout.PrefillTokens),
  bucketed: rows to a power of two B, lengths to T = length_bucket.

  Returns (tokens i32[B, T], inputs PagedAttentionInputs, logits_index
  i32[B] (each row's last token), sampling tuple of [B] arrays), as numpy
  arrays; padding rows and positions write to page `num_pages` (dropped).
  """
  batch = next_power_of_two(len(rows))
  length = length_bucket(max(len(p) for p in plans), MIN_PREFILL_LEN)
  num_logical = next_power_of_two(max(map(len, rows)))
  tokens = np.zeros((batch, length), np.int32)
  q_pos = np.full((batch, length), -1, np.int32)
  write_page = np.full((batch, length), num_pages, np.int32)
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
      page_table=table, page_pos=pos, page_shift=shift, page_len=plen,
      q_pos=q_pos, write_page=write_page, write_slot=write_slot)
  return tokens, inputs, logits_index, sampling_arrays(samplings, batch)


def pack_decode(requests, batch: int):
  """Decode rows of `requests` (scheduler.LiveRequest) in `batch` rows (the
  rest done), as `_decode_loop` takes them: (carry, pages, sampling,
  limits) tuples of numpy arrays; see its docstring."""
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
      max(len(r.request.stop_ids) for r in requests), MIN_STOP_BUCKET)
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
  carry = (tokens, position, written, generated, done)
  pages = (table, pos, shift, plen, private_start)
  return carry, pages, sampling, (max_new, stop_ids)


def decode_step_inputs(pages, pos, written, live, num_pages: int,
                       page_size: int) -> PagedAttentionInputs:
  """Page metadata of one decode step (inside jit).

  pages: (page_table, page_pos, page_shift, doc_page_len i32[B, M],
  private_start i32[B]); pos i32[B] each row's token position; written
  i32[B] tokens already in its query pages; live bool[B] (a row not live
  is padding: q_pos -1, write dropped).  The row's private pages count the
  tokens written through this step, so the row sees its own new token.
  """
  page_table, page_pos, page_shift, doc_page_len, private_start = pages
  logical = jnp.arange(page_table.shape[1], dtype=jnp.int32)[None, :]
  private_index = logical - private_start[:, None]  # >= 0 on private pages
  rows = jnp.arange(page_table.shape[0])
  written_after = written + live.astype(jnp.int32)
  private_len = jnp.clip(written_after[:, None] - private_index * page_size,
                         0, page_size)
  page_len = jnp.where(private_index >= 0, private_len, doc_page_len)
  target = jnp.clip(private_start + written // page_size, 0,
                    page_table.shape[1] - 1)
  write_page = jnp.where(live, page_table[rows, target], num_pages)
  return PagedAttentionInputs(
      page_table=page_table, page_pos=page_pos, page_shift=page_shift,
      page_len=page_len, q_pos=jnp.where(live, pos, -1)[:, None],
      write_page=write_page[:, None],
      write_slot=(written % page_size)[:, None])


def advance_decode(nxt, live, generated, done, limits):
  """(generated, done) after a decode step that drew `nxt` i32[B] for the
  `live` rows: a row is done once it drew a stop id or reached its
  max_new_tokens.  limits: (max_new i32[B], stop_ids i32[B, S], -1
  padded)."""
  max_new, stop_ids = limits
  stopped = jnp.any(nxt[:, None] == stop_ids, axis=-1)
  generated_after = generated + live.astype(jnp.int32)
  done_after = done | (live & (stopped | (generated_after >= max_new)))
  return generated_after, done_after


def advance_carry(carry, nxt, limits):
  """The decode carry (tokens, pos, written, generated, done [B]) after one
  step that drew `nxt` i32[B]; returns (carry, live bool[B]: the rows that
  were live in the step, whose `nxt` is a token of their stream)."""
  tokens, pos, written, generated, done = carry
  live = ~done
  step_live = live.astype(jnp.int32)
  generated_after, done_after = advance_decode(nxt, live, generated, done,
                                               limits)
  return (jnp.where(live, nxt, tokens), pos + step_live, written + step_live,
          generated_after, done_after), live
