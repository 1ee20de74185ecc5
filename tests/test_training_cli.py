"""`lazyattn finetune` and `python -m lazyattn_jax.finetune`: help, one-line
errors with exit status 2, and a short run that stops and resumes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from lazyattn_jax import cli
from lazyattn_jax.training.sink_file import save_sink
from tests.training_helpers import export_tiny_model


def _run(*args, module="lazyattn_jax.cli"):
  return subprocess.run([sys.executable, "-m", module, *args],
                        capture_output=True, text=True, timeout=300)


def _one_error_line(proc, want):
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("lazyattn: error:"), lines
  assert want in lines[0], lines


def test_help(capsys):
  with pytest.raises(SystemExit) as exit_:
    cli.main(["finetune", "--help"])
  assert exit_.value.code == 0
  out = capsys.readouterr().out
  for option in ("--full-share", "--kl-weight", "--ce-weight", "--dtype",
                 "--checkpoint-every", "--preamble-sink", "--preamble {chat}",
                 "--out"):
    assert option in out
  assert "--preamble-text" not in out  # replaced: refused, not offered
  thin = _run("--help", module="lazyattn_jax.finetune")
  assert thin.returncode == 0 and "--full-share" in thin.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """The tiny model and tokenizer as a safetensors directory."""
  return export_tiny_model(tmp_path_factory.mktemp("tiny_model"))


def test_a_bad_argument_exits_2_with_one_line(tmp_path):
  _one_error_line(_run("finetune", "--out", str(tmp_path), "--full-share",
                       "1.5"), "--full-share must lie in [0, 1], got 1.5")


@pytest.mark.parametrize("case", ["steps", "dtype", "model", "sink width",
                                  "data"])
def test_bad_settings_are_one_line_usage_errors(tmp_path, model_dir, case,
                                                capsys):
  extra, want = {
      "steps": (["--steps", "0"], "--steps must be > 0"),
      "dtype": (["--dtype", "float8"], "dtype must be one of"),
      "model": (["--model", str(tmp_path / "nope")], "nope"),
      "sink width": (["--model", model_dir, "--preamble-sink",
                      str(tmp_path / "s.safetensors")], "sink width 32"),
      "data": (["--model", model_dir, "--data", "wiki"],
               "unknown data source 'wiki'"),
  }[case]
  save_sink(tmp_path / "s.safetensors", np.zeros((4, 32), np.float32))
  status = cli.main(["finetune", "--out", str(tmp_path / "out"),
                     "--no-progress", *extra])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert err[0].startswith("lazyattn: error:") and want in err[0], err


def test_a_run_stops_and_resumes_to_an_export(tmp_path, model_dir, capsys):
  """With a learned sink as the preamble (frozen)."""
  sink = save_sink(tmp_path / "sink.safetensors",
                   np.random.default_rng(0).normal(size=(4, 64)))
  args = ["finetune", "--model", model_dir, "--out", str(tmp_path / "out"),
          "--steps", "3", "--batch-size", "2", "--lr", "1e-3",
          "--warmup-steps", "1", "--checkpoint-every", "1", "--no-progress",
          "--docs-per-question", "2", "--preamble-sink", sink]
  out = tmp_path / "out"
  assert cli.main(args + ["--stop-at-step", "2"]) == 0
  assert "stopped early; the model so far (step 2)" in capsys.readouterr().out
  # A stopped run leaves the weights so far, marked as such.
  stopped = _export_metadata(out / "model")
  assert (stopped["step"], stopped["finished"]) == ("2", "false")
  assert cli.main(args) == 0
  printed = capsys.readouterr().out
  assert "3/3 steps" in printed and "model:" in printed
  finished = _export_metadata(out / "model")
  assert (finished["step"], finished["finished"]) == ("3", "true")
  log = json.loads((out / "log.json").read_text())
  assert [r["step"] for r in log["history"]] == [0, 1, 2]
  assert log["settings"]["config"]["layout"]["preamble_len"] == 4
  assert log["settings"]["sink_sha256"]
  assert (out / "loss.png").is_file()
  assert (out / "model" / "tokenizer.json").is_file()


def _export_metadata(model_dir) -> dict:
  """The __metadata__ strings of an exported model.safetensors."""
  with open(os.path.join(model_dir, "model.safetensors"), "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(size))["__metadata__"]
