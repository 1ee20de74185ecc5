"""Helpers of the Mosaic GPU prefill tests (test_gpu_prefill_mgpu*.py, and
the decode and prefill-variant tests that run the same checks): contract
shapes, the interpreter marker, a call of the kernel (plain RoPE by
default; the configurations are tests/rope_configs.py), the parity check
against the reference and the float64 truth, and the benchmark-like and
GPU cases."""

from __future__ import annotations

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import lazy_attention_reference
from pallas_kernels.gpu_prefill_mgpu import lazy_prefill_mgpu
from pallas_kernels.testing import (contract_specs, make_case, numpy_truth,
                                    relative_error)
from tests.rope_configs import PLAIN

BF16_TOLERANCE = 2e-2


def _specs(batch, q_len, heads, kv_heads, head_dim, pages, page_size,
           logical, dtype=jnp.bfloat16):
  return contract_specs(batch=batch, q_len=q_len, num_heads=heads,
                        num_kv_heads=kv_heads, head_dim=head_dim,
                        num_pages=pages, page_size=page_size,
                        num_logical_pages=logical, dtype=dtype)


# Benchmark shape: B 4, 512-token chunk, 8192 tokens of context in 16
# documents of 512 plus the chunk's own 32 pages, Hq/Hkv 32/8, H 128, page 16.
BENCH = dict(batch=4, q_len=512, heads=32, kv_heads=8, head_dim=128,
             pages=4 * 544, page_size=16, logical=544)


# The interpreter is a private jax API; where a jax lacks it the interpreter
# parity tests are skipped (the GPU parity tests still cover the kernel).
def _has_interpreter() -> bool:
  try:
    return importlib.util.find_spec(
        "jax._src.pallas.mosaic_gpu.interpret.params") is not None
  except ImportError:
    return False


needs_interpreter = pytest.mark.skipif(
    not _has_interpreter(), reason="this jax has no Mosaic GPU interpreter")


def _call(args, *, rope=PLAIN, block_sizes=None, interpret=False):
  head_dim = args[0].shape[-1]
  return lazy_prefill_mgpu(*[jnp.asarray(a) for a in args], rope=rope,
                           sm_scale=jnp.float32(head_dim ** -0.5),
                           block_sizes=block_sizes, interpret=interpret)


def _check(out, lazy, rope):
  out = np.asarray(jnp.asarray(out).astype(jnp.float32))
  assert out.shape == lazy.q.shape
  assert not np.isnan(out).any(), "NaN leaked into the output"
  reference = np.asarray(lazy_attention_reference(
      *[jnp.asarray(a) for a in lazy.args()], rope=rope).astype(jnp.float32))
  err_ref = relative_error(out, reference.astype(np.float64))
  assert err_ref <= BF16_TOLERANCE, f"vs reference: {err_ref:.3g}"
  if lazy.q.size <= 4096 * 64:
    err_truth = relative_error(out, numpy_truth(lazy, rope))
    assert err_truth <= BF16_TOLERANCE, f"vs float64 truth: {err_truth:.3g}"
  padding = lazy.q_pos < 0
  if padding.any():
    assert np.all(out[padding] == 0.0), "padding rows must be exactly zero"


def _doc_layout_case(rng, *, num_docs, doc_len, q_len, num_heads, num_kv_heads,
                     head_dim, page_size, dtype=jnp.bfloat16):
  """Benchmark-like layout: whole-page documents stored from angle 0 at
  shift = their start, then the chunk's own pages; shuffled physical pages.
  Most KV steps take the fast path (full pages, fully visible)."""
  from pallas_kernels.testing import LazyCase
  doc_pages = doc_len // page_size
  own_pages = -(-q_len // page_size)
  pages = num_docs * doc_pages + own_pages
  page = np.arange(pages)
  page_pos = (page * page_size)[None].astype(np.int32)
  page_shift = np.where(page < num_docs * doc_pages,
                        page * page_size // doc_len * doc_len, 0)
  page_len = np.full((1, pages), page_size, np.int32)
  page_len[0, -1] = q_len - (own_pages - 1) * page_size
  table = rng.permutation(pages).astype(np.int32)[None]
  shape = (num_kv_heads, pages, page_size, head_dim)
  k = rng.standard_normal(shape).astype(np.float32)
  v = rng.standard_normal(shape).astype(np.float32)
  tail = table[0, -1]
  k[:, tail, page_len[0, -1]:] = np.nan  # padding slots of the last page
  v[:, tail, page_len[0, -1]:] = np.nan
  q = rng.standard_normal((1, q_len, num_heads, head_dim)).astype(np.float32)
  q_pos = (num_docs * doc_len + np.arange(q_len, dtype=np.int32))[None]
  return LazyCase(q.astype(dtype), k.astype(dtype), v.astype(dtype), table,
                  page_pos, page_shift[None].astype(np.int32), page_len,
                  q_pos)


def gpu_case(case):
  """(lazy case, rope) of a GPU_CASES-shaped entry: three rows of four
  documents each, bf16."""
  heads, head_dim, page_size, q_len, base, rope, _ = case
  rng = np.random.default_rng(q_len + head_dim)
  lazy = make_case(rng, batch=3, q_len=q_len, num_heads=heads[0],
                   num_kv_heads=heads[1], head_dim=head_dim,
                   page_size=page_size, dtype=jnp.bfloat16,
                   docs_per_row=4, max_doc_len=300, base_position=base)
  return lazy, rope
