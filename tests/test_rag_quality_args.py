"""benchmarks.rag_quality's checks of its arguments and runs: bad values
are argparse's one-line usage error (exit 2) before any model loads, a bad
later run is refused before the first run starts, and a run that fails
anyway leaves the report of the runs before it."""

import json
import re

import pytest

from benchmarks import quality_runs
from benchmarks.rag_quality import main, parse_args


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
    (["--run", "lazy,model=/nonexistent"],
     "run 'lazy model=\"/nonexistent\"': Unknown model '/nonexistent'"),
    (["--modes", "lazy,full", "--engine-option", "recompute=true"],
     "run 'full': QualityOptions apply to modes"),
    (["--run", "lazy,impl=bogus"], "RunnerConfig.impl must be one of"),
    (["--run", "lazy,eviction=mru"], "CacheConfig.eviction must be one of"),
    # An option given twice: which one counts would be a guess (the last
    # one did, silently: a run labelled as recomputing ran without).
    (["--run", "lazy,recompute=true,recompute=false,label=x"],
     "--run 'lazy,recompute=true,recompute=false,label=x': option "
     "'recompute' is given twice"),
    (["--run", "lazy,label=a,label=b"], "option 'label' is given twice"),
    (["--modes", "lazy", "--engine-option", "recompute=true",
      "--engine-option", "recompute=false"],
     "--engine-option 'recompute' is given twice"),
    (["--run", "lazy,label="], "label= is empty"),
    (["--run", "lazy,label= "], "label= is empty"),
    # Refused only when the run's engine was built, after the runs before
    # it had spent their time.
    (["--run", "lazy,dtype=float16"],
     "dtype float16 does not match --dtype float32"),
    (["--dtype", "bfloat16", "--run", "lazy,dtype=float32"],
     "dtype float32 does not match --dtype bfloat16"),
    (["--run", "lazy,mesh=1"], "mesh= is not a run option"),
    # quality= takes no value a run spec can write (it crashed for 5, and
    # null beside a field was dropped without a word).
    (["--run", "lazy,quality=5"], "quality= is not a run option"),
    (["--run", "lazy,quality=null,recompute=true"],
     "quality= is not a run option"),
    (["--run", "lazy,quality=null"], "quality= is not a run option"),
    (["--modes", "lazy", "--engine-option", "quality=null"],
     "run 'lazy': quality= is not a run option"),
    # It was accepted and ignored: the synthetic set has no such parts.
    (["--split", "excluded"],
     "--split excluded applies to --dataset hotpotqa only"),
])
def test_bad_arguments_are_usage_errors(argv, message, capsys):
  # parse_args alone: these must fail before any data or model loads.
  with pytest.raises(SystemExit) as info:
    parse_args(["--no-progress", *argv])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err


def test_a_label_is_the_text_given():
  """A label is not JSON: true, 1.10, null and "1" stay as written (they
  became "True", "1.1", the default label and "1")."""
  labels = ["true", "1.10", "null", '"1"', "1", "lazy + sink", "x=y"]
  _, runs = parse_args(["--no-progress", *[a for label in labels
                                          for a in ("--run",
                                                    f"lazy,label={label}")]])
  assert [r.label for r in runs] == labels
  assert all(r.options == {} for r in runs)


def test_a_run_may_still_replace_a_common_option():
  _, runs = parse_args(["--no-progress", "--modes", "lazy",
                        "--engine-option", "decode_steps=2",
                        "--run", "lazy,decode_steps=4,label=four"])
  assert [(r.label, r.options) for r in runs] == [
      ("lazy", {"decode_steps": 2}), ("four", {"decode_steps": 4})]


# --- checks that need a model: a tiny random one with SmolLM2's tokenizer ----
@pytest.fixture(scope="module")
def tiny_dirs(smollm2_gguf_path, tmp_path_factory):
  """Two tiny HF directories: one with SmolLM2's tokenizer and vocabulary,
  and one of another vocabulary."""
  from flax import nnx
  from models.config import LlamaConfig
  from models.llama import Llama, split_model
  from models.tokenizer import LlamaTokenizer
  from tests.hf_fixtures import write_hf_checkpoint
  tokenizer = LlamaTokenizer.from_gguf(smollm2_gguf_path)
  dirs = []
  for name, vocab in (("text", tokenizer.vocab_size), ("other", 256)):
    config = LlamaConfig.tiny(vocab_size=vocab, max_position=2048)
    params = nnx.to_pure_dict(split_model(Llama(config,
                                                rngs=nnx.Rngs(0)))[1])
    directory = tmp_path_factory.mktemp(f"tiny-{name}")
    write_hf_checkpoint(directory, config, params)
    dirs.append(directory)
  (dirs[0] / "tokenizer.json").write_text(tokenizer.backend.to_str())
  return dirs


def _argv(model, out, *more):
  return ["--model", str(model), "--questions", "2", "--max-new-tokens", "2",
          "--batch", "2", "--impl", "xla", "--no-progress", "--out", str(out),
          *more]


@pytest.mark.parametrize("runs, message", [
    # Only the engine sees the pool dtype against the model's.
    (["--run", "lazy,dtype=bfloat16"], "does not match"),
    (["--run", "lazy,model={other}"], "has a vocabulary of 256 tokens"),
    (["--num-pages", "1"], "--num-pages 1 is too small"),
])
def test_a_bad_later_run_fails_before_the_first(tiny_dirs, tmp_path, runs,
                                                message, capsys):
  text, other = tiny_dirs
  out = tmp_path / "r.json"
  with pytest.raises(SystemExit) as info:
    main(_argv(text, out, "--modes", "full",
               *[r.format(other=other) for r in runs]))
  assert info.value.code == 2
  captured = capsys.readouterr()
  assert message in captured.err and "Traceback" not in captured.err
  assert '"label"' not in captured.out  # no run ran
  assert not out.exists()


def test_options_that_add_pages_are_counted_before_the_first_run(
    tiny_dirs, tmp_path, capsys):
  """A pool that fits every mode's largest request without options, while
  first-page recompute needs more pages: refused before any run."""
  from benchmarks.rag_quality import synthetic_items
  from lazyattn_jax.loading import load_model
  text, _ = tiny_dirs
  out = tmp_path / "r.json"
  argv = _argv(text, out, "--modes", "full",
               "--run", "lazy,recompute=true,label=recompute")
  args, _ = parse_args(argv)
  items, _ = synthetic_items(args)
  loaded = load_model(str(text), "float32", False)
  pages = max(p for mode in ("full", "lazy")
              for p, _ in quality_runs.request_pages(
                  loaded, items, mode, page_size=16, max_new_tokens=2))
  with pytest.raises(SystemExit) as info:
    main([*argv, "--num-pages", str(pages)])
  assert info.value.code == 2
  captured = capsys.readouterr()
  assert re.search(r"run 'recompute', question \d+: request needs \d+ "
                   "pages", captured.err)
  assert f"--num-pages {pages} is too small for it" in captured.err
  assert '"label"' not in captured.out and not out.exists()


def test_a_failed_run_keeps_the_report_of_the_runs_before(
    tiny_dirs, tmp_path, capsys, monkeypatch):
  """A run that fails in the middle (here its request loop) after passing
  every check: the report holds the runs before it."""
  from benchmarks import quality_loop
  text, _ = tiny_dirs
  out = tmp_path / "r.json"
  original = quality_loop.generate_all

  def fail_the_second_run(engine, items, sampling, batch, *, desc, progress):
    if desc == "broken":
      raise RuntimeError("device lost")
    return original(engine, items, sampling, batch, desc=desc,
                    progress=progress)

  monkeypatch.setattr(quality_loop, "generate_all", fail_the_second_run)
  with pytest.raises(SystemExit) as info:
    main(_argv(text, out, "--modes", "full", "--run", "lazy,label=broken"))
  assert "run 'broken' failed after 1 finished run(s): " \
         "RuntimeError: device lost" in str(info.value.code)
  report = json.loads(out.read_text())
  assert [r["label"] for r in report["runs"]] == ["full"]
  assert report["failed"].startswith("run 'broken' failed")
  assert out.with_suffix(".png").exists()
  assert "Traceback" not in capsys.readouterr().err

def test_the_report_records_the_code_and_the_files_given_by_path(
    tiny_dirs, tmp_path, monkeypatch):
  """The report names the code's commit (None outside a git checkout) and
  each input given by path, hashed: here the model directory's files and a
  sink file.  The runs themselves are not what this checks: skipped."""
  import hashlib
  import numpy as np
  from benchmarks import quality_loop
  from lazyattn_jax.training.sink_file import save_sink
  text, _ = tiny_dirs
  sink = save_sink(tmp_path / "sink.safetensors",
                   np.full((2, 8), 0.5, np.float32))
  monkeypatch.setattr(quality_loop, "check_engines", lambda *a, **k: None)
  monkeypatch.setattr(quality_loop, "run_all", lambda *a, **k: [])
  out = tmp_path / "r.json"
  main(_argv(text, out, "--run", f"lazy,sink={sink},label=s"))
  report = json.loads(out.read_text())
  sha = lambda path: hashlib.sha256(open(path, "rb").read()).hexdigest()
  assert report["code"] is None or (
      re.fullmatch(r"[0-9a-f]{40}", report["code"]["commit"])
      and isinstance(report["code"]["dirty"], bool))
  assert report["files"][sink]["sha256"] == sha(sink)
  model = report["files"][str(text)]
  assert model["path"] == str(text)
  assert model["files"]["config.json"]["sha256"] == sha(text / "config.json")
  assert model["files"]["config.json"]["size"] == (text /
                                                   "config.json").stat().st_size


def test_a_malformed_hotpotqa_file_is_a_usage_error(tmp_path, capsys):
  """It ended in a traceback: the data loads in `main`, outside the checks
  of `parse_args`."""
  bad = tmp_path / "hotpot.json"
  bad.write_text('{"not": "a list"}')
  with pytest.raises(SystemExit) as info:
    main(["--no-progress", "--dataset", "hotpotqa", "--hotpotqa-json",
          str(bad), "--out", str(tmp_path / "report.json")])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert "holds a JSON list of questions" in err and "Traceback" not in err


def test_the_plot_title_names_the_hotpotqa_part():
  from benchmarks.rag_quality import _plot_title
  report = dict(dataset="hotpotqa", layout="dataset", model="/m/model.gguf",
                device="cpu", date="2026-12-06")
  assert "held out, layout dataset" in _plot_title(report, [])
  report["split"] = "excluded"
  assert "excluded from training, layout dataset" in _plot_title(report, [])
