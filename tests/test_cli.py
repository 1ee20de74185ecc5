"""The `lazyattn` command line: demo output and one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests import fast_compile


def run_cli(*args, timeout=900):
  # The commands load the 135M model: optimized code is faster there.
  return subprocess.run([sys.executable, "-m", "lazyattn_jax.cli", *args],
                        capture_output=True, text=True, timeout=timeout,
                        env=fast_compile.default_env())


@pytest.mark.slow
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


def _assert_usage_error(proc, want):
  """Exit status 2, one stderr line `lazyattn: error: ...`, no traceback."""
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  lines = proc.stderr.strip().splitlines()
  assert len(lines) == 1, proc.stderr[-2000:]
  assert lines[0].startswith("lazyattn: error:") and want in lines[0], lines


def _tiny_gguf(path):
  """A small but well-formed Llama GGUF header with one tensor."""
  import gguf
  import numpy as np
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_uint32("llama.block_count", 1)
  writer.add_uint32("llama.embedding_length", 16)
  writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(64)])
  writer.add_tensor("token_embd.weight", np.ones((64, 16), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_a_model_without_a_tokenizer_is_refused_in_one_line(files, tmp_path):
  """rag reads text: a model without tokenizer.json is exit 2 and one
  error line (after the weights' progress bar), not "pass token ids"."""
  import dataclasses

  from flax import nnx

  from models.config import LlamaConfig
  from models.llama import Llama, split_model
  from tests.hf_fixtures import write_hf_checkpoint
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=512)
  write_hf_checkpoint(tmp_path / "hf", config, nnx.to_pure_dict(split_model(
      Llama(config, rngs=nnx.Rngs(0)))[1]))
  proc = run_cli("rag", "--doc", str(files[0]), "--query", "q",
                 "--cache-pages", "64", "--model", str(tmp_path / "hf"))
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines()[-1] == (
      f"lazyattn: error: lazyattn rag needs a model with a tokenizer: "
      f"{tmp_path / 'hf'} has none (no tokenizer.json)")


def _tiny_hf_config(directory):
  import json
  directory.mkdir()
  (directory / "config.json").write_text(json.dumps(dict(
      model_type="llama", vocab_size=64, hidden_size=16, num_hidden_layers=1,
      num_attention_heads=2, intermediate_size=32)))


@pytest.mark.parametrize("case", ["truncated gguf", "corrupted gguf",
                                  "hf dir without config.json",
                                  "hf dir with broken weights",
                                  "cache pages 0", "impl bogus"])
def test_bad_model_or_option_exits_2_with_one_line(files, tmp_path, case):
  good = files[0]
  model, extra, want = None, [], "model"
  if case == "truncated gguf":
    _tiny_gguf(tmp_path / "whole.gguf")
    data = (tmp_path / "whole.gguf").read_bytes()
    model = tmp_path / "cut.gguf"
    model.write_bytes(data[:len(data) // 2])
    want = "cut.gguf"
  elif case == "corrupted gguf":
    model = tmp_path / "junk.gguf"
    model.write_bytes(bytes(range(256)) * 40)
    want = "junk.gguf"
  elif case == "hf dir without config.json":
    model = tmp_path / "hf"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    want = "config.json"
  elif case == "hf dir with broken weights":
    model = tmp_path / "hf"
    _tiny_hf_config(model)
    (model / "model.safetensors").write_bytes(b"\x10" + b"\0" * 7 + b"{[")
    want = "model.safetensors"
  elif case == "cache pages 0":
    extra, want = ["--cache-pages", "0"], "--cache-pages"
  else:
    extra, want = ["--impl", "bogus"], "--impl must be one of auto, xla"
  args = ["rag", "--doc", str(good), "--query", "q", *extra]
  if model is not None:
    args += ["--model", str(model)]
  _assert_usage_error(run_cli(*args), want)


def test_rag_labels_what_was_cached_before_the_run(tmp_path):
  # A cold run encodes both documents: neither was cached before it, even
  # though generate() then finds both in the cache.
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_text("The Orrin Bridge was built in 1887.", encoding="utf-8")
  b.write_text("Mira Lake freezes every January.", encoding="utf-8")
  proc = run_cli("rag", "--doc", str(a), str(b), "--query",
                 "When was the Orrin Bridge built?", "--max-new-tokens", "4")
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = [l for l in proc.stdout.splitlines() if "time to first token" in l]
  assert len(lines) == 1, proc.stdout
  assert "a.txt [encoded], b.txt [encoded]" in lines[0], lines[0]


def test_a_failed_generation_is_one_line_and_exit_1(monkeypatch, capsys):
  from lazyattn_jax import cli
  from lazyattn_jax.errors import RequestFailedError

  def fail(args):
    raise RequestFailedError("RuntimeError: device lost\ndetails")
  monkeypatch.setattr(cli, "run_rag", fail)
  assert cli.main(["rag", "--doc", "x.txt", "--query", "q"]) == 1
  err = capsys.readouterr().err
  assert err == "lazyattn: error: generation failed: RuntimeError: device lost\n"


@pytest.mark.parametrize("command", ["rag", "finetune"])
def test_ctrl_c_is_one_line_and_exit_130(monkeypatch, capsys, tmp_path,
                                         command):
  from lazyattn_jax import cli
  from lazyattn_jax.training import finetune_cli

  def interrupted(args):
    raise KeyboardInterrupt
  monkeypatch.setattr(cli, "run_rag", interrupted)
  monkeypatch.setattr(finetune_cli, "run", interrupted)
  argv = (["rag", "--doc", "x.txt", "--query", "q"] if command == "rag" else
          ["finetune", "--out", str(tmp_path / "ft")])
  assert cli.main(argv) == 130
  err = capsys.readouterr().err
  assert err.startswith("lazyattn: interrupted") and err.count("\n") == 1
  if command == "finetune":
    assert f"resumes from the last checkpoint under {tmp_path / 'ft'}" in err


def test_quality_flags_become_engine_settings(tmp_path):
  import numpy as np
  from lazyattn_jax.cli import build_parser
  from lazyattn_jax.cli_options import quality_settings
  from lazyattn_jax.quality_options import QualityOptions
  sink = np.ones((2, 8), np.float32)
  np.save(tmp_path / "sink.npy", sink)
  parse = lambda *flags: quality_settings(build_parser().parse_args(
      ["rag", "--doc", "a.txt", "--query", "q", *flags]))
  assert parse() == {}
  assert parse("--preamble", "chat", "--recompute") == dict(
      preamble="chat", recompute=True)
  settings = parse("--sink", str(tmp_path / "sink.npy"),
                   "--recompute-tokens", "32")
  assert QualityOptions(**settings) == QualityOptions(
      preamble="sink", sink=sink, recompute=True, recompute_tokens=32)
  # The file the sink trainer writes reads back to the same vectors.
  from lazyattn_jax.training.sink_file import save_sink
  trained = save_sink(tmp_path / "sink.safetensors", sink + 1, {"steps": 3})
  np.testing.assert_array_equal(parse("--sink", trained)["sink"], sink + 1)


@pytest.mark.parametrize("flags,want", [
    (["--recompute-tokens", "6"],
     "recompute_tokens=6 is not a multiple of the page size (16)"),
    (["--preamble", "chat", "--sink", "s.npy"], "two preambles"),
    (["--sink", "no-such.npy"], "cannot read --sink no-such.npy"),
    (["--sink", "no-such.safetensors"],
     "cannot read --sink no-such.safetensors: sink file not found"),
])
def test_bad_quality_flags_are_one_line_usage_errors(files, flags, want,
                                                     capsys):
  # Refused before any model is loaded (a missing model would say so).
  from lazyattn_jax import cli
  status = cli.main(["rag", "--doc", str(files[0]), "--query", "q",
                     "--model", "/no/such/model.gguf", *flags])
  err = capsys.readouterr().err
  assert status == 2 and err.count("\n") == 1, err
  assert err.startswith("lazyattn: error:") and want in err, err


@pytest.mark.parametrize("command,flags,want", [
    # --kv-dtype offered bfloat16 and float16 to rag and demo, which had no
    # --dtype: the engine built, then every request failed (exit 1).
    ("rag", ["--kv-dtype", "bfloat16"],
     "--kv-dtype bfloat16 does not match --dtype float32: the KV pool is in "
     "the compute dtype or float8_e4m3fn; give --kv-dtype float32 or "
     "float8_e4m3fn, or --dtype bfloat16"),
    ("demo", ["--kv-dtype", "float16"],
     "--kv-dtype float16 does not match --dtype float32"),
    ("serve", ["--dtype", "bfloat16", "--kv-dtype", "float32"],
     "--kv-dtype float32 does not match --dtype bfloat16"),
    # argparse's choices printed the usage too.
    ("rag", ["--kv-dtype", "bogus"], "--kv-dtype is not a dtype: 'bogus'"),
    # A TypeError traceback (exit 1).
    ("serve", ["--dtype", "bogus"],
     "--dtype must be one of float32, bfloat16, float16, got 'bogus'"),
    ("demo", ["--dtype", "int32"],
     "--dtype must be one of float32, bfloat16, float16, got 'int32'"),
    # A ZeroDivisionError traceback (exit 1).
    ("serve", ["--page-size", "0"], "--page-size must be >= 1, got 0"),
    ("serve", ["--page-size", "-16"], "--page-size must be >= 1, got -16"),
])
def test_bad_dtype_or_page_size_is_a_one_line_usage_error(files, command,
                                                          flags, want, capsys):
  # Refused before any model is loaded (a missing model would say so).
  from lazyattn_jax import cli
  args = ["--doc", str(files[0]), "--query", "q"] if command == "rag" else []
  status = cli.main([command, *args, "--model", "/no/such/model.gguf",
                     *flags])
  err = capsys.readouterr().err
  assert status == 2 and err.count("\n") == 1, err
  assert err.startswith("lazyattn: error: ") and want in err, err


def test_rag_and_demo_take_the_dtype_their_kv_dtype_needs():
  # --kv-dtype bfloat16 works with --dtype bfloat16, on every command.
  from lazyattn_jax.cli import _check_arguments, build_parser
  for command in (["rag", "--doc", "a.txt", "--query", "q"], ["demo"],
                  ["serve"]):
    for dtypes in (["--dtype", "bfloat16", "--kv-dtype", "bfloat16"],
                   ["--dtype", "float16"], ["--kv-dtype", "float8_e4m3fn"],
                   ["--kv-dtype", "float32"]):
      args = build_parser().parse_args([*command, *dtypes])
      _check_arguments(args)
      assert args.dtype == (dtypes[1] if dtypes[0] == "--dtype"
                            else "float32")


def test_a_bad_dtype_is_one_line_from_the_command_line():
  proc = run_cli("serve", "--dtype", "bogus", "--model", "/no/such/model.gguf")
  _assert_usage_error(proc, "--dtype must be one of float32, bfloat16, "
                            "float16, got 'bogus'")


# Not ids "gpu": conftest skips tests with that keyword where there is no GPU.
@pytest.mark.parametrize("impl", ["gpu", "tpu"], ids=lambda i: f"impl_{i}")
def test_an_impl_for_another_backend_is_one_line(files, impl):
  # --impl gpu on a CPU host failed every step's compile (three tracebacks,
  # "Only interpret mode is supported on CPU backend").
  import jax
  backend = jax.default_backend()
  if backend == impl:
    pytest.skip(f"JAX runs on {impl} here")
  others = " or gpu" if backend == "gpu" else " or tpu" if (
      backend == "tpu") else ""
  proc = run_cli("rag", "--doc", str(files[0]), "--query", "q", "--impl",
                 impl, "--cache-pages", "64", "--max-new-tokens", "2")
  _assert_usage_error(proc, f"--impl {impl} needs JAX's {impl} backend, but "
                            f"JAX runs on {backend} here; use --impl auto or "
                            f"xla{others}")
