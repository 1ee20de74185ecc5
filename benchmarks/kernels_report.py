"""The final table and bar verdicts of benchmarks/kernels.py."""

from __future__ import annotations

import datetime

import jax

from benchmarks.kernel_cases import decode_shape_name

def find_result(results, section, shape, method):
  for r in results:
    if (r.section, r.shape, r.method) == (section, shape, method):
      return r if r.seconds else None
  return None


def _fastest(results, section, shape, prefix):
  timed = [r for r in results if r.section == section and r.shape == shape
           and r.method.startswith(prefix) and r.seconds]
  return min(timed, key=lambda r: r.seconds) if timed else None


def report(results, decode_shapes, prefill_shapes, decode_variant,
           prefill_variant, mosaic_candidates=()):
  """Prints the table and the bar verdicts (judged on the chosen variants;
  `mosaic_candidates` names the Mosaic prefill tiles timed beside the
  default)."""
  lines = []
  out = lines.append
  out("")
  out("=" * 78)
  out(f"device: {jax.devices()[0].device_kind}   jax {jax.__version__}   "
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}")
  out(f"{'section':8s} {'shape':14s} {'method':28s} {'ms':>9s} {'rate':>14s}"
      "  note")
  order = ([("decode", decode_shape_name(*s)) for s in decode_shapes]
           + [("prefill", s[0]) for s in prefill_shapes])
  for section, shape in order:
    for r in results:
      if (r.section, r.shape) != (section, shape):
        continue
      if r.seconds:
        rate = (f"{r.tb_per_s:8.2f} TB/s" if r.section == "decode" else
                f"{r.tflop_per_s:6.1f} TFLOP/s")
        ms = f"{r.seconds * 1e3:9.3f}"
      else:
        rate, ms = "", "-"
      out(f"{r.section:8s} {r.shape:14s} {r.method:28s} {ms:>9s} {rate:>14s}"
          f"  {r.note}")
  out(f"chosen variants: decode {decode_variant}, prefill {prefill_variant}")
  out("bars (issue 2), judged on the chosen variants:")
  verdict = lambda ok: "PASS" if ok else "MISS"
  # The Triton decode's bars only where its rows were asked for (not with
  # --no-triton-decode or --prefill-only): absent rows are no MISS, but
  # rows that were asked for and failed are.
  asked = any(r.section == "decode" and r.method.startswith(
      ("tune:lazy[", "lazy[")) for r in results)
  triton_shapes = decode_shapes if asked else []
  ratios, speedups = [], []
  for batch, context in triton_shapes:
    shape = decode_shape_name(batch, context)
    lazy = find_result(results, "decode", shape, f"lazy[{decode_variant}]")
    shift0 = find_result(results, "decode", shape, f"lazy-shift0[{decode_variant}]")
    paged = _fastest(results, "decode", shape, "jax-paged[")
    ratios.append((shape, lazy.seconds / shift0.seconds
                   if lazy and shift0 else None))
    speedups.append((shape, paged.seconds / lazy.seconds
                     if lazy and paged else None))
  if triton_shapes:
    if all(r is not None for _, r in ratios):
      worst = max(ratios, key=lambda x: x[1])
      out(f"  lazy / shift-0 time <= 1.05 at every decode shape: "
          f"{verdict(worst[1] <= 1.05)} (worst {worst[1]:.3f} at "
          f"{worst[0]})")
    else:
      out(f"  lazy / shift-0 time <= 1.05: MISS (not measured: {ratios})")
    if all(r is not None for _, r in speedups):
      worst = min(speedups, key=lambda x: x[1])
      out(f"  lazy >= 1.3x faster than jax paged_attention (its faster "
          f"setting) at every decode shape: {verdict(worst[1] >= 1.3)} "
          f"(worst {worst[1]:.2f}x at {worst[0]})")
    else:
      out(f"  lazy >= 1.3x faster than jax paged_attention: MISS (not "
          f"measured: {speedups})")
    big = find_result(results, "decode", "B64/ctx8192",
                      f"lazy[{decode_variant}]")
    if big:
      out(f"  >= 2.5 TB/s KV read at B64/ctx8192: "
          f"{verdict(big.tb_per_s >= 2.5)} ({big.tb_per_s:.2f} TB/s)")
    else:
      out("  >= 2.5 TB/s KV read at B64/ctx8192: MISS (not measured)")
  if decode_shapes:
    _report_mosaic_decode(out, results, decode_shapes, decode_variant)
  cudnn = find_result(results, "prefill", "chunk512", "cudnn")
  mosaic = [f"lazy-mosaic{part}{suffix}" for suffix in
            [""] + [f"[{name}]" for name in mosaic_candidates]
            for part in ("", " per-layer")]
  # No prefill bars when the prefill section did not run (--decode-only).
  for method in ([f"lazy[{prefill_variant}]"] + mosaic
                 if prefill_shapes else []):
    lazy = find_result(results, "prefill", "chunk512", method)
    if lazy and cudnn:
      ratio = lazy.tflop_per_s / cudnn.tflop_per_s
      out(f"  {method} prefill >= 0.9x cuDNN TFLOP/s at chunk512 "
          f"(issue 16): "
          f"{verdict(ratio >= 0.9)} ({ratio:.3f}x: {lazy.tflop_per_s:.1f} "
          f"vs {cudnn.tflop_per_s:.1f})")
    else:
      out(f"  {method} prefill >= 0.9x cuDNN at chunk512: MISS (not "
          "measured)")
  print("\n".join(lines), flush=True)


def _report_mosaic_decode(out, results, decode_shapes, triton_variant):
  """Issue #16 bars of the Mosaic GPU decode, per variant: time / shift-0
  time <= 1.02 at every shape, >= 4.1 TB/s at B64/ctx8192; and its time
  against the Triton kernel's."""
  verdict = lambda ok: "PASS" if ok else "MISS"
  # Decode rows only: the prefill's tile candidates share the prefix.
  names = sorted({r.method[len("lazy-mosaic["):-1] for r in results
                  if r.section == "decode"
                  and r.method.startswith("lazy-mosaic[")})
  for name in names:
    ratios, vs_triton = [], []
    for batch, context in decode_shapes:
      shape = decode_shape_name(batch, context)
      mosaic = find_result(results, "decode", shape, f"lazy-mosaic[{name}]")
      shift0 = find_result(results, "decode", shape, f"lazy-mosaic-shift0[{name}]")
      triton = find_result(results, "decode", shape, f"lazy[{triton_variant}]")
      ratios.append(mosaic.seconds / shift0.seconds
                    if mosaic and shift0 else None)
      vs_triton.append(f"{shape} {triton.seconds / mosaic.seconds:.2f}x"
                       if mosaic and triton else f"{shape} -")
    if ratios and None not in ratios:
      out(f"  lazy-mosaic[{name}] / shift-0 time <= 1.02 at every decode "
          f"shape: {verdict(max(ratios) <= 1.02)} (worst {max(ratios):.3f})")
    else:
      out(f"  lazy-mosaic[{name}] / shift-0 <= 1.02: MISS (not measured)")
    big = find_result(results, "decode", "B64/ctx8192", f"lazy-mosaic[{name}]")
    out(f"  lazy-mosaic[{name}] >= 4.1 TB/s at B64/ctx8192: "
        + (f"{verdict(big.tb_per_s >= 4.1)} ({big.tb_per_s:.2f} TB/s)"
           if big else "MISS (not measured)"))
    layer = find_result(results, "decode", "B64/ctx8192",
                  f"lazy-mosaic per-layer[{name}]")
    if layer:
      out(f"  lazy-mosaic per-layer[{name}] >= 4.1 TB/s at B64/ctx8192: "
          f"{verdict(layer.tb_per_s >= 4.1)} ({layer.tb_per_s:.2f} TB/s)")
    out(f"  lazy-mosaic[{name}] speed vs Triton lazy: {', '.join(vs_triton)}")
