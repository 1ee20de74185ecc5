"""Random inputs for the lazy attention contract, and a float64 NumPy truth.

For checking an implementation of the contract: the kernel tests and the
GPU checks in benchmarks/ use them.  Every physical slot that the contract
says must never be read (unused pages, padding slots past page_len) is
filled with NaN, so a stray read shows up as NaN in the output.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.rope import RopeConfig
from pallas_kernels.sizes import ceil_div


@dataclasses.dataclass
class LazyCase:
  q: np.ndarray
  k_pages: np.ndarray
  v_pages: np.ndarray
  page_table: np.ndarray
  page_pos: np.ndarray
  page_shift: np.ndarray
  page_len: np.ndarray
  q_pos: np.ndarray

  def args(self):
    return (self.q, self.k_pages, self.v_pages, self.page_table, self.page_pos,
            self.page_shift, self.page_len, self.q_pos)


def contract_specs(*, batch, q_len, num_heads, num_kv_heads, head_dim,
                   num_pages, page_size, num_logical_pages,
                   dtype=jnp.float32):
  """jax.ShapeDtypeStruct of the contract's eight array arguments, in order
  (for jax.export and shape-only calls)."""
  spec = jax.ShapeDtypeStruct
  pages = spec((num_kv_heads, num_pages, page_size, head_dim), dtype)
  meta = spec((batch, num_logical_pages), jnp.int32)
  return ([spec((batch, q_len, num_heads, head_dim), dtype), pages, pages]
          + [meta] * 4 + [spec((batch, q_len), jnp.int32)])


def zero_args(**sizes):
  """Zero arrays of `contract_specs(**sizes)`: the cheapest valid-shaped
  call, for argument checks."""
  return [jnp.zeros(s.shape, s.dtype) for s in contract_specs(**sizes)]


def make_case(rng: np.random.Generator, *, batch=2, q_len=7, num_heads=9,
              num_kv_heads=3, head_dim=64, page_size=16, dtype=np.float32,
              docs_per_row=3, max_doc_len=40, base_position=0,
              empty_page=True, shared_doc=True, padding_rows=True,
              extra_logical_pages=1, extra_physical_pages=3,
              nan_fill=True, shuffle_pages=True) -> LazyCase:
  """Builds one lazy request batch: [doc 0]...[doc n-1][query rows].

  Each row gets `docs_per_row` documents of ragged length (1..max_doc_len),
  each in whole pages stored from angle 0, then the query's own in-place
  pages (shift 0) holding keys for the query rows.  With `shared_doc`, row 0's
  first document is also read by every other row at a different position
  (hence a different shift) from the same physical pages.  `base_position`
  offsets every logical position (a long prior context), so shifts and
  q_pos reach that size.  Physical pages are handed out in shuffled order,
  or with `shuffle_pages=False` in allocation order (each document's pages
  consecutive, as the cache allocates them in a fresh pool).
  """
  lazy_rows = []  # per row: list of (length, physical pages or None, shift, pos)
  doc_store = []  # physical documents: (length, page ids)
  num_physical = extra_physical_pages
  def alloc(n_tokens):
    nonlocal num_physical
    n_pages = ceil_div(n_tokens, page_size)
    ids = list(range(num_physical, num_physical + n_pages))
    num_physical += n_pages
    return ids

  shared = None
  if shared_doc:
    length = int(rng.integers(1, max_doc_len + 1))
    shared = (length, alloc(length))
    doc_store.append(shared)

  rows_pages = []  # per row: list of (phys, pos, shift, len)
  rows_qpos = []
  for b in range(batch):
    pos = base_position + int(rng.integers(0, 5))
    pages = []
    docs = []
    for d in range(docs_per_row):
      if shared is not None and ((b == 0 and d == 0) or (b > 0 and d == 1)):
        docs.append(shared)
      else:
        length = int(rng.integers(1, max_doc_len + 1))
        doc = (length, alloc(length))
        doc_store.append(doc)
        docs.append(doc)
    for d, (length, ids) in enumerate(docs):
      for j, pid in enumerate(ids):
        pages.append((pid, pos + j * page_size, pos,
                      min(page_size, length - j * page_size)))
      pos += length
      if empty_page and d == 0:
        pages.append((-1, pos, pos, 0))  # unused logical page between docs
    # Query rows: the last rows may be padding.
    n_pad = int(rng.integers(1, 3)) if (padding_rows and q_len > 2) else 0
    n_real = q_len - n_pad
    qpos = [pos + t for t in range(n_real)] + [-1] * n_pad
    rows_qpos.append(qpos)
    if n_real:
      ids = alloc(n_real)
      for j, pid in enumerate(ids):
        pages.append((pid, pos + j * page_size, 0,
                      min(page_size, n_real - j * page_size)))
    rows_pages.append(pages)
    lazy_rows.append(docs)

  num_logical = max(len(p) for p in rows_pages) + extra_logical_pages
  page_table = np.zeros((batch, num_logical), np.int32)
  page_pos = np.zeros((batch, num_logical), np.int32)
  page_shift = np.zeros((batch, num_logical), np.int32)
  page_len = np.zeros((batch, num_logical), np.int32)
  # Shuffle physical ids; ids 0..extra_physical_pages-1 are never written.
  perm = (rng.permutation(num_physical) if shuffle_pages
          else np.arange(num_physical)).astype(np.int32)
  unused_ids = perm[:extra_physical_pages]
  for b, pages in enumerate(rows_pages):
    for m in range(num_logical):
      if m < len(pages) and pages[m][0] >= 0:
        pid, p, s, n = pages[m]
        page_table[b, m] = perm[pid]
        page_pos[b, m], page_shift[b, m], page_len[b, m] = p, s, n
      else:
        page_table[b, m] = unused_ids[(b + m) % len(unused_ids)]
        page_pos[b, m] = base_position + 10**6 if m >= len(pages) else pages[m][1]
        page_shift[b, m] = int(rng.integers(0, 1000))
        page_len[b, m] = 0

  fill = np.nan if nan_fill else 0.0
  shape = (num_kv_heads, num_physical, page_size, head_dim)
  k_pages = np.full(shape, fill, np.float32)
  v_pages = np.full(shape, fill, np.float32)
  for b in range(batch):
    for m in range(num_logical):
      n = page_len[b, m]
      if n:
        pid = page_table[b, m]
        k_pages[:, pid, :n] = rng.standard_normal((num_kv_heads, n, head_dim))
        v_pages[:, pid, :n] = rng.standard_normal((num_kv_heads, n, head_dim))
  q = rng.standard_normal((batch, q_len, num_heads, head_dim)).astype(np.float32)
  q_pos = np.asarray(rows_qpos, np.int32)
  to = lambda x: x.astype(dtype)
  return LazyCase(to(q), to(k_pages), to(v_pages), page_table, page_pos,
                  page_shift, page_len, q_pos)


def numpy_truth(case: LazyCase, rope: RopeConfig, sm_scale=None) -> np.ndarray:
  """float64 NumPy evaluation of the contract, straight from its definition."""
  q = case.q.astype(np.float64)
  k_pages = case.k_pages.astype(np.float64)
  v_pages = case.v_pages.astype(np.float64)
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  inv_freq = rope.inv_frequencies(head_dim)
  out = np.zeros_like(q)
  half = head_dim // 2
  for b in range(batch):
    for t in range(q_len):
      qp = int(case.q_pos[b, t])
      if qp < 0:
        continue
      for n in range(num_heads):
        h = n // group
        scores, values = [], []
        for m in range(case.page_table.shape[1]):
          angle = (qp - int(case.page_shift[b, m])) * inv_freq
          cos = np.concatenate([np.cos(angle)] * 2)
          sin = np.concatenate([np.sin(angle)] * 2)
          x = q[b, t, n]
          xr = np.concatenate([-x[half:], x[:half]])
          qm = x * cos + xr * sin
          for i in range(int(case.page_len[b, m])):
            if case.page_pos[b, m] + i <= qp:
              k = k_pages[h, case.page_table[b, m], i]
              scores.append(qm @ k * sm_scale)
              values.append(v_pages[h, case.page_table[b, m], i])
        if scores:
          s = np.asarray(scores)
          w = np.exp(s - s.max())
          out[b, t, n] = (w / w.sum()) @ np.asarray(values)
  return out


def relative_error(out, truth) -> float:
  out = np.asarray(out, np.float64)
  denom = np.linalg.norm(truth)
  return float(np.linalg.norm(out - truth) / (denom if denom > 0 else 1.0))


def quantize_case(case: LazyCase):
  """float8 pages of `case`: (LazyCase with float8_e4m3fn pages, k_scales,
  v_scales), scales f32 [K, num_pages] (pallas_kernels/kv_quant.py).

  Slots that must never be read stay NaN in the float8 pages, and pages no
  row uses get NaN scales, so a kernel that reads either shows NaN.
  """
  from pallas_kernels.kv_quant import quantize_pages
  used = np.zeros(case.k_pages.shape[1], bool)
  used[case.page_table[case.page_len > 0]] = True
  quantized = []
  for pages in (case.k_pages, case.v_pages):
    fp8, scales = quantize_pages(np.asarray(pages, np.float32))
    fp8 = jnp.where(jnp.isnan(jnp.asarray(pages, jnp.float32)),
                    jnp.nan, fp8.astype(jnp.float32)).astype(fp8.dtype)
    scales = jnp.where(jnp.asarray(used)[None, :], scales, jnp.nan)
    quantized.append((fp8, scales))
  (k_fp8, k_scales), (v_fp8, v_scales) = quantized
  return (dataclasses.replace(case, k_pages=k_fp8, v_pages=v_fp8), k_scales,
          v_scales)


def contiguous_block_count(page_table: np.ndarray,
                           pages_per_block: int) -> tuple[int, int]:
  """(blocks whose page ids are consecutive, all blocks) of a [B, M] table
  cut into blocks of `pages_per_block` logical pages (the last one of a row
  padded with -1): the steps the Mosaic GPU kernels copy in one TMA copy
  (`MgpuBlockSizes.copy_contiguous_blocks`)."""
  table = np.asarray(page_table)
  batch, pages = table.shape
  padded = -(-pages // pages_per_block) * pages_per_block
  blocks = np.full((batch, padded), -1, np.int64)
  blocks[:, :pages] = table
  blocks = blocks.reshape(batch, -1, pages_per_block)
  steps = blocks - blocks[..., :1]
  consecutive = np.all(steps == np.arange(pages_per_block), axis=-1)
  consecutive &= np.all(blocks >= 0, axis=-1)
  return int(consecutive.sum()), int(consecutive.size)
