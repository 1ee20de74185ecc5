"""The CPU suite compiles with LLVM's optimizations off.

Most CPU tests compile many small programs and run each once or twice:
compiling is most of their time, and `--xla_backend_optimization_level=0`
cuts it by about a third (tests/test_tensor_parallel.py's subprocesses
always used it).  The flag goes into XLA_FLAGS before JAX starts a backend,
so subprocesses of the tests inherit it.  A run of the 135M-parameter model
is the exception: its unoptimized code runs ~1.7x longer than the compile
saves, so the tests that run it in a subprocess use `default_env()`.

Left alone where an accelerator plugin is installed (the flag would slow
the GPU's code too) or where XLA_FLAGS already sets an optimization level.
"""

from __future__ import annotations

import importlib.util
import os

FLAG = "--xla_backend_optimization_level=0"


def _accelerator_plugin() -> bool:
  return any(importlib.util.find_spec(name) is not None
             for name in ("jax_plugins", "libtpu"))


def enable() -> None:
  """Adds FLAG to XLA_FLAGS; call before JAX initializes its backend."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_backend_optimization_level" in flags or _accelerator_plugin():
    return
  os.environ["XLA_FLAGS"] = f"{flags} {FLAG}".strip()


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
