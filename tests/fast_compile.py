"""The CPU suite compiles with LLVM's optimizations off, into one cache.

Most CPU tests compile many small programs and run each once or twice:
compiling is most of their time, and `--xla_backend_optimization_level=0`
cuts it by about a third (tests/test_tensor_parallel.py's subprocesses
always used it).  The flag goes into XLA_FLAGS before JAX starts a backend,
so subprocesses of the tests inherit it.  A run of the 135M-parameter model
is the exception: its unoptimized code runs ~1.7x longer than the compile
saves, so the tests that run it in a subprocess use `default_env()`.
The run's processes also share one compilation cache (about 5% off).

Both left alone where an accelerator plugin is installed (the flag would slow
the GPU's code too) or where XLA_FLAGS already sets an optimization level.
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import tempfile

FLAG = "--xla_backend_optimization_level=0"
# The run's compilation cache directory, made by the first process that
# enables fast compiles (pytest's main process) and inherited by the rest.
CACHE_ENV = "LAZYATTN_TEST_COMPILE_CACHE"


def _accelerator_plugin() -> bool:
  return any(importlib.util.find_spec(name) is not None
             for name in ("jax_plugins", "libtpu"))


def enable() -> None:
  """Adds FLAG to XLA_FLAGS and shares one compilation cache across the
  run; call before JAX initializes its backend."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" in flags or _accelerator_plugin():
    return
  os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()
  _share_compilation_cache()


def _share_compilation_cache() -> None:
  """One persistent compilation cache for the whole run, empty at its
  start: xdist workers and test subprocesses that compile a program another
  one compiled (the same model at the same shapes) load it instead.  It
  lives in a temporary directory that the process that made it removes at
  exit, so nothing carries over between runs."""
  import jax
  directory = os.environ.get(CACHE_ENV)
  if directory is None:
    directory = tempfile.mkdtemp(prefix="lazyattn-test-xla-cache-")
    os.environ[CACHE_ENV] = directory
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
  settings = {"jax_compilation_cache_dir": directory,
              "jax_persistent_cache_min_compile_time_secs": 0,
              "jax_persistent_cache_min_entry_size_bytes": 0}
  for name, value in settings.items():
    os.environ[name.upper()] = str(value)  # for subprocesses
    jax.config.update(name, value)


def default_env() -> dict:
  """os.environ with FLAG taken out of XLA_FLAGS again, for a subprocess that
  runs the real model (execution, not compilation, is most of its time)."""
  env = dict(os.environ)
  flags = env.get("XLA_FLAGS", "").replace(FLAG, "").split()
  if flags:
    env["XLA_FLAGS"] = " ".join(flags)
  else:
    env.pop("XLA_FLAGS", None)
  return env
