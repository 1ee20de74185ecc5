"""Reading a Hugging Face `config.json` (and the stop ids of
`generation_config.json`) into a `models.config.LlamaConfig`.

The settings are read as transformers 5 reads them, so that a checkpoint
runs here as it runs there:

- a field config.json leaves out takes its family's transformers default
  (max_position_embeddings: Llama 2048, Mistral 131072, Qwen2/Qwen3 32768;
  Mistral: 8 KV heads and a 4096-token window; Qwen2/Qwen3: 32 KV heads
  and, with `use_sliding_window`, a 4096-token window on the layers from
  `max_window_layers` (28) on; Qwen3: head_dim 128);
- RoPE settings come from `rope_scaling` when it is non-empty, else from
  `rope_parameters` (transformers 4 and 5 spellings), never a mix of the two:
  theta from the chosen dict, else the top-level `rope_theta`, else 10000; a
  Llama-3 scaling's original context from the top-level
  `original_max_position_embeddings`, else the dict's, else
  `max_position_embeddings`;
- every EOS id (a list in config.json, or more in generation_config.json)
  stops generation.
"""

from __future__ import annotations

import os

from models.architectures import Architecture, architecture_from_hf
from models.config import Llama3RopeScaling, LlamaConfig, whole_number
from models.errors import ModelFileNotFoundError, ModelFormatError
from models.json_files import read_json_object

__all__ = ["config_from_hf", "load_hf_config"]

# transformers' defaults, per family, of the fields a config.json may leave
# out (a field set to null falls back as in transformers: KV heads to the
# query heads, head_dim to hidden_size / heads).
_FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "bos_token_id": 1,
              "eos_token_id": 2},
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096,
                "max_position_embeddings": 4096 * 32, "bos_token_id": 1,
                "eos_token_id": 2},
    "qwen2": {"num_key_value_heads": 32, "sliding_window": 4096,
              "max_window_layers": 28, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128,
              "sliding_window": 4096, "max_window_layers": 28,
              "max_position_embeddings": 32768},
}


def _field(hf: dict, family: Architecture, name: str, defaulted: list):
  """`hf[name]`, or the family's transformers default (noted in
  `defaulted`, for error messages) when config.json leaves it out."""
  if name in hf:
    return hf[name]
  value = _FAMILY_DEFAULTS[family.name].get(name)
  if value is not None:
    defaulted.append(f"{name}={value}")
  return value


def _rope_settings(hf: dict, family: Architecture,
                   path: str) -> tuple[float, Llama3RopeScaling | None]:
  """(rope_theta, Llama-3 scaling or None) from an HF config dict."""
  # transformers 5: `rope_parameters = rope_scaling or rope_parameters`,
  # the chosen dict taken whole.
  settings = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
  if not isinstance(settings, dict):
    raise ModelFormatError(f"{path}: rope settings must be a JSON object, "
                           f"got {settings!r}")
  # transformers 5 may key them by layer type (beside `layer_types`); read
  # flat, such a dict has no rope_type and would pass as plain RoPE.
  nested = sorted(k for k, v in settings.items() if isinstance(v, dict))
  if nested:
    raise ModelFormatError(
        f"{path}: rope settings keyed by layer type ({', '.join(nested)}) "
        "are not supported (one setting for every layer is)")
  theta = (settings["rope_theta"] if "rope_theta" in settings
           else hf.get("rope_theta", 10000.0))
  # A null rope_type falls back to `type` (transformers fails on a null
  # with a scaling `type`, so such a config is refused, not read as plain).
  rope_type = settings.get("rope_type") or settings.get("type") or "default"
  partial = settings.get("partial_rotary_factor", 1.0)
  if partial is not None and float(partial) != 1.0:
    raise ModelFormatError(f"{path}: partial_rotary_factor {partial} is not "
                           "supported (RoPE over the whole head is)")
  if rope_type == "default":
    return float(theta), None
  if rope_type != "llama3":
    raise ModelFormatError(f"{path}: rope type {rope_type!r} is not "
                           "supported (plain and 'llama3' RoPE are)")
  # The top-level field wins (transformers' exception for Phi-3-style
  # configs); without either, the pretraining context is the model's.
  original = hf.get("original_max_position_embeddings")
  if original is None:
    original = settings.get("original_max_position_embeddings")
  if original is None:
    original = _field(hf, family, "max_position_embeddings", [])
  return float(theta), Llama3RopeScaling(
      factor=float(settings["factor"]),
      low_freq_factor=float(settings.get("low_freq_factor", 1.0)),
      high_freq_factor=float(settings.get("high_freq_factor", 4.0)),
      original_max_position=whole_number(
          original, "original_max_position_embeddings"))


def _token_ids(value) -> list[int]:
  """The ids of an HF `*_token_id` field: null, an int or a list."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  return [whole_number(v, "a token id") for v in values]


def _eos_setting(config_ids: list[int], generation_ids: list[int],
                 vocab: int) -> int | tuple[int, ...] | None:
  """The EOS ids of config.json and generation_config.json inside the
  vocabulary, first seen first: an int for one, a tuple for several."""
  ids = config_ids + generation_ids
  ids = list(dict.fromkeys(i for i in ids if 0 <= i < vocab))
  if not ids:
    return None
  return ids[0] if len(ids) == 1 else tuple(ids)


def _sliding_window(hf: dict, family: Architecture) -> int | None:
  """The attention window of a model with a sliding layer, or None.

  Mistral's window is in force on every layer unless config.json sets it to
  null.  Qwen's slides only the layers of type "sliding_attention": those
  `layer_types` names, else, with `use_sliding_window`, the layers from
  `max_window_layers` on, so with none of them sliding (the usual Qwen2.5
  config) it is full attention, as in transformers.  Llama has no window.
  Left out, a field is transformers' default of the family.
  """
  if family.name == "mistral":
    window = _field(hf, family, "sliding_window", [])
    return None if window is None else whole_number(window, "sliding_window")
  if family.name not in ("qwen2", "qwen3"):
    return None  # transformers' Llama reads no window fields
  layer_types = hf.get("layer_types")
  if layer_types is None:
    if not hf.get("use_sliding_window"):
      return None
    first = whole_number(_field(hf, family, "max_window_layers", []),
                         "max_window_layers")
    layer_types = ["sliding_attention"
                   if i >= first else "full_attention"
                   for i in range(whole_number(hf["num_hidden_layers"],
                                               "num_hidden_layers"))]
  if "sliding_attention" not in layer_types:
    return None
  # Sliding layers without use_sliding_window fail in transformers; the
  # window is kept, since within it both readings are the same function.
  window = _field(hf, family, "sliding_window", [])
  return None if window is None else whole_number(window, "sliding_window")


def _max_position(hf: dict, family: Architecture, requested: int | None,
                  path: str, defaulted: list) -> int:
  """The model's positions, limited to its attention window if it has one:
  within the window, full attention (which the kernels compute) and
  sliding-window attention are the same function, for every layer or some
  (per-layer windows are not served)."""
  window = _sliding_window(hf, family)
  if window is not None and requested is not None and requested > window:
    raise ModelFormatError(
        f"{path}: max_position {requested} exceeds the model's sliding "
        f"window of {window} tokens; sliding-window attention is not "
        "supported beyond the window")
  configured = (whole_number(requested, "max_position") if requested else
                whole_number(_field(hf, family, "max_position_embeddings",
                                    defaulted), "max_position_embeddings"))
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
                   max_position: int | None = None,
                   generation: dict | None = None) -> LlamaConfig:
  """LlamaConfig from the dict of an HF `config.json` of a supported
  architecture (a missing `model_type` means llama).

  Args:
    hf: config.json's object.
    path: named in error messages.
    max_position: overrides max_position_embeddings (a sliding-window
      model is limited to its window).
    generation: generation_config.json's object, if any: its EOS ids stop
      generation too.

  Raises:
    ModelFormatError: not a supported configuration (message says why; an
      unsupported model type lists the supported ones).
  """
  if not isinstance(hf, dict):
    raise ModelFormatError(f"{path}: expected a JSON object, got "
                           f"{type(hf).__name__}")
  try:  # checked apart, so that its error names its own file
    generation_ids = _token_ids((generation or {}).get("eos_token_id"))
  except (ValueError, TypeError) as e:
    raise ModelFormatError(
        f"generation_config.json beside {path}: eos_token_id "
        f"{generation.get('eos_token_id')!r} is not a token id or a list of "
        f"them") from e
  family = architecture_from_hf(hf.get("model_type", "llama"), path)
  _check_unsupported_flags(hf, family, path)
  if hf.get("hidden_act", "silu") != "silu":
    raise ModelFormatError(f"{path}: hidden_act {hf['hidden_act']!r} is not "
                           "supported (only 'silu')")
  defaulted = []
  try:
    num_heads = whole_number(hf["num_attention_heads"], "num_attention_heads")
    hidden = whole_number(hf["hidden_size"], "hidden_size")
    num_kv_heads = _field(hf, family, "num_key_value_heads", defaulted)
    head_dim = _field(hf, family, "head_dim", defaulted)
    theta, scaling = _rope_settings(hf, family, path)
    bos = _token_ids(_field(hf, family, "bos_token_id", defaulted))
    bos = bos[0] if bos else None
    vocab = whole_number(hf["vocab_size"], "vocab_size")
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=whole_number(hf["num_hidden_layers"], "num_hidden_layers"),
        num_heads=num_heads,
        num_kv_heads=(num_heads if num_kv_heads is None else
                      whole_number(num_kv_heads, "num_key_value_heads")),
        head_dim=(hidden // num_heads if head_dim is None else
                  whole_number(head_dim, "head_dim")),
        intermediate_size=whole_number(hf["intermediate_size"],
                                       "intermediate_size"),
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        max_position=_max_position(hf, family, max_position, path,
                                   defaulted),
        bos_token_id=bos if bos is not None and 0 <= bos < vocab else None,
        eos_token_id=_eos_setting(
            _token_ids(_field(hf, family, "eos_token_id", defaulted)),
            generation_ids, vocab),
        attention_bias=family.attention_bias,
        qk_norm=family.qk_norm,
    )
  except KeyError as e:
    raise ModelFormatError(f"{path}: missing field {e.args[0]!r}") from e
  except ModelFormatError:
    raise
  except (ValueError, TypeError, AttributeError, ZeroDivisionError) as e:
    # LlamaConfig's own checks, or a field of the wrong type.
    note = (f" (fields left out take transformers' {family.name} defaults: "
            f"{', '.join(defaulted)})" if defaulted else "")
    raise ModelFormatError(f"{path}: unsupported model configuration: {e}"
                           f"{note}") from e


def load_hf_config(directory: str,
                   max_position: int | None = None) -> LlamaConfig:
  """The LlamaConfig of a checkpoint directory: its config.json, and the
  EOS ids of its generation_config.json where there is one.

  Raises:
    ModelFileNotFoundError: no config.json in `directory`.
    ModelFormatError: an unreadable or unsupported configuration.
  """
  config_path = os.path.join(directory, "config.json")
  if not os.path.isfile(config_path):
    raise ModelFileNotFoundError(f"{directory}: no config.json")
  hf = read_json_object(config_path)
  generation_path = os.path.join(directory, "generation_config.json")
  generation = (read_json_object(generation_path)
                if os.path.isfile(generation_path) else None)
  return config_from_hf(hf, config_path, max_position, generation)
