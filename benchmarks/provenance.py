"""Provenance of a benchmark report: which code and which input files its
numbers came from (`benchmarks.rag_quality` records both)."""

from __future__ import annotations

# A file given by path is hashed (sha256) up to HASH_LIMIT bytes; past that
# (model weights) only its size and modification time are recorded, so the
# record costs well under a second whatever the model.
HASH_LIMIT = 64 << 20
MAX_LISTED_FILES = 1000  # files recorded of one directory


def code_version() -> dict | None:
  """{"commit": HEAD's hash, "dirty": whether tracked files differ from
  it} of the git checkout this file is tracked in; None where there is
  none (an installed copy, no git, git failing): never an error.
  Untracked files do not make it dirty (as `git describe --dirty`)."""
  import os
  import subprocess
  here = os.path.dirname(os.path.abspath(__file__))
  # No optional locks: a report must not take the index lock of a checkout
  # others are working in.
  env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")

  def git(*argv):
    return subprocess.run(["git", "-C", here, *argv], capture_output=True,
                          text=True, timeout=30, env=env,
                          check=True).stdout.strip()

  try:
    # The repository git finds must be the one this code is part of.
    git("ls-files", "--error-unmatch", "--", os.path.basename(__file__))
    commit = git("rev-parse", "--verify", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
  except (OSError, subprocess.SubprocessError, ValueError):
    return None
  return dict(commit=commit, dirty=dirty)


def _stat_record(path: str, st, budget: list) -> dict:
  """size, mtime (UTC) and, while `budget[0]` bytes remain, sha256."""
  import time

  from lazyattn_jax.file_digest import file_sha256
  record = dict(size=st.st_size, mtime=time.strftime(
      "%Y-%m-%dT%H:%M:%SZ", time.gmtime(st.st_mtime)))
  if st.st_size <= budget[0]:
    record["sha256"] = file_sha256(path)
    budget[0] -= st.st_size
  return record


def file_record(path: str) -> dict | None:
  """What a run read from a file or directory given by path: its absolute
  path and, for a file, its size, mtime and sha256 (sha256 only up to
  HASH_LIMIT bytes); for a directory (a Hugging Face model) the same for
  each file under it, the smallest hashed first while the directory's
  hashed bytes stay within HASH_LIMIT (configs and tokenizer, not
  multi-GB weights), at most MAX_LISTED_FILES files.  None for what is
  neither (a model name); a file that cannot be read is recorded with its
  error, never raised."""
  import os
  full = os.path.abspath(os.path.expanduser(str(path)))
  budget = [HASH_LIMIT]
  try:
    if os.path.isfile(full):
      return dict(path=full, **_stat_record(full, os.stat(full), budget))
    if not os.path.isdir(full):
      return None
    found = []
    for root, dirs, names in os.walk(full):
      dirs.sort()
      for name in sorted(names):
        entry = os.path.join(root, name)
        if os.path.isfile(entry):
          found.append((os.stat(entry), os.path.relpath(entry, full), entry))
    listed = sorted(found[:MAX_LISTED_FILES], key=lambda f: (f[0].st_size,
                                                             f[1]))
    files = {rel: _stat_record(entry, st, budget)
             for st, rel, entry in listed}
    record = dict(path=full, files=dict(sorted(files.items())))
    if len(found) > MAX_LISTED_FILES:
      record["files_not_listed"] = len(found) - MAX_LISTED_FILES
    return record
  except OSError as err:
    return dict(path=full, error=f"{type(err).__name__}: {err}")


def input_files(model: str, runs, data_path: str = "") -> dict:
  """{path as given: `file_record`} of each input given by path: --model
  and each run's model= (unless a known model name, which pins its file),
  each run's sink=PATH, and `data_path` (--hotpotqa-json)."""
  from lazyattn_jax.default_model import KNOWN_MODEL_NAMES
  paths = [str(name) for name in [model, *(r.options.get("model")
                                           for r in runs)]
           if name and str(name).strip().lower() not in KNOWN_MODEL_NAMES]
  paths += [r.options["sink"] for r in runs
            if isinstance(r.options.get("sink"), str)]
  if data_path:
    paths.append(str(data_path))
  records = {path: file_record(path) for path in dict.fromkeys(paths)}
  return {path: record for path, record in records.items() if record}
