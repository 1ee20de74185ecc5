"""benchmarks/decode_step on CPU: every variant times a full batch and
reports its floor; bad settings are refused."""

import json

import pytest

from benchmarks import decode_step

SMALL = ["--model", "tiny", "--batch", "3", "--doc-len", "24",
         "--docs-per-request", "2", "--query-len", "4", "--loops", "1",
         "--page-size", "8", "--decode-steps", "2", "--copy-mib", "4"]


@pytest.mark.slow
def test_variants_run_side_by_side(tmp_path):
  out = tmp_path / "step.json"
  rows = decode_step.main(SMALL + ["--variants", "triton,plain,unroll,merge,graphs",
                                   "--profile-dir", str(tmp_path / "prof"),
                                   "--out", str(out)])
  report = json.loads(out.read_text())
  assert [r["variant"] for r in report["runs"]] == ["triton", "plain",
                                                    "unroll", "merge",
                                                    "graphs"]
  assert report["copy_tb_s"] > 0 and report["weight_gb"] > 0
  # The floor divides by the faster of the copy's and the read's rates.
  assert report["floor_tb_s"] == max(report["copy_tb_s"],
                                     report["read_tb_s"])
  for row in rows:
    assert row["batch"] == 3 and row["step_s"] > 0
    # At least the three rows' prompts (2 x 24 + 4 tokens) of tiny's K/V.
    assert row["kv_gb_per_step"] * 1e9 >= 3 * 52 * row["kv_bytes_per_token"]
    assert row["step_over_floor"] == pytest.approx(
        row["step_s"] / row["floor_s"])
    assert row["top_kinds"] and row["busy_s_per_step"] > 0


def test_bandwidth_counts_a_copy_twice_and_a_read_once(monkeypatch):
  """A copy moves each byte twice (read, write), a reduction once: with
  every call taking the same time, the copy's rate is twice the read's."""
  import types
  clock = iter(range(10**6))
  # Only decode_step's clock: jax's own calls must not advance it.
  monkeypatch.setattr(decode_step, "time", types.SimpleNamespace(
      perf_counter=lambda: float(next(clock))))
  rates = decode_step.hbm_bandwidth(1)
  assert rates["copy"] == pytest.approx(2 * rates["read"])
  assert rates["read"] > 0


@pytest.mark.parametrize("argv,match", [
    (["--variants", "fast"], "--variants takes entries"),
    (["--batch", "0"], "must be >= 1"),
])
def test_bad_settings_are_refused(argv, match, capsys):
  with pytest.raises(SystemExit):
    decode_step.parse_args(argv)
  assert match in capsys.readouterr().err


def test_the_floor_counts_a_float8_pools_page_scales():
  """Before: K and V bytes only, 65,536 a token for the Llama-3-8B shape's
  float8 pool, where its pages also hold 4-byte scales per layer and KV
  head (65,664 a token at 16-token pages): float8 floors were 0.2% low."""
  from benchmarks.decode_step import kv_bytes_per_token
  from models.config import LlamaConfig
  config = LlamaConfig.llama3_8b()
  assert kv_bytes_per_token(config, 16, "bfloat16") == 131072
  assert kv_bytes_per_token(config, 16, "float8_e4m3fn") == 65536 + 128
  assert kv_bytes_per_token(config, 64, "float8_e4m3fn") == 65536 + 32
