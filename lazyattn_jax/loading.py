"""Loading a model and its tokenizer by name or path, for `from_pretrained`."""

from __future__ import annotations

import dataclasses
import os
import warnings

import jax.numpy as jnp
import numpy as np

from lazyattn_jax.cache_config import (MAX_POOL_TOKENS, CacheConfig,
                                       check_compute_dtype,
                                       check_impl_page_size, check_pool_dtype)
from lazyattn_jax.errors import InvalidOptionError


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
  from models.tokenizer import LlamaTokenizer, UnsupportedTokenizerError
  dtype = check_compute_dtype(dtype)
  path = resolve_model_path(name_or_path)
  # The tokenizer is built before any weight is read: a broken tokenizer
  # file is refused before minutes of loading, not after.
  if path.is_dir():
    from models.safetensors_loader import load_safetensors
    tokenizer = (LlamaTokenizer.from_tokenizer_json(path)
                 if (path / "tokenizer.json").is_file() else None)
    config, model = load_safetensors(path, dtype=dtype, progress=progress,
                                     sharding=sharding)
    return LoadedModel(config, model, tokenizer, f"hf:{os.path.abspath(path)}")
  from models.gguf_loader import load_gguf
  built = []

  def build_tokenizer(metadata):  # from the metadata load_gguf has read
    try:
      built.append(LlamaTokenizer.from_gguf_metadata(metadata.key_values()))
    except UnsupportedTokenizerError as e:  # SentencePiece (Llama 2, Mistral)
      warnings.warn(f"{path.name}: {e}", stacklevel=4)
      built.append(None)
  config, model, _ = load_gguf(path, dtype=dtype, progress=progress,
                               sharding=sharding,
                               before_weights=build_tokenizer)
  return LoadedModel(config, model, built[0],
                     f"gguf:{path.name}:{path.stat().st_size}")


# from_pretrained's pool when no cache_config is given.
DEFAULT_NUM_PAGES = 1024
DEFAULT_PAGE_SIZE = 16


def pool_size(cache_config, num_pages, page_size, kv_dtype) -> tuple:
  """(num_pages, page_size) of from_pretrained's pool, defaults filled in.

  Beside a `cache_config` none of the three may be given: they describe
  the pool it replaces, and a float8 `kv_dtype` dropped without a word
  would cost twice a bfloat16 pool's memory.  InvalidOptionError for that
  or for a bad size (`check_pool_size`)."""
  if cache_config is not None:
    given = [name for name, value in (("num_pages", num_pages),
                                      ("page_size", page_size),
                                      ("kv_dtype", kv_dtype))
             if value is not None]
    if given:
      raise InvalidOptionError(
          f"{', '.join(given)} given beside cache_config, which replaces "
          f"the pool they describe: set them in cache_config (num_pages, "
          f"page_size, dtype) instead")
    return None, None
  num_pages = DEFAULT_NUM_PAGES if num_pages is None else num_pages
  page_size = DEFAULT_PAGE_SIZE if page_size is None else page_size
  check_pool_size(num_pages, page_size)
  return num_pages, page_size


def check_pool_size(num_pages, page_size) -> None:
  """InvalidOptionError naming `num_pages` or `page_size` unless each is an
  int >= 1 and the pool's tokens fit in int32 (as `CacheConfig` requires):
  checked before the model loads, where a page size of 0 would otherwise
  end in a ZeroDivisionError and too large a pool in a ValueError after
  the weights have loaded."""
  for name, value in (("num_pages", num_pages), ("page_size", page_size)):
    if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
        or value < 1):
      raise InvalidOptionError(f"{name} must be an int >= 1, got {value!r}")
  if int(num_pages) * int(page_size) > MAX_POOL_TOKENS:
    raise InvalidOptionError(
        f"num_pages * page_size (the pool's tokens) must be at most "
        f"{MAX_POOL_TOKENS}, got {num_pages} * {page_size}")


def default_cache_config(config, dtype, num_pages: int, page_size: int,
                         mode: str = "lazy") -> CacheConfig:
  """A pool of `num_pages` pages for `config` in `dtype` (the compute dtype,
  or "float8_e4m3fn": `CacheConfig.pool_bytes` counts its scales): a
  quarter as many document slots, and documents up to half the pool (or the
  model's context).  In prefix mode, whose cache entries are single prompt
  pages, a slot for every page.  InvalidOptionError for pages longer than
  the model's context, which no request could fill."""
  if page_size > config.max_position:
    raise InvalidOptionError(
        f"page_size {page_size} is longer than the model's context "
        f"({config.max_position} positions)")
  if mode == "prefix":
    max_docs, max_doc_pages = max(16, num_pages), 1
  else:
    max_docs = max(16, num_pages // 4)
    max_doc_pages = max(1, min(num_pages // 2,
                               config.max_position // page_size))
  return CacheConfig(
      num_pages=num_pages, page_size=page_size,
      num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim, dtype=jnp.dtype(dtype).name,
      max_docs=max_docs, max_pages_per_doc=max_doc_pages)


def engine_arguments(name_or_path: str, *, dtype, cache_config, num_pages,
                     page_size, kv_dtype, mode, scheduler, runner, quality, progress,
                     mesh, tensor_parallel, vocab_parallel, settings) -> dict:
  """`LazyEngine(...)`'s arguments for `LazyEngine.from_pretrained` (whose
  docstring describes these): settings are checked before the model loads,
  then the model loads and the default answer-quality options, which
  depend on the model, are chosen."""
  from lazyattn_jax.config import split_settings
  from lazyattn_jax.modes import MODES, check_quality
  from lazyattn_jax.quality_options import (DEFAULT, QualityOptions,
                                            default_quality,
                                            pop_quality_fields, split_quality,
                                            with_fields)
  from lazyattn_jax.sharding import tensor_parallel_for
  from lazyattn_jax.trained_quality import trained_default
  dtype = check_compute_dtype(dtype)
  num_pages, page_size = pool_size(cache_config, num_pages, page_size,
                                   kv_dtype)
  if cache_config is None:
    if kv_dtype is not None:
      check_pool_dtype(kv_dtype, dtype)
  else:
    check_pool_dtype(cache_config.dtype, dtype,
                     pool_name="cache_config.dtype")
  settings = dict(settings)
  if scheduler is None:
    settings.setdefault("max_batch", 8)
  if isinstance(quality, str) and quality != DEFAULT:
    raise InvalidOptionError(f"quality must be {DEFAULT!r}, None or a "
                             f"QualityOptions, got {quality!r}")
  given = pop_quality_fields(settings)
  # A `lazyattn finetune` export's default is the layout it was trained for.
  quality = trained_default(name_or_path, mode, quality, given)
  use_default = isinstance(quality, str)
  if use_default:  # what can be checked before the model (and its sink)
    takes = mode in MODES and MODES[mode].takes_quality_options
    quality = QualityOptions(recompute=takes)
  quality = split_quality(quality, dict(given))
  scheduler, runner = split_settings(
      scheduler, runner, settings,
      also_known=tuple(f.name for f in dataclasses.fields(QualityOptions)))
  page = cache_config.page_size if cache_config is not None else page_size
  check_quality(mode, page, quality)
  check_impl_page_size(page, runner.impl, name="cache_config.page_size"
                       if cache_config is not None else "page_size")
  parallel = dict(mesh=mesh, tensor_parallel=tensor_parallel,
                  vocab_parallel=vocab_parallel)
  loaded = load_model(name_or_path, dtype, progress,
                      sharding=lambda config: tensor_parallel_for(
                          config, **parallel))
  if cache_config is None:
    cache_config = default_cache_config(
        loaded.config, dtype if kv_dtype is None else kv_dtype, num_pages,
        page_size, mode)
  if use_default:
    quality = with_fields(default_quality(
        MODES[mode].takes_quality_options, loaded.model_id,
        cache_config.dtype), given)
  return dict(config=loaded.config, model=loaded.model,
              cache_config=cache_config, mode=mode, scheduler=scheduler,
              runner=runner, model_id=loaded.model_id,
              tokenizer=loaded.tokenizer, quality=quality, **parallel)
