"""How many of a serving run's KV blocks the Mosaic GPU kernels copy whole.

A kernel step reads a block of 128 keys' logical pages (8 pages of 16
tokens).  Where the block's physical page ids are consecutive the producer
copies it in one TMA copy per K and V
(`MgpuBlockSizes.copy_contiguous_blocks`), else page by page.  Whether they
are depends on the request's layout (documents that do not fill whole
blocks share blocks), on the cache's allocator (`page_allocation.py`) and
on how fragmented the pool has become.

This drives one engine, in the one mode of `--modes`, through
rag_serving's trace (`run_trace`): first `--warm-cache-requests` requests,
then the measured `--num-requests`, on the same cache.  It reads the page
rows of every decode call's requests in the measured trace (each call is
`--decode-steps` steps) and prints the share of their blocks whose pages
are consecutive, and the share of cached documents whose pages are
consecutive at the end.  The layout depends on neither the device nor the
model's size, so the tiny model on a CPU measures the paper-like load.

Of rag_serving's options, those of the model, corpus, trace (--rate
included: both traces arrive at that rate), pool, scheduler and kernels
apply, and --out; there is no warm-up replay, no progress bar
(--no-progress changes nothing) and no plot, and only the base run: the
options of rag_serving's other runs and outputs (NOT_RUN_HERE:
--warmup-requests, --kv-dtypes, --quality-runs, --sink-len, sweeps,
decode-during-prefill runs, --skip-base, --merge, --plot-dir,
--profile-replay-dir) are refused, as is a pool too small for the mode's
largest request, before any work.

Example (the paper-like load's cache, 20% pool, on CPU, about a minute):
  python -m benchmarks.page_contiguity --model tiny --num-docs 2000 \\
      --doc-len 512 --docs-per-request 8 --query-len 64 --output-len 64 \\
      --concurrency 32 --max-batch 32 --num-requests 64 --decode-steps 16 \\
      --warm-cache-requests 192 --cache-fraction 0.2 --modes lazy
"""

from __future__ import annotations

import json
import sys

import numpy as np

from benchmarks import rag_serving, rag_serving_checks, rag_serving_cli
from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.testing import contiguous_block_count

# Keys per step of the default Mosaic GPU kernels (prefill's is the same).
KERNEL_BLOCK_KEYS = MgpuDecodeBlockSizes().block_kv
# Options of benchmarks.rag_serving this benchmark accepts but does not run.
NOT_RUN_HERE = ("warmup_requests", "kv_dtypes", "quality_runs", "sink_len",
                "sweep_rates", "sweep_cache_fractions",
                "decode_during_prefill_runs", "decode_during_prefill_only",
                "skip_base", "merge", "plot_dir", "profile_replay_dir")


class BlockTally:
  """Running counts of consecutive blocks over the rows it is shown."""

  def __init__(self, block_pages: int):
    self.block_pages = block_pages
    self.consecutive = 0
    self.blocks = 0

  def add_rows(self, rows):
    for row in rows:
      if len(row):
        merged, total = contiguous_block_count(
            np.asarray(row.table, np.int64)[None], self.block_pages)
        self.consecutive += merged
        self.blocks += total

  @property
  def share(self) -> float:
    return self.consecutive / max(self.blocks, 1)


def cached_documents_consecutive(state) -> tuple[int, int]:
  """(cached documents whose pages are consecutive, cached documents)."""
  valid = np.asarray(state.doc_valid)
  counts = np.asarray(state.doc_num_pages)[valid]
  pages = np.asarray(state.doc_pages)[valid]
  consecutive = sum(
      bool(np.all(np.diff(p[:n]) == 1)) for p, n in zip(pages, counts))
  return consecutive, int(valid.sum())


def count_decoded_rows(engine, tally: BlockTally):
  """Shows `tally` the rows of every decode call of this engine's runner
  (and of every run of decode riders), before it runs."""
  runner = engine.runner
  decode, decode_riders = runner.decode_async, runner.decode_riders

  def counted_decode(state, requests, *args, **kwargs):
    tally.add_rows(r.layout.row for r in requests)
    return decode(state, requests, *args, **kwargs)

  def counted_riders(requests, *args, **kwargs):
    tally.add_rows(r.layout.row for r in requests)
    return decode_riders(requests, *args, **kwargs)

  runner.decode_async, runner.decode_riders = counted_decode, counted_riders


def parse_args(argv=None):
  """rag_serving's options (rag_serving_cli.py), checked, less those this
  benchmark does not run (NOT_RUN_HERE), with one mode; a refused one is
  a one-line usage error (exit 2)."""
  args = rag_serving_cli.parse_args(argv, description=__doc__)
  error = rag_serving_checks.not_run_error(
      args, rag_serving_cli.parse_args([]), NOT_RUN_HERE,
      "benchmarks.page_contiguity")
  if not error and len(args.mode_list) != 1:
    error = f"--modes takes one mode here, got {args.modes!r}"
  if error:
    rag_serving_cli.usage_error(error, __doc__)
  return args


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  args = parse_args(argv)
  block_pages = max(1, KERNEL_BLOCK_KEYS // args.page_size)
  config, model, dtype = rag_serving.build_model(args)
  pages = args.cache_pages or rag_serving.cache_pages_for(
      args, args.cache_fraction)
  error = rag_serving_checks.pool_error(
      args, config.hidden_size,
      [(args.mode_list[0], "", pages, "--cache-fraction or --cache-pages")])
  if error:  # before the warm-cache trace spends its time
    rag_serving_cli.usage_error(error, __doc__)
  measured = rag_serving.make_trace(args, config.vocab_size,
                                    args.num_requests, args.seed + 2)
  warmer = rag_serving.make_trace(args, config.vocab_size,
                                  args.warm_cache_requests, args.seed + 3)
  engine = rag_serving.make_engine(args, config, model, dtype,
                                   args.mode_list[0], pages)
  try:
    rag_serving.run_trace(engine, warmer, args)
    tally = BlockTally(block_pages)
    count_decoded_rows(engine, tally)
    rag_serving.run_trace(engine, measured, args)
    docs = cached_documents_consecutive(engine.state)
  finally:
    engine.close()
  report = dict(
      mode=args.mode_list[0], cache_pages=pages, block_pages=block_pages,
      warm_cache_requests=args.warm_cache_requests,
      measured_requests=args.num_requests,
      blocks_seen=tally.blocks, consecutive_blocks=tally.consecutive,
      consecutive_block_share=round(tally.share, 4),
      cached_documents=docs[1], consecutive_documents=docs[0],
      command="python -m benchmarks.page_contiguity " + " ".join(argv))
  print(json.dumps(report, indent=1))
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
