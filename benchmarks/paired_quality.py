"""Is a quality difference between two runs more than noise?

Reads a `benchmarks.rag_quality` report written with `--save-predictions`
(every run answered the same items, in the same order) and compares runs
item by item:
- the mean of the metric in each run and their difference, with a 95%
  paired bootstrap interval (items resampled together in both runs; where
  several items share a question, as in the gold-sweep layout, whole
  questions are resampled, since their items are not independent);
- for a yes/no metric (contained, accuracy, EM): the items only one run
  got right, and the exact two-sided sign test on them (McNemar's exact
  test): the chance of a split at least this uneven if neither run were
  better.

  python -m benchmarks.paired_quality REPORT.json \\
      --compare "lazy + sink" "lazy + sink fp8 pages" --metric accuracy

Several reports (e.g. the held-out HotpotQA questions and `--split
excluded`) pool: a label's runs are joined across them in the order given,
and an item (question id and position) may appear in only one of them.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

from lazyattn_jax.quality import metrics

METRICS = ("contained", "accuracy", "em", "f1")


def item_scores(run: dict, metric: str) -> np.ndarray:
  """Per-item values of `metric` from a run's saved predictions.
  accuracy: the synthetic set's criterion (`metrics.mentions_answer`)."""
  if "predictions" not in run:
    raise ValueError(f"run {run['label']!r} has no predictions (run "
                     "rag_quality with --save-predictions)")
  out = []
  for p in run["predictions"]:
    if metric == "accuracy":
      out.append(float(metrics.mentions_answer(p["text"], p["answer"])))
    else:
      out.append(float(getattr(metrics.score(p["text"], p["answer"]),
                               metric)))
  return np.asarray(out)


# What names an item in a run's saved predictions, and so must be the same
# in both runs item by item: the question's id and gold position (written by
# rag_quality), its gold answer(s), and its question text where a report
# stores it.  A field is compared where either run's item has it.
PAIRING_FIELDS = (("id", "question"), ("position", "position"),
                  ("answer", "gold answer"), ("answers", "gold answers"),
                  ("question", "question text"), ("query", "query text"))
_ABSENT = object()


def pairing_error(run_a: dict, run_b: dict) -> str | None:
  """Why two runs' predictions cannot be compared item by item, as one
  line, or None: a run without predictions, none at all, different counts,
  an item without its text or gold answer, or the first item where the two
  runs differ in a `PAIRING_FIELDS` field (the question's id, its position
  in a gold sweep, its gold answer(s), its question text): then they did
  not answer the same items in the same order."""
  for run in (run_a, run_b):
    if "predictions" not in run:
      return (f"run {run['label']!r} has no predictions (run rag_quality "
              f"with --save-predictions)")
    if not run["predictions"]:
      return f"run {run['label']!r} has no items in its predictions"
  a, b = run_a["predictions"], run_b["predictions"]
  if len(a) != len(b):
    return (f"runs {run_a['label']!r} and {run_b['label']!r} answered "
            f"{len(a)} and {len(b)} items: not the same items")
  for i, (pa, pb) in enumerate(zip(a, b)):
    for run, p in ((run_a, pa), (run_b, pb)):
      missing = ([k for k in ("text", "answer") if k not in p]
                 if isinstance(p, dict) else ["fields"])
      if missing:
        return (f"item {i} of run {run['label']!r} has no "
                f"{' or '.join(missing)}: not a saved prediction")
    for key, name in PAIRING_FIELDS:
      va, vb = pa.get(key, _ABSENT), pb.get(key, _ABSENT)
      if va != vb:
        show = lambda v: "none" if v is _ABSENT else repr(v)
        return (f"item {i} differs: run {run_a['label']!r} has {name} "
                f"{show(va)}{_where(pa, key)}, run {run_b['label']!r} has "
                f"{show(vb)}{_where(pb, key)}: not the same items")
  return None


def _where(p: dict, key: str) -> str:
  """The question an item's differing field belongs to, for the message
  (the original " (position N)" after an id)."""
  if key == "id":
    return f" (position {p.get('position')})"
  if key != "position" and "id" in p:
    return f" (question {p['id']!r})"
  return ""


def sign_test_p(wins_a: int, wins_b: int) -> float:
  """Exact two-sided sign test of a split of discordant items:
  min(1, 2 P(X <= min(wins_a, wins_b))), X ~ Binomial(n, 1/2), as
  scipy.stats.binomtest(wins_a, n).pvalue.  The tail is summed in Python
  integers and divided by 2^n once (correctly rounded), so any n works
  (a float 2.0 ** n overflows past n = 1023)."""
  n = wins_a + wins_b
  if n == 0:
    return 1.0
  term = tail = 1  # C(n, 0)
  for k in range(min(wins_a, wins_b)):
    term = term * (n - k) // (k + 1)  # C(n, k + 1), exact
    tail += term
  return min(1.0, (2 * tail) / (1 << n))


def compare(a: np.ndarray, b: np.ndarray, *, questions=None,
            resamples: int = 10000, seed: int = 0) -> dict:
  """Paired comparison of per-item scores a and b (same items).

  `questions`: each item's question id; where some question has several
  items the bootstrap resamples questions (a cluster bootstrap: the mean
  difference over the drawn questions' items), else items, with the same
  draws as without ids.  The sign test counts items either way."""
  if a.shape != b.shape or a.ndim != 1 or not a.size:
    raise ValueError(f"need two equal, non-empty score lists, got "
                     f"{a.shape} and {b.shape}")
  rng = np.random.default_rng(seed)
  group = (np.arange(a.size) if questions is None else
           np.unique(np.asarray([str(q) for q in questions]),
                     return_inverse=True)[1].reshape(-1))
  groups = int(group.max()) + 1
  if groups == a.size:
    picks = rng.integers(0, a.size, size=(resamples, a.size))
    diffs = (b[picks] - a[picks]).mean(axis=1)
  else:
    diff_sums = np.bincount(group, weights=b - a, minlength=groups)
    sizes = np.bincount(group, minlength=groups)
    picks = rng.integers(0, groups, size=(resamples, groups))
    diffs = diff_sums[picks].sum(axis=1) / sizes[picks].sum(axis=1)
  low, high = np.percentile(diffs, [2.5, 97.5])
  row = dict(items=int(a.size), mean_a=float(a.mean()), mean_b=float(b.mean()),
             diff=float(b.mean() - a.mean()), diff_ci95=[float(low),
                                                         float(high)],
             resampled="items" if groups == a.size else "questions")
  if groups != a.size:
    row["questions"] = groups
  if set(np.unique(np.concatenate([a, b]))) <= {0.0, 1.0}:
    only_a = int(np.sum((a == 1) & (b == 0)))
    only_b = int(np.sum((a == 0) & (b == 1)))
    row.update(only_a=only_a, only_b=only_b,
               sign_test_p=sign_test_p(only_a, only_b))
  return row


# Report fields that say what the items are: reports that differ in one
# hold different kinds of items and are not pooled.
ITEM_KIND_FIELDS = ("dataset", "layout", "sweep_docs")
# A run's settings: pooled where they differ, with a warning naming them.
RUN_SETTING_FIELDS = ("mode", "options")


def load_report(path: str) -> dict:
  """A rag_quality report: ValueError, one line, for a file that is
  missing, not JSON, or without labelled runs."""
  try:
    with open(path) as f:
      report = json.load(f)
  except OSError as err:
    raise ValueError(f"{path}: {err.strerror or err}") from err
  except (json.JSONDecodeError, UnicodeDecodeError) as err:
    raise ValueError(f"{path} is not a JSON report ({err})") from err
  runs = report.get("runs") if isinstance(report, dict) else None
  if not isinstance(runs, list) or not all(
      isinstance(r, dict) and "label" in r for r in runs):
    raise ValueError(f"{path} is not a rag_quality report (no list of "
                     "labelled runs)")
  return report


def pooled_runs(reports: list[tuple[str, dict]], warn=None
                ) -> dict[str, dict]:
  """Each label's runs joined across (name, report) pairs: a run of its
  label and its predictions, in the order given (no other field: a pooled
  run has no one mode, score or time).  A label is kept only where every
  report has it.  `warn(line)` hears of settings (model, mode, options)
  that differ between the reports' runs.

  ValueError: reports of different kinds of items (dataset, layout), a
  synthetic report among several (its item ids are numbers per report),
  a run with predictions in one report and not in another, or an item
  (id, position) in two reports (or one report given twice), which
  pooling would count twice."""
  names = [name for name, _ in reports]
  if len(reports) > 1:
    _check_poolable(reports, warn)
  by_label = [{r["label"]: r for r in report["runs"]} for _, report in reports]
  pooled = {}
  for label in by_label[0]:
    if not all(label in runs for runs in by_label):
      continue
    parts = [runs[label] for runs in by_label]
    run = dict(label=label)
    has = ["predictions" in part for part in parts]
    if all(has):
      run["predictions"] = [p for part in parts for p in part["predictions"]]
      if len(parts) > 1:
        _refuse_repeats(label, names, parts)
    elif any(has):
      raise ValueError(f"run {label!r} has no predictions in "
                       f"{names[has.index(False)]} (run rag_quality with "
                       "--save-predictions)")
    if len(parts) > 1 and warn is not None:
      for field in RUN_SETTING_FIELDS:
        values = [part.get(field) for part in parts]
        if any(v != values[0] for v in values):
          warn(f"run {label!r} pooled with different {field}: " + "; ".join(
              f"{name}: {value!r}" for name, value in zip(names, values)))
    pooled[label] = run
  return pooled


def _check_poolable(reports, warn):
  for field in ITEM_KIND_FIELDS:
    values = [report.get(field) for _, report in reports]
    if any(v != values[0] for v in values):
      raise ValueError(f"the reports differ in {field} (" + ", ".join(
          f"{name}: {value!r}" for (name, _), value in zip(reports, values))
          + "): not items of one kind")
  if any(report.get("dataset") == "synthetic" for _, report in reports):
    raise ValueError("synthetic reports do not pool: their items are "
                     "numbered afresh in each report, so one id names "
                     "different questions")
  models = [report.get("model") for _, report in reports]
  if warn is not None and any(m != models[0] for m in models):
    warn("pooling reports of different models: " + "; ".join(
        f"{name}: {m!r}" for (name, _), m in zip(reports, models)))


def _refuse_repeats(label, names, parts):
  seen = {}
  for index, (name, part) in enumerate(zip(names, parts)):
    for p in part["predictions"]:
      if not isinstance(p, dict) or p.get("id") is None:
        continue
      key = (p["id"], p.get("position"))
      if seen.setdefault(key, index) != index:
        first = names[seen[key]]
        where = (f"both {first} and {name}" if first != name else
                 f"{name}, given twice")
        raise ValueError(f"question {key[0]!r} (position {key[1]}) of run "
                         f"{label!r} is in {where}: pooling would count it "
                         "twice")


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("report", nargs="+",
                 help="one rag_quality report, or several to pool")
  p.add_argument("--compare", nargs=2, action="append", required=True,
                 metavar=("LABEL_A", "LABEL_B"))
  p.add_argument("--metric", choices=METRICS, default="contained")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  warn = lambda line: print(f"{p.prog}: warning: {line}", file=sys.stderr)
  try:
    reports = [(path, load_report(path)) for path in args.report]
    runs = pooled_runs(reports, warn)
  except ValueError as err:
    p.error(str(err))
  rows = []
  for label_a, label_b in args.compare:
    missing = [x for x in (label_a, label_b) if x not in runs]
    if missing:
      lacking = [name for name, report in reports
                 if missing[0] not in {r["label"] for r in report["runs"]}]
      where = f" in {', '.join(lacking)}" if len(reports) > 1 else ""
      p.error(f"no run labelled {missing[0]!r}{where}; runs: {sorted(runs)}")
    error = pairing_error(runs[label_a], runs[label_b])
    if error:
      p.error(error)
    ids = [p.get("id") for p in runs[label_a]["predictions"]]
    row = compare(item_scores(runs[label_a], args.metric),
                  item_scores(runs[label_b], args.metric),
                  questions=None if None in ids else ids)
    rows.append(dict(a=label_a, b=label_b, metric=args.metric, **row))
    extra = ("" if "only_a" not in row else
             f"; only A {row['only_a']}, only B {row['only_b']}, "
             f"sign test p {row['sign_test_p']:.3f}")
    print(f"{label_b} - {label_a}: {row['diff']:+.3f} "
          f"[{row['diff_ci95'][0]:+.3f}, {row['diff_ci95'][1]:+.3f}] "
          f"({args.metric}, {row['items']} items{extra})")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(report=args.report[0] if len(args.report) == 1
                     else args.report, comparisons=rows), f, indent=2)
  return rows


if __name__ == "__main__":
  main(sys.argv[1:])
