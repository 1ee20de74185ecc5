"""`python -m lazyattn_jax.training.sink`: the sink trainer's command
line (options, checks made before anything loads, the output files)."""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

from lazyattn_jax.loading import DEFAULT_PAGE_SIZE
from lazyattn_jax.training import parallel, report
from lazyattn_jax.training.cli_errors import out_of_memory_hint
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.interrupt import stop_on_interrupt
from lazyattn_jax.training.optim import OptimizerConfig
from lazyattn_jax.training.sink import (INITS, OUTPUT_FILES, SinkConfig,
                                        train_sink)
from lazyattn_jax.training.sink_file import save_sink


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(
      prog="python -m lazyattn_jax.training.sink",
      description="Train a learned document sink (P vectors every document "
                  "is encoded after) by distillation from the frozen model's "
                  "full attention.  Writes OUT/sink.safetensors, "
                  "OUT/sink_loss.png and OUT/sink_log.json.")
  from lazyattn_jax.training.cli_options import add_shared_options
  add_shared_options(p, steps=300, batch_size=8, lr=3e-3, warmup_steps=20)
  p.add_argument("--out", required=True, help="output directory")
  p.add_argument("--preamble-len", type=int, default=16,
                 help="P, the number of sink vectors (default 16)")
  p.add_argument("--init", choices=INITS, default="chat",
                 help="initial vectors: the chat prefix's first P token "
                      "embeddings, or a generic text's (default chat)")
  p.add_argument("--eval-batches", type=int, default=4)
  p.add_argument("--float8-pages", action="store_true",
                 help="train and score the sink on its keys and values as "
                      "a float8 pool returns them, for engines with "
                      "kv_dtype float8_e4m3fn")
  p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                 help="the serving pool's tokens per page, which groups "
                      "the preamble's float8 scales (default "
                      f"{DEFAULT_PAGE_SIZE}, the engine's)")
  return p


def run(args) -> dict:
  """Runs the command line's training; returns its summary."""
  from lazyattn_jax.training.data import (load_source,
                                          resolve_docs_per_question)
  from lazyattn_jax.training.model_io import check_dtype, load_trainable
  check_dtype(args.dtype)
  # The count the source uses, as the log records it (None for hotpotqa,
  # which refuses a value).
  args.docs_per_question = resolve_docs_per_question(
      args.data, args.docs_per_question)
  # As `lazyattn finetune`: no time at all is a mistake, not a request for
  # the untrained initial sink.
  if args.max_minutes is not None and not args.max_minutes > 0:
    raise TrainingInputError("--max-minutes must be > 0")
  if not args.max_len > 0:
    raise TrainingInputError(f"--max-len must be > 0, got {args.max_len}")
  parallel.check_device_count(args.devices, "--devices")
  config = SinkConfig(
      preamble_len=args.preamble_len, steps=args.steps,
      batch_size=args.batch_size, seed=args.seed, init=args.init,
      remat=args.remat, max_len=args.max_len,
      eval_batches=args.eval_batches, devices=args.devices,
      float8_pages=args.float8_pages, page_size=args.page_size,
      optimizer=OptimizerConfig(learning_rate=args.lr,
                                warmup_steps=args.warmup_steps,
                                clip_norm=args.clip_norm))
  # Made and checked before loading anything: the results are written
  # only after training, and a bad --out must not cost a finished run.
  report.prepare_output_dir(args.out, files=OUTPUT_FILES)
  source = load_source(args.data, seed=args.seed + 1,
                       docs_per_question=args.docs_per_question)
  model = load_trainable(args.model, args.dtype, progress=not args.no_progress)
  started = time.time()
  with out_of_memory_hint(args), stop_on_interrupt("sink") as interrupted:
    result = train_sink(model, source, config, max_minutes=args.max_minutes,
                        should_stop=interrupted,
                        progress=not args.no_progress)
  seconds = time.time() - started
  with report.output_errors(args.out):
    path = _write_outputs(args, config, model, result, seconds)
  times = [r["step_s"] for r in result.history.rows[1:]]
  summary = dict(sink=path, seconds=round(seconds, 1),
                 median_step_s=round(float(np.median(times)), 4) if times
                 else None, **result.eval_kl)
  if interrupted():
    summary["interrupted_at_step"] = len(result.history.rows)
  print(summary)
  return summary


def _write_outputs(args, config, model, result, seconds) -> str:
  """Writes OUTPUT_FILES under args.out; returns the sink file's path."""
  metadata = dict(model=args.model, model_id=model.model_id,
                  model_sha256=model.sha256,
                  steps=len(result.history.rows),
                  init=config.init, data=args.data, dtype=args.dtype,
                  float8_pages=str(config.float8_pages).lower(),
                  **({"page_size": config.page_size} if config.float8_pages
                     else {}),
                  date=time.strftime("%Y-%m-%d"),
                  **{f"eval_kl_{k}": f"{v:.6g}"
                     for k, v in result.eval_kl.items()})
  path = save_sink(os.path.join(args.out, "sink.safetensors"), result.sink,
                   metadata)
  report.plot_losses(result.history, os.path.join(args.out, "sink_loss.png"),
                     f"sink P={config.preamble_len} on {args.data}",
                     keys=("kl",))
  report.write_log(os.path.join(args.out, "sink_log.json"), vars(args),
                   result.history, metadata=metadata, eval_kl=result.eval_kl,
                   eval_indices=result.eval_indices,
                   train_size=result.train_size,
                   seconds=seconds, devices=[str(d) for d in jax.devices()],
                   peak_memory_bytes=parallel.peak_memory_bytes(
                       parallel.data_mesh(args.devices)))
  return path


def main(argv=None) -> int:
  from lazyattn_jax.cli import EXIT_INTERRUPTED
  from lazyattn_jax.training.cli_errors import USER_ERRORS, first_line
  args = build_parser().parse_args(argv)
  try:
    summary = run(args)
  except USER_ERRORS as e:
    print(f"sink: error: {first_line(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:  # a second Ctrl-C, or one before training
    print("sink: interrupted", file=sys.stderr)
    return EXIT_INTERRUPTED
  return EXIT_INTERRUPTED if "interrupted_at_step" in summary else 0
