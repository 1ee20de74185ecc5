"""Bad option values of the smaller benchmark command lines (mixed_step,
decode_step, serve_load, rag_quality, ape_probe): a one-line usage error
(exit 2) when the options are parsed, before any work, never a traceback
or a silently changed value."""

from __future__ import annotations

import pytest

from benchmarks import (ape_probe, decode_step, mixed_step, rag_quality,
                        serve_load)
from tests.usage_errors import assert_refused


MIXED = ["--model", "tiny", "--doc-len", "16", "--batch", "2"]


def test_mixed_step_refuses_partial_documents(capsys):
  assert_refused(capsys, mixed_step.parse_args, MIXED + ["--prefill-tokens", "40,24"],
           "--prefill-tokens entries must be multiples of --doc-len 16 "
           "(whole documents), got 40")
  args = mixed_step.parse_args(MIXED + ["--prefill-tokens", "32,48"])
  assert args.token_list == [32, 48]


@pytest.mark.parametrize("parse", [decode_step.parse_args,
                                   mixed_step.parse_args])
@pytest.mark.parametrize("argv, message", [
    (["--impl", "bogus"], "--impl must be one of ('auto', 'xla', 'gpu', "
                          "'tpu'), got 'bogus'"),
    (["--kv-dtype", "float8"], "--kv-dtype must be among"),
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    # The engine takes a pool in the model's compute dtype or float8 only:
    # these were accepted, then the run crashed after its first mode.
    (["--model", "tiny", "--kv-dtype", "bfloat16"], "--kv-dtype bfloat16 "
     "does not match --model tiny's compute dtype: give float32 or "
     "float8_e4m3fn"),
    # The report was opened after the run: a bad path lost every row.
    (["--out", "/proc/no/r.json"], "cannot create the output directory"),
])
def test_kernel_and_pool_options_are_checked_when_parsed(capsys, parse, argv,
                                                         message):
  """As rag_serving checks them (rag_serving_checks.kernel_error), before
  the model is built, not when the run's settings are."""
  assert_refused(capsys, parse, MIXED + argv, message)


@pytest.mark.parametrize("parse", [decode_step.parse_args,
                                   mixed_step.parse_args])
def test_good_kernel_and_pool_options_pass(parse):
  args = parse(MIXED + ["--impl", "xla", "--kv-dtype", "float8_e4m3fn"])
  assert (args.impl, args.kv_dtype) == ("xla", "float8_e4m3fn")


def test_mixed_step_refuses_empty_documents_in_one_line(capsys):
  """--doc-len 0 was a ZeroDivisionError of the --prefill-tokens checks."""
  assert_refused(capsys, mixed_step.parse_args, ["--doc-len", "0"],
           "sizes and counts must be >= 1")


def test_decode_step_refuses_no_copy(capsys):
  assert_refused(capsys, decode_step.parse_args, ["--copy-mib", "0"],
           "--copy-mib must be >= 1, got 0")


@pytest.mark.parametrize("argv, message", [
    (["--bad-fraction", "1.0"], "--bad-fraction must be in [0, 1), got 1.0"),
    (["--bad-fraction", "-0.1"], "--bad-fraction must be in [0, 1)"),
    (["--rate", "0"], "--rate must be finite and > 0"),
    (["--rate", "-3"], "--rate must be finite and > 0"),
    # Each of these was accepted and ended in a traceback or a hang.
    (["--rate", "inf"], "--rate must be finite and > 0"),
    (["--max-connections", "0"], "--max-connections must be >= 1, got 0"),
    (["--num-requests", "0"], "--num-requests must be >= 1, got 0"),
    (["--check", "-1"], "--check must be finite and >= 0, got -1"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--zipf", "nan"], "--zipf must be finite and >= 0, got nan"),
    (["--cache-fraction", "nan"], "--cache-fraction must be finite and > 0"),
    (["--num-docs", "2", "--docs-per-request", "3"],
     "--docs-per-request 3 is more than --num-docs 2"),
    (["--mode", "bogus"], "--mode and --check-mode must be among"),
    (["--out", "/proc/no/r.json"], "cannot create the output directory"),
])
def test_serve_load_refuses_values_it_cannot_run(capsys, argv, message):
  assert_refused(capsys, serve_load.parse_args, argv, message)


def test_serve_load_keeps_its_rate():
  assert serve_load.parse_args(["--rate", "0.5"]).rate == 0.5


@pytest.mark.parametrize("questions", ["0", "-2"])
def test_rag_quality_needs_a_question(capsys, questions):
  assert_refused(capsys, rag_quality.parse_args, ["--questions", questions],
           f"--questions must be >= 1, got {questions}")


def test_rag_quality_refuses_a_missing_hotpotqa_file(capsys, tmp_path):
  missing = tmp_path / "none.json"
  assert_refused(capsys, rag_quality.parse_args,
           ["--dataset", "hotpotqa", "--hotpotqa-json", str(missing)],
           f"--hotpotqa-json: no such file: {missing}")


@pytest.mark.parametrize("settings, message", [
    ("abc", "--settings takes T:S pairs"),
    ("1:0", "must be > 0, got '1:0'"),
    ("1:nan", "must be > 0"),
])
def test_ape_probe_refuses_bad_settings(capsys, settings, message):
  assert_refused(capsys, ape_probe.main, ["--settings", settings], message)
