"""How many answers differ word for word between runs of a merged report."""
import json, sys
rep = json.load(open(sys.argv[1]))
runs = {r["label"]: r["predictions"] for r in rep["runs"]}
for cfg in ("lazy + sink", "lazy + sink + recompute"):
  got = {v: runs.get(f"{v} {cfg}") for v in "ABC"}
  if any(x is None for x in got.values()):
    continue
  n = len(got["A"])
  d = lambda x, y: sum(a["text"] != b["text"] for a, b in zip(got[x], got[y]))
  print(f"{cfg} ({n} items): texts differ A/B {d('A','B')}, A/C {d('A','C')}, B/C {d('B','C')}; "
        f"C equals A where A!=B: {sum(a['text']!=b['text'] and c['text']==a['text'] for a,b,c in zip(got['A'],got['B'],got['C']))}, "
        f"C equals B where A!=B: {sum(a['text']!=b['text'] and c['text']==b['text'] for a,b,c in zip(got['A'],got['B'],got['C']))}")
