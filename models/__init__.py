"""Flax (NNX) Llama whose attention calls the lazy attention kernel contract.

Weight loaders (GGUF, HF safetensors) are imported on first use, so importing
`models.paged_inputs` or the model does not pull in the `gguf` package.
"""

from models.config import Llama3RopeScaling, LlamaConfig
from models.dense_reference import causal_mask, dense_forward
from models.llama import (Llama, forward, kv_cache_shape, llama_from_params,
                          param_shapes, split_model)
from models.paged_inputs import PagedAttentionInputs

_LAZY = {
    "GgufMetadata": "models.gguf_loader",
    "load_gguf": "models.gguf_loader",
    "read_gguf_metadata": "models.gguf_loader",
    "load_safetensors": "models.safetensors_loader",
}


def __getattr__(name):
  if name in _LAZY:
    import importlib
    return getattr(importlib.import_module(_LAZY[name]), name)
  raise AttributeError(f"module 'models' has no attribute {name!r}")


__all__ = [
    "GgufMetadata",
    "Llama",
    "Llama3RopeScaling",
    "LlamaConfig",
    "PagedAttentionInputs",
    "causal_mask",
    "dense_forward",
    "forward",
    "kv_cache_shape",
    "llama_from_params",
    "load_gguf",
    "load_safetensors",
    "param_shapes",
    "read_gguf_metadata",
    "split_model",
]
