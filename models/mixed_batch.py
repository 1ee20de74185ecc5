"""One forward pass over decode rows and prefill-chunk rows together.

Issue #16 part 2 (chunked prefill mixed with decode).  A decode step is
bound by reading the weights; a prefill chunk is bound by compute.  Running
both in one pass reads the weights once per step and lets the decode tokens
ride along the prefill's matmuls.  So the dense parts (embedding, norms,
Q/K/V and O projections, MLP, LM head) run once over the flattened
concatenation of all tokens, [R, D] with R = B_d + B_p * T, while attention
runs per part, each with its own `PagedAttentionInputs`: the decode rows
([B_d, 1] queries) and the chunk rows ([B_p, T] queries), so each part keeps
its own kernel (decode or prefill) and plan.

Order inside a layer: both parts' new K/V are scattered into the pool in one
write, then both attend.  That is the order a batched prefill already uses
(every row writes, then every row attends), so a row sees its own tokens'
keys of this layer, as in `Llama.__call__`; keys of a row's earlier chunks
are in its pages from earlier steps.

Precondition (`check_disjoint_parts`, run whenever the page metadata is
concrete): the two parts belong to different requests, so no row of one part
lists, with a visible slot, a page a row of the other part writes, and no
two parts write the same page.  Under it the step's result equals running
the prefill rows and the decode rows as two separate calls, in either order
(tests/test_mixed_step.py compares it with the prefill rows first).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from models.llama import finish_outputs, run_decoder_layers
from models.paged_inputs import PagedAttentionInputs
from models.paged_pool import PoolAccess


def _concrete(*arrays) -> bool:
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def check_disjoint_parts(decode_inputs: PagedAttentionInputs,
                         prefill_inputs: PagedAttentionInputs,
                         num_pages: int):
  """Raises ValueError if the decode and prefill parts of a mixed step
  could see each other's writes of this step.

  Checked: the pages the decode rows write and the pages the prefill rows
  write are disjoint, and neither part lists (with page_len > 0) a page the
  other part writes.  Writes outside [0, num_pages) are dropped by the model
  and are ignored here.  Needs concrete (not traced) metadata.
  """
  def written(inputs):
    page = np.asarray(inputs.write_page).reshape(-1)
    return set(page[(page >= 0) & (page < num_pages)].tolist())

  def read(inputs):
    table = np.asarray(inputs.page_table)
    return set(table[np.asarray(inputs.page_len) > 0].tolist())

  decode_writes, prefill_writes = written(decode_inputs), written(
      prefill_inputs)
  for what, pages in (("write", decode_writes & prefill_writes),
                      ("decode rows read", read(decode_inputs) &
                       prefill_writes),
                      ("prefill rows read", read(prefill_inputs) &
                       decode_writes)):
    if pages:
      raise ValueError(
          f"mixed step: decode and prefill rows must not share pages, but "
          f"{what} pages {sorted(pages)[:8]} the other part writes")


def mixed_forward(model, decode_tokens, decode_inputs: PagedAttentionInputs,
                  prefill_tokens, prefill_inputs: PagedAttentionInputs,
                  k_cache, v_cache, *, impl: str = "auto",
                  prefill_logits_index, unroll: int | bool = 1,
                  pool_as_bits: bool = False, tensor_parallel=None):
  """A forward pass over B_d decode rows and B_p prefill-chunk rows.

  Args:
    model: a `models.llama.Llama`.
    decode_tokens: int32 [B_d], each decode row's input token.
    decode_inputs: page metadata of the decode rows (q_pos, write_page,
      write_slot [B_d, 1]).
    prefill_tokens: int32 [B_p, T], the chunk rows' tokens.
    prefill_inputs: page metadata of the chunk rows ([B_p, T] per token).
    k_cache, v_cache: the pools, as for `Llama.__call__` (float or float8
      `QuantizedPool`).
    impl: attention implementation (`pallas_kernels.lazy_attention`).
    prefill_logits_index: int32 [B_p], the chunk position whose logits each
      prefill row returns (its last real token, typically).
    unroll: layer-scan unroll factor.
    pool_as_bits: carry 16-bit pools as uint16 (see `Llama.__call__`).
    tensor_parallel: a `models.sharding.TensorParallel`, as for
      `Llama.__call__`: the KV write and both parts' attention run per
      device on its heads, the dense parts are partitioned by GSPMD.

  Returns:
    (decode logits f32 [B_d, V], prefill logits f32 [B_p, V], k_cache,
    v_cache) with both parts' K/V written.

  Raises:
    ValueError: bad shapes, or (concrete metadata) parts sharing pages, see
      `check_disjoint_parts`.
  """
  c = model.config
  decode_tokens = jnp.asarray(decode_tokens)
  prefill_tokens = jnp.asarray(prefill_tokens)
  if decode_tokens.ndim != 1:
    raise ValueError(f"decode_tokens must be [B_d], got {decode_tokens.shape}")
  # Each part must be a valid call on its own (shapes, pools, metadata).
  model._check_call(decode_tokens[:, None], k_cache, v_cache, decode_inputs,
                    None, None)
  model._check_call(prefill_tokens, k_cache, v_cache, prefill_inputs,
                    jnp.asarray(prefill_logits_index), None)
  num_decode = decode_tokens.shape[0]
  num_chunks, chunk = prefill_tokens.shape
  if not num_decode and not num_chunks:
    raise ValueError("mixed_forward needs decode rows or chunk rows")
  pool = PoolAccess.of(k_cache, pool_as_bits=pool_as_bits)
  parts = (decode_inputs, prefill_inputs)
  if _concrete(*jax.tree_util.tree_leaves(parts)):
    check_disjoint_parts(decode_inputs, prefill_inputs, pool.num_pages)

  # One token row per written token, decode rows first: [R] with
  # R = B_d + B_p * T, the order of the flattened residual stream below.
  flat = lambda name: jnp.concatenate([getattr(p, name).reshape(-1)
                                       for p in parts])
  write_page, write_slot = flat("write_page"), flat("write_slot")
  writable = pool.writable(write_page, write_slot)
  key_pos = jnp.maximum(flat("q_pos"), 0)[None]  # [1, R]
  # A part with no rows is left out statically (no kernel call on an empty
  # batch), so a step of decode rows only or chunk rows only is valid.
  shapes = [shape for shape in ((num_decode, 1), (num_chunks, chunk))
            if shape[0]]
  used = tuple(inputs for inputs in parts if inputs.q_pos.shape[0])
  plans = tuple(model.attention_plan(shape, k_cache, inputs, impl)
                for shape, inputs in zip(shapes, used))

  def write_and_attend(q, k, v, k_pool, v_pool, rows, offset, key_pos,
                       part_inputs, part_plans):
    # q [1, R, N, H], k and v [1, R, K, H]: the flattened stream's heads
    # (this device's under tensor parallelism, so counts come from shapes).
    k_pool, v_pool = pool.write_kv(k, v, key_pos, k_pool, v_pool, rows,
                                   c.rope)
    # Each part attends with its own rows' queries ([B, T, N, H], rows in
    # stream order) and its own metadata and plan.
    outs, start = [], 0
    for shape, inputs, plan in zip(shapes, part_inputs, part_plans):
      size = shape[0] * shape[1]
      part_q = q[0, start:start + size].reshape(*shape, *q.shape[2:])
      out = pool.attend(part_q, k_pool, v_pool, inputs, offset, plan,
                        rope=c.rope, impl=impl)
      outs.append(out.reshape(size, *q.shape[2:]))
      start += size
    return jnp.concatenate(outs)[None], k_pool, v_pool

  if tensor_parallel is not None:
    write_and_attend = tensor_parallel.attention_per_device(write_and_attend)

  def attend(layer, q, k, v, pools):
    offset = layer * pool.num_pages
    rows = pool.write_rows(writable, write_page, write_slot, offset)
    out, k_pool, v_pool = write_and_attend(q, k, v, *pools, rows, offset,
                                           key_pos, used, plans)
    return out, (k_pool, v_pool)

  x = jnp.concatenate([model.embed(decode_tokens),  # [1, R, D]
                       model.embed(prefill_tokens).reshape(
                           num_chunks * chunk, c.hidden_size)])[None]
  x, (k_out, v_out) = run_decoder_layers(
      model.layers.stacked(), x, (pool.to_rows(k_cache), pool.to_rows(v_cache)),
      attend, config=c, dtype=model.dtype, unroll=unroll)
  # The LM head runs only on the rows whose logits are wanted: every decode
  # row and one position per chunk row.
  chunk_rows = x[0, num_decode:].reshape(num_chunks, chunk, c.hidden_size)
  picked = chunk_rows[jnp.arange(num_chunks), prefill_logits_index]
  logits = model.output_logits(jnp.concatenate([x[0, :num_decode], picked]))
  logits, k_out, v_out = finish_outputs(
      logits, pool.from_rows(k_out, k_cache), pool.from_rows(v_out, v_cache),
      tensor_parallel)
  return logits[:num_decode], logits[num_decode:], k_out, v_out
