"""GPU kernel benchmark: lazy decode and prefill against their baselines.

Run on a GPU machine from the repository root:
  python -m benchmarks.kernels [--json results.json] [--quick]

Everything is measured side by side in one run and printed as one table,
last.  What is measured (issue 2):

Decode, bf16, Hq/Hkv 32/8, H 128, page 16, documents of 512 tokens (so the
shift changes every 32 pages), B in {8, 32, 64}, context in {4096, 8192}:
  lazy        lazy_decode_gpu with the real per-document shifts;
  lazy-shift0 the same kernel and block sizes with every shift 0;
  lazy-fp8[v], lazy-mosaic-fp8[default] (with --fp8)
              both kernels on float8 e4m3 pools (TB/s of the float8
              bytes), real shifts and shift 0 in alternation;
  lazy-mosaic[v], lazy-mosaic-shift0[v]
              the Mosaic GPU (Hopper) decode kernel (lazy_decode_mgpu, what
              lazy_attention(impl="gpu") runs on Hopper) with each of
              MOSAIC_DECODE_VARIANTS, real shifts and shift 0 timed in
              alternation like the Triton pair;
  lazy-mosaic per-layer, lazy-mosaic-shift0 per-layer
              the default Mosaic decode with its per-batch plan made once
              outside the timed call (as the model does for all layers);
  jax-paged   jax.experimental.pallas.ops.gpu.paged_attention on the same
              pool, read as pre-rotated keys (its default settings);
  xla-dense   a dense XLA decode over contiguous pre-rotated K/V.
TB/s counts the K and V bytes a decode step needs: B * context * Hkv * H *
2 (K and V) * 2 bytes, read once.

Prefill, bf16, same heads: a chunk of 128 or 512 query tokens against 8192
tokens of context held in 16 documents of 512 (each at its own shift) plus
the chunk's own pages; and a causal document prefill of 2048 tokens against
its own pages (shift 0).  The baseline is cuDNN flash attention
(jax.nn.dot_product_attention(implementation="cudnn")) on the equivalent
dense, pre-rotated inputs: for the chunk, K/V of context + chunk with no mask
(cuDNN's causal mask is aligned to the top-left corner, which is not the
chunk's mask; the chunk's own triangle is 1% or 3% of the pairs, so cuDNN does
that much extra work); for the document, is_causal=True.  FLOPs are counted
the same way for both: 4 * H * Hq per visible (query, key) pair, pairs
counted from the lazy inputs' causal mask.  Lazy prefill rows: the Triton
kernel ("lazy[...]"), the Mosaic GPU kernel that lazy_attention(impl="gpu")
runs on Hopper ("lazy-mosaic", default tiles, and "lazy-mosaic[...]" for the
MOSAIC_CANDIDATES tiles), each also "per-layer": the per-batch plan made
once outside the timed call, as the model does for all its layers.

Block sizes: a few variants of each kernel run at tuning shapes ("tune:"
rows); the fastest (geometric mean) is the one measured everywhere and judged
by the bars.  Lazy decode with real shifts and with shift 0 are timed in
alternation (seven rounds, medians), so that drift cannot fake or hide a few
percent between them.

Timing: each measured function runs in a jitted step that calls it several
times in a chain (every call's query, and the lazy path's q_pos, depend on the
previous output through a zero-valued scalar, so XLA can neither merge calls
nor hoist the lazy path's per-call metadata work out of the chain; the Mosaic
prefill's q_pos alone, since it rotates the raw query in its kernel and q + 0
would be a pass of its own before it), cycling
over enough independent input sets that one cycle reads several times the
60 MB L2.  Steps are dispatched back to back, then synchronised; the reported
time is the median over repeats of (elapsed / calls).  The lazy times include
everything the public API does per call: query rotation, work lists, the
kernel and (decode) the split combine.

Where it lives: this module is the command line; the shapes and tiles it
times are in kernel_variants.py, the decode and prefill runs and their
result rows in kernel_runs.py, inputs and baselines in kernel_cases.py, the
timer in kernel_timing.py and the final table in kernels_report.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import jax

from benchmarks.kernel_cases import PAGE_LAYOUTS
# Result also stays importable from here, where
# tests/test_kernel_benchmark_helpers.py takes it.
from benchmarks.kernel_runs import (Budget, Result, compile_once, run_decode,
                                    run_prefill)
from benchmarks.kernel_variants import (
    DECODE_SHAPES, DECODE_TUNING_SHAPES, DECODE_VARIANTS, MOSAIC_CANDIDATES,
    MOSAIC_DECODE_VARIANTS, PREFILL_SHAPES, PREFILL_TUNING_SHAPE,
    PREFILL_VARIANTS)
from benchmarks.kernels_report import report


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="also write all results to this file")
  parser.add_argument("--quick", action="store_true",
                      help="two decode shapes, one prefill shape, 2 variants")
  parser.add_argument("--time-budget", type=float, default=480.0,
                      help="seconds after which remaining lazy variants are "
                      "skipped (baselines still run)")
  parser.add_argument("--decode-only", action="store_true",
                      help="only the decode section (Triton, Mosaic GPU "
                      "and the baselines)")
  parser.add_argument("--no-mosaic-decode", action="store_true",
                      help="skip the Mosaic GPU decode rows")
  parser.add_argument("--decode-shapes", default="",
                      help="comma-separated BxCONTEXT decode shapes, e.g. "
                      "64x8192 (default: DECODE_SHAPES)")
  parser.add_argument("--mosaic-variants", default="",
                      help="comma-separated MOSAIC_DECODE_VARIANTS names to "
                      "time (default: all)")
  parser.add_argument("--no-triton-decode", action="store_true",
                      help="skip the Triton decode rows (tuning included)")
  parser.add_argument("--no-baselines", action="store_true",
                      help="skip JAX's paged attention and dense XLA decode")
  parser.add_argument("--fp8", action="store_true",
                      help="also time decode and prefill (Triton and Mosaic "
                      "GPU) on float8 e4m3 pools")
  parser.add_argument("--prefill-only", action="store_true",
                      help="only the prefill section")
  parser.add_argument("--prefill-shapes", default="",
                      help="comma-separated PREFILL_SHAPES names, e.g. "
                      "chunk512 (default: all)")
  parser.add_argument("--no-triton-prefill", action="store_true",
                      help="skip the Triton prefill tuning and rows (its "
                      "float8 row then takes the default tiles)")
  parser.add_argument("--page-layout", choices=PAGE_LAYOUTS,
                      default="pages",
                      help="where each row's pages lie in the pool: every "
                      "page shuffled (default), or each document's pages "
                      "consecutive and the documents shuffled")
  parser.add_argument("--compile-once", action="store_true",
                      help="only run lazy decode (B8/ctx4096) and prefill "
                      "(chunk512) once with the default block sizes, e.g. "
                      "under XLA_FLAGS=--xla_dump_to=DIR to read the PTX")
  args = parser.parse_args(argv)
  if jax.default_backend() != "gpu":
    raise SystemExit("benchmarks.kernels needs a GPU (jax.default_backend() "
                     f"is {jax.default_backend()!r})")
  decode_shapes, prefill_shapes = DECODE_SHAPES, PREFILL_SHAPES
  decode_variants, prefill_variants = DECODE_VARIANTS, PREFILL_VARIANTS
  if args.quick:
    decode_shapes = DECODE_TUNING_SHAPES
    prefill_shapes = [s for s in PREFILL_SHAPES if s[0] == PREFILL_TUNING_SHAPE]
    decode_variants = dict(list(DECODE_VARIANTS.items())[:2])
    prefill_variants = dict(list(PREFILL_VARIANTS.items())[:2])
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"page layout: {args.page_layout}", flush=True)
  if args.compile_once:
    compile_once()
    return
  budget = Budget(args.time_budget)
  results: list[Result] = []
  mosaic_decode = {} if args.no_mosaic_decode else MOSAIC_DECODE_VARIANTS
  if args.decode_shapes:
    try:
      decode_shapes = [(int(b), int(c)) for b, c in (
          shape.split("x") for shape in args.decode_shapes.split(","))]
    except ValueError:
      parser.error(f"--decode-shapes takes BxCONTEXT,..., e.g. 64x8192; got "
                   f"{args.decode_shapes!r}")
  if args.mosaic_variants:
    names = args.mosaic_variants.split(",")
    unknown = set(names) - set(mosaic_decode)
    if unknown:
      parser.error(f"unknown --mosaic-variants {sorted(unknown)}; known: "
                   f"{sorted(MOSAIC_DECODE_VARIANTS)}")
    mosaic_decode = {name: mosaic_decode[name] for name in names}
  if args.quick:
    mosaic_decode = dict(list(mosaic_decode.items())[:1])
  if args.no_triton_decode:
    decode_variants = {}
  if args.no_triton_prefill:
    prefill_variants = {}
  if args.prefill_shapes:
    names = args.prefill_shapes.split(",")
    unknown = set(names) - {s[0] for s in PREFILL_SHAPES}
    if unknown:
      parser.error(f"unknown --prefill-shapes {sorted(unknown)}; known: "
                   f"{[s[0] for s in PREFILL_SHAPES]}")
    prefill_shapes = [s for s in prefill_shapes if s[0] in names]
  decode_variant = prefill_variant = None
  if args.prefill_only:
    decode_shapes = []
  else:
    decode_variant = run_decode(results, decode_variants, decode_shapes,
                                DECODE_TUNING_SHAPES, budget, mosaic_decode,
                                fp8=args.fp8,
                                baselines=not args.no_baselines,
                                layout=args.page_layout)
  if args.decode_only:
    prefill_shapes = []
  else:
    prefill_variant = run_prefill(results, prefill_variants, prefill_shapes,
                                  PREFILL_TUNING_SHAPE, budget, fp8=args.fp8,
                                  layout=args.page_layout)
  report(results, decode_shapes, prefill_shapes, decode_variant,
         prefill_variant, mosaic_candidates=tuple(MOSAIC_CANDIDATES))
  if args.json:
    with open(args.json, "w") as f:
      json.dump({
          "device": jax.devices()[0].device_kind,
          "jax": jax.__version__,
          "page_layout": args.page_layout,
          "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
          "decode_variant": decode_variant,
          "decode_block_sizes": (dataclasses.asdict(
              decode_variants[decode_variant]) if decode_variant else None),
          "prefill_variant": prefill_variant,
          "prefill_block_sizes": (dataclasses.asdict(
              prefill_variants[prefill_variant]) if prefill_variant else None),
          "results": [dataclasses.asdict(r) for r in results],
      }, f, indent=1)


if __name__ == "__main__":
  main()
