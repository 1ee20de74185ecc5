"""Load a Hugging Face checkpoint directory (config.json + safetensors) of a
supported architecture (`models.architectures`: llama, mistral, qwen2, qwen3).

Handles one `*.safetensors` file or many, with `model.safetensors.index.json`
when sharded, and both spellings of the RoPE settings (`rope_theta` +
`rope_scaling` of transformers 4, `rope_parameters` of transformers 5).

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

from models.architectures import Architecture, architecture_from_hf
from models.config import Llama3RopeScaling, LlamaConfig
from models.errors import ModelFileNotFoundError, ModelFormatError
from models.llama import Llama, llama_from_params
from models.weights import (CheckpointNames, check_tensors, expected_shapes,
                            load_params)

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


def _rope_type(settings: dict):
  return settings.get("rope_type", settings.get("type", "default"))


def _rope_settings(hf: dict,
                   path: str) -> tuple[float, Llama3RopeScaling | None]:
  """(rope_theta, Llama-3 scaling or None) from an HF config dict."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
  # A config may carry both spellings (transformers v5's rope_parameters,
  # v4's rope_scaling); a scaling named in either applies.
  kinds = {name: _rope_type(d) for name, d in
           (("rope_parameters", params), ("rope_scaling", scaling))}
  scaled = {name: kind for name, kind in kinds.items()
            if kind not in (None, "default")}
  if not scaled:
    return float(theta), None
  if len(set(scaled.values())) > 1:
    raise ModelFormatError(f"{path}: rope_parameters and rope_scaling name "
                           f"different RoPE types ({kinds})")
  settings = ({**scaling, **params} if "rope_parameters" in scaled
              else {**params, **scaling})
  rope_type = next(iter(scaled.values()))
  if rope_type != "llama3":
    raise ModelFormatError(f"{path}: rope type {rope_type!r} is not "
                           "supported (plain and 'llama3' RoPE are)")
  return float(theta), Llama3RopeScaling(
      factor=float(settings["factor"]),
      low_freq_factor=float(settings.get("low_freq_factor", 1.0)),
      high_freq_factor=float(settings.get("high_freq_factor", 4.0)),
      original_max_position=int(settings.get(
          "original_max_position_embeddings", 8192)))


def _single_token_id(value) -> int | None:
  if isinstance(value, list):
    value = value[0] if value else None
  return None if value is None else int(value)


def _sliding_window(hf: dict, model_type: str) -> int | None:
  """The attention window of a sliding-window model, or None.

  Mistral's `sliding_window` is in force whenever it is set; Qwen's only with
  `use_sliding_window` (or a layer of type "sliding_attention").
  """
  window = hf.get("sliding_window")
  if window is None:
    return None
  if (model_type == "mistral" or hf.get("use_sliding_window") or
      "sliding_attention" in (hf.get("layer_types") or ())):
    return int(window)
  return None


def _max_position(hf: dict, model_type: str, requested: int | None,
                  path: str) -> int:
  """The model's positions, limited to its attention window if it has one:
  within the window, full attention (which the kernels compute) and
  sliding-window attention are the same function."""
  window = _sliding_window(hf, model_type)
  if window is not None and requested is not None and requested > window:
    raise ModelFormatError(
        f"{path}: max_position {requested} exceeds the model's sliding "
        f"window of {window} tokens; sliding-window attention is not "
        "supported beyond the window")
  configured = int(requested or hf.get("max_position_embeddings", 8192))
  return configured if window is None else min(configured, window)


def _check_unsupported_flags(hf: dict, family: Architecture, path: str):
  if hf.get("mlp_bias"):
    raise ModelFormatError(f"{path}: mlp_bias=true is not supported")
  # HF's attention_bias also puts a bias on the output projection, which
  # this model does not have; Qwen2's Q/K/V biases come with its family.
  if hf.get("attention_bias"):
    raise ModelFormatError(f"{path}: attention_bias=true is not supported "
                           f"for model_type {family.name!r}")


def config_from_hf(hf: dict, path: str = "config.json",
                   max_position: int | None = None) -> LlamaConfig:
  """LlamaConfig from the dict of an HF `config.json` of a supported
  architecture (a missing `model_type` means llama).

  Raises:
    ModelFormatError: not a supported configuration (message says why; an
      unsupported model type lists the supported ones).
  """
  if not isinstance(hf, dict):
    raise ModelFormatError(f"{path}: expected a JSON object, got "
                           f"{type(hf).__name__}")
  family = architecture_from_hf(hf.get("model_type", "llama"), path)
  _check_unsupported_flags(hf, family, path)
  if hf.get("hidden_act", "silu") != "silu":
    raise ModelFormatError(f"{path}: hidden_act {hf['hidden_act']!r} is not "
                           "supported (only 'silu')")
  try:
    num_heads = int(hf["num_attention_heads"])
    hidden = int(hf["hidden_size"])
    theta, scaling = _rope_settings(hf, path)
    eos = _single_token_id(hf.get("eos_token_id"))
    bos = _single_token_id(hf.get("bos_token_id"))
    vocab = int(hf["vocab_size"])
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=int(hf["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or num_heads),
        head_dim=int(hf.get("head_dim") or hidden // num_heads),
        intermediate_size=int(hf["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=_max_position(hf, family.name, max_position, path),
        bos_token_id=bos if bos is not None and 0 <= bos < vocab else None,
        eos_token_id=eos if eos is not None and 0 <= eos < vocab else None,
        attention_bias=family.attention_bias,
        qk_norm=family.qk_norm,
    )
  except KeyError as e:
    raise ModelFormatError(f"{path}: missing field {e.args[0]!r}") from e
  except ModelFormatError:
    raise
  except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
    # LlamaConfig's own checks, or a field of the wrong type.
    raise ModelFormatError(f"{path}: unsupported model configuration: {e}"
                           ) from e


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
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index_path):
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
  # Without an index, transformers reads model.safetensors alone; other
  # files beside it (an old copy, an adapter) are not part of the model.
  names = (["model.safetensors"]
           if os.path.isfile(os.path.join(directory, "model.safetensors"))
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


def _params_from_checkpoint(config: LlamaConfig,
                            tensors: dict[str, _SafetensorsFile],
                            directory: str, param_dtype,
                            progress: bool, sharding=None) -> dict:
  expected = expected_shapes(config, _HF_NAMES)
  # Older checkpoints store RoPE's inverse frequencies; they are recomputed.
  # A tied model may also store its output matrix, which transformers
  # ignores (the embedding is the output matrix).
  ignored = (lambda name: name.endswith("rotary_emb.inv_freq") or
             (config.tie_word_embeddings and name == _HF_NAMES.lm_head))
  check_tensors({name: file.shape(name) for name, file in tensors.items()
                 if not ignored(name)}, expected, directory)
  for name in expected:  # refuse before reading anything
    tensors[name].check_dtype(name)
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
  config_path = os.path.join(directory, "config.json")
  if not os.path.isfile(config_path):
    raise ModelFileNotFoundError(f"{directory}: no config.json")
  try:
    with open(config_path, encoding="utf-8") as f:
      hf = json.load(f)
  except ValueError as e:  # JSON or UTF-8 errors
    raise ModelFormatError(f"{config_path}: not valid JSON ({e})") from e
  config = config_from_hf(hf, config_path, max_position)
  tensors = _open_checkpoint(directory)
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  placement = sharding(config) if sharding is not None else None
  params = _params_from_checkpoint(config, tensors, directory, param_dtype,
                                   progress, placement)
  model = llama_from_params(
      config if placement is None else placement.model_config(config),
      params, dtype=dtype, param_dtype=param_dtype)
  return config, model
