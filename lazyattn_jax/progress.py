"""The progress bar class the library's long calls use."""

from __future__ import annotations

import importlib.util


def progress_bar_class():
  """tqdm.auto's bar (a widget in Jupyter) where ipywidgets is installed,
  else tqdm's text bar: without ipywidgets, tqdm.auto in Jupyter warns
  "IProgress not found" before falling back to text anyway."""
  if importlib.util.find_spec("ipywidgets") is None:
    from tqdm import tqdm
  else:
    from tqdm.auto import tqdm
  return tqdm
