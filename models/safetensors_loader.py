"""Load a Hugging Face checkpoint directory (config.json + safetensors) of a
supported architecture (`models.architectures`: llama, mistral, qwen2, qwen3).

Handles one `*.safetensors` file or many, with `model.safetensors.index.json`
when sharded; config.json is read by `models.hf_config`.

Tensors are read one at a time straight from the files (numpy memmap, with
ml_dtypes for bfloat16, which numpy itself cannot name) and written into
device arrays of the target dtype (`models.weights.load_params`): the
safetensors package's numpy backend rejects bfloat16, and its jax backend
would place every tensor on the accelerator in the file's dtype.
"""

from __future__ import annotations

import json
import math
import os
import struct

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import LlamaConfig
from models.errors import ModelFileNotFoundError, ModelFormatError
from models.hf_config import config_from_hf, load_hf_config
from models.llama import Llama, llama_from_params
from models.weights import (CheckpointNames, check_tensors, expected_shapes,
                            load_params)

# config_from_hf is re-exported: callers import it from here.
__all__ = ["config_from_hf", "load_safetensors"]

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
_HF_NAMES = CheckpointNames(
    embed_tokens="model.embed_tokens.weight", final_norm="model.norm.weight",
    lm_head="lm_head.weight", layer_template="model.layers.{i}.{name}",
    layer_names={
        "attn_norm": "input_layernorm.weight",
        "q_proj": "self_attn.q_proj.weight",
        "k_proj": "self_attn.k_proj.weight",
        "v_proj": "self_attn.v_proj.weight",
        "o_proj": "self_attn.o_proj.weight",
        "mlp_norm": "post_attention_layernorm.weight",
        "gate_proj": "mlp.gate_proj.weight", "up_proj": "mlp.up_proj.weight",
        "down_proj": "mlp.down_proj.weight",
        "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
        "v_bias": "self_attn.v_proj.bias",
        "q_norm": "self_attn.q_norm.weight",
        "k_norm": "self_attn.k_norm.weight"})
# Byte width of every dtype a safetensors header may name (to check offsets
# of tensors we do not load, too).
_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
                "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4,
                "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class _SafetensorsFile:
  """Lazy reader of one .safetensors file: name -> numpy memmap view.

  The header is checked when the file is opened (every entry's dtype, shape
  and byte range against the file size), so a truncated or corrupted file
  is refused before any tensor is read.
  """

  def __init__(self, path: str):
    self.path = path
    try:
      size = os.path.getsize(path)
      with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
          raise ModelFormatError(f"{path}: not a safetensors file (shorter "
                                 "than its 8-byte header length)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8:
          raise ModelFormatError(
              f"{path}: not a safetensors file, or truncated: its header "
              f"length says {header_len} bytes, the file has {size}")
        header = json.loads(f.read(header_len))
    except FileNotFoundError as e:
      raise ModelFileNotFoundError(f"safetensors file not found: {path}"
                                   ) from e
    except ModelFormatError:
      raise
    except OSError as e:  # a directory of that name, no permission, ...
      raise ModelFormatError(f"{path}: cannot be read as a safetensors file "
                             f"({e.strerror or e})") from e
    except ValueError as e:  # JSON or UTF-8 errors in the header
      raise ModelFormatError(f"{path}: not a safetensors file (unreadable "
                             f"header: {e})") from e
    if not isinstance(header, dict):
      raise ModelFormatError(f"{path}: not a safetensors file (the header "
                             "is not a JSON object)")
    header.pop("__metadata__", None)
    self.header = header
    self._data_start = 8 + header_len
    for name, info in header.items():
      problem = _header_entry_problem(info, size - self._data_start)
      if problem:
        raise ModelFormatError(f"{path}: tensor {name!r}: {problem}; the file "
                               "is corrupted or truncated")
    self._memmap = None

  def names(self):
    return self.header.keys()

  def shape(self, name: str) -> tuple[int, ...]:
    return tuple(self.header[name]["shape"])

  def check_dtype(self, name: str):
    """Raises ModelFormatError if tensor `name`'s dtype cannot be loaded."""
    dtype = self.header[name]["dtype"]
    if dtype not in _SAFETENSORS_DTYPES:
      raise ModelFormatError(f"{self.path}: tensor {name!r} has dtype "
                             f"{dtype}; supported: "
                             f"{', '.join(_SAFETENSORS_DTYPES)}")

  def get(self, name: str) -> np.ndarray:
    self.check_dtype(name)
    info = self.header[name]
    if self._memmap is None:
      self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    begin, end = info["data_offsets"]
    raw = self._memmap[self._data_start + begin:self._data_start + end]
    return np.asarray(raw).view(_SAFETENSORS_DTYPES[info["dtype"]]).reshape(
        info["shape"])


def _header_entry_problem(info, data_size: int) -> str | None:
  """Why a safetensors header entry is invalid, or None."""
  if not isinstance(info, dict):
    return "its header entry is not a JSON object"
  dtype, shape, offsets = (info.get("dtype"), info.get("shape"),
                           info.get("data_offsets"))
  if not isinstance(dtype, str):
    return f"dtype {dtype!r} is not a string"
  if not (isinstance(shape, list) and
          all(isinstance(d, int) and d >= 0 for d in shape)):
    return f"shape {shape!r} is not a list of sizes"
  if not (isinstance(offsets, list) and len(offsets) == 2 and
          all(isinstance(o, int) for o in offsets) and
          0 <= offsets[0] <= offsets[1] <= data_size):
    return (f"data_offsets {offsets!r} do not lie within the file's "
            f"{data_size} data bytes")
  width = _DTYPE_BYTES.get(dtype)
  if width is not None and offsets[1] - offsets[0] != width * math.prod(shape):
    return (f"{offsets[1] - offsets[0]} bytes do not hold a {dtype} tensor "
            f"of shape {shape}")
  return None


def _open_checkpoint(directory: str) -> dict[str, _SafetensorsFile]:
  """Tensor name -> the file holding it."""
  # transformers reads model.safetensors before an index, so an index that
  # an earlier sharded save left beside it (save_pretrained keeps it) is
  # not the model's.
  single_path = os.path.join(directory, "model.safetensors")
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index_path) and not os.path.isfile(single_path):
    try:
      with open(index_path) as f:
        weight_map = json.load(f)["weight_map"]
      shards = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      raise ModelFormatError(f"{index_path}: not a safetensors index (no "
                             f"readable weight_map: {e!r})") from e
    files = {name: _SafetensorsFile(os.path.join(directory, name))
             for name in shards}
    for tensor, name in weight_map.items():
      if tensor not in files[name].header:
        raise ModelFormatError(f"{index_path}: the index puts tensor "
                               f"{tensor!r} in {name}, which does not hold "
                               f"it")
    return {tensor: files[name] for tensor, name in weight_map.items()}
  # Other files beside model.safetensors (an old copy, an adapter) are not
  # part of the model either.
  names = (["model.safetensors"] if os.path.isfile(single_path)
           else sorted(n for n in os.listdir(directory)
                       if n.endswith(".safetensors")))
  if not names:
    raise ModelFileNotFoundError(f"{directory}: no *.safetensors files")
  by_tensor = {}
  for name in names:
    file = _SafetensorsFile(os.path.join(directory, name))
    for tensor in file.names():
      if tensor in by_tensor:  # which copy is the model's is unknowable
        raise ModelFormatError(
            f"{directory}: tensor {tensor!r} is in both "
            f"{os.path.basename(by_tensor[tensor].path)} and {name}, and "
            f"no model.safetensors.index.json says which to use")
      by_tensor[tensor] = file
  return by_tensor


def _check_tied_lm_head(tensors: dict[str, _SafetensorsFile],
                        directory: str):
  """Refuses a tied checkpoint whose stored lm_head.weight is not its
  embedding: transformers 4 would ignore that matrix and transformers 5
  unties the model to use it, so which model was meant is unknowable."""
  embed, head = _HF_NAMES.embed_tokens, _HF_NAMES.lm_head
  tensors[head].check_dtype(head)
  a, b = tensors[embed].get(embed), tensors[head].get(head)
  # Compared block by block: the memmapped tensors are read from disk, and
  # no full-size temporary is made.
  rows = max(1, (1 << 22) // max(1, math.prod(a.shape[1:])))
  same = a.shape == b.shape and all(
      np.array_equal(a[i:i + rows], b[i:i + rows])
      for i in range(0, a.shape[0], rows))
  if not same:
    raise ModelFormatError(
        f"{directory}: config.json sets tie_word_embeddings=true, but the "
        f"checkpoint also stores {head!r}, which differs from {embed!r}; "
        "set tie_word_embeddings to false to use the stored lm_head, or "
        "remove it to tie the output to the embedding")


def _params_from_checkpoint(config: LlamaConfig,
                            tensors: dict[str, _SafetensorsFile],
                            directory: str, param_dtype,
                            progress: bool, sharding=None) -> dict:
  expected = expected_shapes(config, _HF_NAMES)
  # Older checkpoints store RoPE's inverse frequencies; they are recomputed.
  # A tied model may also store its output matrix, a copy of the embedding
  # (checked below).
  ignored = (lambda name: name.endswith("rotary_emb.inv_freq") or
             (config.tie_word_embeddings and name == _HF_NAMES.lm_head))
  check_tensors({name: file.shape(name) for name, file in tensors.items()
                 if not ignored(name)}, expected, directory)
  for name in expected:  # refuse before reading anything
    tensors[name].check_dtype(name)
  if config.tie_word_embeddings and _HF_NAMES.lm_head in tensors:
    _check_tied_lm_head(tensors, directory)
  return load_params(config, _HF_NAMES, lambda name: tensors[name].get(name),
                     param_dtype=param_dtype, progress=progress,
                     description="Loading safetensors weights",
                     sharding=sharding)


def load_safetensors(directory, *, dtype=jnp.float32, param_dtype=None,
                     max_position: int | None = None, progress: bool = False,
                     sharding=None) -> tuple[LlamaConfig, Llama]:
  """Loads an HF checkpoint directory of a supported architecture.

  Everything is checked before any tensor is read (the configuration, every
  tensor's name, shape and dtype); then the tensors are read one at a time,
  straight into device arrays of `param_dtype`.

  Args:
    directory: holds config.json and *.safetensors (and
      model.safetensors.index.json when sharded); tokenizer files there are
      read by the tokenizer, not here.
    dtype: compute dtype of the model.
    param_dtype: storage dtype of the weights (default: `dtype`).
    max_position: overrides max_position_embeddings (a sliding-window
      model is limited to its window).
    progress: show a progress bar while reading the tensors.
    sharding: optional callable, the checkpoint's LlamaConfig -> a
      `models.sharding.TensorParallel` (or None): called once the config is
      read and before any tensor is, it may refuse the model; each device
      then receives only its shard of every tensor.

  Returns:
    (config, model): the checkpoint's config; the model runs with
    `sharding.model_config(config)` (more KV heads where they are
    replicated).

  Raises:
    ModelFileNotFoundError (a ModelFormatError and a FileNotFoundError): no
      directory, config.json, safetensors files, or a shard the index names.
    ModelFormatError: not a supported Llama checkpoint: an unreadable
      config.json or weights file, a missing, unexpected or wrongly shaped
      tensor, an unsupported dtype or architecture (message says which;
      for an architecture, it lists the supported ones).
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise ModelFileNotFoundError(
        f"checkpoint directory not found: {directory}")
  config = load_hf_config(directory, max_position)
  tensors = _open_checkpoint(directory)
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  placement = sharding(config) if sharding is not None else None
  params = _params_from_checkpoint(config, tensors, directory, param_dtype,
                                   progress, placement)
  model = llama_from_params(
      config if placement is None else placement.model_config(config),
      params, dtype=dtype, param_dtype=param_dtype)
  return config, model
