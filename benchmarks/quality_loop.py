"""The run loop of `benchmarks.rag_quality`: every run's engine built and
checked before the first run starts, then the runs one after another, and a
failed run's error carrying the rows of the runs before it for the report.
The pieces a run is made of (options, engines, the request loop, the
summary) are in `benchmarks.quality_runs`.
"""

from __future__ import annotations

import json
import time

from benchmarks.quality_runs import (CompileClock, Run, generate_all,
                                     make_engine, summarize_run)


class RunFailedError(Exception):
  """A run failed: `rows` are the JSON rows of the runs that finished before
  it, for the report; the message is one line naming the run."""

  def __init__(self, label: str, error: BaseException, rows: list):
    first = (str(error).splitlines() or [""])[0]
    super().__init__(f"run {label!r} failed after {len(rows)} finished "
                     f"run(s): {type(error).__name__}: {first}")
    self.rows = rows


def check_vocabularies(loaded, runs, models: dict) -> None:
  """ValueError for a run whose model (`models[name]` of its `model`
  option, loaded before the first run starts) takes other tokens than
  `loaded`: the pool is sized from `loaded`'s tokens."""
  for run in runs:
    model = run_model(run, loaded, models)
    if model.config.vocab_size != loaded.config.vocab_size:
      raise ValueError(
          f"run {run.label!r}: model {run.options['model']} has a vocabulary "
          f"of {model.config.vocab_size} tokens, --model's has "
          f"{loaded.config.vocab_size}")


def run_model(run: Run, loaded, models: dict):
  """The loaded model `run` runs on: its `model` option's, else --model's."""
  name = run.options.get("model")
  return models[str(name)] if name else loaded


def check_engines(loaded, models: dict, runs, items, args,
                  pages_for_mode) -> None:
  """Builds every run's engine and prepares every item on it (validation
  only), then closes it, before the first run starts: what only the engine
  checks (a mode refusing an option, a pool dtype the model cannot compute
  with, a request that its pool cannot hold once the run's options add
  pages) then fails at once instead of after the earlier runs.  Building
  costs a pool allocation and preparing the tokenizing, not a compile.
  Raises ValueError naming the run."""
  from lazyattn_jax.errors import LazyAttnError
  sampling = _sampling(args)
  for run in runs:
    pages = pages_for_mode(run.mode)
    engine = make_engine(run_model(run, loaded, models), run,
                         num_pages=pages, page_size=args.page_size,
                         dtype=args.dtype, max_batch=args.batch,
                         impl=args.impl)
    try:
      for i, item in enumerate(items):
        engine.prepare(item.query, list(item.documents), sampling)
    except LazyAttnError as err:
      pool = (f"--num-pages {pages} is too small for it"
              if args.num_pages else f"its pool of {pages} pages")
      raise ValueError(f"run {run.label!r}, question {i}: {err} ({pool})"
                       ) from err
    finally:
      engine.close()


def _sampling(args):
  """Greedy decoding of at most --max-new-tokens, as every run uses."""
  from lazyattn_jax.sampling import SamplingParams
  return SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)


def run_all(loaded, runs, items, args, pages_for_mode, models: dict):
  """Every run over the same items; returns the JSON rows.  A run with a
  `model` option runs on `models[name]` (loaded in args.dtype; a
  fine-tuned copy of `loaded`, say: `check_vocabularies`) instead of
  `loaded`.  A run that fails raises RunFailedError holding the rows of
  the runs before it, so that their results can still be reported."""
  sampling = _sampling(args)
  rows = []
  for run in runs:
    try:
      rows.append(_one_run(run_model(run, loaded, models), run, items, args,
                           pages_for_mode, sampling))
    except Exception as err:
      raise RunFailedError(run.label, err, rows) from err
    row = {k: v for k, v in rows[-1].items() if k != "predictions"}
    print(json.dumps(row), flush=True)
  return rows


def _one_run(model, run: Run, items, args, pages_for_mode, sampling) -> dict:
  """The JSON row of `run` on `model`."""
  engine = make_engine(model, run, num_pages=pages_for_mode(run.mode),
                       page_size=args.page_size, dtype=args.dtype,
                       max_batch=args.batch, impl=args.impl)
  try:
    with CompileClock() as clock:
      t0 = time.perf_counter()
      results = generate_all(engine, items, sampling, args.batch,
                             desc=run.label, progress=args.progress)
      seconds = time.perf_counter() - t0
  finally:
    engine.close()  # frees its pool before the next run allocates one
  row = summarize_run(run, items, results, seconds,
                      legacy_accuracy=args.dataset == "synthetic",
                      predictions=args.save_predictions,
                      last_gold=args.dataset == "hotpotqa"
                      and args.layout == "dataset")
  row.update(compiles=clock.compiles, compile_seconds=round(clock.seconds, 2))
  return row
