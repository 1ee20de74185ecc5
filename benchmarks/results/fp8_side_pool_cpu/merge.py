"""Merge rag_quality reports (same items) into one, for paired_quality.

  python merge.py OUT.json A.json B.json ...   (runs concatenated; a later
  file with the same label replaces nothing: labels must differ)
  With --concat OUT.json PART1.json PART2.json: the same labels in each part,
  items appended (questions 0-199 then 200-599), summary fields recomputed
  from the predictions (`resummarize`); the fields predictions cannot give
  (per type, doc hits, times) are kept per part under "parts".
  With --resummarize FILE.json: the same recomputation in place, for a
  file concatenated before it was done (its "parts" then hold only the
  first part's fields, which is all such a file still has).
"""
import json
import sys

from lazyattn_jax.quality import metrics

PER_PART = ("by_type", "doc_hit_rate", "seconds", "seconds_per_item",
            "compiles", "compile_seconds", "errors")


def resummarize(run, parts):
  """Recomputes `run`'s summary from its predictions; `parts` are the
  per-part rows whose other fields it keeps."""
  preds = run["predictions"]
  scores = [metrics.score(p["text"], p["answer"]) for p in preds]
  summary = metrics.summarize(scores)
  run.update(items=len(preds), questions=len({p["id"] for p in preds}),
             em=summary["em"], f1=summary["f1"],
             contained=summary["contained"],
             by_gold_position=metrics.summarize_by(
                 scores, [p["position"] for p in preds]))
  if "accuracy" in run:  # the synthetic set's original criterion
    correct = [metrics.mentions_answer(p["text"], p["answer"]) for p in preds]
    by_pos = {}
    for p, ok in zip(preds, correct):
      by_pos.setdefault(p["position"], []).append(ok)
    run.update(accuracy=sum(correct) / len(correct), correct=sum(correct),
               accuracy_by_answer_position={
                   str(k): sum(v) / len(v) for k, v in sorted(by_pos.items())})
  run["parts"] = [{k: part[k] for k in PER_PART if k in part}
                  for part in parts]
  for k in PER_PART:
    run.pop(k, None)


args = sys.argv[1:]
if args[0] == "--concat":
  out, parts = args[1], [json.load(open(p)) for p in args[2:]]
  base = parts[0]
  for run in base["runs"]:
    rows = [dict(run)]
    for part in parts[1:]:
      other = {r["label"]: r for r in part["runs"]}[run["label"]]
      run["predictions"] = run["predictions"] + other["predictions"]
      rows.append(other)
    resummarize(run, rows)
  base["concatenated_from"] = args[2:]
  json.dump(base, open(out, "w"), indent=1)
elif args[0] == "--resummarize":
  out = args[1]
  base = json.load(open(out))
  for run in base["runs"]:
    resummarize(run, [dict(run)])
  json.dump(base, open(out, "w"), indent=1)
else:
  out, reports = args[0], [json.load(open(p)) for p in args[1:]]
  base = reports[0]
  for r in reports[1:]:
    base["runs"] += r["runs"]
  labels = [r["label"] for r in base["runs"]]
  assert len(set(labels)) == len(labels), labels
  base["merged_from"] = args[1:]
  json.dump(base, open(out, "w"), indent=1)
print(out, [(r["label"], len(r["predictions"])) for r in base["runs"]])
