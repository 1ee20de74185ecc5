"""RAG serving benchmark: lazy vs full recompute, prefix caching, Block-Attention.

Every mode runs in one process on the same request trace, one after another,
with the same model and kernels.  Each mode gets a fresh cache and its own
warm-up: by default the measured trace is replayed first (again, up to
MAX_WARMUP_REPLAYS times, while a replay still compiles), so every shape bucket
it needs is compiled before timing; the cache is then emptied and the measured
trace runs (`compiles_during_measurement` in the output checks it).

By default the measured trace starts from an empty cache, so a short trace
mostly measures first-use misses.  `--warm-cache-requests N` serves N other
requests of the same popularity first (after every emptying, warm-up
replays included) and measures from the cache they leave: the steady state
of a server that has been running.

Every run's pool must hold its mode's largest request (block mode also
copies the documents' pages); this is checked before the first run.

Example (CPU smoke; half the corpus, so block mode's copies fit):
  python -m benchmarks.rag_serving --model tiny --num-docs 24 --num-requests 16 \
      --cache-fraction 0.5
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from benchmarks import rag_serving_checks, rag_serving_cli
from benchmarks.rag_report import merge_rows, plot, print_table
# The trace, model, engine and pool sizes; also imported from here by other
# benchmarks and tests (decode_step.py, serve_load.py, tensor_parallel.py...).
from benchmarks.rag_serving_setup import (Trace, build_model, cache_pages_for,
                                          make_engine, make_trace,
                                          same_bytes_pages)


def run_trace(engine, trace: Trace, args, progress=None):
  """Drives the engine through the trace; returns (results, seconds from
  the first request's arrival to the last result)."""
  from lazyattn_jax.sampling import SamplingParams
  sampling = SamplingParams(max_new_tokens=args.output_len, temperature=0.0,
                            stop_token_ids=())
  pending = list(range(len(trace.requests)))
  results = []
  start = time.perf_counter()

  def submit(i, arrival=None):
    query, docs = trace.requests[i]
    engine.submit(query, [trace.corpus[d] for d in docs], sampling,
                  arrival_time=arrival)

  # Closed loop: at least one request in flight, so the loop below always
  # has work until the trace is done (it never spins on an idle engine).
  in_flight_limit = max(1, args.concurrency)
  if trace.arrivals is None:
    for i in pending[:in_flight_limit]:
      submit(i)
    pending = pending[in_flight_limit:]
  while pending or engine.has_work():
    if trace.arrivals is not None:
      now = time.perf_counter() - start
      while pending and trace.arrivals[pending[0]] <= now:
        i = pending.pop(0)
        submit(i, start + float(trace.arrivals[i]))
      if not engine.has_work():
        time.sleep(max(0.0, float(trace.arrivals[pending[0]]) -
                       (time.perf_counter() - start)))
        continue
    done = engine.step()
    results.extend(done)
    if progress is not None:
      progress.update(len(done))
    if trace.arrivals is None:
      for _ in done:
        if pending:
          submit(pending.pop(0))
      if pending and not engine.has_work():  # nothing in flight: top up
        submit(pending.pop(0))
  # Open loop: the wait for the first arrival is no serving time.
  lead_in = float(trace.arrivals[0]) if trace.arrivals is not None else 0.0
  return results, time.perf_counter() - start - lead_in


def summarize(mode, engine, results, seconds, extra) -> dict:
  """The row of one mode's run.  Failed and cancelled requests are counted
  (`failed`) and left out of every other figure: their ttft_s is 0.
  Percentiles are numpy's default (linear interpolation between the two
  nearest requests); `per_request_records` gives what they are taken over."""
  failed = sum(r.finish_reason not in ("stop", "length") for r in results)
  results = [r for r in results if r.finish_reason in ("stop", "length")]
  if not results:
    raise RuntimeError(f"{mode}: all {failed} requests failed")
  ttft = np.array([r.ttft_s for r in results])
  tpot = np.array([r.decode_time_per_token_s for r in results
                   if len(r.token_ids) > 1])
  hits = [h for r in results for h in r.doc_hits]
  tokens = sum(len(r.token_ids) for r in results)
  return dict(
      mode=mode, requests=len(results), failed=failed, seconds=seconds,
      ttft_p50_s=float(np.percentile(ttft, 50)),
      ttft_p90_s=float(np.percentile(ttft, 90)),
      ttft_p99_s=float(np.percentile(ttft, 99)),
      # Undefined (null) where no answer has a second token: 0.0 read as
      # a TPOT that passes any bar.
      tpot_p50_s=float(np.percentile(tpot, 50)) if tpot.size else None,
      throughput_tok_s=tokens / seconds,
      throughput_req_s=len(results) / seconds,
      doc_hit_rate=float(np.mean(hits)) if hits else 0.0,
      # The round's prefill work done before a request's first token: TTFT's
      # in-round wait in device-independent units (CPU runs show the schedule).
      prefill_tokens_before_first_token_p50=float(np.percentile(
          [r.prefill_tokens_before_first_token for r in results], 50)),
      prefill_tokens_computed=engine.stats.prefill_tokens_computed,
      kv_pages_written_for_cached_docs=engine.stats.kv_pages_written_for_cached_docs,
      peak_pages_used=engine.stats.peak_pages_used,
      # Decode loops alone: riders' tokens in mixed steps take no loop time.
      decode_tok_s=(engine.stats.decode_loop_tokens /
                    max(engine.stats.decode_seconds, 1e-9)),
      compiles_total=engine.compile_count,
      **extra)


def per_request_records(results) -> list[dict]:
  """One record per measured request, in completion order, from which the
  row's figures can be computed again (--per-request)."""
  return [dict(request_id=r.request_id, finish_reason=r.finish_reason,
               ttft_s=r.ttft_s, latency_s=r.latency_s,
               output_tokens=len(r.token_ids),
               decode_time_per_token_s=(r.decode_time_per_token_s
                                        if len(r.token_ids) > 1 else None),
               doc_hits=list(r.doc_hits),
               prefill_tokens_before_first_token=(
                   r.prefill_tokens_before_first_token))
          for r in results]


def run_mode(args, config, model, dtype, mode, cache_pages, warm, measured,
             cache_warmer=None, quality_name="", label_suffix=""):
  """One mode on a fresh engine and pool (compiled programs are shared by
  every engine on the model, so a new engine does not recompile); the pool is
  freed before returning, so modes never hold two pools at once.
  `cache_warmer`: a trace served (closed loop) before the measured one
  without emptying the cache in between.  `quality_name`: a set of
  answer-quality options (`quality_options_named`), reported in the row's
  mode as "MODE + NAME"."""
  from tqdm import tqdm
  extra = {}
  if quality_name:
    extra["quality"] = quality_options_named(quality_name, config,
                                             args.sink_len)
  engine = make_engine(args, config, model, dtype, mode, cache_pages, **extra)
  label = (f"{mode} + {quality_name}" if quality_name else mode) + label_suffix
  try:
    return _run_engine(args, engine, label, cache_pages, warm, measured, tqdm,
                       cache_warmer)
  finally:
    engine.close()


def quality_options_named(name: str, config, sink_len: int):
  """QualityOptions for a --quality-runs entry.  The sink here is random
  vectors: what a learned sink costs does not depend on its values."""
  from lazyattn_jax.quality_options import QualityOptions
  parts = set(name.split("+"))
  if name not in rag_serving_cli.QUALITY_RUNS:
    raise ValueError(f"--quality-runs entries are "
                     f"{rag_serving_cli.QUALITY_RUNS}, got {name!r}")
  sink = None
  if "sink" in parts:
    sink = np.random.default_rng(0).normal(
        0.0, 0.02, (sink_len, config.hidden_size)).astype(np.float32)
  return QualityOptions(preamble="sink" if sink is not None else None,
                        sink=sink, recompute="recompute" in parts)


# A warm-up replay that compiled something ran at a different pace than the
# measured run will (compiles stall it), so its batches can differ; it is
# replayed until one pass compiles nothing, at most this many times.
MAX_WARMUP_REPLAYS = 3


def _run_engine(args, engine, mode, cache_pages, warm, measured, tqdm,
                cache_warmer=None):
  if mode.split(" ")[0] == "full":  # no cache to warm
    cache_warmer = None

  def empty_and_warm_cache():
    engine.reset_cache()
    if cache_warmer is not None and cache_warmer.requests:
      run_trace(engine, cache_warmer, args)

  for _ in range(MAX_WARMUP_REPLAYS if warm.requests else 0):
    compiles_before = engine.compile_count
    empty_and_warm_cache()
    run_trace(engine, warm, args)
    if engine.compile_count == compiles_before:
      break
  empty_and_warm_cache()
  engine.reset_stats()
  compiles_before = engine.compile_count
  with tqdm(total=len(measured.requests), desc=f"{mode:>6}", file=sys.stderr,
            disable=args.no_progress) as bar:
    results, seconds = run_trace(engine, measured, args, bar)
  row = summarize(mode, engine, results, seconds, dict(
      cache_pages=cache_pages, rate=args.rate, concurrency=args.concurrency,
      warm_cache_requests=(len(cache_warmer.requests) if cache_warmer
                           else 0),
      compiles_during_measurement=engine.compile_count - compiles_before))
  if getattr(args, "per_request", False):
    row["per_request"] = per_request_records(results)
  if getattr(args, "profile_replay_dir", ""):
    empty_and_warm_cache()
    row["profile"] = profile_replay(engine, measured, args, mode)
  return row


def profile_replay(engine, measured, args, label: str) -> dict:
  """Replays the measured trace once more under `jax.profiler` and reads
  where the device time went (`benchmarks.comm_profile.op_breakdown`) and
  what the host did while the device idled (`benchmarks.idle_profile`);
  the measured row is not affected.  The caller resets the cache first, so
  the replay prefills what the measured run prefilled."""
  import re
  import jax
  from benchmarks.comm_profile import op_breakdown, read_trace
  from benchmarks.idle_profile import idle_attribution
  directory = os.path.join(args.profile_replay_dir,
                           re.sub(r"[^A-Za-z0-9_.-]+", "_", label))
  engine.reset_stats()
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 1  # idle_profile reads the Python calls
  with jax.profiler.trace(directory, create_perfetto_trace=True,
                          profiler_options=options):
    _, seconds = run_trace(engine, measured, args)
  events = read_trace(directory)
  breakdown = op_breakdown(directory, top=15, events=events)
  idle = idle_attribution(directory, top=20, events=events)
  return dict(wall_s=seconds, busy_s=breakdown["busy_s"],
              idle_s=idle["idle_s"], idle_by_gap_size=idle["by_gap_size"],
              idle_by_own_frame=idle["by_own_frame"],
              idle_by_frame=[[n[:160], t, s] for n, t, s in idle["by_frame"]],
              prefill_tokens_computed=engine.stats.prefill_tokens_computed,
              span_s=breakdown["span_s"],
              top_kinds=[[n[:80], t, c] for n, t, c in breakdown["by_kind"]],
              top_ops=[[n[:80], t, c] for n, t, c in breakdown["by_op"]])


def parse_args(argv=None):
  """The benchmark's options (rag_serving_cli.py), headed by this module's
  docstring."""
  return rag_serving_cli.parse_args(argv, description=__doc__)


def main(argv=None):
  args = parse_args(argv)
  if args.merge:
    report = merge_rows(args.merge)
    if args.out:
      with open(args.out, "w") as f:
        f.write(json.dumps(report, indent=2))
    if args.plot_dir:
      plot(report, args.plot_dir)
    return
  import jax
  config, model, dtype = build_model(args)
  measured = make_trace(args, config.vocab_size, args.num_requests, args.seed + 2)
  warm = (measured if args.warmup_requests < 0 else
          make_trace(args, config.vocab_size, args.warmup_requests, args.seed + 1))
  base_pages = args.cache_pages or cache_pages_for(args, args.cache_fraction)
  error = rag_serving_checks.pool_error(
      args, config.hidden_size,
      rag_serving_checks.planned_pools(args, config, dtype, base_pages))
  if error:  # before the first run: a later mode must not lose the earlier
    rag_serving_cli.usage_error(error, __doc__)
  cache_warmer = None
  if args.warm_cache_requests:
    closed = argparse.Namespace(**vars(args))
    closed.rate = 0.0  # served closed-loop, as fast as the engine goes
    cache_warmer = make_trace(closed, config.vocab_size,
                              args.warm_cache_requests, args.seed + 3)
  header = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d"), model=args.model,
                command="python -m benchmarks.rag_serving " +
                " ".join(argv if argv is not None else sys.argv[1:]))
  def record(row, kind):
    if args.out:  # partial results survive a run cut short
      with open(args.out + ".partial.jsonl", "a") as f:
        f.write(json.dumps(dict(header, kind=kind, **row)) + "\n")
    print_table([row], file=sys.stderr)

  runs = []
  for mode in ([] if args.skip_base else args.mode_list):
    if not args.decode_during_prefill_only:
      runs.append(run_mode(args, config, model, dtype, mode, base_pages,
                           warm, measured, cache_warmer))
      record(runs[-1], "base")
    for kv_dtype in args.kv_dtypes:
      pooled = argparse.Namespace(**vars(args))
      pooled.kv_dtype = kv_dtype
      pages = same_bytes_pages(config, args, dtype, kv_dtype, base_pages)
      runs.append(run_mode(pooled, config, model, dtype, mode, pages, warm,
                           measured, cache_warmer,
                           label_suffix=f" [{kv_dtype} pages]"))
      runs[-1]["kv_dtype"] = kv_dtype
      record(runs[-1], "base")
    if args.decode_during_prefill_runs or args.decode_during_prefill_only:
      riding = argparse.Namespace(**vars(args))
      riding.decode_during_prefill = True
      runs.append(run_mode(riding, config, model, dtype, mode, base_pages,
                           warm, measured, cache_warmer,
                           label_suffix=" [decode during prefill]"))
      record(runs[-1], "base")
    for name in (args.quality_runs if mode in ("lazy", "block") else []):
      runs.append(run_mode(args, config, model, dtype, mode, base_pages, warm,
                           measured, cache_warmer, quality_name=name))
      record(runs[-1], "base")
  sweeps = dict(rate=[], cache=[])
  for rate in [float(r) for r in args.sweep_rates.split(",") if r]:
    swept = argparse.Namespace(**vars(args))
    swept.rate = rate
    trace = make_trace(swept, config.vocab_size, args.num_requests, args.seed + 2)
    for mode in args.mode_list:
      sweeps["rate"].append(run_mode(swept, config, model, dtype, mode,
                                     base_pages, warm if args.warmup_requests >= 0
                                     else trace, trace, cache_warmer))
      record(sweeps["rate"][-1], "rate")
  for fraction in [float(f) for f in args.sweep_cache_fractions.split(",") if f]:
    pages = cache_pages_for(args, fraction)
    for mode in args.mode_list:
      row = run_mode(args, config, model, dtype, mode, pages, warm, measured,
                     cache_warmer)
      row["cache_fraction"] = fraction
      sweeps["cache"].append(row)
      record(row, "cache")
  report = dict(header, args={k: v for k, v in vars(args).items()
                              if k != "mode_list"},
                runs=runs, sweeps=sweeps)
  text = json.dumps(report, indent=2)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  if args.plot_dir:
    plot(report, args.plot_dir)
  print(text if not args.out else json.dumps(runs, indent=2))
  print_table(runs, file=sys.stderr)
  return report


if __name__ == "__main__":
  main()
