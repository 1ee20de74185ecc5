"""The pieces of `benchmarks.rag_quality`: runs, engines, the request loop,
the summary of a run and its plot.

A run is (mode, engine options, label).  Options are keyword settings by
name: a field of `CacheConfig` (e.g. eviction), of `SchedulerConfig` or
`RunnerConfig` (e.g. decode_steps, impl) goes to that config, and anything
else is passed to `LazyEngine(...)` as a keyword argument, so quality options
the engine grows (a document preamble, first-page recompute) need no change
here.  QualityOptions are given by field (preamble=, sink=, recompute=,
recompute_tokens=), never as quality=.  An option given twice in one --run
or among the --engine-options is refused; a label is text as written.
What a report records of its code and inputs is `benchmarks.provenance`.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import sys

from lazyattn_jax.quality import metrics

DEFAULT_MODES = "full,prefix,block,lazy"


@dataclasses.dataclass(frozen=True)
class Run:
  """One measured configuration: a mode, engine options and a label."""
  mode: str
  options: dict = dataclasses.field(default_factory=dict)
  label: str = ""


def parse_value(text: str):
  """A setting's value: JSON if it parses (1, 0.5, true, null, "x"), else the
  text itself (so impl=xla needs no quotes)."""
  try:
    return json.loads(text)
  except json.JSONDecodeError:
    return text


def parse_option(text: str) -> tuple[str, object]:
  """"key=value" -> (key, value); raises ValueError otherwise."""
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise ValueError(f"an engine option is KEY=VALUE, got {text!r}")
  return key.strip(), parse_value(value.strip())


def parse_run(spec: str, common: dict) -> Run:
  """"MODE[,KEY=VALUE...][,label=NAME]" -> Run; `common` options apply first
  (a run's own option replaces a common one of the same key).

  Values are JSON where they parse (`parse_value`); the label is text,
  kept as written (label=true is "true", label=1.10 is "1.10").  It
  defaults to the mode followed by the run's own options.  ValueError for
  an option given twice (which one counts would be a guess) or an empty
  label.
  """
  mode, *rest = [part.strip() for part in spec.split(",")]
  own, label = {}, None
  for part in rest:
    if not part:
      continue
    key, value = parse_option(part)
    if key in own or (key == "label" and label is not None):
      raise ValueError(f"--run {spec!r}: option {key!r} is given twice: "
                       f"give each option once")
    if key == "label":
      label = part.partition("=")[2].strip()
      if not label:
        raise ValueError(f"--run {spec!r}: label= is empty: give the run "
                         f"a name, or leave label= out for the default")
    else:
      own[key] = value
  if label is None:
    label = " ".join([mode] + [f"{k}={json.dumps(v)}" for k, v in own.items()])
  return Run(mode, {**common, **own}, label)


def parse_options(texts) -> dict:
  """The --engine-option settings as a dict; ValueError for a key given
  twice."""
  options = {}
  for text in texts:
    key, value = parse_option(text)
    if key in options:
      raise ValueError(f"--engine-option {key!r} is given twice: give each "
                       f"option once")
    options[key] = value
  return options


def runs_from_args(args) -> list[Run]:
  """--modes (one run per mode, with --engine-option) then each --run."""
  from lazyattn_jax.modes import MODES
  common = parse_options(args.engine_option)
  modes = args.modes
  if modes is None:
    modes = "" if args.run else DEFAULT_MODES
  suffix = f" {args.label}" if args.label else ""
  runs = [Run(m.strip(), dict(common), m.strip() + suffix)
          for m in modes.split(",") if m.strip()]
  runs += [parse_run(spec, common) for spec in args.run]
  for run in runs:
    if run.mode not in MODES:
      raise ValueError(f"mode must be one of {tuple(MODES)}, got {run.mode!r}")
    try:  # bad options fail before any work
      check_run(run, args.page_size, args.dtype)
    except (ValueError, TypeError) as err:
      kind = TypeError if isinstance(err, TypeError) else ValueError
      raise kind(f"run {run.label!r}: {err}") from None
  labels = [r.label for r in runs]
  if len(set(labels)) != len(labels):
    raise ValueError(f"run labels must differ, got {labels}")
  if not runs:
    raise ValueError("no runs: give --modes or --run")
  return runs


def check_model_name(name: str) -> None:
  """UnknownModelError unless `name` is a model name or path
  `load_model` would take.  The known names are not fetched here (that is
  `load_model`'s work, with its progress bar); a path is only looked at."""
  from lazyattn_jax.default_model import KNOWN_MODEL_NAMES, resolve_model_path
  if str(name).strip().lower() not in KNOWN_MODEL_NAMES:
    resolve_model_path(str(name))


def check_run(run: Run, page_size: int, compute_dtype: str = "float32"
              ) -> None:
  """What can be checked of a run before any model loads, so that a bad
  later run fails before the earlier ones spend their time: its options
  are taken by someone (`route_options`), each config takes its values,
  a pool dtype= serves the models' `compute_dtype` (--dtype), its mode
  takes its quality options, and its model= names a model.
  Raises ValueError (InvalidOptionError, UnknownModelError) or TypeError."""
  from lazyattn_jax.cache_config import CacheConfig, check_pool_dtype
  from lazyattn_jax.config import split_settings
  from lazyattn_jax.modes import check_quality
  cache, settings, extra = route_options(run.options)
  # The model's shape is not known yet: a one-page pool of one-wide layers
  # stands in for it, to check the values of the run's own fields.
  dataclasses.replace(CacheConfig(
      num_pages=1, page_size=page_size, num_layers=1, num_kv_heads=1,
      head_dim=1, dtype="float32", max_pages_per_doc=1), **cache)
  if "dtype" in cache:
    check_pool_dtype(cache["dtype"], compute_dtype, pool_name="dtype",
                     compute_name="--dtype")
  split_settings(None, None, settings)
  check_quality(run.mode, cache.get("page_size", page_size),
                extra.get("quality"))
  if run.options.get("model"):
    check_model_name(run.options["model"])


def route_options(options: dict) -> tuple[dict, dict, dict]:
  """(CacheConfig fields, Scheduler/RunnerConfig settings, LazyEngine
  keyword arguments) of a run's options; TypeError for an option nobody
  takes.  QualityOptions fields become one `quality=QualityOptions(...)`
  argument; `sink=PATH` reads a sink file (and implies preamble=sink)."""
  from lazyattn_jax.cache_config import CacheConfig
  from lazyattn_jax.config import RunnerConfig, SchedulerConfig
  from lazyattn_jax.engine import LazyEngine
  cache_fields = {f.name for f in dataclasses.fields(CacheConfig)}
  setting_fields = {f.name for c in (SchedulerConfig, RunnerConfig)
                    for f in dataclasses.fields(c)}
  from lazyattn_jax.quality_options import QualityOptions
  quality_fields = {f.name for f in dataclasses.fields(QualityOptions)}
  if "quality" in options:
    # LazyEngine's quality= takes a QualityOptions, which a run spec cannot
    # write; null would only say what a run without options does already
    # (rag_quality's engines have no default options), and beside fields
    # it would be overruled by them.  So no value of it means anything here.
    raise TypeError(
        "quality= is not a run option: a run has no quality options unless "
        "it gives them, by field: preamble=, sink=, recompute=, "
        "recompute_tokens= (QualityOptions)")
  if "mesh" in options:  # JSON writes no jax.sharding.Mesh
    raise TypeError("mesh= is not a run option: a run spec cannot write a "
                    "Mesh; give tensor_parallel=N")
  options = {k: v for k, v in options.items() if k != "model"}  # run_all's
  cache = {k: v for k, v in options.items() if k in cache_fields}
  settings = {k: v for k, v in options.items() if k in setting_fields}
  quality = {k: v for k, v in options.items() if k in quality_fields}
  extra = {k: v for k, v in options.items()
           if k not in cache and k not in settings and k not in quality}
  params = inspect.signature(LazyEngine.__init__).parameters
  takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
  fixed = {"self", "config", "model", "cache_config", "mode", "scheduler",
           "runner", "model_id", "tokenizer"}
  unknown = sorted(k for k in extra
                   if k in fixed or (not takes_any and k not in params))
  if unknown:
    raise TypeError(f"unknown engine options {unknown}: not a field of "
                    "CacheConfig, SchedulerConfig, RunnerConfig or "
                    "QualityOptions nor a keyword argument of LazyEngine")
  if quality:
    if isinstance(quality.get("sink"), str):  # a sink file's path
      from lazyattn_jax.cli_options import read_sink
      quality = dict(quality, sink=read_sink(quality["sink"]),
                     preamble=quality.get("preamble", "sink"))
    extra["quality"] = QualityOptions(**quality)
  return cache, settings, extra


def make_engine(loaded, run: Run, *, num_pages: int, page_size: int,
                dtype: str, max_batch: int, impl: str):
  """A LazyEngine for `run` on the loaded model (weights shared, compiled
  programs shared with the other runs' engines)."""
  from lazyattn_jax.config import split_settings
  from lazyattn_jax.engine import LazyEngine
  from lazyattn_jax.loading import default_cache_config
  cache, settings, extra = route_options(run.options)
  cache_config = dataclasses.replace(
      default_cache_config(loaded.config, dtype, num_pages, page_size,
                           run.mode), **cache)
  scheduler, runner = split_settings(
      None, None, {"max_batch": max_batch, "impl": impl, **settings})
  return LazyEngine(loaded.config, loaded.model, cache_config, mode=run.mode,
                    scheduler=scheduler, runner=runner,
                    model_id=loaded.model_id, tokenizer=loaded.tokenizer,
                    **extra)


def pages_for_batch(loaded, items, mode: str, *, page_size: int, batch: int,
                    max_new_tokens: int) -> int:
  """A pool that holds `batch` of the largest requests at once in `mode`.

  Counted as the mode itself counts admission (`ReuseMode.cache_needs`) on
  the real token lengths, plus one page per document and one per request of
  headroom for engine options that add private pages (a first-page
  recompute, a preamble).  A smaller pool still works: requests then wait
  for each other's pages.
  """
  needs = [pages + docs + 1 for pages, docs in request_pages(
      loaded, items, mode, page_size=page_size, max_new_tokens=max_new_tokens)]
  return max(1, sum(sorted(needs, reverse=True)[:batch]))


def request_pages(loaded, items, mode: str, *, page_size: int,
                  max_new_tokens: int) -> list[tuple[int, int]]:
  """(pages, documents) of each item's request in `mode` without engine
  options, as the engine counts its pages against the whole pool: a pool
  smaller than the largest of these can serve no run of `mode`."""
  from lazyattn_jax.modes import make_mode
  from lazyattn_jax.requests import (TokenRequest, encode_documents,
                                     encode_request)
  from lazyattn_jax.sampling import SamplingParams
  tokenizer, vocab = loaded.tokenizer, loaded.config.vocab_size
  reuse = make_mode(mode, page_size, loaded.model_id)
  sampling = SamplingParams(max_new_tokens=max_new_tokens)
  doc_ids, query_ids, needs = {}, {}, []
  for item in items:
    for text in item.documents:
      if text not in doc_ids:
        doc_ids[text] = encode_documents(tokenizer, [text], vocab)[0]
    if item.query not in query_ids:
      query_ids[item.query] = encode_request(tokenizer, item.query, [], vocab)
    query, leading_docs, leading = query_ids[item.query]
    request = TokenRequest(
        tuple(query), tuple(leading_docs) + tuple(doc_ids[t] for t in
                                                  item.documents),
        sampling, (), leading)
    needs.append((reuse.cache_needs(request).pages(page_size),
                  len(request.documents)))
  return needs


def generate_all(engine, items, sampling, batch: int, *, desc: str,
                 progress: bool):
  """Results of every item, in order, keeping `batch` requests in flight.

  Everything is validated before anything runs, so a bad item fails the
  run at once rather than after an hour.
  """
  from lazyattn_jax.progress import progress_bar_class
  tqdm = progress_bar_class()
  prepared = [engine.prepare(item.query, list(item.documents), sampling)
              for item in items]
  results = [None] * len(items)
  inflight = {}
  upcoming = iter(range(len(items)))

  def top_up():
    while len(inflight) < batch:
      i = next(upcoming, None)
      if i is None:
        return
      inflight[engine.submit_prepared(prepared[i])] = i

  with tqdm(total=len(items), desc=desc, unit="q", file=sys.stderr,
            disable=not progress) as bar:
    top_up()
    while inflight:
      for result in engine.step():
        engine.pop_result(result.request_id)
        results[inflight.pop(result.request_id)] = result
        bar.update(1)
      top_up()
  return results


def summarize_run(run: Run, items, results, seconds: float, *,
                  legacy_accuracy: bool, predictions: bool,
                  last_gold: bool) -> dict:
  """The JSON row of one run: overall, per gold position, per type (and
  per slot of the last supporting paragraph with `last_gold`)."""
  texts = [r.text or "" for r in results]
  scores = [metrics.score(t, item.answer) for t, item in zip(texts, items)]
  hits = [h for r in results for h in r.doc_hits]
  row = dict(label=run.label, mode=run.mode, options=run.options,
             items=len(items), questions=len({i.example_id for i in items}),
             errors=sum(r.finish_reason == "error" for r in results),
             **{k: v for k, v in metrics.summarize(scores).items() if k != "n"},
             by_gold_position=metrics.summarize_by(
                 scores, [i.position for i in items]),
             by_type=metrics.summarize_by(scores, [i.type for i in items]),
             doc_hit_rate=sum(hits) / len(hits) if hits else 0.0,
             seconds=seconds, seconds_per_item=seconds / max(1, len(items)))
  if last_gold:
    row["by_last_gold_position"] = metrics.summarize_by(
        scores, [i.gold_slots[-1] for i in items])
  if legacy_accuracy:  # the synthetic set's original criterion
    correct = [metrics.mentions_answer(t, i.answer)
               for i, t in zip(items, texts)]
    by_pos = {}
    for item, ok in zip(items, correct):
      by_pos.setdefault(item.position, []).append(ok)
    row.update(accuracy=sum(correct) / max(1, len(correct)),
               correct=sum(correct), accuracy_by_answer_position={
                   str(k): sum(v) / len(v) for k, v in sorted(by_pos.items())})
  if predictions:
    row["predictions"] = [
        dict(id=i.example_id, position=i.position, answer=i.answer, text=t)
        for i, t in zip(items, texts)]
  return row


class CompileClock:
  """Seconds JAX spent tracing, lowering and compiling while in the `with`
  block, and how many backend compiles, from `jax.monitoring` events (so a
  run's time splits into compiling and serving)."""

  _PREFIX = "/jax/core/compile/"
  _BACKEND = "/jax/core/compile/backend_compile_duration"

  def __init__(self):
    self.seconds = 0.0
    self.compiles = 0

  def _listen(self, event: str, duration: float, **_):
    if event.startswith(self._PREFIX):
      self.seconds += duration
      self.compiles += event == self._BACKEND

  def __enter__(self):
    import jax
    jax.monitoring.register_event_duration_secs_listener(self._listen)
    return self

  def __exit__(self, *exc):
    import jax
    jax.monitoring.unregister_event_duration_listener(self._listen)
    return False


METRIC_NAMES = {"f1": "F1", "em": "exact match",
                "contained": "answer contained"}


def plot_by_position(rows, path, *, metric: str, title: str, xlabel: str):
  """One line per run: `metric` against the gold position.  The x ticks say
  how many items each position holds when that differs between positions
  (the dataset layout)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, ax = plt.subplots(figsize=(7, 4.2))
  for row in rows:
    cells = row["by_gold_position"]
    xs = sorted(int(k) for k in cells)
    ax.plot(xs, [100 * cells[str(x)][metric] for x in xs], marker="o",
            label=f"{row['label']} ({100 * row[metric]:.1f})")
  cells = rows[0]["by_gold_position"]
  xs = sorted(int(k) for k in cells)
  counts = [cells[str(x)]["n"] for x in xs]
  ax.set_xticks(xs, [f"{x}\nn={n}" for x, n in zip(xs, counts)]
                if len(set(counts)) > 1 else [str(x) for x in xs])
  ax.set_ylim(bottom=0)
  ax.set_xlabel(xlabel)
  ax.set_ylabel(f"{METRIC_NAMES[metric]} (%, SQuAD/HotpotQA normalization)")
  ax.set_title(title, fontsize=10)
  ax.grid(alpha=0.3)
  ax.legend(title="run (overall)", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
