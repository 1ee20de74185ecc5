"""benchmarks/serve_load.py end to end on the tiny model (CPU)."""

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.mark.slow
def test_load_run_accounts_for_every_page_and_checks_answers(tmp_path):
  from benchmarks import serve_load
  out = tmp_path / "load.json"
  code = serve_load.main([
      "--model", "tiny", "--api", "completions", "--num-requests", "80",
      "--rate", "200", "--num-docs", "40", "--check", "8", "--check-alone",
      "--warmup-requests", "8", "--seed", "1", "--out", str(out)])
  report = json.loads(out.read_text())
  assert code == 0
  assert report["accounting"]["free_plus_cached_equals_total"]
  assert report["accounting"]["live_document_references"] == 0
  assert report["http"]["http_5xx"] == 0
  check = report["check"]
  assert check["checked"] == 8
  assert check["mismatched"] == []
  assert check["alone_vs_batched_mismatched"] == []
  assert check["server_vs_alone_mismatched"] == []
  # A tenth misbehave on purpose: some get 400/404, none is a server error.
  kinds = {r.split("/")[0] for r in report["http"]["outcomes"]}
  assert "normal" in kinds and len(kinds) > 1
  # The client's records are in the report, and give its TTFT again.
  ok = [r for r in report["records"]
        if r["kind"] == "normal" and r["outcome"] == "ok"]
  assert len(ok) == report["http"]["requests"]
  import numpy as np
  assert report["http"]["ttft_s"]["p50"] == pytest.approx(
      np.percentile([r["ttft_s"] for r in ok], 50), rel=1e-12)
