"""The mixed step against its two parts run apart (issue 16, part 2).

A full batch of requests (the paper-like load's shape by default, as
`benchmarks.decode_step`) is admitted and decodes.  Then, for each
`--prefill-tokens` entry, that many tokens of new documents are admitted
and timed three ways on the same pool, each call waited for:
  prefill  one prefill call encoding the documents;
  decode   one decode step of the running rows (a one-step decode loop);
  mixed    one mixed step: the running rows decode a token inside the call
           that encodes the documents (`ModelRunner.mixed_step`);
  chained  per step of `--chain` mixed steps with the same riders, their
           decode state kept on the device between steps and read back once
           at the end (`ModelRunner.mixed_step_async`, as the rounds run
           them).
A mixed step pays when it takes less than prefill plus decode.  The
documents' pages are written again by every call (same tokens, same
result), and the decode rows write the same slot each time, so every call
does the same work.  With `--profile-dir`, one traced call of each kind
gives its device busy time and busiest op kinds.

  python -m benchmarks.mixed_step --prefill-tokens 512,1024,2048 --out m.json
  python -m benchmarks.mixed_step --model tiny --batch 2 --doc-len 16 \\
      --docs-per-request 2 --query-len 4 --page-size 8 \\
      --prefill-tokens 32 --repeats 2  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from benchmarks import decode_step, rag_serving
from pallas_kernels.sizes import ceil_div


def parse_args(argv=None):
  p = argparse.ArgumentParser(
      description=__doc__,
      formatter_class=argparse.RawDescriptionHelpFormatter)
  decode_step.add_workload_arguments(p)
  p.add_argument("--prefill-tokens", default="512,1024,2048",
                 help="comma-separated document tokens per call (whole "
                      "documents of --doc-len)")
  p.add_argument("--repeats", type=int, default=7,
                 help="timed calls of each kind (after one untimed)")
  p.add_argument("--chain", type=int, default=4,
                 help="mixed steps per timed 'chained' call")
  p.add_argument("--profile-dir", default="")
  p.add_argument("--host-profile", type=int, default=0, metavar="N",
                 help="print the host's Python profile (cProfile) of N more "
                      "calls of each kind, the busiest functions first")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  decode_step.check_workload(p, args)
  # Before --prefill-tokens: its checks divide by --doc-len.
  if min(args.batch, args.docs_per_request, args.doc_len, args.query_len,
         args.repeats, args.chain) < 1:
    p.error("sizes and counts must be >= 1")
  try:
    args.token_list = [int(t) for t in args.prefill_tokens.split(",") if t]
  except ValueError:
    p.error(f"--prefill-tokens takes integers, got {args.prefill_tokens!r}")
  if not args.token_list or min(args.token_list) < args.doc_len:
    p.error("--prefill-tokens entries must be at least --doc-len")
  uneven = [t for t in args.token_list if t % args.doc_len]
  if uneven:  # whole documents are encoded: the count run must be recorded
    p.error(f"--prefill-tokens entries must be multiples of --doc-len "
            f"{args.doc_len} (whole documents), got {uneven[0]}")
  # decode_step's engine settings read these.
  args.decode_steps, args.loops = 1, 1
  return args


def admit_documents(engine, documents):
  """Admits `documents` (token-id lists) into the engine's cache; returns
  their (row, plan) prefill pieces.  Nothing is encoded here."""
  rounds, scheduler = engine.rounds, engine.scheduler
  keys, lengths = scheduler.mode.entries(documents)
  rounds.state, admission = scheduler.cache.admit(rounds.state, keys,
                                                  lengths, 0)
  jobs = scheduler.mode.encode_jobs(documents, admission)
  rounds.state = scheduler.cache.finish(rounds.state, admission)
  return [job.row_and_plan(engine.cache_config.page_size) for job in jobs]


def timed(call, repeats: int) -> list[float]:
  """Seconds of `repeats` calls of `call` (each waits), after one more."""
  call()
  times = []
  for _ in range(repeats):
    started = time.perf_counter()
    call()
    times.append(time.perf_counter() - started)
  return times


def print_host_profile(name: str, call, calls: int, top: int = 25):
  """cProfile of `calls` calls of `call`, to stderr: where the host's time
  goes (packing, dispatch, waiting for the device)."""
  import cProfile
  import io
  import pstats
  profile = cProfile.Profile()
  profile.enable()
  for _ in range(calls):
    call()
  profile.disable()
  text = io.StringIO()
  pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(top)
  print(f"== host profile: {name}, {calls} calls", file=sys.stderr)
  print(text.getvalue(), file=sys.stderr)


def main(argv=None):
  args = parse_args(argv)
  import jax
  from benchmarks.comm_profile import op_breakdown
  from lazyattn_jax.sampling import SamplingParams
  config, model, dtype = rag_serving.build_model(
      decode_step.serving_args(args, 1, "plain"))
  rng = np.random.default_rng(args.seed)
  requests = decode_step.random_requests(args, config.vocab_size, rng)
  random_tokens = lambda n: rng.integers(1, config.vocab_size, n).tolist()
  new_docs = ceil_div(max(args.token_list), args.doc_len)
  tokens_per_row = args.docs_per_request * args.doc_len + args.query_len
  max_new = 16 * args.batch
  pages = (args.batch * (ceil_div(tokens_per_row + max_new, args.page_size)
                         + 1) + new_docs * ceil_div(args.doc_len,
                                                    args.page_size))
  engine = rag_serving.make_engine(
      decode_step.serving_args(args, pages, "plain"), config, model, dtype,
      "lazy", pages)
  header = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"), model=args.model,
                batch=args.batch,
                command="python -m benchmarks.mixed_step " + " ".join(
                    argv if argv is not None else sys.argv[1:]))
  print(json.dumps(header), file=sys.stderr)
  rows = []
  try:
    sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0,
                              stop_token_ids=())
    decode_step.admit_all(engine, requests, sampling)
    riders = engine.scheduler.decoding()
    if len(riders) != args.batch:
      raise RuntimeError(f"{len(riders)} of {args.batch} rows decoding")
    runner, rounds = engine.runner, engine.rounds
    for tokens in args.token_list:
      pieces = admit_documents(
          engine, [random_tokens(args.doc_len)
                   for _ in range(tokens // args.doc_len)])
      rows_, plans = map(list, zip(*pieces))
      greedy = [SamplingParams()] * len(rows_)

      def prefill():
        rounds.state, fetch = runner.prefill_async(rounds.state, rows_,
                                                   plans, greedy)
        fetch()

      def prefill_dispatch():
        """Seconds until the prefill call returns, before its wait."""
        started = time.perf_counter()
        rounds.state, fetch = runner.prefill_async(rounds.state, rows_,
                                                   plans, greedy)
        seconds = time.perf_counter() - started
        fetch()
        return seconds

      def decode():
        rounds.state = runner.decode(rounds.state, riders, args.batch, 1)[0]

      def mixed():
        rounds.state = runner.mixed_step(rounds.state, riders, args.batch,
                                         rows_, plans, greedy,
                                         [False] * len(rows_))[0]

      def chained():
        run = runner.decode_riders(riders, args.batch)
        for _ in range(args.chain):
          rounds.state, _ = runner.mixed_step_async(
              rounds.state, run, rows_, plans, greedy, [False] * len(rows_))
        run.collect()

      row = dict(prefill_tokens=tokens, chain=args.chain)
      for name, call in (("prefill", prefill), ("decode", decode),
                         ("mixed", mixed), ("chained", chained)):
        row[f"{name}_s"] = float(np.median(timed(call, args.repeats)))
        if name == "chained":
          row["chained_s"] /= args.chain
        if args.host_profile:
          print_host_profile(name, call, args.host_profile)
        if args.profile_dir:
          directory = f"{args.profile_dir}/{name}_{tokens}"
          with jax.profiler.trace(directory, create_perfetto_trace=True):
            call()
          breakdown = op_breakdown(directory, top=10)
          row[f"{name}_busy_s"] = breakdown["busy_s"]
          row[f"{name}_top_kinds"] = [[n[:80], s, c] for n, s, c
                                      in breakdown["by_kind"]]
      prefill_dispatch()
      row["prefill_dispatch_s"] = float(np.median(
          [prefill_dispatch() for _ in range(args.repeats)]))
      row["mixed_over_parts"] = row["mixed_s"] / (row["prefill_s"] +
                                                   row["decode_s"])
      rows.append(row)
      print(f"{tokens} tokens: prefill {row['prefill_s'] * 1e3:.2f} ms, "
            f"(returns after {row['prefill_dispatch_s'] * 1e3:.2f} ms), "
            f"decode {row['decode_s'] * 1e3:.2f} ms, mixed "
            f"{row['mixed_s'] * 1e3:.2f} ms "
            f"({row['mixed_over_parts']:.2f}x the parts), chained "
            f"{row['chained_s'] * 1e3:.2f} ms a step", file=sys.stderr)
      if args.out:
        with open(args.out, "w") as f:
          json.dump(dict(header, runs=rows), f, indent=2)
  finally:
    engine.close()
  return rows


if __name__ == "__main__":
  main()
