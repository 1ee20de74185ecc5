"""Command-line options of the RAG serving benchmark (rag_serving.py), also
parsed by the benchmarks built on it (decode_step, tensor_parallel)."""

from __future__ import annotations

import argparse
import os

from benchmarks import rag_serving_checks
from lazyattn_jax.modes import MODES

# The quality options a run can add beside each mode (--quality-runs).
QUALITY_RUNS = ("recompute", "sink", "sink+recompute")


def parse_args(argv=None, description: str | None = None):
  """The benchmark's options (`python -m benchmarks.rag_serving --help`),
  checked; `description` heads the help text."""
  p = build_parser(description)
  args = p.parse_args(argv)
  return _checked(p, args)


def usage_error(message: str, description: str | None = None):
  """Exits as a bad option value does (usage, one error line, status 2):
  for problems found after parsing but before any run."""
  build_parser(description).error(message)


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="tiny",
                 choices=["tiny", "smollm2", "llama3-8b-shape"])
  p.add_argument("--num-docs", type=int, default=64)
  p.add_argument("--docs-per-request", type=int, default=4)
  p.add_argument("--doc-len", type=int, default=32)
  p.add_argument("--query-len", type=int, default=8)
  p.add_argument("--output-len", type=int, default=8)
  p.add_argument("--zipf", type=float, default=1.1,
                 help="popularity exponent (0 = uniform)")
  p.add_argument("--rate", type=float, default=0.0,
                 help="Poisson arrivals per second (0 = closed loop)")
  p.add_argument("--concurrency", type=int, default=8,
                 help="requests in flight in closed-loop mode")
  p.add_argument("--num-requests", type=int, default=32)
  p.add_argument("--warmup-requests", type=int, default=-1,
                 help="warm-up trace length; -1 replays the measured trace "
                      "(same shapes, so no compilation is left for the "
                      "measured run)")
  p.add_argument("--warm-cache-requests", type=int, default=0,
                 help="serve this many other requests (same popularity) "
                      "before the measured trace without emptying the cache, "
                      "so the measurement starts from a warm cache; 0 "
                      "measures from an empty cache")
  p.add_argument("--cache-pages", type=int, default=0,
                 help="pool size in pages (0: --cache-fraction of the corpus)")
  p.add_argument("--cache-fraction", type=float, default=1.0 / 3.0,
                 help="pool size as a fraction of the corpus's pages; every "
                      "mode's in-flight pages (query, output, block copies) "
                      "come out of the same pool")
  p.add_argument("--add-working-pages", action="store_true",
                 help="add room for max_batch in-flight requests (including "
                      "block-mode copies) on top of --cache-fraction")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--kv-dtype", default="",
                 help="KV pool dtype (default: the model's compute dtype); "
                      "float8_e4m3fn: float8 pages with per-page scales")
  p.add_argument("--kv-dtypes", default="",
                 help="also run each mode with pools of these dtypes "
                      "(comma-separated, e.g. float8_e4m3fn) holding the "
                      "same bytes as the base pool, so more pages")
  p.add_argument("--modes", default=",".join(MODES))
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--impl", default="auto")
  p.add_argument("--max-batch", type=int, default=16)
  p.add_argument("--decode-steps", type=int, default=8)
  p.add_argument("--max-prefill-tokens", type=int, default=16384)
  p.add_argument("--sweep-rates", default="",
                 help="comma-separated Poisson rates for the TTFT-vs-rate plot")
  p.add_argument("--sweep-cache-fractions", default="",
                 help="comma-separated corpus fractions for throughput vs budget")
  p.add_argument("--skip-base", action="store_true",
                 help="run only the sweeps")
  p.add_argument("--quality-runs", default="",
                 help="also run lazy and block with these answer-quality "
                      f"option sets, comma-separated from {QUALITY_RUNS} "
                      "(the cost of the options; the sink is random)")
  p.add_argument("--sink-len", type=int, default=16,
                 help="vectors of the sink in --quality-runs")
  p.add_argument("--out", default="", help="JSON output path")
  p.add_argument("--per-request", action="store_true",
                 help="add each row's per-request records (TTFT, latency, "
                      "tokens, hits) to the report, to compute its "
                      "percentiles again")
  p.add_argument("--plot-dir", default="", help="where to write PNG plots")
  p.add_argument("--no-progress", action="store_true")
  p.add_argument("--prefill-tokens-per-step", type=int, default=0,
                 help="admission budget of prefill tokens per scheduling "
                      "step (0 = admit all that fit)")
  p.add_argument("--eviction", choices=("lfu", "lru"), default="lfu",
                 help="order in which cached documents leave a full pool "
                      "(CacheConfig.eviction), for every cached mode")
  p.add_argument("--group-tokens", type=int, default=0,
                 help="lazy/block: new document tokens per first-token group "
                      "of a scheduling round (0 = --max-prefill-tokens)")
  p.add_argument("--decode-unroll", action="store_true",
                 help="fully unroll the layer loop in decode steps")
  p.add_argument("--prefill-chunk-tokens", type=int, default=0,
                 help="encode documents in chunks of this many tokens, one "
                      "prefill call each (0 = whole documents)")
  p.add_argument("--decode-during-prefill-runs", action="store_true",
                 help="also run each mode with running requests decoding "
                      "inside the round's prefill calls (SchedulerConfig."
                      "decode_during_prefill), beside the plain run")
  p.add_argument("--decode-loops-to-first-finish", action="store_true",
                 help="end each decode loop at the first request that reaches "
                      "its output length (SchedulerConfig."
                      "decode_loops_to_first_finish), in every run")
  p.add_argument("--decode-during-prefill-only", action="store_true",
                 help="run each mode only with decode during prefill (no "
                      "plain run)")
  p.add_argument("--merge", nargs="+", default=[], metavar="JSONL",
                 help="instead of running: merge the per-run rows of these "
                      ".partial.jsonl files (a later row of the same kind, "
                      "mode and sweep point replaces an earlier one) into "
                      "--out and --plot-dir")
  p.add_argument("--triton-gemm", action="store_true",
                 help="GPU: compile the steps with XLA's Triton gemm fusions, "
                      "which copy each layer's weights first (the setting "
                      "before RunnerConfig.gpu_weights_in_place)")
  p.add_argument("--gpu-xla-option", action="append", default=[],
                 type=xla_option, metavar="NAME=VALUE",
                 help="one more XLA compile option for the steps on GPU "
                      "(RunnerConfig.gpu_xla_options); repeatable")
  p.add_argument("--profile-replay-dir", default="",
                 help="after each measured run, replay its trace once more "
                      "under jax.profiler here and report the busiest ops "
                      "(the row's `profile`)")
  p.add_argument("--pool-as-bits", action="store_true",
                 help="carry a 16-bit KV pool as uint16 through the layer loop")
  return p


def _checked(p, args):
  modes = [m for m in args.modes.split(",") if m]
  bad = [m for m in modes if m not in MODES]
  if bad:
    p.error(f"unknown modes {bad}; choose from {tuple(MODES)}")
  args.kv_dtypes = [d for d in args.kv_dtypes.split(",") if d]
  args.quality_runs = [q for q in args.quality_runs.split(",") if q]
  bad = [q for q in args.quality_runs if q not in QUALITY_RUNS]
  if bad:
    p.error(f"unknown --quality-runs {bad}; choose from {QUALITY_RUNS}")
  if args.warm_cache_requests < 0:
    p.error(f"--warm-cache-requests must be >= 0, got "
            f"{args.warm_cache_requests}")
  args.mode_list = modes
  error = rag_serving_checks.check_values(args)
  if error:
    p.error(error)
  for path in (args.out, args.plot_dir and os.path.join(args.plot_dir, "x")):
    error = rag_serving_checks.out_path_error(path)
    if error:
      p.error(error)
  return args


def xla_option(text: str) -> tuple:
  """NAME=VALUE as (name, value): true/false as bools, numbers as int or
  float, anything else as the string."""
  name, sep, value = text.partition("=")
  if not sep or not name:
    raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
  if value.lower() in ("true", "false"):
    return name, value.lower() == "true"
  for kind in (int, float):
    try:
      return name, kind(value)
    except ValueError:
      pass
  return name, value
