"""GGUF metadata the loaders refuse or work around: a tokenizer the project
cannot rebuild (SentencePiece: Llama 2, Mistral) leaves a token-id model,
while linear RoPE scaling, mixture-of-experts and self-contradicting
tokenizer metadata are ModelFormatErrors naming what is wrong (and so is
an out-of-vocabulary stop id in a model directory's config.json)."""

import re

import gguf
import pytest

from lazyattn_jax.loading import load_model
from models.errors import ModelFormatError
from models.gguf_loader import load_gguf
from tests.test_loaders import _source, write_llama_gguf

Q = gguf.GGMLQuantizationType


def _write(tmp_path, **kwargs):
  config, params = _source(False)
  path = tmp_path / "m.gguf"
  write_llama_gguf(path, config, params, Q.F32, **kwargs)
  return path


def test_the_fixture_gguf_loads_with_its_tokenizer(tmp_path):
  loaded = load_model(str(_write(tmp_path)), "float32", False)
  assert loaded.tokenizer is not None
  assert loaded.tokenizer.encode("tok") == [7]


def test_a_sentencepiece_gguf_loads_for_token_ids_with_a_warning(tmp_path):
  path = _write(tmp_path, tokenizer_model="llama")
  with pytest.warns(UserWarning, match="tokenizer.ggml.model is 'llama'; "
                    "only byte-level BPE"):
    loaded = load_model(str(path), "float32", False)
  assert loaded.tokenizer is None
  from lazyattn_jax import LazyEngine
  with pytest.warns(UserWarning):
    engine = LazyEngine.from_pretrained(str(path), num_pages=32, impl="xla",
                                        max_batch=1, progress=False)
  result = engine.generate([5, 6, 7], [[1, 2, 3]], max_new_tokens=2)
  assert len(result.token_ids) >= 1 and result.text is None


@pytest.mark.parametrize("scaling_type", [None, "", "none"])
@pytest.mark.parametrize("key", ["llama.rope.scaling.factor",
                                 "llama.rope.scale_linear"])
def test_a_linear_rope_factor_is_refused_whatever_the_type(tmp_path, key,
                                                           scaling_type):
  # llama.cpp applies such a factor as linear scaling whatever the type
  # ("none" too): loading it as plain RoPE would put every position in the
  # wrong place.
  strings = ({} if scaling_type is None else
             {"llama.rope.scaling.type": scaling_type})
  with pytest.raises(ModelFormatError, match=rf"{key} = 4.0 asks for linear "
                     "RoPE scaling, which is not supported"):
    load_gguf(_write(tmp_path, float_fields={key: 4.0},
                     string_fields=strings))
  load_gguf(_write(tmp_path, float_fields={key: 1.0},  # no scaling: fine
                   string_fields=strings))


def test_a_mixture_of_experts_gguf_names_what_is_supported(tmp_path):
  with pytest.raises(ModelFormatError, match=r"llama.expert_count = 8: "
                     r"mixture-of-experts models are not supported \(dense "
                     r"llama, qwen2, qwen3 are\)"):
    load_gguf(_write(tmp_path, uint_fields={"llama.expert_count": 8}))


def test_merges_of_unknown_tokens_are_a_model_format_error(tmp_path):
  path = _write(tmp_path, merges=["t o", "to notatoken"])
  with pytest.raises(ModelFormatError, match="tokenizer.ggml.merges cannot "
                     "be built: .*notatoken"):
    load_model(str(path), "float32", False)


@pytest.mark.parametrize("merge", ["to", "t o x"])
def test_a_malformed_merge_is_a_model_format_error(tmp_path, merge):
  """A damaged file, like merges of unknown tokens: not loaded as a model
  without a tokenizer."""
  path = _write(tmp_path, merges=["t o", merge])
  with pytest.raises(ModelFormatError, match="malformed merge"):
    load_model(str(path), "float32", False)


@pytest.mark.parametrize("key, message", [
    ("tokenizer.ggml.eos_token_id", "eos_token_id=99999 is outside"),
    ("tokenizer.ggml.eot_token_id", "stop token id 99999 is outside"),
])
def test_a_special_id_outside_the_vocabulary_is_a_model_format_error(
    tmp_path, key, message):
  path = _write(tmp_path, uint_fields={key: 99999})
  with pytest.raises(ModelFormatError, match=message):
    load_model(str(path), "float32", False)


def test_a_stop_id_outside_the_vocabulary_in_a_model_directory(tmp_path):
  # The tokenizer.json path has the same twin: config.json's eos_token_id.
  import json
  from models.tokenizer import LlamaTokenizer
  from tests.training_helpers import tiny_tokenizer
  (tmp_path / "tokenizer.json").write_text(tiny_tokenizer().backend.to_str())
  (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 99999}))
  # Without an eos_token in tokenizer_config.json the first stop id is EOS.
  with pytest.raises(ModelFormatError, match=re.escape(
      f"{tmp_path}: eos_token_id=99999 is outside the vocabulary")):
    LlamaTokenizer.from_tokenizer_json(tmp_path)


def test_a_broken_tokenizer_is_refused_before_any_weight_is_read(
    tmp_path, monkeypatch):
  """README: every check runs before any weight is read.  Before: the
  tokenizer was built after the weights had loaded (minutes for a large
  model), for a GGUF file and a model directory alike."""
  import models.gguf_loader
  import models.safetensors_loader
  from tests.hf_fixtures import write_hf_checkpoint
  from tests.test_loaders import _source

  def no_weights(*args, **kwargs):
    raise AssertionError("weights were read before the tokenizer's check")
  monkeypatch.setattr(models.gguf_loader, "_params_from_gguf", no_weights)
  monkeypatch.setattr(models.safetensors_loader, "_params_from_checkpoint",
                      no_weights)
  path = _write(tmp_path, merges=["t o", "to"])
  with pytest.raises(ModelFormatError, match="malformed merge"):
    load_model(str(path), "float32", False)
  config, params = _source(True)
  directory = tmp_path / "ckpt"
  write_hf_checkpoint(directory, config, params)
  (directory / "tokenizer.json").write_text("{not json")
  with pytest.raises(ModelFormatError, match="tokenizer.json"):
    load_model(str(directory), "float32", False)


@pytest.mark.parametrize("key", [
    "llama.block_count", "llama.embedding_length", "llama.context_length",
    "llama.feed_forward_length", "llama.attention.head_count",
    "llama.attention.head_count_kv", "llama.rope.dimension_count",
    "tokenizer.ggml.eos_token_id"])
def test_an_integer_field_stored_as_a_fraction_is_refused_by_name(tmp_path,
                                                                  key):
  # int() made a block_count of 2.5 two layers, loading a file llama.cpp
  # refuses.
  with pytest.raises(ModelFormatError, match=re.escape(
      f"{key} must be an integer, got 2.5")):
    load_gguf(_write(tmp_path, float_fields={key: 2.5}))
