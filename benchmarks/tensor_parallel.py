"""Serving at tensor parallel 1 and 2 (or any list), side by side in one run.

The paper-like load of benchmarks/h200_engine.sh by default: a Llama-3-8B
shape with random bf16 weights, 2,000 documents of 512 tokens, 8 per
request, Zipf 1.1, 64-token queries and answers, 32 requests in flight, a
pool of 20% of the corpus.  For each device count in `--tensor-parallel`,
the same model (the same random weights, drawn straight into their shards)
serves the same trace (`benchmarks.rag_serving`: warm-up replays, then the
measured run); rows report the decode-step time, decode and overall
throughput, TTFT, and per-device memory.  With `--profile-dir`, a few
decode loops of a full batch are traced with `jax.profiler` and the
communication share of device time is read from the trace
(`benchmarks.comm_profile`).

`--model llama3-70b-shape`: 80 layers, hidden 8192, 64 query / 8 KV heads,
FFN 28672, random bf16 weights (140 GB: two H200s or more), the pool sized
from the memory left on the devices (`--pool-memory-fraction`).  Every
count's pool must hold each mode's largest request: a pool from
--cache-fraction is checked before the first run, one from device memory
once that count's weights are placed, before its first run.

The options of `benchmarks.rag_serving` that shape one run (corpus,
trace, pool, scheduler, kernels, --modes, --out) apply too (given after
these ones they override the paper-like defaults); its extra runs, sweeps,
merging and plots (NOT_RUN_HERE) are refused.  Examples:
  python -m benchmarks.tensor_parallel --tensor-parallel 1,2 --out tp.json
  python -m benchmarks.tensor_parallel --model llama3-70b-shape \\
      --tensor-parallel 2 --profile-dir /tmp/tp70 --out tp70.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import sys
import time

from benchmarks import rag_serving, rag_serving_checks

PAPER_LOAD = ["--num-docs", "2000", "--docs-per-request", "8", "--doc-len",
              "512", "--query-len", "64", "--output-len", "64", "--zipf", "1.1",
              "--concurrency", "32", "--max-batch", "32", "--num-requests",
              "64", "--cache-fraction", "0.2", "--decode-steps", "16",
              "--modes", "lazy"]
MODELS = ("tiny", "llama3-8b-shape", "llama3-70b-shape")
# Options of benchmarks.rag_serving this benchmark accepts but does not run.
NOT_RUN_HERE = ("sweep_rates", "sweep_cache_fractions", "kv_dtypes",
                "quality_runs", "sink_len", "decode_during_prefill_runs",
                "decode_during_prefill_only", "skip_base", "merge", "plot_dir")


def model_config(name: str):
  """(LlamaConfig, dtype name) of a --model choice."""
  from models.config import LlamaConfig
  if name == "tiny":  # heads divide by 1, 2 and 4
    return dataclasses.replace(LlamaConfig.tiny(num_heads=8, num_kv_heads=4),
                               max_position=1 << 16), "float32"
  if name == "llama3-8b-shape":
    return LlamaConfig.llama3_8b(), "bfloat16"
  if name == "llama3-70b-shape":
    return LlamaConfig.llama3_8b(num_layers=80, hidden_size=8192,
                                 num_heads=64, num_kv_heads=8,
                                 intermediate_size=28672), "bfloat16"
  raise SystemExit(f"unknown --model {name!r}; choose from {MODELS}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__, add_help=False,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="llama3-8b-shape", choices=MODELS)
  p.add_argument("--tensor-parallel", default="1,2",
                 help="comma-separated device counts, run in this order")
  p.add_argument("--vocab-parallel", choices=("auto", "on", "off"),
                 default="auto",
                 help="split the embedding and LM head over the vocabulary "
                      "(auto: when it divides by the device count)")
  p.add_argument("--pool-memory-fraction", type=float, default=None,
                 help="size the pool as this fraction of the device memory "
                      "left after the weights (default 0.5 for the 70B "
                      "shape; otherwise the pool is --cache-fraction of the "
                      "corpus, the same for every device count)")
  p.add_argument("--profile-dir", default="",
                 help="trace a few decode loops per device count here and "
                      "report the communication share")
  p.add_argument("--profile-loops", type=int, default=2,
                 help="decode loops (of --decode-steps steps) to trace")
  p.add_argument("-h", "--help", action="store_true")
  own, rest = p.parse_known_args(argv)
  if own.help:
    p.print_help()
    raise SystemExit(0)
  args = rag_serving.parse_args(PAPER_LOAD + rest)
  defaults = rag_serving.parse_args(PAPER_LOAD)
  error = rag_serving_checks.not_run_error(args, defaults, NOT_RUN_HERE,
                                          "benchmarks.tensor_parallel")
  if error:
    p.error(error)
  for name, value in vars(own).items():
    setattr(args, name, value)
  try:
    args.tp_list = [int(n) for n in own.tensor_parallel.split(",") if n]
  except ValueError:
    p.error(f"--tensor-parallel takes comma-separated ints, got "
            f"{own.tensor_parallel!r}")
  if not args.tp_list or min(args.tp_list) < 1:
    p.error("--tensor-parallel needs device counts >= 1")
  if args.pool_memory_fraction is None:
    args.pool_memory_fraction = 0.5 if own.model == "llama3-70b-shape" else 0.0
  return args


def _free_bytes(engine_devices) -> int | None:
  """Device memory left on the fullest device, or None where JAX cannot
  say (CPU)."""
  free = []
  for device in engine_devices:
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      return None
    free.append(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
  return min(free)


def pool_pages(args, config, dtype, tp, devices) -> tuple[int, str]:
  """Pages of the pool, and the option to raise for more: --cache-fraction
  of the corpus, or --pool-memory-fraction of the memory the weights left
  on the devices (where JAX can say how much; not on CPU)."""
  import jax.numpy as jnp
  if args.pool_memory_fraction > 0:
    free = _free_bytes(devices)
    if free is not None:
      replicas = 1 if tp is None else tp.kv_replicas
      heads = config.num_kv_heads * replicas // len(devices)
      kv_dtype = jnp.dtype(args.kv_dtype or dtype)
      per_page = (2 * config.num_layers * heads * args.page_size *
                  config.head_dim * kv_dtype.itemsize)
      if kv_dtype == jnp.float8_e4m3fn:  # a float32 scale per head and layer
        per_page += 2 * config.num_layers * heads * 4
      return (int(args.pool_memory_fraction * free // per_page),
              "--pool-memory-fraction")
  return (args.cache_pages or rag_serving.cache_pages_for(
      args, args.cache_fraction), "--cache-fraction or --cache-pages")


def profile_decode(engine, trace, args, directory: str) -> dict:
  """Traces `--profile-loops` decode loops of a full batch (its prefill
  is left out of the trace) and reads the communication share."""
  import jax
  from benchmarks.comm_profile import (communication_share, op_breakdown,
                                       read_trace)
  from lazyattn_jax.sampling import SamplingParams
  loops = args.profile_loops
  sampling = SamplingParams(max_new_tokens=args.decode_steps * (loops + 2),
                            temperature=0.0, stop_token_ids=())
  for query, docs in trace.requests[:args.max_batch]:
    engine.submit(query, [trace.corpus[d] for d in docs], sampling)
  while engine.scheduler.waiting:  # admit and prefill everyone first
    engine.step()
  steps_before = engine.stats.decode_steps
  started = time.perf_counter()
  with jax.profiler.trace(directory, create_perfetto_trace=True):
    for _ in range(loops):
      engine.step()
  seconds = time.perf_counter() - started
  steps = engine.stats.decode_steps - steps_before
  while engine.has_work():
    engine.step()
  events = read_trace(directory)
  share = communication_share(directory, events=events)
  breakdown = op_breakdown(directory, events=events)
  per_step = 1.0 / max(steps, 1)
  return dict(share, trace_dir=directory, decode_steps_traced=steps,
              traced_step_s=seconds * per_step,
              comm_s_per_step=share["comm_s"] * per_step,
              busy_s_per_step=breakdown["busy_s"] * per_step,
              span_s_per_step=breakdown["span_s"] * per_step,
              top_kinds=breakdown["by_kind"], top_ops=breakdown["by_op"])


class PoolTooSmall(Exception):
  """A count's pool, sized from device memory, cannot hold a mode's largest
  request (one line: main reports it as a usage error)."""


def run_one(args, config, dtype, n: int, measured, warm, cache_warmer):
  """Rows (one per mode) at `n` devices; frees its model before returning."""
  import jax
  from flax import nnx
  from tqdm import tqdm
  from lazyattn_jax.sharding import random_model, tensor_parallel_for
  vocab = {"auto": None, "on": True, "off": False}[args.vocab_parallel]
  tp = tensor_parallel_for(config, tensor_parallel=n, vocab_parallel=vocab)
  started = time.perf_counter()
  model = random_model(config, tp, dtype=dtype, seed=args.seed)
  jax.block_until_ready(jax.tree_util.tree_leaves(nnx.state(model)))
  build_s = time.perf_counter() - started
  devices = list(tp.mesh.devices.flat) if tp else [jax.devices()[0]]
  pages, option = pool_pages(args, config, dtype, tp, devices)
  # With --pool-memory-fraction the pages are known only now (the memory
  # the weights left, or --cache-fraction's where JAX cannot say, as on
  # CPU): checked before this count's first run.
  error = rag_serving_checks.pool_error(
      args, config.hidden_size,
      [(mode, "", pages, option) for mode in args.mode_list])
  if error:
    raise PoolTooSmall(f"--tensor-parallel {n}: {error}")
  rows = []
  for mode in args.mode_list:
    engine = rag_serving.make_engine(args, config, model, dtype, mode, pages,
                                     tensor_parallel=n,
                                     vocab_parallel=vocab)
    try:
      row = rag_serving._run_engine(args, engine, mode, pages, warm, measured,
                                    tqdm, cache_warmer)
      stats = engine.stats
      memory = engine.memory
      row.update(
          tensor_parallel=n, model_build_s=build_s,
          kv_replicas=tp.kv_replicas if tp else 1,
          vocab_parallel=bool(tp and tp.vocab_parallel),
          # None: no decode step ran (--output-len 1: prefill gives the
          # only token), so there is no step time to compare.
          decode_step_s=(stats.decode_seconds / stats.decode_steps
                         if stats.decode_steps else None),
          weights_gb_per_device=memory.get("weights_bytes_per_device",
                                           memory["weights_bytes"]) / 1e9,
          kv_pool_gb_per_device=memory.get("kv_pool_bytes_per_device",
                                           memory["kv_pool_bytes"]) / 1e9)
      if args.profile_dir:
        row["profile"] = profile_decode(
            engine, measured, args, f"{args.profile_dir}/tp{n}_{mode}")
      rows.append(row)
      print_rows([row], file=sys.stderr)
    finally:
      engine.close()
  del model
  gc.collect()
  return rows


def print_rows(rows, file=sys.stdout):
  cols = ["tensor_parallel", "mode", "decode_step_s", "decode_tok_s",
          "throughput_tok_s", "ttft_p50_s", "weights_gb_per_device",
          "kv_pool_gb_per_device", "cache_pages"]
  print(" | ".join(cols + ["comm_share"]), file=file)
  for r in rows:
    cells = [f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
             for c in cols]
    share = r.get("profile", {}).get("comm_share")
    print(" | ".join(cells + ["-" if share is None else f"{share:.3f}"]),
          file=file)


def main(argv=None):
  args = parse_args(argv)
  import jax
  from lazyattn_jax.errors import TensorParallelError
  from lazyattn_jax.sharding import tensor_parallel_for
  config, dtype = model_config(args.model)
  vocab = {"auto": None, "on": True, "off": False}[args.vocab_parallel]
  for n in args.tp_list:  # every count before the first run spends time
    try:
      tensor_parallel_for(config, tensor_parallel=n, vocab_parallel=vocab)
    except TensorParallelError as e:
      print(f"benchmarks.tensor_parallel: error: --tensor-parallel {n}: {e}",
            file=sys.stderr)
      raise SystemExit(2) from None
  if args.pool_memory_fraction <= 0:  # the same pool at every count
    pages = args.cache_pages or rag_serving.cache_pages_for(
        args, args.cache_fraction)
    error = rag_serving_checks.pool_error(
        args, config.hidden_size,
        [(mode, "", pages, "--cache-fraction or --cache-pages")
         for mode in args.mode_list])
    if error:
      print(f"benchmarks.tensor_parallel: error: {error}", file=sys.stderr)
      raise SystemExit(2)
  measured = rag_serving.make_trace(args, config.vocab_size,
                                    args.num_requests, args.seed + 2)
  warm = (measured if args.warmup_requests < 0 else rag_serving.make_trace(
      args, config.vocab_size, args.warmup_requests, args.seed + 1))
  cache_warmer = None
  if args.warm_cache_requests:
    closed = argparse.Namespace(**vars(args))
    closed.rate = 0.0
    cache_warmer = rag_serving.make_trace(closed, config.vocab_size,
                                          args.warm_cache_requests,
                                          args.seed + 3)
  rows, error = [], None
  for n in args.tp_list:
    try:
      rows += run_one(args, config, dtype, n, measured, warm, cache_warmer)
    except PoolTooSmall as e:
      error = str(e)
      break
  if error and not rows:
    print(f"benchmarks.tensor_parallel: error: {error}", file=sys.stderr)
    raise SystemExit(2)
  base = {r["mode"]: r for r in rows if r["tensor_parallel"] == args.tp_list[0]}
  for r in rows:  # against the first device count of the list
    ref = base.get(r["mode"])
    r["decode_step_speedup"] = (ref["decode_step_s"] / r["decode_step_s"]
                                if ref["decode_step_s"] and r["decode_step_s"]
                                else None)
    r["throughput_ratio"] = r["throughput_tok_s"] / ref["throughput_tok_s"]
  report = dict(device=str(jax.devices()[0].device_kind),
                devices=jax.device_count(), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d"), model=args.model,
                command="python -m benchmarks.tensor_parallel " +
                " ".join(argv if argv is not None else sys.argv[1:]),
                runs=rows)
  if error:  # the counts measured before it are kept
    report["error"] = error
  if any(r["decode_step_s"] is None for r in rows):
    print("benchmarks.tensor_parallel: no decode step ran in some rows "
          "(--output-len 1?): their decode_step_s and decode_step_speedup "
          "are null", file=sys.stderr)
  text = json.dumps(report, indent=2, default=str)
  if args.out:
    with open(args.out, "w") as f:
      f.write(text)
  print_rows(rows)
  if error:
    print(f"benchmarks.tensor_parallel: error: {error} (the report holds the "
          f"counts measured before it)", file=sys.stderr)
    raise SystemExit(2)
  return report


if __name__ == "__main__":
  main()
