"""Reading the JSON files that come beside a model's weights (config.json,
generation_config.json, tokenizer_config.json, ...)."""

from __future__ import annotations

import json
import os

from models.errors import ModelFormatError

__all__ = ["read_json_object"]


def read_json_object(path: str | os.PathLike, *,
                     missing_ok: bool = False) -> dict:
  """The JSON object in `path`; {} for a missing file if `missing_ok`.

  Raises:
    ModelFormatError: not valid JSON, not UTF-8, or not an object.
    FileNotFoundError: a missing file, unless `missing_ok`.
  """
  if missing_ok and not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding="utf-8") as f:
      value = json.load(f)
  except ValueError as e:  # JSON or UTF-8 errors
    raise ModelFormatError(f"{path}: not valid JSON ({e})") from e
  if not isinstance(value, dict):
    raise ModelFormatError(f"{path}: expected a JSON object, got "
                           f"{type(value).__name__}")
  return value
