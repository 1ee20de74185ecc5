"""Read a GGUF file's header: its key/value metadata (tokenizer included).

The tensors are left to `models.gguf_loader`; this part is what the
tokenizer needs too, and it is where a corrupted or truncated file is caught:
`gguf.GGUFReader` parses the whole header (and the tensor table) when it
opens a file.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import gguf
import numpy as np

from models.config import whole_number
from models.errors import ModelFileNotFoundError, ModelFormatError

# What gguf.GGUFReader (and decoding its strings) raises on a corrupted or
# truncated file: it parses with numpy views, so an early end of file shows
# as an empty view (IndexError) or a bad reshape or enum value (ValueError);
# garbage values may have any type (TypeError).
_READER_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError,
                  OSError)
# Large tokenizer arrays, kept out of GgufMetadata.fields.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges", "tokenizer.ggml.scores")


@dataclasses.dataclass(frozen=True)
class GgufMetadata:
  """What a GGUF file says besides its tensors.

  Attributes:
    path: the file.
    architecture: `general.architecture` (e.g. "llama").
    name: `general.name`, if present.
    tokenizer_model: `tokenizer.ggml.model` ("gpt2" for byte-level BPE,
      "llama" for SentencePiece).
    tokenizer_pre: `tokenizer.ggml.pre` (pre-tokenizer name, e.g. "smollm").
    tokens: the vocabulary, index = token id.
    token_types: per-token type (1 normal, 2 unknown, 3 control,
      4 user-defined, 5 unused, 6 byte), if present.
    merges: BPE merges ("a b" strings), if present.
    scores: SentencePiece scores, if present.
    bos_token_id, eos_token_id, unknown_token_id, padding_token_id: ids.
    add_bos_token, add_eos_token, add_space_prefix: tokenizer flags.
    chat_template: Jinja chat template, if present.
    fields: every other key/value (scalars, strings, small arrays as lists).
  """

  path: str
  architecture: str
  name: str | None
  tokenizer_model: str | None
  tokenizer_pre: str | None
  tokens: tuple[str, ...]
  token_types: tuple[int, ...] | None
  merges: tuple[str, ...] | None
  scores: tuple[float, ...] | None
  bos_token_id: int | None
  eos_token_id: int | None
  unknown_token_id: int | None
  padding_token_id: int | None
  add_bos_token: bool | None
  add_eos_token: bool | None
  add_space_prefix: bool | None
  chat_template: str | None
  fields: dict[str, Any]

  def key_values(self) -> dict[str, Any]:
    """Every key/value of the file under its GGUF key, tokenizer arrays
    included: what `models.tokenizer.LlamaTokenizer.from_gguf_metadata`
    takes, so a caller of `load_gguf` need not parse the file again."""
    values = dict(self.fields)
    for key, value in (("tokenizer.ggml.tokens", self.tokens),
                       ("tokenizer.ggml.token_type", self.token_types),
                       ("tokenizer.ggml.merges", self.merges),
                       ("tokenizer.ggml.scores", self.scores)):
      if value:
        values[key] = list(value)
    return values


def _field_value(field) -> Any:
  """Python value of a GGUF key/value field (strings decoded, arrays listed)."""
  if not field.types:
    return None
  main = field.types[0]
  if main == gguf.GGUFValueType.ARRAY:
    if field.types[-1] == gguf.GGUFValueType.STRING:
      return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    if not field.data:
      return []
    return np.concatenate([field.parts[i] for i in field.data]).tolist()
  if main == gguf.GGUFValueType.STRING:
    return bytes(field.parts[-1]).decode("utf-8")
  return field.parts[-1].tolist()[0]


def open_gguf(path: str) -> tuple[gguf.GGUFReader, GgufMetadata]:
  """(reader, metadata) of a GGUF file.

  Raises:
    ModelFormatError: a corrupted or truncated file, or no
      general.architecture (ModelFileNotFoundError: no such file).
  """
  if not os.path.isfile(path):
    raise ModelFileNotFoundError(f"GGUF file not found: {path}")
  try:
    reader = gguf.GGUFReader(path)
    return reader, _metadata_from_reader(reader, path)
  except ModelFormatError:
    raise
  except _READER_ERRORS as e:
    raise ModelFormatError(f"{path} is not a readable GGUF file (corrupted "
                           f"or truncated?): {type(e).__name__}: {e}") from e


def _metadata_from_reader(reader: gguf.GGUFReader, path: str) -> GgufMetadata:
  values = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue  # file-format bookkeeping (version, counts)
    values[key] = _field_value(field)

  def optional_tuple(key):
    value = values.get(key)
    return None if value is None else tuple(value)

  def optional_int(key):
    value = values.get(key)
    try:
      return None if value is None else whole_number(value, key)
    except ValueError as e:
      raise ModelFormatError(f"{path}: {e}") from None

  def optional_bool(key):
    value = values.get(key)
    return None if value is None else bool(value)

  architecture = values.get("general.architecture")
  if not isinstance(architecture, str):
    raise ModelFormatError(f"{path}: GGUF metadata lacks "
                           "general.architecture")
  tokens = values.get("tokenizer.ggml.tokens")
  return GgufMetadata(
      path=path,
      architecture=architecture,
      name=values.get("general.name"),
      tokenizer_model=values.get("tokenizer.ggml.model"),
      tokenizer_pre=values.get("tokenizer.ggml.pre"),
      tokens=tuple(tokens) if tokens is not None else (),
      token_types=optional_tuple("tokenizer.ggml.token_type"),
      merges=optional_tuple("tokenizer.ggml.merges"),
      scores=optional_tuple("tokenizer.ggml.scores"),
      bos_token_id=optional_int("tokenizer.ggml.bos_token_id"),
      eos_token_id=optional_int("tokenizer.ggml.eos_token_id"),
      unknown_token_id=optional_int("tokenizer.ggml.unknown_token_id"),
      padding_token_id=optional_int("tokenizer.ggml.padding_token_id"),
      add_bos_token=optional_bool("tokenizer.ggml.add_bos_token"),
      add_eos_token=optional_bool("tokenizer.ggml.add_eos_token"),
      add_space_prefix=optional_bool("tokenizer.ggml.add_space_prefix"),
      chat_template=values.get("tokenizer.chat_template"),
      fields={k: v for k, v in values.items() if k not in _TOKENIZER_ARRAYS},
  )


def read_gguf_metadata(path) -> GgufMetadata:
  """Reads a GGUF file's metadata (tokenizer included) without its tensors.

  Raises:
    ModelFormatError: the file is not a readable GGUF file
      (ModelFileNotFoundError: there is no such file).
  """
  return open_gguf(os.fspath(path))[1]
