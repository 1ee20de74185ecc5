"""The decode step at a full batch, against its HBM floor.

A full batch of requests (the paper-like load's shape by default: 8
documents of 512 tokens, a 64-token query, 32 rows, Llama-3-8B shape with
random bf16 weights) is admitted and prefilled once; then whole decode
loops (`--decode-steps` steps each, nothing else waiting) are timed.  The
floor is the bytes one step must read, the weights once and every row's
K/V, over the device's measured HBM bandwidth: the larger of a copy's
(a jitted copy or negation of a large array, counting reads and writes)
and a read's (a jitted sum or max of it, counting the reads).

Each `--variants` entry runs on a fresh engine over the same requests:
  plain   the default runner settings;
  unroll  the layer loop fully unrolled in decode (RunnerConfig
          decode_layer_unroll=True);
  bits    the pool carried as uint16 bits (pool_as_bits);
  triton  XLA's Triton gemm fusions, which copy each layer's weights
          (gpu_weights_in_place=False, the setting before it existed);
  merge   XLA's dot merger back on for decode at its default threshold
          (xla_gpu_dot_merger_threshold_mb=32), so each step concatenates
          every layer's Q, K and V weights into one gemm (the default
          before the decode loop turned it off: step_jit.DECODE_GPU_OPTIONS);
  graphs  the layer and step loops captured as CUDA graphs (XLA command
          buffers with WHILE and CONDITIONAL), against the launch gaps
          between the step's few hundred kernels.
`--gpu-xla-option NAME=VALUE` adds an XLA option to every variant.
With `--profile-dir`, one traced loop per variant gives the ops that take
the step's time (`benchmarks.comm_profile.op_breakdown`).

  python -m benchmarks.decode_step --variants triton,plain --out step.json
  python -m benchmarks.decode_step --model tiny --batch 2 --doc-len 16 \\
      --docs-per-request 2 --query-len 4 --loops 2 --page-size 8  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks import rag_serving, rag_serving_checks
from pallas_kernels.sizes import ceil_div

MODELS = ("tiny", "llama3-8b-shape")
# XLA command buffers (CUDA graphs) for the default kinds plus while loops
# and conditionals, so a scan's body launches as one graph.
GRAPHS = ("xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,"
          "CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL")
# rag_serving options of each variant (the module docstring says what each is).
VARIANTS = {
    "plain": [],
    "unroll": ["--decode-unroll"],
    "bits": ["--pool-as-bits"],
    "triton": ["--triton-gemm"],
    "merge": ["--gpu-xla-option", "xla_gpu_dot_merger_threshold_mb=32"],
    "graphs": ["--gpu-xla-option", GRAPHS],
}


def add_workload_arguments(p):
  """The options `serving_args` and `random_requests` read: the model, the
  rows and their documents and query, the pool, the implementation, and
  the seed (benchmarks/mixed_step.py takes them too)."""
  p.add_argument("--model", default="llama3-8b-shape", choices=MODELS)
  p.add_argument("--batch", type=int, default=32)
  p.add_argument("--docs-per-request", type=int, default=8)
  p.add_argument("--doc-len", type=int, default=512)
  p.add_argument("--query-len", type=int, default=64)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--kv-dtype", default="")
  p.add_argument("--impl", default="auto")
  p.add_argument("--gpu-xla-option", action="append", default=[],
                 metavar="NAME=VALUE")
  p.add_argument("--seed", type=int, default=0)


def check_workload(p, args):
  """Refuses (p.error: one usage line, exit 2) workload options the run's
  settings could not take, before any work: --impl and --kv-dtype as
  rag_serving checks them, the page size, and that --out can be written."""
  error = (rag_serving_checks.kernel_error(args.impl, args.kv_dtype,
                                          model=args.model) or
           rag_serving_checks.out_path_error(args.out))
  if error:
    p.error(error)
  if args.page_size < 1:
    p.error(f"--page-size must be >= 1, got {args.page_size}")


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  add_workload_arguments(p)
  p.add_argument("--decode-steps", type=int, default=16)
  p.add_argument("--loops", type=int, default=5,
                 help="timed decode loops per variant (after one untimed)")
  p.add_argument("--variants", default="triton,plain")
  p.add_argument("--copy-mib", type=int, default=4096,
                 help="array size for the bandwidth measurements")
  p.add_argument("--profile-dir", default="")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  check_workload(p, args)
  args.variant_list = [v for v in args.variants.split(",") if v]
  bad = [v for v in args.variant_list if v not in VARIANTS]
  if bad or not args.variant_list:
    p.error(f"--variants takes entries of {tuple(VARIANTS)}, got "
            f"{args.variants!r}")
  if min(args.batch, args.docs_per_request, args.doc_len, args.query_len,
         args.loops, args.decode_steps) < 1:
    p.error("sizes and counts must be >= 1")
  if args.copy_mib < 1:
    p.error(f"--copy-mib must be >= 1, got {args.copy_mib}")
  return args


def _median_rate(fn, x, bytes_moved: int, chained: bool) -> float:
  """Bytes per second of the median of five timings of ten calls of `fn`:
  chained (each call takes the last one's output) or independent (all
  dispatched, then waited on), so host dispatch stays hidden."""
  fn(x).block_until_ready()
  times = []
  for _ in range(5):
    started = time.perf_counter()
    y = x
    outs = []
    for _ in range(10):
      if chained:
        y = fn(y)
      else:
        outs.append(fn(x))
    (y if chained else outs[-1]).block_until_ready()
    times.append((time.perf_counter() - started) / 10)
  return bytes_moved / float(np.median(times))


def hbm_bandwidth(mib: int) -> dict:
  """The device's measured HBM bandwidth on a `mib` MiB bf16 array, in
  bytes per second: `copy`, counting reads and writes, is the faster of a
  jitted copy (a device-to-device memcpy) and a jitted negation; `read`,
  which counts the reads only, is the faster of a jitted float32 sum and a
  jitted max (they write one scalar).  A decode step mostly reads, so the
  floor takes the larger of the two."""
  import jax
  import jax.numpy as jnp
  x = jnp.ones((mib * (1 << 19),), jnp.bfloat16)
  copy = max(_median_rate(fn, x, 2 * x.nbytes, chained=True)
             for fn in (jax.jit(lambda a: a.copy()), jax.jit(jnp.negative)))
  read = max(_median_rate(fn, x, x.nbytes, chained=False)
             for fn in (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)),
                        jax.jit(jnp.max)))
  return dict(copy=copy, read=read)


def prefill_budget(args) -> int:
  """Prefill tokens per call: rag_serving's default, or one whole row."""
  return max(16384, args.docs_per_request * args.doc_len + args.query_len)


def serving_args(args, cache_pages: int, variant: str):
  """rag_serving's settings for one variant's engine."""
  argv = ["--model", args.model, "--max-batch", str(args.batch),
          "--decode-steps", str(args.decode_steps), "--doc-len",
          str(args.doc_len), "--docs-per-request", str(args.docs_per_request),
          "--num-docs", str(args.batch * args.docs_per_request),
          "--query-len", str(args.query_len), "--max-prefill-tokens",
          str(prefill_budget(args)), "--page-size",
          str(args.page_size), "--impl", args.impl, "--cache-pages",
          str(cache_pages), "--seed", str(args.seed)]
  if args.kv_dtype:
    argv += ["--kv-dtype", args.kv_dtype]
  argv += VARIANTS[variant]
  for option in args.gpu_xla_option:
    argv += ["--gpu-xla-option", option]
  return rag_serving.parse_args(argv)


def random_requests(args, vocab_size: int, rng) -> list:
  """`args.batch` (query, documents) pairs of random token ids."""
  tokens = lambda n: rng.integers(1, vocab_size, n).tolist()
  return [(tokens(args.query_len),
           [tokens(args.doc_len) for _ in range(args.docs_per_request)])
          for _ in range(args.batch)]


def admit_all(engine, requests, sampling):
  """Submits `requests` and runs scheduling rounds until none waits (a
  round's prefill is bounded by max_prefill_tokens)."""
  for query, docs in requests:
    engine.submit(query, docs, sampling)
  for _ in range(4 * len(requests)):
    engine.step()
    if not engine.scheduler.waiting:
      break


def run_variant(args, config, model, dtype, variant, requests, weight_bytes,
                kv_per_token, bandwidth):
  """Times `args.loops` decode loops of the full batch on a fresh engine."""
  import jax
  from benchmarks.comm_profile import op_breakdown
  from lazyattn_jax.sampling import SamplingParams
  tokens_per_row = args.docs_per_request * args.doc_len + args.query_len
  # Rows admitted early decode during later admission rounds: they must
  # not finish before the timed loops.
  rounds = ceil_div(args.batch * tokens_per_row, prefill_budget(args)) + 2
  max_new = args.decode_steps * (args.loops + 2 + rounds)
  pages = args.batch * (ceil_div(tokens_per_row + max_new, args.page_size) + 1)
  settings = serving_args(args, pages, variant)
  engine = rag_serving.make_engine(settings, config, model, dtype, "lazy",
                                   pages)
  sampling = SamplingParams(
      max_new_tokens=max_new,
      temperature=0.0, stop_token_ids=())
  try:
    compile_started = time.perf_counter()
    admit_all(engine, requests, sampling)
    engine.step()  # one more untimed loop
    warm_s = time.perf_counter() - compile_started
    if len(engine.scheduler.decoding()) != args.batch:
      raise RuntimeError(f"{len(engine.scheduler.decoding())} of "
                         f"{args.batch} rows decoding after admission")
    # K/V one step reads: every row's context at the middle of the timed
    # loops.
    context = sum(r.decode_position for r in engine.scheduler.decoding())
    context += args.batch * args.decode_steps * args.loops // 2
    floor_bytes = weight_bytes + context * kv_per_token
    engine.reset_stats()
    for _ in range(args.loops):
      engine.step()
    stats = engine.stats
    step_s = stats.decode_seconds / stats.decode_steps
    row = dict(variant=variant, batch=args.batch, step_s=step_s,
               kv_gb_per_step=context * kv_per_token / 1e9,
               kv_bytes_per_token=kv_per_token,
               floor_s=floor_bytes / bandwidth,
               step_over_floor=step_s * bandwidth / floor_bytes,
               decode_tok_s=args.batch / step_s,
               warm_and_compile_s=warm_s)
    if args.profile_dir:
      directory = f"{args.profile_dir}/{variant}"
      with jax.profiler.trace(directory, create_perfetto_trace=True):
        engine.step()
      breakdown = op_breakdown(directory, top=12)
      per_step = 1.0 / args.decode_steps
      row.update(busy_s_per_step=breakdown["busy_s"] * per_step,
                 span_s_per_step=breakdown["span_s"] * per_step,
                 top_kinds=[[name[:80], s * per_step, n * per_step]
                            for name, s, n in breakdown["by_kind"]])
    return row
  finally:
    engine.close()


def kv_bytes_per_token(config, page_size: int, kv_dtype: str) -> float:
  """K and V bytes a decode step reads per context token: every layer's
  and KV head's, with a float8 pool's per-page scales spread over the
  page's tokens (the pool's own byte count, `CacheConfig.bytes_per_page`)."""
  from lazyattn_jax.cache_config import CacheConfig
  pool = CacheConfig(num_pages=1, page_size=page_size,
                     num_layers=config.num_layers,
                     num_kv_heads=config.num_kv_heads,
                     head_dim=config.head_dim, dtype=kv_dtype, max_docs=1,
                     max_pages_per_doc=1)
  return pool.bytes_per_page / page_size


def main(argv=None):
  args = parse_args(argv)
  import jax
  from flax import nnx
  config, model, dtype = rag_serving.build_model(serving_args(args, 1,
                                                            "plain"))
  requests = random_requests(args, config.vocab_size,
                             np.random.default_rng(args.seed))
  weight_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(
      nnx.state(model)))
  if not config.tie_word_embeddings:  # decode reads one embedding row a token
    weight_bytes -= model.embed_tokens[...].nbytes
  kv_per_token = kv_bytes_per_token(config, args.page_size,
                                    args.kv_dtype or dtype)
  measured = hbm_bandwidth(args.copy_mib)
  bandwidth = max(measured.values())
  header = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"), model=args.model,
                command="python -m benchmarks.decode_step " + " ".join(
                    argv if argv is not None else sys.argv[1:]),
                copy_tb_s=measured["copy"] / 1e12,
                read_tb_s=measured["read"] / 1e12,
                floor_tb_s=bandwidth / 1e12, weight_gb=weight_bytes / 1e9)
  print(json.dumps(header), file=sys.stderr)
  rows = []
  for variant in args.variant_list:
    row = run_variant(args, config, model, dtype, variant, requests,
                      weight_bytes, kv_per_token, bandwidth)
    rows.append(row)
    print(f"{variant}: step {row['step_s'] * 1e3:.2f} ms, floor "
          f"{row['floor_s'] * 1e3:.2f} ms ({row['step_over_floor']:.2f}x)",
          file=sys.stderr)
    if args.out:
      with open(args.out, "w") as f:
        json.dump(dict(header, runs=rows), f, indent=2)
  return rows


if __name__ == "__main__":
  main()
