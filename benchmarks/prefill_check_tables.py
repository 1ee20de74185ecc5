"""Sampling and tables of benchmarks/mgpu_prefill_check.py: rows sampled
round-robin, each sample settled first; one table per sampling; each row's
ratio to cuDNN over several tables."""

from __future__ import annotations

import statistics

import jax

from benchmarks.kernel_timing import SETTLE_S

# Samples of each row in one table.
SAMPLES = 21


def sample_round_robin(timers, windows=None, settle_s=SETTLE_S):
  """(method, median seconds or None, note) of each timer (or failure
  note) in `timers`: SAMPLES rounds, each sampling every timer once, in
  reverse order every other round, so slow drifts of clock or temperature
  over the run, and a row's place in a round, hit every row alike.  Each
  sample first settles for `settle_s` seconds: the H200 runs these kernels at its
  700 W power cap, where cuDNN's call holds the clock near 1.62 GHz and
  the lazy kernel's near 1.76-1.80 GHz, and a sample taken right after
  another row's would run at that row's clock (benchmarks/RESULTS.md,
  'The power cap and the order of samples').  `windows` (a dict), if
  given, gets each row's timed stretches as [(start, end)] in
  time.monotonic() seconds (for gpu_clock_log.ClockLog.during)."""
  live = {m: t for m, t in timers.items() if not isinstance(t, str)}
  samples = {m: [] for m in live}
  for round_index in range(SAMPLES):
    order = list(live) if round_index % 2 == 0 else list(live)[::-1]
    for method in order:
      samples[method].append(live[method].sample(settle_s=settle_s))
      if windows is not None:
        windows.setdefault(method, []).append(live[method].timed_window)
  return [(m, statistics.median(samples[m]), "") if m in live
          else (m, None, t) for m, t in timers.items()]


def print_table(rows):
  """One table of (shape, variant, seconds or None, flops, note) rows: ms,
  TFLOP/s and the ratio to the shape's cuDNN row, three decimals."""
  print("\n" + "=" * 72)
  print(f"device: {jax.devices()[0].device_kind}   jax {jax.__version__}")
  print(f"{'shape':10s} {'variant':24s} {'ms':>9s} {'TFLOP/s':>9s} "
        f"{'x cuDNN':>8s}  SM clock, power while timed")
  ratios = table_ratios(rows)
  for shape in dict.fromkeys(r[0] for r in rows):
    for _, method, seconds, flops, note in (r for r in rows if r[0] == shape):
      if seconds:
        rate = flops / seconds
        # Three decimals: the bar is 0.9, and 0.896 must not print 0.90.
        ratio = (f"{ratios[shape, method]:8.3f}" if (shape, method) in ratios
                 else f"{'-':>8s}")
        print(f"{shape:10s} {method:24s} {seconds * 1e3:9.3f} "
              f"{rate / 1e12:9.1f} {ratio}  {note}")
      else:
        print(f"{shape:10s} {method:24s} {'-':>9s} {'-':>9s} {'-':>8s}  "
              f"{note}")
  print("bar (issue 16): lazy prefill >= 0.9x cuDNN TFLOP/s at chunk512, "
        "whole call")


def table_ratios(rows):
  """{(shape, variant): x cuDNN} of one table's timed rows (cuDNN's own
  included): each row's FLOP/s over its shape's cuDNN row's; rows of a
  shape without a cuDNN time are left out."""
  cudnn_rate = {shape: flops / seconds
                for shape, method, seconds, flops, _ in rows
                if method == "cudnn" and seconds}
  return {(shape, method): flops / seconds / cudnn_rate[shape]
          for shape, method, seconds, flops, _ in rows
          if seconds and shape in cudnn_rate}


def print_tables_summary(per_table):
  """Each row's x cuDNN over several tables: median, lowest, highest and
  every table's, in order (one table resolves about +-1.3%, so a bar met
  or missed by about 1% is better read off the median of several;
  benchmarks/RESULTS.md)."""
  ratios = [table_ratios(rows) for rows in per_table]
  print(f"\nx cuDNN over {len(per_table)} tables (each against its own "
        "cuDNN row)")
  print(f"{'shape':10s} {'variant':36s} {'median':>7s} {'low':>7s} "
        f"{'high':>7s}  tables")
  for key in dict.fromkeys(k for r in ratios for k in r):
    seen = [r[key] for r in ratios if key in r]
    print(f"{key[0]:10s} {key[1]:36s} {statistics.median(seen):7.3f} "
          f"{min(seen):7.3f} {max(seen):7.3f}  "
          + " ".join(f"{x:.3f}" for x in seen)
          + (f" ({len(per_table) - len(seen)} failed)"
             if len(seen) < len(per_table) else ""))
