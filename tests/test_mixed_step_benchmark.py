"""benchmarks/mixed_step on CPU: each size times the prefill, the decode
step, the mixed step alone and chained, with device busy times from a
trace; bad settings are refused."""

import json

import pytest

from benchmarks import mixed_step

SMALL = ["--model", "tiny", "--batch", "2", "--doc-len", "16",
         "--docs-per-request", "2", "--query-len", "4", "--page-size", "8",
         "--repeats", "1", "--chain", "2"]


@pytest.mark.slow
def test_each_size_times_the_step_and_its_parts(tmp_path):
  out = tmp_path / "mixed.json"
  rows = mixed_step.main(SMALL + ["--prefill-tokens", "16,32",
                                  "--profile-dir", str(tmp_path / "prof"),
                                  "--out", str(out)])
  report = json.loads(out.read_text())
  assert [r["prefill_tokens"] for r in report["runs"]] == [16, 32]
  for row in rows:
    for kind in ("prefill", "decode", "mixed", "chained"):
      assert row[f"{kind}_s"] > 0 and row[f"{kind}_busy_s"] > 0
      assert row[f"{kind}_top_kinds"]
    assert 0 < row["prefill_dispatch_s"]
    assert row["mixed_over_parts"] == pytest.approx(
        row["mixed_s"] / (row["prefill_s"] + row["decode_s"]))


@pytest.mark.parametrize("argv,match", [
    (["--prefill-tokens", "256,x"], "--prefill-tokens takes integers"),
    (["--prefill-tokens", "100"], "at least --doc-len"),
    (["--repeats", "0"], "must be >= 1"),
])
def test_bad_settings_are_refused(argv, match, capsys):
  with pytest.raises(SystemExit):
    mixed_step.parse_args(argv)
  assert match in capsys.readouterr().err
