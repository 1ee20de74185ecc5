"""Loading a model and its tokenizer by name or path, for `from_pretrained`."""

from __future__ import annotations

import dataclasses
import os

import jax.numpy as jnp

from lazyattn_jax.cache_config import CacheConfig


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  """Weights, tokenizer and the id that keys their documents in the cache."""
  config: object  # models.config.LlamaConfig
  model: object  # models.llama.Llama
  tokenizer: object | None  # models.tokenizer.LlamaTokenizer
  model_id: str


def load_model(name_or_path: str, dtype, progress: bool,
               sharding=None) -> LoadedModel:
  """Loads "smollm2-135m-instruct" (the embedded default model, fetched into
  a user cache on first use), a .gguf file, or a HF safetensors directory
  (config.json, *.safetensors, optional tokenizer.json; without a tokenizer
  the engine takes token ids only), of any architecture and tensor type
  `models.gguf_loader` and `models.safetensors_loader` accept.  Weights
  stream tensor by tensor into `dtype` on the device, or, with `sharding`
  (the file's LlamaConfig -> a models.sharding.TensorParallel or None),
  into each device's shard of them."""
  from lazyattn_jax.default_model import resolve_model_path
  from models.tokenizer import LlamaTokenizer
  dtype = jnp.dtype(dtype)
  path = resolve_model_path(name_or_path)
  if path.is_dir():
    from models.safetensors_loader import load_safetensors
    config, model = load_safetensors(path, dtype=dtype, progress=progress,
                                     sharding=sharding)
    tokenizer = None
    if (path / "tokenizer.json").is_file():
      tokenizer = LlamaTokenizer.from_tokenizer_json(path)
    return LoadedModel(config, model, tokenizer, f"hf:{os.path.abspath(path)}")
  from models.gguf_loader import load_gguf
  config, model, metadata = load_gguf(path, dtype=dtype, progress=progress,
                                      sharding=sharding)
  # From the metadata already read: parsing the file again costs seconds.
  tokenizer = LlamaTokenizer.from_gguf_metadata(metadata.key_values())
  return LoadedModel(config, model, tokenizer,
                     f"gguf:{path.name}:{path.stat().st_size}")


def default_cache_config(config, dtype, num_pages: int,
                         page_size: int) -> CacheConfig:
  """A pool of `num_pages` pages for `config` in `dtype` (the compute dtype,
  or "float8_e4m3fn": `CacheConfig.pool_bytes` counts its scales): a
  quarter as many document slots, and documents up to half the pool (or the
  model's context)."""
  max_doc_pages = max(1, min(num_pages // 2, config.max_position // page_size))
  return CacheConfig(
      num_pages=num_pages, page_size=page_size,
      num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim, dtype=jnp.dtype(dtype).name,
      max_docs=max(16, num_pages // 4), max_pages_per_doc=max_doc_pages)
