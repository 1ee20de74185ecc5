"""benchmarks.rag_quality's checks of its arguments: bad values are
argparse's one-line usage error (exit 2) before any model loads."""

import pytest

from benchmarks.rag_quality import parse_args


@pytest.mark.parametrize("argv, message", [
    (["--docs-per-question", "0"], "--docs-per-question must lie in [1,"),
    (["--people", "3", "--docs-per-question", "4"],
     "--docs-per-question must lie in [1, --people = 3]"),
    (["--people", "0"], "--people must lie in [1,"),
    (["--people", "100000"], "--people must lie in [1,"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--batch", "0"], "--batch must be >= 1"),
    (["--page-size", "0"], "--page-size must be >= 1"),
    (["--num-pages", "0"], "--num-pages must be >= 1"),
    (["--impl", "bogus"], "--impl must be one of auto, xla, gpu, tpu"),
    (["--model", "/nonexistent"], "Unknown model '/nonexistent'"),
    (["--dtype", "float64"], "--dtype must be one of float32, bfloat16"),
    (["--dataset", "hotpotqa", "--layout", "gold-sweep", "--sweep-docs",
      "1"], "--sweep-docs must be >= 2"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
  # parse_args alone: these must fail before any data or model loads.
  with pytest.raises(SystemExit) as info:
    parse_args(["--no-progress", *argv])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err
