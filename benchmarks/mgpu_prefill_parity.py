"""Part (a) of benchmarks/mgpu_prefill_check.py: parity of
lazy_prefill_mgpu against the jnp reference (and the float64 truth where
small) on a few cases and at the benchmark layout for every variant; each
case is wrapped so that one failure is printed and the others still run."""

from __future__ import annotations

import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_cases import ROPE, SM_SCALE
from benchmarks.mgpu_prefill_cases import VARIANTS, build_inputs
from pallas_kernels import RopeConfig, lazy_attention_reference
from pallas_kernels.gpu_prefill_mgpu import lazy_prefill_mgpu
from pallas_kernels.testing import make_case, numpy_truth, relative_error


def _parity_cases():
  plain = RopeConfig(theta=10000.0)
  cases = []
  for name, kwargs, rope, sizes in [
      ("32-8_H128_p16_T64", dict(num_heads=32, num_kv_heads=8, head_dim=128,
                                 page_size=16, q_len=64), plain, None),
      ("32-8_H128_p16_T200_base2^20_llama3",
       dict(num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
            q_len=200, base_position=2**20), ROPE, None),
      ("9-3_H64_p8_T37", dict(num_heads=9, num_kv_heads=3, head_dim=64,
                              page_size=8, q_len=37), plain, None),
      ("8-8_H128_p16_T130_k128w1s2",
       dict(num_heads=8, num_kv_heads=8, head_dim=128, page_size=16,
            q_len=130, base_position=60000), ROPE, VARIANTS["k128w1s2"]),
  ]:
    cases.append((name, lambda kwargs=kwargs: make_case(
        np.random.default_rng(len(name)), batch=3, dtype=jnp.bfloat16,
        docs_per_row=4, max_doc_len=300, **kwargs), rope, sizes))
  return cases


def run_parity():
  print("# parity (relative L2 error, bf16 tolerance 2e-2)", flush=True)
  ok = True

  def report(name, out, reference, truth_fn, padding):
    out = np.asarray(jnp.asarray(out).astype(jnp.float32))
    reference = np.asarray(jnp.asarray(reference).astype(jnp.float32))
    nan = bool(np.isnan(out).any())
    err = relative_error(out, reference.astype(np.float64))
    max_abs = float(np.nanmax(np.abs(out - reference)))
    line = (f"  {name:42s} max|err| {max_abs:.3e}  rel {err:.3e} (vs ref)")
    if truth_fn is not None:
      line += f"  rel {relative_error(out, truth_fn()):.3e} (vs f64 truth)"
    pad_ok = padding is None or not padding.any() or bool(
        np.all(out[padding] == 0.0))
    good = (not nan) and err <= 2e-2 and pad_ok
    line += f"  nan={nan} padding_zero={pad_ok}  {'OK' if good else 'FAIL'}"
    print(line, flush=True)
    return good

  for name, make, rope, sizes in _parity_cases():
    try:
      lazy = make()
      args = [jnp.asarray(a) for a in lazy.args()]
      out = jax.jit(lambda *a: lazy_prefill_mgpu(
          *a, rope=rope, sm_scale=jnp.float32(a[0].shape[-1] ** -0.5),
          block_sizes=sizes))(*args)
      reference = lazy_attention_reference(*args, rope=rope)
      # The float64 truth is a Python loop: only for small cases.
      rows = lazy.q.shape[0] * lazy.q.shape[1] * lazy.q.shape[2]
      truth = (lambda: numpy_truth(lazy, rope)) if rows <= 1000 else None
      ok &= report(name, out, reference, truth, lazy.q_pos < 0)
    except Exception as e:  # keep going
      ok = False
      print(f"  {name:42s} FAILED: {type(e).__name__}: {e}", flush=True)
      traceback.print_exc(file=sys.stdout)
  # Benchmark layout (smaller): every variant on shuffled pages; the
  # default with each document's pages consecutive (whole-block copies).
  for layout, variants in (("pages", VARIANTS.items()),
                           ("documents", [("default", None)])):
    try:
      args = build_inputs(jax.random.PRNGKey(0), np.random.default_rng(0),
                          batch=2, q_len=256, context=2048,
                          layout=layout)[:8]
      reference = lazy_attention_reference(*args, rope=ROPE,
                                           sm_scale=SM_SCALE)
    except Exception as e:
      print(f"  benchmark-layout inputs ({layout}) FAILED: {e}", flush=True)
      return False
    for vname, sizes in variants:
      name = f"bench-layout {layout} B2 T256 ctx2048 [{vname}]"
      try:
        out = jax.jit(lambda *a, sizes=sizes: lazy_prefill_mgpu(
            *a, rope=ROPE, sm_scale=jnp.float32(SM_SCALE),
            block_sizes=sizes))(*args)
        ok &= report(name, out, reference, None, None)
      except Exception as e:
        ok = False
        print(f"  {name} FAILED: {type(e).__name__}: {e}", flush=True)
        traceback.print_exc(file=sys.stdout)
  return ok
