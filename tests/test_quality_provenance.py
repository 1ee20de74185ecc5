"""benchmarks.provenance: of a rag_quality report: the code's
git commit and dirty flag (None outside a git checkout, never an error),
and a record of each input given by path (sha256 up to a size; size and
mtime past it)."""

import hashlib
import shutil
import subprocess

import pytest

from benchmarks import provenance
from benchmarks.provenance import file_record, input_files
from benchmarks.quality_runs import Run

needs_git = pytest.mark.skipif(shutil.which("git") is None,
                               reason="needs the git command")


def _copy_of_provenance(directory, monkeypatch):
  """benchmarks/provenance.py copied under `directory`, and the module
  told that it is that file, which code_version looks up."""
  target = directory / "benchmarks" / "provenance.py"
  target.parent.mkdir(parents=True)
  shutil.copyfile(provenance.__file__, target)
  monkeypatch.setattr(provenance, "__file__", str(target))
  return target


def _git(repo, *argv):
  return subprocess.run(
      ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t",
       "-c", "commit.gpgsign=false", *argv],
      check=True, capture_output=True, text=True).stdout.strip()


@needs_git
def test_code_version_is_the_checkouts_commit_and_dirty_flag(
    tmp_path, monkeypatch):
  repo = tmp_path / "repo"
  repo.mkdir()
  target = _copy_of_provenance(repo, monkeypatch)
  _git(repo, "init", "-q")
  _git(repo, "add", ".")
  _git(repo, "commit", "-q", "-m", "one")
  head = _git(repo, "rev-parse", "HEAD")
  assert provenance.code_version() == dict(commit=head, dirty=False)
  (repo / "notes.txt").write_text("untracked")  # as git describe --dirty
  assert provenance.code_version() == dict(commit=head, dirty=False)
  with open(target, "a") as f:
    f.write("\n# changed\n")
  assert provenance.code_version() == dict(commit=head, dirty=True)
  assert not (repo / ".git" / "index.lock").exists()


@needs_git
def test_code_version_is_none_outside_a_checkout_of_this_code(
    tmp_path, monkeypatch):
  monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
  _copy_of_provenance(tmp_path / "plain", monkeypatch)
  assert provenance.code_version() is None
  # Inside another repository that does not track this file: not its code.
  other = tmp_path / "other"
  other.mkdir()
  _git(other, "init", "-q")
  (other / "x").write_text("x")
  _git(other, "add", "x")
  _git(other, "commit", "-q", "-m", "x")
  _copy_of_provenance(other, monkeypatch)
  assert provenance.code_version() is None
  # No git at all.
  monkeypatch.setenv("PATH", str(tmp_path / "empty"))
  assert provenance.code_version() is None


def test_a_small_file_is_hashed(tmp_path):
  sink = tmp_path / "sink.safetensors"
  sink.write_bytes(b"\0sink" * 100)
  record = file_record(str(sink))
  assert record["path"] == str(sink) and record["size"] == 500
  assert record["sha256"] == hashlib.sha256(sink.read_bytes()).hexdigest()
  assert record["mtime"].endswith("Z")


def test_large_files_get_size_and_mtime_only(tmp_path, monkeypatch):
  """Multi-GB weights are not read: past HASH_LIMIT bytes (per file given,
  and per directory, the smallest files hashed first) no sha256."""
  monkeypatch.setattr(provenance, "HASH_LIMIT", 100)
  weights = tmp_path / "model.gguf"
  weights.write_bytes(b"w" * 101)
  assert "sha256" not in file_record(str(weights))
  assert file_record(str(weights))["size"] == 101
  model = tmp_path / "hf"
  (model / "sub").mkdir(parents=True)
  (model / "config.json").write_text("{}" * 10)       # 20 bytes: hashed
  (model / "sub" / "extra.txt").write_text("e" * 30)  # 30: 50 of 100 spent
  (model / "tokenizer.json").write_text("t" * 70)     # 70: past the budget
  (model / "model.safetensors").write_bytes(b"w" * 5000)
  files = file_record(str(model))["files"]
  assert list(files) == ["config.json", "model.safetensors", "sub/extra.txt",
                         "tokenizer.json"]
  assert files["config.json"]["sha256"] == hashlib.sha256(
      b"{}" * 10).hexdigest()
  assert "sha256" in files["sub/extra.txt"]
  assert "sha256" not in files["tokenizer.json"]
  assert "sha256" not in files["model.safetensors"]
  assert files["model.safetensors"]["size"] == 5000
  assert files["tokenizer.json"]["size"] == 70


def test_inputs_given_by_path_are_recorded_names_are_not(tmp_path):
  sink, data, model = (tmp_path / "s.npy", tmp_path / "d.json",
                       tmp_path / "m")
  sink.write_bytes(b"s")
  data.write_text("[]")
  model.mkdir()
  (model / "config.json").write_text("{}")
  runs = [Run("lazy", {}, "lazy"),
          Run("lazy", {"sink": str(sink)}, "sink"),
          Run("lazy", {"model": str(model), "sink": str(sink)}, "tuned"),
          Run("lazy", {"model": "smollm2-135m-instruct"}, "named")]
  files = input_files("smollm2-135m-instruct", runs, str(data))
  assert list(files) == [str(model), str(sink), str(data)]
  assert files[str(sink)]["sha256"] == hashlib.sha256(b"s").hexdigest()
  assert "config.json" in files[str(model)]["files"]
  assert input_files(str(tmp_path / "missing.gguf"), []) == {}


def test_an_unreadable_file_is_recorded_not_raised(tmp_path, monkeypatch):
  secret = tmp_path / "sink.npy"
  secret.write_bytes(b"x")

  def refuse(*args, **kwargs):
    raise PermissionError(13, "Permission denied", str(secret))

  from lazyattn_jax import file_digest  # where the file is read
  monkeypatch.setattr(file_digest, "open", refuse, raising=False)
  record = file_record(str(secret))
  assert record["path"] == str(secret)
  assert record["error"].startswith("PermissionError")
