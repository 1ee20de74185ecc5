"""SHA-256 of files read in chunks, so a model file is never held whole."""

from __future__ import annotations

import hashlib
import os

_CHUNK_BYTES = 1 << 22


def update_from_file(digest, path: str | os.PathLike) -> None:
  """Feeds the bytes of the file at `path` into `digest` (a hashlib object).

  Raises OSError when the file cannot be read."""
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK_BYTES):
      digest.update(chunk)


def file_sha256(path: str | os.PathLike) -> str:
  """The hex SHA-256 of one file.  Raises OSError when it cannot be read."""
  digest = hashlib.sha256()
  update_from_file(digest, path)
  return digest.hexdigest()
