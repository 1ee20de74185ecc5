"""Load a Hugging Face Llama checkpoint directory (config.json + safetensors).

Handles one `*.safetensors` file or many, with `model.safetensors.index.json`
when sharded, and both spellings of the RoPE settings (`rope_theta` +
`rope_scaling` of transformers 4, `rope_parameters` of transformers 5).

Tensors are read straight from the files into host memory (numpy memmap, with
ml_dtypes for bfloat16, which numpy itself cannot name), stacked per layer on
the host, and only then handed to the device: the safetensors package's numpy
backend rejects bfloat16, and its jax backend would place every tensor on the
accelerator before stacking.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from models.config import Llama3RopeScaling, LlamaConfig
from models.llama import LAYER_PARAM_NAMES, Llama, llama_from_params

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
}
# Our stacked layer name -> HF name inside model.layers.{i}.
_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "mlp_norm": "post_attention_layernorm",
    "gate_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "down_proj": "mlp.down_proj",
}


def _rope_settings(hf: dict,
                   path: str) -> tuple[float, Llama3RopeScaling | None]:
  """(rope_theta, Llama-3 scaling or None) from an HF config dict."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
  settings = {**scaling, **params}
  rope_type = settings.get("rope_type", settings.get("type", "default"))
  if rope_type in (None, "default"):
    return float(theta), None
  if rope_type != "llama3":
    raise ValueError(f"{path}: rope type {rope_type!r} is not supported "
                     "(plain and 'llama3' RoPE are)")
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


def config_from_hf(hf: dict, path: str = "config.json",
                   max_position: int | None = None) -> LlamaConfig:
  """LlamaConfig from the dict of an HF Llama `config.json`."""
  model_type = hf.get("model_type", "llama")
  if model_type != "llama":
    raise ValueError(f"{path}: model_type {model_type!r} is not supported "
                     "(only 'llama')")
  for flag in ("attention_bias", "mlp_bias"):
    if hf.get(flag):
      raise ValueError(f"{path}: {flag}=true is not supported")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"{path}: hidden_act {hf['hidden_act']!r} is not "
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
        max_position=int(max_position or
                         hf.get("max_position_embeddings", 8192)),
        bos_token_id=bos if bos is not None and 0 <= bos < vocab else None,
        eos_token_id=eos if eos is not None and 0 <= eos < vocab else None,
    )
  except KeyError as e:
    raise ValueError(f"{path}: missing field {e.args[0]!r}") from e


class _SafetensorsFile:
  """Lazy reader of one .safetensors file: name -> numpy memmap view."""

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      (header_len,) = struct.unpack("<Q", f.read(8))
      header = json.loads(f.read(header_len))
    header.pop("__metadata__", None)
    self.header = header
    self._data_start = 8 + header_len
    self._memmap = None

  def names(self):
    return self.header.keys()

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    dtype = _SAFETENSORS_DTYPES.get(info["dtype"])
    if dtype is None:
      raise ValueError(f"{self.path}: tensor {name!r} has dtype "
                       f"{info['dtype']}; supported: "
                       f"{', '.join(_SAFETENSORS_DTYPES)}")
    if self._memmap is None:
      self._memmap = np.memmap(self.path, dtype=np.uint8, mode="r")
    begin, end = info["data_offsets"]
    raw = self._memmap[self._data_start + begin:self._data_start + end]
    return np.asarray(raw).view(dtype).reshape(info["shape"])


def _open_checkpoint(directory: str) -> dict[str, _SafetensorsFile]:
  """Tensor name -> the file holding it."""
  index_path = os.path.join(directory, "model.safetensors.index.json")
  if os.path.isfile(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    files = {name: _SafetensorsFile(os.path.join(directory, name))
             for name in sorted(set(weight_map.values()))}
    return {tensor: files[name] for tensor, name in weight_map.items()}
  names = sorted(n for n in os.listdir(directory) if n.endswith(".safetensors"))
  if not names:
    raise FileNotFoundError(f"{directory}: no *.safetensors files")
  by_tensor = {}
  for name in names:
    file = _SafetensorsFile(os.path.join(directory, name))
    for tensor in file.names():
      by_tensor[tensor] = file
  return by_tensor


@jax.jit
def _swap_last_axes(x):
  return jnp.swapaxes(x, -1, -2)


def _params_from_checkpoint(config: LlamaConfig, tensors: dict,
                            directory: str) -> dict[str, Any]:
  def get(name):
    file = tensors.get(name)
    if file is None:
      raise ValueError(f"{directory}: checkpoint has no tensor {name!r}")
    return file.get(name)

  params = {"embed_tokens": get("model.embed_tokens.weight"),
            "final_norm": get("model.norm.weight")}
  if not config.tie_word_embeddings:
    params["lm_head"] = _swap_last_axes(get("lm_head.weight"))  # -> [D, V]
  layers = {}
  for ours in LAYER_PARAM_NAMES:
    hf_name = _HF_LAYER_NAMES[ours]
    # Stack contiguous HF [out, in] matrices, transpose to [in, out] in XLA.
    stacked = np.stack([get(f"model.layers.{i}.{hf_name}.weight")
                        for i in range(config.num_layers)])
    layers[ours] = stacked if ours.endswith("norm") else _swap_last_axes(
        stacked)
  params["layers"] = layers
  known = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
  known.update(f"model.layers.{i}.{n}.weight" for i in range(config.num_layers)
               for n in _HF_LAYER_NAMES.values())
  unexpected = sorted(n for n in set(tensors) - known
                      if not n.endswith("rotary_emb.inv_freq"))
  if unexpected:
    raise ValueError(f"{directory}: unexpected tensors for a Llama model: "
                     f"{unexpected[:8]}")
  return params


def load_safetensors(directory, *, dtype=jnp.float32, param_dtype=None,
                     max_position: int | None = None
                     ) -> tuple[LlamaConfig, Llama]:
  """Loads an HF Llama checkpoint directory.

  Args:
    directory: holds config.json and *.safetensors (and
      model.safetensors.index.json when sharded); tokenizer files there are
      read by the tokenizer, not here.
    dtype: compute dtype of the model.
    param_dtype: storage dtype of the weights (default: `dtype`).
    max_position: overrides max_position_embeddings.

  Returns:
    (config, model).

  Raises:
    FileNotFoundError: no directory, config.json or safetensors files.
    ValueError: not a supported Llama checkpoint (message says why).
  """
  directory = os.fspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"checkpoint directory not found: {directory}")
  config_path = os.path.join(directory, "config.json")
  if not os.path.isfile(config_path):
    raise FileNotFoundError(f"{directory}: no config.json")
  with open(config_path) as f:
    config = config_from_hf(json.load(f), config_path, max_position)
  tensors = _open_checkpoint(directory)
  params = _params_from_checkpoint(config, tensors, directory)
  model = llama_from_params(config, params, dtype=dtype,
                            param_dtype=param_dtype)
  return config, model
