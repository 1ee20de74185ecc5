"""The Mosaic prefill check's kernel variants (block sizes by name) and
its benchmark inputs (benchmarks/mgpu_prefill_check.py, its parity part
benchmarks/mgpu_prefill_parity.py, and the probes that reuse them)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_cases import (HEAD_DIM, NUM_HEADS, NUM_KV_HEADS,
                                     PAGE_SIZE, dense_from_pages,
                                     page_metadata, random_array)
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes


def _tiles(block_kv, wgs, stages, *, sched, f32_query, registers=False,
           cos_sin_in_records=False):
  return MgpuBlockSizes(block_kv=block_kv, num_compute_wgs=wgs,
                        num_stages=stages, schedule_barrier=sched,
                        query_in_f32=f32_query, query_in_registers=registers,
                        cos_sin_in_records=cos_sin_in_records)


VARIANTS = {
    # f32 query storage (the previous default used k64w2s2).
    "k64w2s3-sched": _tiles(64, 2, 3, sched=True, f32_query=True),
    "k64w2s2-sched": _tiles(64, 2, 2, sched=True, f32_query=True),
    "k64w2s2-nosched": _tiles(64, 2, 2, sched=False, f32_query=True),
    "k64w2s3-nosched": _tiles(64, 2, 3, sched=False, f32_query=True),
    "k128w1s2": _tiles(128, 1, 2, sched=False, f32_query=True),
    # 16-bit query storage: half the query's shared memory, which makes room
    # for 128-key steps with two compute warpgroups.
    "k64w2s2-q16": _tiles(64, 2, 2, sched=False, f32_query=False),
    "k128w2s2-q16": _tiles(128, 2, 2, sched=False, f32_query=False),
    "k128w2s2-q16-sched": _tiles(128, 2, 2, sched=True, f32_query=False),
    # The rotated query in registers (MgpuBlockSizes.query_in_registers).
    "k128w2s2-qreg-sched": _tiles(128, 2, 2, sched=True, f32_query=False,
                                  registers=True),
    # ... with each segment's cos / sin in the step records (one copy
    # fewer a step): the default.
    "k128w2s2-qreg-csrec-sched": _tiles(128, 2, 2, sched=True,
                                        f32_query=False, registers=True,
                                        cos_sin_in_records=True),  # default
}


def _default_with(**fields):
  """The default variant with `fields` changed."""
  return dataclasses.replace(VARIANTS["k128w2s2-qreg-csrec-sched"], **fields)


# The default with one TMA copy per page even where a block's pages are
# consecutive (timed against it with --page-layout documents).
VARIANTS["k128w2s2-qreg-csrec-sched-pagecopy"] = _default_with(
    copy_contiguous_blocks=False)
# The default with the query rotated by an XLA pass before the kernel (the
# default rotates it in the kernel: MgpuBlockSizes.rotates_query_in_kernel).
VARIANTS["k128w2s2-qreg-csrec-xlarope-sched"] = _default_with(
    query_rope_in_kernel=False)
# The default with each segment's query rotation in f32 arithmetic (the
# default computes it in packed 16-bit: MgpuBlockSizes.segment_rotation_16bit).
VARIANTS["k128w2s2-qreg-csrec-rot32-sched"] = _default_with(
    segment_rotation_16bit=False)
# The default's plan (in one Mosaic GPU launch, gpu_prefill_plan_kernel, on
# the GPU) and launch (programmatic dependent launch:
# MgpuBlockSizes.dependent_launch) taken apart.  Before 2026-12-04 18:10
# UTC the default name meant "-xlaplan".
VARIANTS["k128w2s2-qreg-csrec-sched-xlaplan"] = _default_with(
    plan_in_kernel=False, dependent_launch=False)
VARIANTS["k128w2s2-qreg-csrec-sched-plank"] = _default_with(
    plan_in_kernel=True, dependent_launch=False)
VARIANTS["k128w2s2-qreg-csrec-sched-plank-pdl"] = _default_with(
    plan_in_kernel=True, dependent_launch=True)
VARIANTS["k128w2s2-qreg-csrec-sched-pdl"] = _default_with(
    plan_in_kernel=False, dependent_launch=True)
# The default with each step's K and V pages prefetched into L2 before the
# producer waits for the step's slot (MgpuBlockSizes.l2_prefetch).
VARIANTS["k128w2s2-qreg-csrec-sched-l2pf"] = _default_with(l2_prefetch=True)


def build_inputs(key, rng, *, batch, q_len, context, layout="pages"):
  """Lazy arguments (8) + dense pre-rotated K and V [B, S, K, H]; `layout`
  places the pages in the pool (kernel_cases.PAGE_LAYOUTS)."""
  table, pos, shift, length = page_metadata(rng, batch, context, q_len,
                                            layout)
  pool_shape = (NUM_KV_HEADS, table.size, PAGE_SIZE, HEAD_DIM)
  kq, kk, kv = jax.random.split(key, 3)
  q = random_array(kq, (batch, q_len, NUM_HEADS, HEAD_DIM))
  k_pages, v_pages = random_array(kk, pool_shape), random_array(kv, pool_shape)
  q_pos = jnp.broadcast_to(context + jnp.arange(q_len, dtype=jnp.int32),
                           (batch, q_len))
  return (q, k_pages, v_pages, table, pos, shift, length, q_pos,
          dense_from_pages(k_pages, table), dense_from_pages(v_pages, table))


def coarse_pages(lazy_args, factor):
  """The lazy arguments on a pool whose pages are `factor` of the pool's
  pages (the same K/V bytes, each row's pages in shuffled order)."""
  q, k_pages, v_pages, table, pos, shift, length, q_pos = lazy_args
  heads, num_pages, page, dim = k_pages.shape
  batch, pages = table.shape
  pool = lambda x: x.reshape(heads, num_pages // factor, page * factor, dim)
  coarse_table = np.random.default_rng(2).permutation(
      num_pages // factor).reshape(batch, pages // factor)
  return (q, pool(k_pages), pool(v_pages),
          jnp.asarray(coarse_table, jnp.int32), pos[:, ::factor],
          shift[:, ::factor], jnp.sum(length.reshape(batch, -1, factor),
                                      axis=-1).astype(jnp.int32), q_pos)
