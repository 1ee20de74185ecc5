"""CPU check of the serving benchmark (issue 5): properties of its JSON."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def report(tmp_path_factory):
  # --out in a directory that does not exist yet: the benchmark makes it
  # before any work (it once crashed after the first mode, losing the run).
  out = tmp_path_factory.mktemp("rag") / "new" / "rag.json"
  plots = out.parent / "plots"
  cmd = [sys.executable, "-m", "benchmarks.rag_serving", "--model", "tiny",
         "--num-docs", "12", "--docs-per-request", "3", "--doc-len", "20",
         "--query-len", "6", "--output-len", "3", "--num-requests", "10",
         "--concurrency", "4", "--max-batch", "4", "--page-size", "8",
         "--cache-fraction", "1.0", "--add-working-pages",
         "--modes", "lazy,block,prefix,full",
         "--sweep-cache-fractions", "1.0", "--out", str(out),
         "--plot-dir", str(plots), "--no-progress", "--per-request"]
  subprocess.run(cmd, check=True, timeout=900,
                 cwd=pathlib.Path(__file__).resolve().parents[1])
  return json.loads(out.read_text()), plots


def test_json_has_every_mode_and_field(report):
  data, _ = report
  runs = {r["mode"]: r for r in data["runs"]}
  assert set(runs) == {"lazy", "block", "prefix", "full"}
  for r in runs.values():
    for key in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
                "throughput_tok_s", "throughput_req_s", "doc_hit_rate",
                "prefill_tokens_computed", "kv_pages_written_for_cached_docs",
                "peak_pages_used"):
      assert key in r, key
    assert r["requests"] == 10
    assert 0 < r["ttft_p50_s"] <= r["ttft_p90_s"] <= r["ttft_p99_s"]
    assert r["compiles_during_measurement"] == 0
    # A request's first token needs at least its own query prefilled, and
    # waits for no more than everything the run prefilled.
    assert (0 < r["prefill_tokens_before_first_token_p50"]
            <= r["prefill_tokens_computed"])
  for key in ("device", "jax", "date", "command"):
    assert data[key]


def test_per_request_records_give_the_row_s_figures_again(report):
  """The published figures can be computed again from the records (before,
  none were kept), with numpy's default percentile."""
  np = pytest.importorskip("numpy")
  data, _ = report
  for row in data["runs"]:
    records = [r for r in row["per_request"]
               if r["finish_reason"] in ("stop", "length")]
    assert len(records) == row["requests"] == 10
    ttft = [r["ttft_s"] for r in records]
    for q in (50, 90, 99):
      assert row[f"ttft_p{q}_s"] == pytest.approx(np.percentile(ttft, q),
                                                  rel=1e-12)
    tpot = [r["decode_time_per_token_s"] for r in records
            if r["decode_time_per_token_s"] is not None]
    assert row["tpot_p50_s"] == pytest.approx(np.percentile(tpot, 50),
                                              rel=1e-12)
    tokens = sum(r["output_tokens"] for r in records)
    assert row["throughput_tok_s"] == pytest.approx(tokens / row["seconds"])
    hits = [h for r in records for h in r["doc_hits"]]
    assert row["doc_hit_rate"] == pytest.approx(np.mean(hits))


def test_reuse_properties(report):
  data, _ = report
  runs = {r["mode"]: r for r in data["runs"]}
  # With a cache that holds the whole corpus, lazy and block hit the same
  # documents, and both reuse more than exact-prefix caching can.
  assert runs["lazy"]["doc_hit_rate"] == runs["block"]["doc_hit_rate"]
  assert runs["lazy"]["doc_hit_rate"] > runs["prefix"]["doc_hit_rate"]
  assert runs["full"]["doc_hit_rate"] == 0
  assert runs["lazy"]["kv_pages_written_for_cached_docs"] == 0
  assert runs["block"]["kv_pages_written_for_cached_docs"] > 0
  # lazy computes the fewest prefill tokens (block, which caches the same
  # documents, ties with it; its extra work is the copies counted above).
  lazy = runs["lazy"]["prefill_tokens_computed"]
  assert lazy <= runs["block"]["prefill_tokens_computed"]
  assert lazy < runs["prefix"]["prefill_tokens_computed"]
  assert lazy < runs["full"]["prefill_tokens_computed"]
  assert runs["lazy"]["peak_pages_used"] < runs["block"]["peak_pages_used"]


def test_plot_written(report):
  _, plots = report
  assert (plots / "throughput_vs_cache.png").stat().st_size > 1000


def test_merge_later_rows_replace_earlier(tmp_path):
  from benchmarks.rag_serving import merge_rows
  head = dict(device="d", jax="j", date="t", model="m")
  first = tmp_path / "a.jsonl"
  second = tmp_path / "b.jsonl"
  first.write_text("\n".join(json.dumps(dict(head, **row)) for row in [
      dict(kind="rate", mode="lazy", rate=2.0, ttft_p50_s=4.5),
      dict(kind="rate", mode="block", rate=2.0, ttft_p50_s=0.25),
      dict(kind="cache", mode="lazy", cache_fraction=0.05, ttft_p50_s=8.0),
  ]) + "\n")
  second.write_text(json.dumps(dict(head, kind="rate", mode="lazy", rate=2.0,
                                    ttft_p50_s=0.3, date="later",
                                    command="run two")) + "\n")
  report = merge_rows([str(first), str(second)])
  rates = {r["mode"]: r["ttft_p50_s"] for r in report["sweeps"]["rate"]}
  assert rates == {"lazy": 0.3, "block": 0.25}
  assert [r["cache_fraction"] for r in report["sweeps"]["cache"]] == [0.05]
  assert report["runs"] == [] and report["device"] == "d"
  # The newest row's date (it was the oldest's), and the commands of the
  # rows kept, so a report merged from mixed runs says so.
  assert report["date"] == "later" and report["commands"] == ["run two"]


@pytest.mark.slow
def test_warm_cache_requests_measure_from_a_warm_cache(tmp_path):
  """--warm-cache-requests serves other requests of the same popularity
  first (full recompute has no cache and skips them): the measured trace
  then hits more documents than from an empty cache, and nothing compiles
  during measurement."""
  def run(extra):
    out = tmp_path / f"rag{len(extra)}.json"
    cmd = [sys.executable, "-m", "benchmarks.rag_serving", "--model", "tiny",
           "--num-docs", "40", "--docs-per-request", "3", "--doc-len", "16",
           "--query-len", "4", "--output-len", "2", "--num-requests", "8",
           "--concurrency", "4", "--max-batch", "4", "--page-size", "8",
           "--zipf", "1.2", "--cache-fraction", "1.0", "--add-working-pages",
           "--modes", "lazy", "--out", str(out), "--no-progress"] + extra
    subprocess.run(cmd, check=True, timeout=600,
                   cwd=pathlib.Path(__file__).resolve().parents[1])
    return {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
  cold = run([])["lazy"]
  both = run(["--warm-cache-requests", "24", "--modes", "lazy,full"])
  warm = both["lazy"]
  assert both["full"]["warm_cache_requests"] == 0  # no cache to warm
  assert cold["warm_cache_requests"] == 0
  assert warm["warm_cache_requests"] == 24
  assert warm["requests"] == cold["requests"] == 8
  assert warm["doc_hit_rate"] > cold["doc_hit_rate"]
  assert warm["prefill_tokens_computed"] < cold["prefill_tokens_computed"]
  assert warm["compiles_during_measurement"] == 0


def test_unwritable_out_path_is_refused_before_any_work(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("not a directory")
  cmd = [sys.executable, "-m", "benchmarks.rag_serving", "--model", "tiny",
         "--out", str(blocker / "x.json")]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 2
  assert "cannot create the output directory" in done.stderr
  assert "Traceback" not in done.stderr


@pytest.mark.slow
def test_quality_runs_measure_the_options_on_the_same_trace(tmp_path):
  """--quality-runs repeats lazy with answer-quality options: first-page
  recompute adds one page of tokens per document after the first of each
  request, and the shared pages are still never written for a hit."""
  runs = _serving_runs(
      tmp_path, "--num-docs", "12", "--docs-per-request", "3", "--doc-len",
      "20", "--query-len", "6", "--output-len", "2", "--num-requests", "6",
      "--concurrency", "3", "--max-batch", "4", "--page-size", "8",
      "--cache-fraction", "1.0", "--add-working-pages", "--modes",
      "lazy,full", "--quality-runs", "recompute,sink+recompute",
      "--sink-len", "4")
  assert list(runs) == ["lazy", "lazy + recompute", "lazy + sink+recompute",
                        "full"]
  base, recompute = runs["lazy"], runs["lazy + recompute"]
  assert base["doc_hit_rate"] == recompute["doc_hit_rate"]
  # 6 requests x 2 later documents x one 8-token page.
  assert (recompute["prefill_tokens_computed"] -
          base["prefill_tokens_computed"]) == 6 * 2 * 8
  for row in runs.values():
    assert row["kv_pages_written_for_cached_docs"] == 0


def test_unknown_quality_run_is_refused(tmp_path):
  cmd = [sys.executable, "-m", "benchmarks.rag_serving", "--model", "tiny",
         "--quality-runs", "recompute,chat"]
  done = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                        cwd=pathlib.Path(__file__).resolve().parents[1])
  assert done.returncode == 2
  assert "unknown --quality-runs ['chat']" in done.stderr


@pytest.mark.slow
def test_kv_dtypes_run_the_same_bytes_of_float8_pages(tmp_path):
  """--kv-dtypes float8_e4m3fn repeats each mode with a float8 pool of the
  same bytes: a float32 page's bytes hold four float8 pages less their
  scales, and the larger pool hits at least as often."""
  runs = _serving_runs(
      tmp_path, "--num-docs", "24", "--docs-per-request", "3", "--doc-len",
      "16", "--query-len", "4", "--output-len", "2", "--num-requests", "8",
      "--concurrency", "4", "--max-batch", "4", "--page-size", "8",
      "--zipf", "1.2", "--cache-fraction", "0.3", "--add-working-pages",
      "--modes", "lazy", "--kv-dtypes", "float8_e4m3fn")
  base, fp8 = runs["lazy"], runs["lazy [float8_e4m3fn pages]"]
  assert fp8["kv_dtype"] == "float8_e4m3fn"
  # tiny: 2 layers x 2 KV heads; a float32 page of 8 x 16 values is 512
  # bytes, a float8 one 128 bytes plus a 4-byte scale (K and V each).
  assert fp8["cache_pages"] == base["cache_pages"] * 512 // 132
  assert fp8["doc_hit_rate"] >= base["doc_hit_rate"]
  assert fp8["kv_pages_written_for_cached_docs"] == 0


RIDING_LOAD = ("--num-docs", "12", "--docs-per-request", "3", "--doc-len",
               "16", "--query-len", "4", "--output-len", "6",
               "--num-requests", "8", "--concurrency", "4", "--max-batch",
               "4", "--page-size", "8", "--cache-fraction", "1.0",
               "--add-working-pages", "--modes", "lazy")


@pytest.mark.slow
def test_decode_during_prefill_runs_beside_the_plain_run(tmp_path):
  """--decode-during-prefill-runs repeats each mode with running requests
  decoding inside the round's prefill calls: the same trace, documents and
  prefill work, every token generated.  --decode-during-prefill-only runs
  that alone, with the same result."""
  runs = _serving_runs(tmp_path, *RIDING_LOAD, "--decode-during-prefill-runs")
  base, riding = runs["lazy"], runs["lazy [decode during prefill]"]
  for key in ("doc_hit_rate", "prefill_tokens_computed", "requests"):
    assert riding[key] == base[key], key
  assert riding["kv_pages_written_for_cached_docs"] == 0
  (tmp_path / "only").mkdir()
  only = _serving_runs(tmp_path / "only", *RIDING_LOAD,
                       "--decode-during-prefill-only")
  assert list(only) == ["lazy [decode during prefill]"]
  for key in ("doc_hit_rate", "prefill_tokens_computed", "requests"):
    assert only["lazy [decode during prefill]"][key] == riding[key], key


@pytest.mark.slow
def test_profile_replay_reports_the_busiest_ops(tmp_path):
  """--profile-replay-dir replays each measured trace under the profiler
  and adds where the device time went to the row.  The replay starts from
  the cache the measured run started from, so it prefills the same work."""
  runs = _serving_runs(
      tmp_path, "--num-docs", "8", "--docs-per-request", "2", "--doc-len",
      "16", "--query-len", "4", "--output-len", "3", "--num-requests", "3",
      "--concurrency", "2", "--max-batch", "2", "--page-size", "8",
      "--cache-fraction", "1.0", "--add-working-pages", "--modes", "lazy",
      "--profile-replay-dir", str(tmp_path / "prof"))
  profile = runs["lazy"]["profile"]
  assert (profile["prefill_tokens_computed"]
          == runs["lazy"]["prefill_tokens_computed"])
  assert profile["wall_s"] > 0 and profile["busy_s"] > 0
  assert profile["top_kinds"] and profile["top_ops"]
  assert profile["idle_s"] > 0 and profile["idle_by_own_frame"]
  assert list((tmp_path / "prof" / "lazy").rglob("*.trace.json.gz"))


def _serving_runs(tmp_path, *args) -> dict:
  """rag_serving on the tiny model with `args`; its runs by mode label."""
  out = tmp_path / "rag.json"
  cmd = [sys.executable, "-m", "benchmarks.rag_serving", "--model", "tiny",
         *args, "--out", str(out), "--no-progress"]
  subprocess.run(cmd, check=True, timeout=600,
                 cwd=pathlib.Path(__file__).resolve().parents[1])
  return {r["mode"]: r for r in json.loads(out.read_text())["runs"]}


def test_failed_requests_are_counted_and_left_out_of_the_figures():
  # A failed request's ttft_s is 0: it pulled the TTFT percentiles down
  # and counted in requests/s and the hit rate, with no sign in the row.
  from types import SimpleNamespace as Result
  from benchmarks.rag_serving import summarize
  from lazyattn_jax.engine_stats import EngineStats
  ok = Result(finish_reason="length", ttft_s=2.0, decode_time_per_token_s=0.1,
              token_ids=[1, 2, 3], doc_hits=[True],
              prefill_tokens_before_first_token=5)
  failed = Result(finish_reason="error", ttft_s=0.0,
                  decode_time_per_token_s=0.0, token_ids=[], doc_hits=[False],
                  prefill_tokens_before_first_token=0)
  engine = Result(stats=EngineStats(), compile_count=0)
  row = summarize("lazy", engine, [ok, failed], 1.0, {})
  assert (row["requests"], row["failed"]) == (1, 1)
  assert row["ttft_p50_s"] == 2.0 and row["doc_hit_rate"] == 1.0
  assert row["throughput_tok_s"] == 3.0
  with pytest.raises(RuntimeError, match="all 1 requests failed"):
    summarize("lazy", engine, [failed], 1.0, {})
  # One-token answers have no TPOT: null, not 0.0 (which passed any bar).
  one = Result(finish_reason="length", ttft_s=1.0, decode_time_per_token_s=0.0,
               token_ids=[7], doc_hits=[], prefill_tokens_before_first_token=5)
  assert summarize("lazy", engine, [one], 1.0, {})["tpot_p50_s"] is None
