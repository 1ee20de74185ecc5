"""Inputs, baselines and lazy-call wrappers of the kernel benchmarks
(benchmarks/kernels.py, benchmarks/mgpu_prefill_check.py): the shapes of
record (bf16, Hq/Hkv 32/8, H 128, pages of 16, documents of 512), paged
inputs with real per-document shifts, dense equivalents for the baselines,
and the Mosaic kernels' per-batch plans made outside the timed call."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_timing import perturb_none, perturb_query
from pallas_kernels.gpu_decode_mgpu import (DecodePlan,
                                            lazy_decode_mgpu_planned,
                                            plan_decode)
from pallas_kernels.gpu_prefill_mgpu import (MgpuBlockSizes, PrefillPlan,
                                             lazy_prefill_mgpu_planned,
                                             plan_prefill)
from pallas_kernels.rope import RopeConfig

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PAGE_SIZE, DOC_LEN = 16, 512
DTYPE = jnp.bfloat16
ROPE = RopeConfig(theta=500000.0, factor=8.0, low_freq_factor=1.0,
                  high_freq_factor=4.0, original_max_position=8192)
SM_SCALE = HEAD_DIM ** -0.5
L2_BYTES = 60e6
# One cycle over the input sets reads at least this much KV.
MIN_CYCLE_BYTES = 4 * L2_BYTES


# Where a row's pages lie in the pool: "pages" shuffles every page (no two
# of a block adjacent); "documents" keeps each document's pages (and the
# row's own pages) consecutive, as the cache allocates them
# (lazyattn_jax/page_allocation.py), and shuffles the documents.
PAGE_LAYOUTS = ("pages", "documents")


def page_metadata(rng, batch, doc_tokens, own_tokens, layout="pages"):
  """Logical pages of each row: documents of DOC_LEN (shift = their start),
  then `own_tokens` written in place (shift 0).  Every row reads its own
  physical pages, placed by `layout` (PAGE_LAYOUTS), so bytes read are
  real HBM traffic."""
  if layout not in PAGE_LAYOUTS:
    raise ValueError(f"layout must be one of {PAGE_LAYOUTS}, got {layout!r}")
  doc_pages = doc_tokens // PAGE_SIZE
  pages = doc_pages + own_tokens // PAGE_SIZE
  page = np.arange(pages)
  page_pos = np.broadcast_to(page * PAGE_SIZE, (batch, pages))
  doc_start = (page * PAGE_SIZE) // DOC_LEN * DOC_LEN
  page_shift = np.broadcast_to(np.where(page < doc_pages, doc_start, 0),
                               (batch, pages))
  page_len = np.full((batch, pages), PAGE_SIZE)
  if layout == "pages":
    page_table = rng.permutation(batch * pages).reshape(batch, pages)
  else:
    # Units of consecutive pages: each document, then the row's own pages.
    unit_of_page = np.where(page < doc_pages, page // (DOC_LEN // PAGE_SIZE),
                            -(-doc_pages // (DOC_LEN // PAGE_SIZE)))
    units = [(b, u) for b in range(batch) for u in np.unique(unit_of_page)]
    page_table = np.zeros((batch, pages), np.int64)
    next_id = 0
    for i in rng.permutation(len(units)):
      b, u = units[i]
      members = np.nonzero(unit_of_page == u)[0]
      page_table[b, members] = next_id + np.arange(len(members))
      next_id += len(members)
  as_i32 = lambda a: jnp.asarray(np.ascontiguousarray(a), jnp.int32)
  return (as_i32(page_table), as_i32(page_pos), as_i32(page_shift),
          as_i32(page_len))


def random_array(key, shape):
  return jax.random.normal(key, shape, jnp.float32).astype(DTYPE)


def num_sets(kv_bytes):
  return max(1, min(8, math.ceil(MIN_CYCLE_BYTES / kv_bytes)))


def dense_from_pages(pages, page_table):
  """[K, P, ps, H] pool, [B, M] table -> contiguous [B, M * ps, K, H]."""
  gathered = pages[:, page_table]  # [K, B, M, ps, H]
  k, b, m, ps, h = gathered.shape
  return jnp.transpose(gathered.reshape(k, b, m * ps, h), (1, 2, 0, 3))


def decode_shape_name(batch, context):
  return f"B{batch}/ctx{context}"


def decode_inputs(key, rng, batch, context, layout="pages"):
  """Input sets for one decode shape (enough sets to outgrow the L2)."""
  table, pos, shift, length = page_metadata(rng, batch, context, 0, layout)
  num_pages = batch * (context // PAGE_SIZE)
  kv_bytes = batch * context * NUM_KV_HEADS * HEAD_DIM * 2 * 2
  pool_shape = (NUM_KV_HEADS, num_pages, PAGE_SIZE, HEAD_DIM)
  sets = []
  for _ in range(num_sets(kv_bytes)):
    key, kq, kk, kv = jax.random.split(key, 4)
    sets.append((random_array(kq, (batch, 1, NUM_HEADS, HEAD_DIM)),
                 random_array(kk, pool_shape), random_array(kv, pool_shape)))
  q_pos = jnp.full((batch, 1), context - 1, jnp.int32)
  lazy_sets = [(q, k, v, table, pos, shift, length, q_pos) for q, k, v in sets]
  shift0_sets = [(q, k, v, table, pos, jnp.zeros_like(shift), length, q_pos)
                 for q, k, v in sets]
  return key, kv_bytes, sets, table, lazy_sets, shift0_sets


def visible_pairs(q_pos, page_pos, page_len):
  slot_pos = (np.asarray(page_pos)[:, :, None]
              + np.arange(PAGE_SIZE)[None, None, :])
  valid = np.arange(PAGE_SIZE)[None, None, :] < np.asarray(page_len)[:, :,
                                                                     None]
  slot_pos = np.where(valid, slot_pos, np.iinfo(np.int32).max).reshape(
      slot_pos.shape[0], -1)
  q_pos = np.asarray(q_pos)
  return int(sum(np.sum(slot_pos[b][None, :] <= q_pos[b][:, None])
                 for b in range(q_pos.shape[0])))


# --------------------------------------------------------------------------
# Baselines


def dense_decode(q, k, v):
  """q [B, N, H]; k, v [B, S, K, H] pre-rotated; plain XLA."""
  batch, heads, dim = q.shape
  kv_heads = k.shape[2]
  qg = q.reshape(batch, kv_heads, heads // kv_heads, dim)
  scores = jnp.einsum("bkgh,bskh->bkgs", qg, k,
                      preferred_element_type=jnp.float32) * SM_SCALE
  weights = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("bkgs,bskh->bkgh", weights.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(batch, heads, dim).astype(q.dtype)


def jax_paged(settings):
  from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

  def run(q, k_pages, v_pages, table, lengths):
    return paged_attention(q, k_pages, v_pages, table, lengths, **settings)
  return run


# Its defaults (block_h 16, 8 pages per compute block, 16 splits, 8 warps,
# 2 stages).  16 pages per block with 8 splits was slower at every decode
# shape (docs/kernels.md).
JAX_PAGED_SETTINGS = {
    "defaults": {},
}


# --------------------------------------------------------------------------
# Lazy calls


def lazy_fn(kernel, block_sizes):
  def run(*args):
    # Float8 sets carry k_scales, v_scales after the 8 contract operands.
    scales = dict(zip(("k_scales", "v_scales"), args[8:]))
    return kernel(*args[:8], rope=ROPE, sm_scale=jnp.float32(SM_SCALE),
                  interpret=False, block_sizes=block_sizes, **scales)
  return run


def decode_planned_sets(sets, block_sizes=None):
  """(q, k, v, q_pos, *DecodePlan) per set: the Mosaic decode's per-batch
  plan made outside the timed call, as a model makes it once per step."""
  # The pool's dtype picks the default block sizes (block_sizes None), as
  # the planned kernel then does.
  make = jax.jit(functools.partial(plan_decode, rope=ROPE, head_dim=HEAD_DIM,
                                   page_size=PAGE_SIZE,
                                   block_sizes=block_sizes),
                 static_argnames=("num_pages", "kv_dtype"))
  return [(q, k, v, q_pos, *make(table, pos, shift, length, q_pos,
                                 num_pages=k.shape[1], kv_dtype=k.dtype),
           *scales)
          for q, k, v, table, pos, shift, length, q_pos, *scales in sets]


def decode_planned(q, k_pages, v_pages, q_pos, *plan_and_scales,
                   block_sizes=None):
  """The per-layer Mosaic decode: `plan_and_scales` is the DecodePlan's
  fields, then k_scales and v_scales for float8 pools."""
  plan = DecodePlan(*plan_and_scales[:len(DecodePlan._fields)])
  scales = plan_and_scales[len(DecodePlan._fields):] or (None, None)
  return lazy_decode_mgpu_planned(q, k_pages, v_pages, q_pos, plan,
                                  rope=ROPE, sm_scale=jnp.float32(SM_SCALE),
                                  block_sizes=block_sizes,
                                  k_scales=scales[0], v_scales=scales[1])


def fp8_sets(sets):
  """The same input sets with float8 e4m3 pools and their page scales."""
  from pallas_kernels.kv_quant import quantize_pages
  out = []
  for q, k, v, table, pos, shift, length, q_pos in sets:
    k8, k_scales = quantize_pages(k)
    v8, v_scales = quantize_pages(v)
    out.append((q, k8, v8, table, pos, shift, length, q_pos, k_scales,
                v_scales))
  return out


def prefill_plan(q, k_pages, v_pages, table, pos, shift, length, q_pos,
          block_sizes=None):
  del v_pages
  return plan_prefill(table, pos, shift, length, q_pos, rope=ROPE,
                      group=q.shape[2] // k_pages.shape[0],
                      head_dim=q.shape[-1], num_pages=k_pages.shape[1],
                      page_size=k_pages.shape[2], block_sizes=block_sizes)


def prefill_plan_only(*lazy_args):
  """The per-batch plan alone; every output feeds the result (x 0.0, a
  float product XLA keeps) so none of it is dead code."""
  plan = prefill_plan(*lazy_args)
  tie = sum(jnp.sum(x.astype(jnp.float32)) for x in plan)
  return lazy_args[0] + (tie * jnp.float32(0)).astype(lazy_args[0].dtype)


def prefill_planned(q, k_pages, v_pages, q_pos, plan, block_sizes=None):
  return lazy_prefill_mgpu_planned(q, k_pages, v_pages, q_pos,
                                   PrefillPlan(*plan), rope=ROPE,
                                   sm_scale=jnp.float32(SM_SCALE),
                                   block_sizes=block_sizes)


def prefill_planned_perturb(block_sizes=None):
  """How a chain perturbs `prefill_planned` with `block_sizes`: q changes
  per layer; a kernel that rotates the raw query itself is timed
  unperturbed (q + 0 would be a pass of its own before it), as the kernel
  alone."""
  sizes = block_sizes or MgpuBlockSizes()
  return perturb_none if sizes.rotates_query_in_kernel else perturb_query

