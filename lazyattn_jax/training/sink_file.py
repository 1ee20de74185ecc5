"""The learned document sink's file: one safetensors tensor "sink", float32
[P, D], with string metadata (the model it was trained for, P, steps,
date, ...).  Small enough to commit (16 x 576 floats is 36 KiB)."""

from __future__ import annotations

import os

import numpy as np

from lazyattn_jax.training.errors import SinkFormatError

SINK_TENSOR = "sink"
FORMAT = "lazyattn-sink-v1"


def check_sink(sink, *, hidden_size: int | None = None,
               preamble_len: int | None = None) -> np.ndarray:
  """`sink` as a float32 [P, D] numpy array.

  Raises:
    SinkFormatError: not 2-D, empty, not finite, or P / D other than asked.
  """
  array = np.asarray(sink)
  if array.ndim != 2 or 0 in array.shape:
    raise SinkFormatError(f"a sink must be a non-empty [P, D] array, got "
                          f"shape {array.shape}")
  if not np.issubdtype(array.dtype, np.floating):
    raise SinkFormatError(f"a sink must hold floats, got {array.dtype}")
  if hidden_size is not None and array.shape[1] != hidden_size:
    raise SinkFormatError(f"sink width {array.shape[1]} does not match the "
                          f"model's hidden size {hidden_size}")
  if preamble_len is not None and array.shape[0] != preamble_len:
    raise SinkFormatError(f"sink has {array.shape[0]} vectors, expected "
                          f"{preamble_len}")
  array = array.astype(np.float32)
  if not np.isfinite(array).all():
    raise SinkFormatError("the sink holds non-finite values")
  return array


def save_sink(path: str | os.PathLike, sink, metadata: dict | None = None
              ) -> str:
  """Writes `sink` (checked, as float32) and `metadata` (values become
  strings) to a safetensors file; returns the path."""
  from safetensors.numpy import save_file
  array = check_sink(sink)
  meta = {str(k): str(v) for k, v in (metadata or {}).items()}
  meta.update(format=FORMAT, preamble_len=str(array.shape[0]),
              hidden_size=str(array.shape[1]))
  path = os.fspath(path)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  save_file({SINK_TENSOR: array}, path, metadata=meta)
  return path


def load_sink(path: str | os.PathLike, *, hidden_size: int | None = None,
              preamble_len: int | None = None
              ) -> tuple[np.ndarray, dict[str, str]]:
  """(sink float32 [P, D], metadata) from a file written by `save_sink`.

  Raises:
    SinkFormatError: no such or unreadable file, no float32 "sink" tensor,
      or a shape other than asked.
  """
  from safetensors import safe_open
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise SinkFormatError(f"sink file not found: {path}")
  try:
    with safe_open(path, framework="numpy") as f:
      names = list(f.keys())
      metadata = dict(f.metadata() or {})
      if names != [SINK_TENSOR]:
        raise SinkFormatError(f"{path}: expected one tensor {SINK_TENSOR!r}, "
                              f"found {names}")
      array = f.get_tensor(SINK_TENSOR)
  except SinkFormatError:
    raise
  except Exception as e:  # the Rust reader raises its own error types
    raise SinkFormatError(f"{path}: not a readable safetensors file ({e})"
                          ) from e
  if array.dtype != np.float32:
    raise SinkFormatError(f"{path}: the sink must be float32, got "
                          f"{array.dtype}")
  return check_sink(array, hidden_size=hidden_size,
                    preamble_len=preamble_len), metadata
