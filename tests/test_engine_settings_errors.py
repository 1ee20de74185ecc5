"""`LazyEngine.from_pretrained` refuses bad dtypes and pool sizes with
InvalidOptionError (a ValueError) naming the setting, before any model loads.

Each test passes a path that does not exist: a setting that gets past the
checks ends in UnknownModelError instead, without loading anything.
"""

from __future__ import annotations

import pytest

from lazyattn_jax.cache_config import CacheConfig, check_matches_model
from lazyattn_jax.default_model import UnknownModelError
from lazyattn_jax.engine import LazyEngine
from lazyattn_jax.errors import InvalidOptionError

NO_MODEL = "/does/not/exist.gguf"


def build(**settings):
  return LazyEngine.from_pretrained(NO_MODEL, progress=False, **settings)


@pytest.mark.parametrize("quality", ["default", None])
@pytest.mark.parametrize("name,value", [
    ("page_size", 0), ("page_size", -16), ("page_size", "16"),
    ("page_size", 16.0), ("page_size", True), ("num_pages", 0),
    ("num_pages", -1)])
def test_a_bad_pool_size_is_refused_by_name(name, value, quality):
  # page_size=0 ended in ZeroDivisionError (in the recompute check, or in
  # the default cache's size once the model had loaded).
  with pytest.raises(InvalidOptionError,
                     match=rf"^{name} must be an int >= 1, got {value!r}$"):
    build(quality=quality, **{name: value})


def test_a_pool_past_int32_tokens_is_refused_before_loading():
  # It was CacheConfig's ValueError, raised once the weights had loaded
  # (and a traceback from `lazyattn rag --cache-pages 200000000`).
  with pytest.raises(InvalidOptionError,
                     match=r"^num_pages \* page_size \(the pool's tokens\) "
                           r"must be at most 2147483647, got 200000000 \* 16$"):
    build(num_pages=200_000_000)
  from lazyattn_jax.default_model import UnknownModelError
  with pytest.raises(UnknownModelError):  # the largest pool passes the check
    build(num_pages=(2**31 - 1) // 16)


@pytest.mark.parametrize("dtype", ["bogus", "int32", "float8_e4m3fn",
                                   "float64", None])
def test_a_bad_compute_dtype_is_refused_by_name(dtype):
  # "bogus" was jnp.dtype's TypeError, which names no setting.
  with pytest.raises(InvalidOptionError,
                     match=rf"^dtype must be one of float32, bfloat16, "
                           rf"float16, got {dtype!r}$"):
    build(dtype=dtype)


@pytest.mark.parametrize("dtype,kv_dtype", [
    ("float32", "bfloat16"), ("float32", "float16"), ("bfloat16", "float32")])
def test_a_pool_in_another_float_dtype_is_refused(dtype, kv_dtype):
  # Such an engine used to build, then fail every request with "k_cache
  # dtype ... must equal the model's compute dtype ...".
  with pytest.raises(InvalidOptionError) as caught:
    build(dtype=dtype, kv_dtype=kv_dtype)
  assert str(caught.value) == (
      f"kv_dtype {kv_dtype} does not match dtype {dtype}: the KV pool is in "
      f"the compute dtype or float8_e4m3fn; give kv_dtype {dtype} or "
      f"float8_e4m3fn, or dtype {kv_dtype}")
  # What the message offers gets past the checks (to the missing model).
  for fixed in (dict(dtype=dtype, kv_dtype=dtype),
                dict(dtype=dtype, kv_dtype="float8_e4m3fn"),
                dict(dtype=kv_dtype, kv_dtype=kv_dtype)):
    with pytest.raises(UnknownModelError):
      build(**fixed)


def test_a_kv_dtype_that_is_no_dtype_is_refused_by_name():
  with pytest.raises(InvalidOptionError,
                     match=r"^kv_dtype is not a dtype: 'bogus'"):
    build(kv_dtype="bogus")


def _cache(dtype):
  return CacheConfig(num_pages=8, num_layers=2, num_kv_heads=2, head_dim=16,
                     dtype=dtype, max_pages_per_doc=4)


def test_a_given_cache_config_in_another_dtype_is_refused():
  with pytest.raises(InvalidOptionError,
                     match=r"^cache_config.dtype bfloat16 does not match "
                           r"dtype float32"):
    build(cache_config=_cache("bfloat16"))
  with pytest.raises(UnknownModelError):  # past the checks
    build(cache_config=_cache("float8_e4m3fn"))


@pytest.mark.parametrize("given", [
    dict(kv_dtype="float8_e4m3fn"), dict(kv_dtype="float32"),
    dict(num_pages=64), dict(page_size=0), dict(page_size=16),
    dict(num_pages=64, kv_dtype="float8_e4m3fn")])
def test_pool_settings_beside_a_cache_config_are_refused(given):
  # They describe the pool cache_config replaces; they were dropped without
  # a word, so kv_dtype="float8_e4m3fn" served a float32 pool.
  with pytest.raises(InvalidOptionError) as caught:
    build(cache_config=_cache("float32"), **given)
  assert str(caught.value) == (
      f"{', '.join(given)} given beside cache_config, which replaces the "
      f"pool they describe: set them in cache_config (num_pages, page_size, "
      f"dtype) instead")


def test_check_matches_model_checks_the_compute_dtype_when_given():
  class Config:  # the fields check_matches_model reads of a LlamaConfig
    num_layers, num_kv_heads, head_dim = 2, 2, 16
  check_matches_model(_cache("bfloat16"), Config, compute_dtype="bfloat16")
  check_matches_model(_cache("float8_e4m3fn"), Config,
                      compute_dtype="float32")
  with pytest.raises(InvalidOptionError,
                     match=r"^cache_config.dtype bfloat16 does not match the "
                           r"model's compute dtype float32"):
    check_matches_model(_cache("bfloat16"), Config, compute_dtype="float32")


def test_an_engine_built_directly_refuses_a_pool_of_another_dtype():
  import dataclasses

  from flax import nnx

  from models.config import LlamaConfig
  from models.llama import Llama
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=64)
  model = Llama(config, rngs=nnx.Rngs(0))  # float32
  pool = dict(num_pages=8, page_size=4, num_layers=config.num_layers,
              num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
              max_docs=4, max_pages_per_doc=4)
  with pytest.raises(InvalidOptionError, match="bfloat16"):
    LazyEngine(config, model, CacheConfig(dtype="bfloat16", **pool))
  LazyEngine(config, model, CacheConfig(dtype="float8_e4m3fn", **pool))


def test_a_model_in_a_dtype_the_engine_cannot_compute_in_is_refused():
  import dataclasses

  from flax import nnx

  from lazyattn_jax.loading import load_model
  from models.config import LlamaConfig
  from models.llama import Llama
  with pytest.raises(InvalidOptionError, match="float64"):
    load_model("smollm2-135m-instruct", "float64", progress=False)
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=64)
  model = Llama(config, rngs=nnx.Rngs(0), dtype="float64")
  pool = dict(num_pages=8, page_size=4, num_layers=config.num_layers,
              num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
              max_docs=4, max_pages_per_doc=4)
  with pytest.raises(InvalidOptionError, match="float64"):
    LazyEngine(config, model, CacheConfig(dtype="float64", **pool))


def _tpu_refusal(name, page_size, impl="tpu", picked=""):
  return (f"{name} {page_size} does not suit impl {impl!r}{picked}: the TPU "
          f"kernels need a page size that is a multiple of 8 (and at most "
          f"65535); choose such a page size, or impl 'xla'")


@pytest.mark.parametrize("page_size", [4, 12, 1 << 16])
def test_a_page_size_the_tpu_kernels_refuse_is_refused_before_loading(
    page_size):
  # Such an engine used to build, then fail every request with the
  # kernels' "impl='tpu' needs a k_pages page size that is a multiple of 8".
  with pytest.raises(InvalidOptionError) as caught:
    build(impl="tpu", page_size=page_size)
  assert str(caught.value) == _tpu_refusal("page_size", page_size)
  with pytest.raises(UnknownModelError):
    build(impl="tpu", page_size=16)
  # XLA takes any page size, and so does the GPU (where the Mosaic GPU
  # kernels do not take it, the Triton kernels run); "auto" is XLA on CPU.
  for impl in ("xla", "gpu", "auto"):
    with pytest.raises(UnknownModelError):
      build(impl=impl, page_size=page_size)
  cache = dict(num_pages=8, page_size=page_size, num_layers=2,
               num_kv_heads=2, head_dim=16, dtype="float32",
               max_pages_per_doc=4)
  with pytest.raises(InvalidOptionError) as caught:
    build(impl="tpu", cache_config=CacheConfig(**cache))
  assert str(caught.value) == _tpu_refusal("cache_config.page_size",
                                           page_size)


def test_an_engine_built_directly_refuses_a_page_size_its_kernels_refuse(
    monkeypatch):
  import dataclasses

  import jax
  from flax import nnx

  from lazyattn_jax import engine as engine_module
  from lazyattn_jax.config import RunnerConfig
  from models.config import LlamaConfig
  from models.llama import Llama
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=64)
  model = Llama(config, rngs=nnx.Rngs(0))
  cache = CacheConfig(num_pages=8, page_size=4, num_layers=config.num_layers,
                      num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, dtype="float32",
                      max_docs=4, max_pages_per_doc=4)
  made = []  # nothing is made when the engine refuses
  with monkeypatch.context() as patch:
    patch.setattr(engine_module, "PagedKVCache",
                  lambda *a, **k: made.append(a))
    with pytest.raises(InvalidOptionError) as caught:
      LazyEngine(config, model, cache, runner=RunnerConfig(impl="tpu"))
    assert str(caught.value) == _tpu_refusal("cache_config.page_size", 4)
    # "auto" resolves as lazy_attention does: the TPU kernels on a TPU.
    patch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(InvalidOptionError) as caught:
      LazyEngine(config, model, cache)
    assert str(caught.value) == _tpu_refusal(
        "cache_config.page_size", 4, "auto",
        " (the TPU kernels on this TPU backend)")
  assert not made
  for impl in ("gpu", "xla", "auto"):  # auto: XLA on CPU
    LazyEngine(config, model, cache, runner=RunnerConfig(impl=impl))
  LazyEngine(config, model, dataclasses.replace(cache, page_size=8),
             runner=RunnerConfig(impl="tpu"))
