"""The `lazyattn` command line: demo output and one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run_cli(*args, timeout=900):
  return subprocess.run([sys.executable, "-m", "lazyattn_jax.cli", *args],
                        capture_output=True, text=True, timeout=timeout)


def test_demo_shows_cache_hits_on_reuse():
  proc = run_cli("demo", "--max-new-tokens", "12")
  assert proc.returncode == 0, proc.stderr[-2000:]
  out = proc.stdout
  assert out.count("Q") >= 3 and "A3:" in out
  lines = [l for l in out.splitlines() if "time to first token" in l]
  assert len(lines) == 3, out
  assert "[encoded]" in lines[0] and "[cached]" not in lines[0]
  assert "[cached]" in lines[1] and "[encoded]" not in lines[1]
  assert "[cached]" in lines[2] and "[encoded]" not in lines[2]
  summary = [l for l in out.splitlines() if l.startswith("First request")]
  assert len(summary) == 1 and "reused request" in summary[0]


@pytest.fixture
def files(tmp_path):
  good = tmp_path / "good.txt"
  good.write_text("The Orrin Bridge was built in 1887.", encoding="utf-8")
  latin = tmp_path / "latin1.txt"
  latin.write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
  huge = tmp_path / "huge.txt"
  huge.write_text("word " * 4000, encoding="utf-8")
  return good, latin, huge


@pytest.mark.parametrize("case", ["missing", "not_utf8", "too_long",
                                  "unknown_model", "empty_query"])
def test_bad_input_exits_2_with_one_line(files, case):
  good, latin, huge = files
  args = {
      "missing": ["rag", "--doc", str(good.parent / "nope.txt"), "--query", "q"],
      "not_utf8": ["rag", "--doc", str(latin), "--query", "q"],
      "too_long": ["rag", "--doc", str(huge), "--query", "q",
                   "--cache-pages", "64"],
      "unknown_model": ["rag", "--doc", str(good), "--query", "q",
                        "--model", "no-such-model"],
      "empty_query": ["rag", "--doc", str(good), "--query", "  "],
  }[case]
  want = {"missing": "not found", "not_utf8": "not UTF-8",
          "too_long": "document 0", "unknown_model": "no-such-model",
          "empty_query": "query is empty"}[case]
  proc = run_cli(*args)
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  errors = [l for l in proc.stderr.splitlines() if l.startswith("lazyattn: error:")]
  assert len(errors) == 1 and want in errors[0], proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr
