"""The progress bar class: tqdm.auto only where ipywidgets can draw it
(without it, tqdm.auto warns "IProgress not found" in Jupyter)."""

from __future__ import annotations

import importlib.util

import tqdm as tqdm_package
import tqdm.auto

from lazyattn_jax.progress import progress_bar_class


def test_text_bar_without_ipywidgets(monkeypatch):
  find = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      None if name == "ipywidgets" else find(name, *a)))
  assert progress_bar_class() is tqdm_package.tqdm


def test_auto_bar_with_ipywidgets(monkeypatch):
  find = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: (
      find("json") if name == "ipywidgets" else find(name, *a)))
  assert progress_bar_class() is tqdm.auto.tqdm
