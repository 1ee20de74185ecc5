"""Reports of the RAG serving benchmark (rag_serving.py): rows of several
runs merged into one report, the summary table, and the sweep plots."""

from __future__ import annotations

import json
import os
import sys


def merge_rows(paths) -> dict:
  """One report from .partial.jsonl rows of several runs (see --merge)."""
  rows = {}
  header = None
  for path in paths:
    with open(path) as f:
      for line in f:
        row = json.loads(line)
        key = (row["kind"], row["mode"], row.get("rate"),
               row.get("cache_fraction"))
        rows[key] = row
        # The newest row's machine and date (they were the oldest's).
        header = {k: row[k] for k in ("device", "jax", "date", "model")}
  if header is None:
    raise SystemExit(f"no rows in {paths}")
  # Every command the kept rows came from: a file appended to by several
  # runs may mix settings, which the report then shows.
  header["commands"] = list(dict.fromkeys(
      r.get("command") for r in rows.values() if r.get("command")))
  by_kind = {"base": [], "rate": [], "cache": []}
  for row in rows.values():
    by_kind[row["kind"]].append(row)
  return dict(header, merged_from=list(paths), runs=by_kind["base"],
              sweeps=dict(rate=by_kind["rate"], cache=by_kind["cache"]))


def print_table(runs, file=sys.stdout):
  cols = ["mode", "ttft_p50_s", "ttft_p90_s", "tpot_p50_s", "throughput_tok_s",
          "decode_tok_s", "throughput_req_s",
          "doc_hit_rate", "prefill_tokens_computed",
          "kv_pages_written_for_cached_docs", "peak_pages_used"]
  print(" | ".join(cols), file=file)
  for r in runs:
    print(" | ".join(f"{r[c]:.4g}" if isinstance(r[c], float) else str(r[c])
                     for c in cols), file=file)


def plot(report, plot_dir):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  os.makedirs(plot_dir, exist_ok=True)
  title = f"{report['model']} on {report['device']} (jax {report['jax']}, {report['date']})"
  rate_rows, cache_rows = report["sweeps"]["rate"], report["sweeps"]["cache"]
  if rate_rows:
    _line_plot(plt, rate_rows, lambda r: r["rate"], "ttft_p50_s",
               "arrival rate (requests/s)", "TTFT p50 (s)", title,
               os.path.join(plot_dir, "ttft_vs_rate.png"), log_y=True)
  if cache_rows:
    _line_plot(plt, cache_rows, lambda r: 100 * r["cache_fraction"],
               "throughput_tok_s", "document cache budget (% of corpus)",
               "throughput (generated tokens/s)", title,
               os.path.join(plot_dir, "throughput_vs_cache.png"))


def _line_plot(plt, rows, x_of, y_key, x_label, y_label, title, path,
               log_y=False):
  """One line per mode of rows[y_key] against x_of(row), saved as a PNG."""
  fig, ax = plt.subplots(figsize=(6, 4))
  for mode in sorted({r["mode"] for r in rows}):
    line = sorted((r for r in rows if r["mode"] == mode), key=x_of)
    ax.plot([x_of(r) for r in line], [r[y_key] for r in line], marker="o",
            label=mode)
  ax.set_xlabel(x_label)
  ax.set_ylabel(y_label)
  if log_y:
    ax.set_yscale("log")
  ax.set_title(title, fontsize=8)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
