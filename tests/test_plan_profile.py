"""benchmarks/plan_profile.py on CPU at small shapes: both plans are
profiled and their ops listed; bad shapes are refused."""

from __future__ import annotations

import pytest

from benchmarks.plan_profile import main


# CI time: the benchmark's own run; the plans themselves are tested in
# test_mgpu_plan_records and test_lazy_attention_plan.
@pytest.mark.slow
def test_every_plan_is_profiled(tmp_path, capsys):
  rows = main(["--trace-dir", str(tmp_path), "--top", "3",
               "--decode-batch", "2", "--context", "1024",
               "--prefill-batch", "1", "--chunk", "64"])
  assert [r["name"] for r in rows] == ["decode_B2_ctx1024_segments",
                                       "decode_B2_ctx1024_blocks",
                                       "decode_B2_ctx1024_blocks_rope",
                                       "decode_B2_ctx1024_fields",
                                       "prefill_B1_chunk64"]
  for row in rows:
    assert row["device_us"] > 0 and row["ops_per_call"] >= 1
    assert 1 <= len(row["top_ops"]) <= 3
  assert "decode_B2_ctx1024_fields:" in capsys.readouterr().out


def test_bad_shapes_are_refused(capsys):
  with pytest.raises(SystemExit) as exit_info:
    main(["--context", "1000"])
  assert exit_info.value.code == 2
  assert "multiple of 512" in capsys.readouterr().err
