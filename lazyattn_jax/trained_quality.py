"""The answer-quality options a fine-tuned model was trained for.

`lazyattn finetune` trains a model for one engine layout: a preamble (none,
the chat template's prefix, or a learned sink) and first-page recompute (k
tokens, or none).  Its export records that layout in the safetensors
metadata (`FINETUNE_METADATA`: the run's recipe, whose config.layout holds
`training.batch.Layout`'s fields) and keeps a learned sink's vectors beside
the weights (`SINK_FILE`).  Served in any other layout the model computes
what it was never trained for, so `LazyEngine.from_pretrained` takes that
layout as its default quality (`trained_default`) in place of the generic
`quality_options.default_quality`; explicit quality arguments still win.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np

from lazyattn_jax.errors import InvalidOptionError
from lazyattn_jax.loading import DEFAULT_PAGE_SIZE
from lazyattn_jax.quality_options import DEFAULT, QualityOptions

FINETUNE_METADATA = "lazyattn_finetune"
SINK_FILE = "lazyattn_sink.safetensors"
# from_pretrained's default page size.  The engine recomputes whole pages
# (QualityOptions.tokens_to_recompute), so the fine-tuning command trains
# only a k that this page size serves.
SERVED_PAGE_SIZE = DEFAULT_PAGE_SIZE
# How to serve an export whose trained preamble cannot be read.
_NAME_THE_PREAMBLE = ("name a preamble (from_pretrained's sink= or "
                      "preamble=, or quality=; lazyattn rag's --sink FILE or "
                      "--preamble chat, or --no-default-quality)")


def layout_quality(layout: dict, sink=None) -> QualityOptions:
  """The QualityOptions that serve a training layout (`Layout`'s fields as
  its recipe records them).  A token preamble is the chat template's
  prefix: the engine serves no other, and `finetune` trains no other.  A
  learned one is `sink` ([P, D]).

  Raises:
    InvalidOptionError: fields that are not a layout, or a learned
      preamble without its sink.
  """
  try:
    length = int(layout.get("preamble_len") or 0)
    ids = layout.get("preamble_ids")
    k = int(layout.get("recompute_tokens") or 0)
  except (AttributeError, TypeError, ValueError):
    raise InvalidOptionError(f"not a training layout: {layout!r}") from None
  recompute = dict(recompute=True, recompute_tokens=k) if k > 0 else {}
  if length <= 0:
    return QualityOptions(**recompute)
  if ids is not None:
    return QualityOptions(preamble="chat", **recompute)
  if sink is None:
    raise InvalidOptionError("the layout's learned preamble needs its sink")
  return QualityOptions(preamble="sink", sink=sink, **recompute)


def finetune_recipe(path) -> dict | None:
  """The recipe in the export at `path`, or None where `path` is no
  directory whose model.safetensors carries one (a model name, a GGUF
  file, a model not fine-tuned here, or a file the loader will report as
  unreadable)."""
  from safetensors import safe_open
  file = pathlib.Path(path).expanduser() / "model.safetensors"
  if not file.is_file():
    return None
  try:
    with safe_open(str(file), framework="numpy") as f:
      text = (f.metadata() or {}).get(FINETUNE_METADATA)
  except Exception:  # noqa: BLE001 - load_model reports a bad file
    return None
  if text is None:
    return None
  try:
    recipe = json.loads(text)
    layout_ok = isinstance(recipe["config"]["layout"], dict)
  except (ValueError, TypeError, KeyError):
    layout_ok = False
  if not layout_ok:
    raise InvalidOptionError(
        f"{file}: its {FINETUNE_METADATA} metadata is not a fine-tuning "
        "recipe with config.layout; pass quality= explicitly")
  return recipe


def _export_sink(directory: pathlib.Path, recipe: dict) -> np.ndarray:
  """The learned sink saved beside the weights, checked against the hash
  the recipe recorded."""
  from lazyattn_jax.training.errors import SinkFormatError
  from lazyattn_jax.training.sink_file import load_sink
  try:
    sink, _ = load_sink(directory / SINK_FILE)
  except SinkFormatError as e:
    # Exports from before the sink was saved with the weights.
    raise InvalidOptionError(
        f"{directory} was fine-tuned after a learned sink, which it does "
        f"not hold ({e}); {_NAME_THE_PREAMBLE} (the sink file the run was "
        "given)") from None
  want = recipe.get("sink_sha256")
  if want and hashlib.sha256(sink.tobytes()).hexdigest() != want:
    raise InvalidOptionError(
        f"{directory / SINK_FILE} is not the sink the model was fine-tuned "
        f"after (its hash differs from the recipe's); {_NAME_THE_PREAMBLE}")
  return sink


def _check_chat_preamble(directory: pathlib.Path, ids):
  """Refuses a token preamble other than the chat prefix: exports of the
  former --preamble-text, whose layout the engine cannot serve."""
  from lazyattn_jax.requests import chat_prefix
  from models.tokenizer import LlamaTokenizer
  if not (directory / "tokenizer.json").is_file():
    return  # make_preamble refuses preamble="chat" without a tokenizer
  tokenizer = LlamaTokenizer.from_tokenizer_json(directory)
  if list(ids) != list(chat_prefix(tokenizer)):
    raise InvalidOptionError(
        f"{directory} was fine-tuned after a token preamble that is not the "
        "chat template's prefix (the former --preamble-text), a layout the "
        f"engine cannot serve; {_NAME_THE_PREAMBLE}, or fine-tune again "
        "with --preamble chat")


def trained_quality(path, preamble_given: bool = False
                    ) -> QualityOptions | None:
  """The layout the export at `path` was fine-tuned for, as
  QualityOptions, or None where it is no such export.  `preamble_given`:
  the caller names the preamble itself, so the trained one is not read
  (the result has none, for the caller's to replace).

  Raises:
    InvalidOptionError: a layout the engine cannot serve (a learned sink
      missing from the export or not the trained one, or a token preamble
      other than the chat prefix).
  """
  recipe = finetune_recipe(path)
  if recipe is None:
    return None
  directory = pathlib.Path(path).expanduser()
  layout = recipe["config"]["layout"]
  if preamble_given:
    layout = dict(layout, preamble_len=0, preamble_ids=None)
  sink = None
  if layout.get("preamble_len") and layout.get("preamble_ids") is None:
    sink = _export_sink(directory, recipe)
  elif layout.get("preamble_len"):
    _check_chat_preamble(directory, layout["preamble_ids"])
  return layout_quality(layout, sink)


def trained_default(name_or_path, mode: str, quality, fields=()):
  """`from_pretrained`'s `quality` argument: where it is "default", the
  mode takes quality options (lazy, block) and `name_or_path` is a
  fine-tuned export, the layout it was trained for; else `quality` as
  given (other modes keep their default of no options).  `fields`: the
  QualityOptions fields the caller gave by name, which replace the
  layout's (a preamble or sink among them replaces the trained one, which
  is then not read)."""
  from lazyattn_jax.default_model import KNOWN_MODEL_NAMES
  from lazyattn_jax.modes import MODES
  if not (isinstance(quality, str) and quality == DEFAULT):
    return quality
  if mode not in MODES or not MODES[mode].takes_quality_options:
    return quality
  if not isinstance(name_or_path, (str, os.PathLike)) or (
      isinstance(name_or_path, str) and
      name_or_path.strip().lower() in KNOWN_MODEL_NAMES):
    return quality  # a model name, resolved as resolve_model_path does
  trained = trained_quality(
      name_or_path, preamble_given=bool({"preamble", "sink"} & set(fields)))
  return quality if trained is None else trained
