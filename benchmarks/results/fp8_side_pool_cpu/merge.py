"""Merge rag_quality reports (same items) into one, for paired_quality.

  python merge.py OUT.json A.json B.json ...   (runs concatenated; a later
  file with the same label replaces nothing: labels must differ)
  With --concat OUT.json PART1.json PART2.json: the same labels in each part,
  items appended (questions 0-199 then 200-599), summary fields recomputed
  for accuracy / f1 / em / contained from predictions.
"""
import json
import sys

args = sys.argv[1:]
if args[0] == "--concat":
  out, parts = args[1], [json.load(open(p)) for p in args[2:]]
  base = parts[0]
  for run in base["runs"]:
    for part in parts[1:]:
      other = {r["label"]: r for r in part["runs"]}[run["label"]]
      run["predictions"] = run["predictions"] + other["predictions"]
    run["items"] = len(run["predictions"])
  base["concatenated_from"] = args[2:]
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
