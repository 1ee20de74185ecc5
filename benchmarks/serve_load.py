"""Load and soak test of `lazyattn serve`: open-loop Poisson traffic over
HTTP with Zipf document popularity, against a pool small enough that
documents are evicted all the time.

One run, one process for the server and the engine (the client runs in a
child process):
  1. the engine compiles on a replay of the trace's first requests;
  2. the trace goes through the server over HTTP; a share of it misbehaves
     on purpose (`--bad-fraction`: bad fields, unknown document ids, streams
     dropped mid-way, clients that give up while queued);
  3. every page is accounted for: free plus cached equals the pool, and no
     document has a reader;
  4. a sample of answers is checked token for token against the same
     requests run directly through the engine, on an empty cache, in
     `--check-mode` (the server's mode by default: a stock model answers
     differently in "full" mode by design, since lazy documents do not
     attend to each other);
  5. with `--direct`, the same trace's well-formed requests run directly
     through the engine (`submit` at the same arrival times, `step` in a
     loop), and both throughputs are printed.  The direct run serves
     neither the bad requests nor those whose clients leave, whose work
     the HTTP run still does until they go: under load, compare the two
     with `--bad-fraction 0`.

Examples:
  python -m benchmarks.serve_load --model tiny-text --num-requests 500
  python -m benchmarks.serve_load --model llama3-8b-shape --api completions \\
      --num-docs 2000 --doc-len 512 --docs-per-request 8 --query-len 64 \\
      --output-len 64 --max-batch 32 --decode-steps 8 --rate 8 \\
      --num-requests 1000 --cache-fraction 0.2 --group-tokens 4096 \\
      --bad-fraction 0 --direct
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys
import time

import numpy as np

from benchmarks import rag_serving_checks
from benchmarks.serve_load_client import EXPECTED_STATUS, KINDS, run_in_child

UNKNOWN_ID = "doc-" + "0" * 24


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="tiny-text",
                 choices=["tiny-text", "tiny", "smollm2", "llama3-8b-shape"],
                 help="tiny-text: the tiny random model with SmolLM2's "
                      "tokenizer (text requests); the others as in "
                      "benchmarks.rag_serving")
  p.add_argument("--api", default="mixed",
                 choices=["chat", "completions", "mixed"],
                 help="chat: text queries and documents; completions: token "
                      "ids; mixed: alternate (chat needs a tokenizer)")
  p.add_argument("--mode", default="lazy")
  p.add_argument("--num-requests", type=int, default=1000)
  p.add_argument("--rate", type=float, default=20.0,
                 help="Poisson arrivals per second")
  p.add_argument("--num-docs", type=int, default=200)
  p.add_argument("--docs-per-request", type=int, default=3)
  p.add_argument("--doc-len", type=int, default=48, help="tokens")
  p.add_argument("--query-len", type=int, default=8)
  p.add_argument("--output-len", type=int, default=8)
  p.add_argument("--zipf", type=float, default=1.1)
  p.add_argument("--cache-fraction", type=float, default=0.25,
                 help="pool pages as a share of the corpus's pages")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--max-batch", type=int, default=8)
  p.add_argument("--decode-steps", type=int, default=4)
  p.add_argument("--max-prefill-tokens", type=int, default=16384)
  p.add_argument("--group-tokens", type=int, default=0)
  p.add_argument("--eviction", choices=("lfu", "lru"), default="lfu")
  p.add_argument("--impl", default="auto")
  p.add_argument("--max-queue", type=int, default=1024)
  p.add_argument("--max-connections", type=int, default=512)
  p.add_argument("--no-stream", action="store_true",
                 help="normal requests do not stream (then TTFT is not "
                      "measured over HTTP)")
  p.add_argument("--bad-fraction", type=float, default=0.1,
                 help="share of requests that misbehave on purpose")
  p.add_argument("--check", type=int, default=50,
                 help="answers checked token for token against the engine")
  p.add_argument("--check-mode", default="",
                 help="mode of the engine the answers are checked against "
                      "(default: --mode)")
  p.add_argument("--check-alone", action="store_true",
                 help="also rerun each checked request alone (batch of one), "
                      "to tell batch-composition numerics from server faults")
  p.add_argument("--direct", action="store_true",
                 help="also run the trace directly through the engine")
  p.add_argument("--warmup-requests", type=int, default=64)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--out", default="", help="JSON report path")
  args = p.parse_args(argv)
  if not 0.0 <= args.bad_fraction < 1.0:  # 1.0 leaves no good request
    p.error(f"--bad-fraction must be in [0, 1), got {args.bad_fraction}")
  if not (args.rate > 0 and math.isfinite(args.rate)):
    p.error(f"--rate must be finite and > 0 (Poisson arrivals per second), "
            f"got {args.rate}")
  error = rag_serving_checks.number_error(
      args, ("num_requests", "num_docs", "docs_per_request", "doc_len",
             "query_len", "output_len", "page_size", "max_batch",
             "decode_steps", "max_prefill_tokens", "max_queue",
             "max_connections"),
      ("zipf", "group_tokens", "check", "warmup_requests"))
  if error:
    p.error(error)
  from lazyattn_jax.modes import MODES
  if args.mode not in MODES or (args.check_mode and
                                args.check_mode not in MODES):
    p.error(f"--mode and --check-mode must be among {tuple(MODES)}, got "
            f"{args.mode!r}, {args.check_mode!r}")
  error = rag_serving_checks.out_path_error(args.out)
  if error:
    p.error(error)
  # Settings benchmarks.rag_serving's engine builder reads.
  args.prefill_tokens_per_step = 0
  args.pool_as_bits = False
  args.decode_unroll = False
  args.kv_dtype = ""  # the pool in the compute dtype
  return args


def build(args):
  """(engine, tokenizer or None, make_engine(mode) for another engine on the
  same model)."""
  from benchmarks import rag_serving
  from lazyattn_jax.default_model import default_gguf_path
  from models.tokenizer import LlamaTokenizer
  from pallas_kernels.sizes import ceil_div
  tokenizer = None
  if args.model == "tiny-text":
    import dataclasses
    from flax import nnx
    from models.config import LlamaConfig
    from models.llama import Llama
    tokenizer = LlamaTokenizer.from_gguf(default_gguf_path())
    config = dataclasses.replace(LlamaConfig.tiny(
        vocab_size=tokenizer.vocab_size), max_position=4096)
    model, dtype = Llama(config, rngs=nnx.Rngs(args.seed)), "float32"
  else:
    config, model, dtype = rag_serving.build_model(args)
    if args.model == "smollm2":
      tokenizer = LlamaTokenizer.from_gguf(default_gguf_path())
  if args.api != "completions" and tokenizer is None:
    raise SystemExit(f"--api {args.api} needs a tokenizer; --model "
                     f"{args.model} has none: use --api completions")
  corpus_pages = args.num_docs * ceil_div(args.doc_len, args.page_size)
  pages = max(1, round(args.cache_fraction * corpus_pages))
  engine_args = argparse.Namespace(**vars(args))
  if args.api != "completions":  # text re-tokenizes to somewhat more tokens
    engine_args.doc_len = 2 * args.doc_len
  def make_engine(mode):
    return rag_serving.make_engine(engine_args, config, model, dtype, mode,
                                   pages, tokenizer=tokenizer)
  return make_engine(args.mode), tokenizer, make_engine


def make_requests(args, engine, tokenizer):
  """The trace: per request its HTTP body, its kind, its arrival and what
  the engine is given for the same request (query, documents)."""
  from benchmarks.rag_serving import make_trace
  trace = make_trace(args, engine.config.vocab_size, args.num_requests,
                     args.seed + 1)
  rng = np.random.default_rng(args.seed + 2)

  def text(tokens):
    return tokenizer.decode(tokens).strip() or "empty"
  corpus_text = ([text(d) for d in trace.corpus] if tokenizer is not None
                 else None)
  requests = []
  for i, (query, docs) in enumerate(trace.requests):
    chat = args.api == "chat" or (args.api == "mixed" and i % 2 == 0)
    if chat:
      q, documents = text(query), [corpus_text[d] for d in docs]
      body = {"messages": [{"role": "user", "content": q}],
              "documents": documents}
    else:
      q, documents = list(query), [list(trace.corpus[d]) for d in docs]
      body = {"prompt": q, "documents": [{"token_ids": d} for d in documents]}
    kind = "normal"
    if rng.random() < args.bad_fraction:
      kind = KINDS[1 + int(rng.integers(len(KINDS) - 1))]
    body.update(model=engine.model_id, max_tokens=args.output_len,
                temperature=0, return_token_ids=True,
                stream=kind == "disconnect_stream" or (
                    kind == "normal" and not args.no_stream))
    if kind.startswith("disconnect"):  # long answers the client leaves
      body["max_tokens"] = 4 * args.output_len
    if kind == "bad_field":
      body["temperature"] = -1
    elif kind == "unknown_id":
      body["documents"] = body["documents"][:-1] + [{"id": UNKNOWN_ID}]
    requests.append({"index": i, "kind": kind, "arrival": float(
        trace.arrivals[i]), "body": body, "query": q, "documents": documents,
        "path": "/v1/chat/completions" if chat else "/v1/completions"})
  return requests


def warm_up(engine, requests, count: int):
  """Compiles on replays of the first requests, arriving as in the trace (a
  server sees small, uneven rounds, whose shapes a batch replay would not
  compile), until a replay compiles nothing (at most three); then empties
  the cache."""
  for _ in range(3 if count else 0):
    before = engine.compile_count
    direct_run(engine, requests[:count])
    if engine.compile_count == before:
      break
  engine.reset_cache()


def sampling(engine, request):
  from lazyattn_jax.sampling import SamplingParams
  return SamplingParams(max_new_tokens=request["body"]["max_tokens"],
                        temperature=0.0)


def http_run(args, engine, requests) -> dict:
  """The trace through the server; returns the client's records, the time
  and the page accounting after it."""
  from lazyattn_jax.server import ServerConfig, create_app
  from lazyattn_jax.server.background import BackgroundServer
  app = create_app(engine, ServerConfig(model_name=engine.model_id,
                                        max_queue=args.max_queue))
  with BackgroundServer(app) as server:
    out = run_in_child(server.url, requests, args.max_connections, args.seed)
    loop = app.state.engine_loop
    deadline = time.monotonic() + 120
    while loop.call(lambda e: e.has_work()).result() and (
        time.monotonic() < deadline):
      time.sleep(0.05)
    out["accounting"] = loop.call(page_accounting).result()
    out["metrics"] = app.state.metrics.render().decode()
  return out


def page_accounting(engine) -> dict:
  """Free plus cached pages equal the pool; each cached page is held once
  (by the table) and no document or request holds a reference."""
  state = engine.state
  stats = engine.cache.stats(state)
  refcount = np.asarray(state.page_refcount)
  valid = np.asarray(state.doc_valid)
  doc_pages = np.asarray(state.doc_pages)[valid]
  held = np.zeros_like(refcount)
  np.add.at(held, doc_pages[doc_pages >= 0], 1)
  return dict(
      stats, num_pages=engine.cache_config.num_pages,
      in_flight=engine.has_work(),
      free_plus_cached_equals_total=(
          stats["free_pages"] + stats["cached_doc_pages"] ==
          engine.cache_config.num_pages),
      refcounts_equal_table=bool((refcount == held).all()),
      live_document_references=int(np.asarray(state.doc_users).sum()))


def check_answers(args, engine, make_engine, requests, records) -> dict:
  """Answers of a random sample of finished normal requests against the same
  requests run directly through an engine in --check-mode, cache emptied."""
  from lazyattn_jax.engine import Request
  ok = [r for r in records if r["kind"] == "normal" and r["outcome"] == "ok"]
  rng = np.random.default_rng(args.seed + 3)
  sample = [ok[i] for i in sorted(rng.choice(len(ok), min(args.check,
                                                          len(ok)),
                                             replace=False))]
  mode = args.check_mode or args.mode
  checker = engine if mode == engine.mode else make_engine(mode)
  checker.reset_cache()
  results = checker.generate_batch([
      Request(requests[r["index"]]["query"], requests[r["index"]]["documents"],
              sampling(engine, requests[r["index"]])) for r in sample])
  mismatched = [r["index"] for r, want in zip(sample, results)
                if r["tokens"] != want.token_ids]
  report = {"checked": len(sample), "mode": mode, "mismatched": mismatched}
  if args.check_alone:
    # Alone: the same engine and cache state as the batched rerun, but other
    # batch shapes.  If these differ from the batched rerun as often as the
    # server's answers do, the differences are numerics, not the server.
    alone = []
    for r in sample:
      checker.reset_cache()
      request = requests[r["index"]]
      alone.append(checker.generate_batch([Request(
          request["query"], request["documents"],
          sampling(engine, request))])[0].token_ids)
    report["alone_vs_batched_mismatched"] = [
        r["index"] for r, a, b in zip(sample, alone, results)
        if a != b.token_ids]
    report["server_vs_alone_mismatched"] = [
        r["index"] for r, a in zip(sample, alone) if r["tokens"] != a]
  return report


def direct_run(engine, requests) -> dict:
  """The normal requests of the trace submitted at their arrival times
  straight to the engine."""
  normal = [r for r in requests if r["kind"] == "normal"]
  engine.reset_cache()
  results, start = [], time.perf_counter()
  pending = collections.deque(normal)
  while pending or engine.has_work():
    now = time.perf_counter() - start
    while pending and pending[0]["arrival"] <= now:
      r = pending.popleft()
      engine.submit(r["query"], r["documents"], sampling(engine, r),
                    arrival_time=start + r["arrival"])
    if not engine.has_work():
      time.sleep(max(0.0, pending[0]["arrival"] - now))
      continue
    for result in engine.step():
      results.append(engine.pop_result(result.request_id) or result)
  seconds = time.perf_counter() - start
  return summary([r.ttft_s for r in results],
                 [r.decode_time_per_token_s for r in results
                  if len(r.token_ids) > 1],
                 sum(len(r.token_ids) for r in results), len(results), seconds,
                 collections.Counter(r.finish_reason for r in results))


def percentiles(values) -> dict:
  """p50, p90 and p99 of the values that are not None: numpy's default
  (linear interpolation between the two nearest), as rag_serving's."""
  values = np.asarray([v for v in values if v is not None], np.float64)
  if not values.size:
    return {}
  return {f"p{q}": float(np.percentile(values, q)) for q in (50, 90, 99)}


def summary(ttft, tpot, tokens, requests, seconds, outcomes) -> dict:
  return {"requests": requests, "seconds": seconds,
          "throughput_tok_s": tokens / seconds,
          "throughput_req_s": requests / seconds,
          "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot),
          "outcomes": dict(outcomes)}


def http_summary(out) -> dict:
  records = out["records"]
  ok = [r for r in records if r["kind"] == "normal" and r["outcome"] == "ok"]
  tpot = [(r["latency_s"] - r["ttft_s"]) / (len(r["tokens"]) - 1)
          for r in ok if r["ttft_s"] is not None and len(r["tokens"]) > 1]
  result = summary([r["ttft_s"] for r in ok], tpot,
                   sum(len(r["tokens"]) for r in ok), len(ok),
                   out["seconds"], collections.Counter(
                       (r["kind"], r["outcome"]) for r in records))
  result["outcomes"] = {f"{k}/{o}": n for (k, o), n in
                        sorted(result["outcomes"].items())}
  result["http_5xx"] = sum(r["status"] >= 500 for r in records)
  result["unexpected"] = [r["index"] for r in records if not _as_expected(r)]
  return result


def finish_reasons(metrics_text: str) -> dict:
  """Requests the server ended, by finish reason, from its /metrics."""
  reasons = {}
  for line in metrics_text.splitlines():
    if line.startswith('lazyattn_requests_total{finish_reason="'):
      reason = line.split('"')[1]
      reasons[reason] = int(float(line.rsplit(" ", 1)[1]))
  return reasons


def _as_expected(record) -> bool:
  kind, outcome = record["kind"], record["outcome"]
  if kind in EXPECTED_STATUS:
    return outcome == f"http_{EXPECTED_STATUS[kind]}"
  if kind.startswith("disconnect"):
    return outcome in ("disconnected", "ok")  # it may finish first
  return outcome == "ok"


def main(argv=None) -> int:
  args = parse_args(argv)
  import jax
  engine, tokenizer, make_engine = build(args)
  requests = make_requests(args, engine, tokenizer)
  print(f"{len(requests)} requests at {args.rate}/s; pool of "
        f"{engine.cache_config.num_pages} pages ({args.cache_fraction:.0%} of "
        f"the corpus); {args.mode} mode; jax {jax.__version__} on "
        f"{jax.devices()[0].device_kind}", file=sys.stderr)
  warm_up(engine, requests, args.warmup_requests)
  out = http_run(args, engine, requests)
  report = {"args": {k: v for k, v in vars(args).items()},
            "http": http_summary(out), "accounting": out["accounting"],
            "server_finish_reasons": finish_reasons(out["metrics"])}
  report["check"] = check_answers(args, engine, make_engine, requests,
                                  out["records"])
  if args.direct:
    warm_up(engine, requests, args.warmup_requests)
    report["direct"] = direct_run(engine, requests)
    direct = report["direct"]["throughput_tok_s"]
    report["http_vs_direct_throughput"] = (  # None: no good request ran
        report["http"]["throughput_tok_s"] / direct if direct else None)
  print(json.dumps(report, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      # The client's records, from which the http figures can be computed
      # again.
      json.dump(dict(report, metrics=out["metrics"], records=out["records"]),
                f, indent=1)
  accounting, check = report["accounting"], report["check"]
  passed = (accounting["free_plus_cached_equals_total"] and
            accounting["refcounts_equal_table"] and
            not accounting["live_document_references"] and
            not accounting["in_flight"] and not report["http"]["http_5xx"] and
            not report["http"]["unexpected"] and not check["mismatched"])
  print("PASS" if passed else "FAIL", file=sys.stderr)
  return 0 if passed else 1


if __name__ == "__main__":
  sys.exit(main())
