"""benchmarks.rag_quality with float8 pages emulated in float32 storage.

EMU (env var):
  off         no patch: the library as it is (dtype=float8_e4m3fn is a real
              float8 pool).
  all         runs whose pool dtype is float8_e4m3fn get a QuantizedPool whose
              `pages` are float32 holding the e4m3 codes (exactly, as float32)
              and the library's own power-of-two per-(head, page) scales,
              written by the library's own `write_quantized_rows` (same
              quantize / rescale rounding); attention dequantizes them as the
              XLA path does for float8 (gathered rows * page scale).
  nopreamble  as `all`, but rows written to the pages in EMU_EXEMPT_PAGES
              (page ids within a layer, comma-separated; the preamble's
              pages) are stored as x / scale in float32 (no e4m3 rounding), so
              they read back as exactly x: a 16-bit-or-better side pool.
              (EMU_SIDE_DTYPE=bfloat16 rounds them to bf16 instead.)
At engine close, the preamble entry's page ids are printed (PREAMBLE_PAGES ...)
so the exempt set can be checked.

  EMU=all python .dev/exp/exp22_sidepool/emu_quality.py <rag_quality args>
"""
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

EMU = os.environ.get("EMU", "off")
EXEMPT = tuple(int(x) for x in os.environ.get("EMU_EXEMPT_PAGES", "").split(",") if x)
SIDE_DTYPE = os.environ.get("EMU_SIDE_DTYPE", "float32")

import models.quantized_pool as qp
import models.paged_pool as pp
import models.llama as llama
import lazyattn_jax.cache_state as cs
import pallas_kernels.lazy_attention
import pallas_kernels.xla_attention
# `pallas_kernels` re-exports functions under its modules' names: take the
# modules themselves.
la = sys.modules["pallas_kernels.lazy_attention"]
xa = sys.modules["pallas_kernels.xla_attention"]
from pallas_kernels import kv_quant
from pallas_kernels.kv_quant import FP8_DTYPE, power_of_two_scale, quantize


def emu_zeros_pool(shape, dtype, device=None):
  if not kv_quant.is_quantized(dtype):
    return jnp.zeros(shape, dtype, device=device)
  return qp.QuantizedPool(pages=jnp.zeros(shape, jnp.float32, device=device),
                          scales=jnp.zeros(shape[:3], jnp.float32, device=device))


def emu_check_quantized_pool(pool, name):
  assert isinstance(pool, qp.QuantizedPool), name
  assert pool.pages.dtype == jnp.float32, pool.pages.dtype


_orig_check_kv_scales = kv_quant.check_kv_scales


def emu_check_kv_scales(k_pages, v_pages, k_scales, v_scales, q_dtype):
  if k_pages.dtype == jnp.float32 and k_scales is not None:
    assert v_pages.dtype == jnp.float32 and v_scales is not None
    return
  return _orig_check_kv_scales(k_pages, v_pages, k_scales, v_scales, q_dtype)


_orig_xla = xa.lazy_attention_xla


def emu_lazy_attention_xla(q, k_pages, v_pages, page_table, *rest, k_scales=None,
                           v_scales=None, **kw):
  if k_scales is None:
    return _orig_xla(q, k_pages, v_pages, page_table, *rest, **kw)
  # Same values as the float8 branch of lazy_attention_xla
  # (_dequantize_gathered: gathered codes .astype(f32) * page scale): the
  # pages the table names are gathered and multiplied by their scale here.
  print("EMU attention traced", q.shape, k_pages.shape, flush=True)
  return _gathered(q, k_pages, v_pages, page_table, k_scales, v_scales, rest, kw)


def _gathered(q, k_pages, v_pages, page_table, k_scales, v_scales, rest, kw):
  # Gather the pages the table names (clipped like a gather), dequantize them,
  # and hand the XLA path a compact pool with a remapped table.
  K, N, P, H = k_pages.shape
  flat = page_table.reshape(-1)
  idx = jnp.clip(flat, 0, N - 1)
  kg = k_pages[:, idx] * k_scales[:, idx][:, :, None, None]
  vg = v_pages[:, idx] * v_scales[:, idx][:, :, None, None]
  new_table = jnp.arange(flat.shape[0], dtype=page_table.dtype).reshape(
      page_table.shape)
  return _orig_xla(q, kg, vg, new_table, *rest, **kw)


def emu_write(self, pool, new_rows, rows):
  if not self.quantized:
    return _orig_write(self, pool, new_rows, rows)
  pages, scales = pool
  assert pages.dtype == jnp.float32
  # A copy of qp.write_quantized_rows with float32 storage of the e4m3
  # codes (a float8 -> float32 scatter does not promote implicitly).
  return write_rows_side(pages, scales, rows, new_rows, self.page_size,
                         self.num_pages)


def write_rows_side(pages, scales, rows, values, page_size, pages_per_layer):
  """qp.write_quantized_rows, except rows on exempt pages keep x / scale
  unrounded (float32), i.e. read back as x."""
  num_rows = pages.shape[1]
  num_pages = scales.shape[1]
  valid = (rows >= 0) & (rows < num_rows)
  page = jnp.where(valid, rows // page_size, num_pages)
  safe_page = jnp.minimum(page, num_pages - 1)
  if EMU == "nopreamble" and EXEMPT:
    exempt = jnp.isin(safe_page % pages_per_layer,
                      jnp.asarray(EXEMPT, jnp.int32))
  else:
    exempt = jnp.zeros(safe_page.shape, bool)
  values = values.astype(jnp.float32)
  need = power_of_two_scale(jnp.max(jnp.abs(values), axis=-1))
  starts = jnp.where(valid & (rows % page_size == 0), page, num_pages)
  kept = scales.at[:, starts].set(0.0, mode="drop")
  old, kept = jax.lax.optimization_barrier((kept[:, safe_page], kept))
  new_scales = kept.at[:, page].max(need, mode="drop")
  new = new_scales[:, safe_page]
  slots = jnp.arange(page_size, dtype=jnp.int32)
  page_rows = safe_page[:, None] * page_size + slots[None, :]
  kv_heads, num_written = need.shape
  earlier = pages[:, page_rows.reshape(-1)].reshape(
      kv_heads, num_written, page_size, -1)
  factor = jnp.where(new > 0, old / jnp.where(new > 0, new, 1.0), 0.0)
  factor = factor[:, :, None, None]
  scaled = jnp.where(factor > 0, earlier * factor, 0.0)
  rescaled = jnp.where(exempt[None, :, None, None], side(scaled, new[:, :, None, None]),
                       scaled.astype(FP8_DTYPE).astype(jnp.float32))
  targets = jnp.where(valid[:, None], page_rows, num_rows).reshape(-1)
  pages = pages.at[:, targets].set(
      rescaled.reshape(kv_heads, num_written * page_size, -1), mode="drop")
  safe_new = jnp.where(new > 0, new, 1.0)[:, :, None]
  exact = jnp.where(new[:, :, None] > 0, values / safe_new, 0.0)
  stored = jnp.where(exempt[None, :, None], side(exact, safe_new),
                     quantize(values, new[:, :, None]).astype(jnp.float32))
  pages = pages.at[:, jnp.where(valid, rows, num_rows)].set(stored, mode="drop")
  return pages, new_scales


def side(y, scale):
  """What the side pool keeps of y = x / scale: y itself (float32), or x
  rounded to SIDE_DTYPE, divided by scale again (exact: powers of two)."""
  if SIDE_DTYPE == "float32":
    return y
  return (y * scale).astype(SIDE_DTYPE).astype(jnp.float32) / scale


_orig_write = pp.PoolAccess.write


def install():
  cs.zeros_pool = emu_zeros_pool
  llama.check_quantized_pool = emu_check_quantized_pool
  la.check_kv_scales = emu_check_kv_scales
  xa.lazy_attention_xla = emu_lazy_attention_xla
  pp.PoolAccess.write = emu_write


def record_preamble():
  from lazyattn_jax.engine import LazyEngine
  orig_close = LazyEngine.close

  def close(self):
    try:
      pre = getattr(self._mode, "preamble", None)
      state = self.state
      if pre is not None and state is not None:
        keys = np.asarray(state.doc_key)
        valid = np.asarray(state.doc_valid)
        for slot in np.flatnonzero(valid):
          if tuple(keys[slot]) == tuple(pre.key):
            n = int(np.asarray(state.doc_num_pages)[slot])
            print("PREAMBLE_PAGES", np.asarray(state.doc_pages)[slot, :n].tolist(),
                  "len", int(np.asarray(state.doc_len)[slot]),
                  "pool", type(state.k).__name__, state.k.dtype, flush=True)
      dump = os.environ.get("DUMP_POOL")
      if dump and state is not None and isinstance(state.k, qp.QuantizedPool):
        out = {}
        for name, pool in (("k", state.k), ("v", state.v)):
          out[name] = (np.asarray(pool.pages.astype(jnp.float32)) *
                       np.asarray(pool.scales)[..., None, None])
          out[name + "_scales"] = np.asarray(pool.scales)
        np.savez(dump, **out)
        print("DUMPED", dump, flush=True)
    except Exception as err:  # diagnostics only
      print("PREAMBLE_PAGES unknown:", repr(err), flush=True)
    return orig_close(self)

  LazyEngine.close = close


if __name__ == "__main__":
  print("EMU", EMU, "EXEMPT", EXEMPT, "SIDE_DTYPE", SIDE_DTYPE, flush=True)
  if EMU != "off":
    install()
  record_preamble()
  from benchmarks import rag_quality
  start = int(os.environ.get("Q_START", "0"))
  if start:  # ask only questions [Q_START, --questions) of the same set
    orig_items = rag_quality.synthetic_items

    def synthetic_items(args):
      items, info = orig_items(args)
      print("Q_START", start, "items", len(items[start:]), flush=True)
      return items[start:], info

    rag_quality.synthetic_items = synthetic_items
  rag_quality.main(sys.argv[1:])
