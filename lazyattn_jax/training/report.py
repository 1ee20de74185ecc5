"""What a training run shows and leaves behind: a progress bar, the loss
history (JSON) and a loss-curve PNG, in an output directory made (and
checked) before the run does any work."""

from __future__ import annotations

import contextlib
import json
import math
import numbers
import os
import sys
import time

from lazyattn_jax.progress import progress_bar_class
from lazyattn_jax.training.errors import OutputPathError

tqdm = progress_bar_class()


def prepare_output_dir(path, *, files=(), dirs=()) -> str:
  """Creates the output directory `path` (and its parents) and checks that
  the run can write its `files` and `dirs` there; returns the path.

  Called before any training, so a bad path costs nothing rather than a
  finished run whose results cannot be written.

  Raises:
    OutputPathError: `path` is a file or cannot be made or written, or one
      of `files` is a directory, or one of `dirs` is not one.
  """
  path = os.fspath(path)
  if os.path.exists(path) and not os.path.isdir(path):
    raise OutputPathError(f"output directory {path} exists and is not a "
                          "directory")
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise OutputPathError(f"cannot create the output directory {path}: "
                          f"{e.strerror or e}") from e
  if not os.access(path, os.W_OK | os.X_OK):
    raise OutputPathError(f"output directory {path} is not writable")
  for name in files:
    if os.path.isdir(os.path.join(path, name)):
      raise OutputPathError(f"{os.path.join(path, name)} is a directory; the "
                            "run writes a file there")
  for name in dirs:
    target = os.path.join(path, name)
    if os.path.exists(target) and not os.path.isdir(target):
      raise OutputPathError(f"{target} is not a directory; the run writes a "
                            "directory there")
  return path


@contextlib.contextmanager
def output_errors(path):
  """Turns an OSError about a file under the output directory `path` (a
  full disk, a file removed or made read-only during the run) into an
  OutputPathError, which the command lines report in one line; other
  OSErrors pass unchanged."""
  root = os.path.realpath(os.fspath(path))
  try:
    yield
  except OSError as e:
    names = [n for n in (e.filename, e.filename2) if n is not None]
    if not any(_under(os.path.realpath(os.fspath(n)), root) for n in names):
      raise
    raise OutputPathError(f"writing {names[0]} failed: {e.strerror or e}"
                          ) from e


def _under(path: str, root: str) -> bool:
  return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class History:
  """Per-step metrics of a run (a list of dicts with "step" and floats)."""

  def __init__(self, rows: list[dict] | None = None):
    self.rows = list(rows or [])

  def add(self, step: int, metrics: dict):
    self.rows.append({"step": int(step),
                      **{k: float(v) for k, v in metrics.items()}})

  def until(self, step: int) -> "History":
    """The rows of steps before `step` (what a checkpoint at `step` holds)."""
    return History([r for r in self.rows if r["step"] < step])

  def series(self, key: str) -> tuple[list[int], list[float]]:
    rows = [r for r in self.rows if key in r]
    return [r["step"] for r in rows], [r[key] for r in rows]


def progress_bar(total: int, start: int, description: str, enabled: bool):
  """A tqdm bar on stderr from step `start` of `total`."""
  return tqdm(total=total, initial=start, desc=description, unit="step",
              disable=not enabled, file=sys.stderr, dynamic_ncols=True)


def plot_losses(history: History, path: str, title: str,
                keys=("loss", "kl", "ce")) -> str | None:
  """Writes a loss-curve PNG; returns its path, or None without matplotlib
  (the numbers are in the JSON log either way)."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    print("matplotlib is not installed: no loss-curve PNG", file=sys.stderr)
    return None
  import numpy as np
  fig, ax = plt.subplots(figsize=(7, 4))
  for key in keys:
    steps, values = history.series(key)
    if not steps:
      continue
    # Each step is one small batch: the raw curve is faint, a moving
    # average over about 2% of the run is drawn on top.
    window = max(1, len(values) // 50)
    line, = ax.plot(steps, values, linewidth=0.6, alpha=0.35)
    smooth = np.convolve(values, np.ones(window) / window, mode="valid")
    ax.plot(steps[window - 1:], smooth, color=line.get_color(), label=key,
            linewidth=1.4)
  ax.set_xlabel("step")
  ax.set_ylabel("loss (nats per answer token)")
  ax.set_yscale("log")
  ax.set_title(title)
  ax.grid(True, alpha=0.3)
  if ax.get_legend_handles_labels()[1]:  # a run of 0 steps has no curve
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def json_safe(value):
  """`value` with every non-finite float (NaN, +-inf) as None.

  json.dump writes those as bare NaN / Infinity, which strict JSON parsers
  (jq, JavaScript, other languages) refuse; null is what they read."""
  if isinstance(value, dict):
    return {k: json_safe(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [json_safe(v) for v in value]
  if isinstance(value, numbers.Real) and not isinstance(
      value, numbers.Integral) and not math.isfinite(value):
    return None
  return value


def write_log(path: str, settings: dict, history: History, **extra):
  """The run's settings, extra facts and every step's metrics as strict
  JSON: a value that is not a finite number (no eval batches, a diverged
  loss) is null."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  record = json_safe(dict(date=time.strftime("%Y-%m-%d %H:%M:%S"),
                          settings=settings, **extra, history=history.rows))
  with open(path, "w", encoding="utf-8") as f:
    json.dump(record, f, indent=1, allow_nan=False)
