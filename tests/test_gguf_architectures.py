"""Every supported architecture as a GGUF file: written with the gguf writer
from the same random weights as the HF safetensors form (Q/K rows permuted
where llama.cpp permutes them: llama, and Mistral, which llama.cpp converts
as llama; not Qwen2 or Qwen3), it loads to the same weights and
configuration.  Unsupported architectures and configurations are refused,
with the supported ones listed, before anything is read."""

from __future__ import annotations

import functools
import json

import gguf
import numpy as np
import pytest
from flax import nnx

import models.gguf_loader
import models.safetensors_loader
from models.errors import ModelFormatError
from models.gguf_loader import load_gguf
from models.llama import split_model
from models.safetensors_loader import config_from_hf, load_safetensors
from tests.hf_arch_models import ARCHS, hf_model, write_gguf_like_llama_cpp
from tests.hf_fixtures import as_hf_tensors

Q = gguf.GGMLQuantizationType


@functools.lru_cache(maxsize=None)
def _model(arch):
  return hf_model(arch, seed=3)


@pytest.fixture(scope="module")
def safetensors_forms(tmp_path_factory):
  """arch -> (config, our parameters as HF tensors) of the HF checkpoint."""
  forms = {}
  for arch in ARCHS:
    directory = tmp_path_factory.mktemp(f"hf-{arch}")
    _model(arch).save_pretrained(directory, safe_serialization=True)
    config, model = load_safetensors(directory)
    forms[arch] = config, _as_hf(model)
  return forms


def _as_hf(model):
  return as_hf_tensors(nnx.to_pure_dict(split_model(model)[1]))


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_loads_the_weights_and_config_of_the_safetensors_form(
    tmp_path, arch, safetensors_forms):
  path = tmp_path / f"{arch}.gguf"
  write_gguf_like_llama_cpp(path, _model(arch), arch)
  config, model, metadata = load_gguf(path)
  want_config, want = safetensors_forms[arch]
  assert metadata.architecture == ("llama" if arch == "mistral" else arch)
  # The file stores the norm epsilon as float32, and llama.cpp's llama
  # metadata has no sliding window (the safetensors form limits Mistral's
  # positions to its window).
  assert config.rms_norm_eps == pytest.approx(want_config.rms_norm_eps,
                                              rel=1e-6)
  assert config.replace(rms_norm_eps=want_config.rms_norm_eps,
                        max_position=want_config.max_position) == want_config
  assert config.max_position == 4096
  assert (config.attention_bias, config.qk_norm) == (arch == "qwen2",
                                                    arch == "qwen3")
  ours = _as_hf(model)
  assert set(ours) == set(want)
  for name, value in want.items():
    np.testing.assert_array_equal(ours[name], value, err_msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_gguf_loads_ggufs_dequantization(tmp_path, arch):
  path = tmp_path / f"{arch}-q8.gguf"
  expected = write_gguf_like_llama_cpp(path, _model(arch), arch,
                                       matrix_type=Q.Q8_0)
  _, model, _ = load_gguf(path)
  ours = _as_hf(model)
  for name, value in expected.items():
    np.testing.assert_array_equal(ours[name], value, err_msg=name)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_permutation_is_undone_only_where_it_was_applied(
    tmp_path, arch):
  """llama and Mistral files hold Q rows permuted, Qwen files as HF does;
  all load to HF's rows."""
  path = tmp_path / f"{arch}.gguf"
  write_gguf_like_llama_cpp(path, _model(arch), arch)
  hf_q = (_model(arch).model.layers[0].self_attn.q_proj.weight
          .detach().numpy())
  stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
  raw = np.asarray(stored["blk.0.attn_q.weight"].data)
  assert raw.shape == hf_q.shape
  assert np.array_equal(raw, hf_q) == (arch in ("qwen2", "qwen3"))
  _, model, _ = load_gguf(path)
  np.testing.assert_array_equal(
      _as_hf(model)["model.layers.0.self_attn.q_proj.weight"], hf_q)


def _write_other_architecture(path, name):
  writer = gguf.GGUFWriter(str(path), name)
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.ones((8, 32), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("name", ["gemma", "phi3", "mistral3", "qwen2moe"])
def test_unsupported_gguf_architecture_lists_the_supported_ones(
    tmp_path, name, monkeypatch):
  path = tmp_path / f"{name}.gguf"
  _write_other_architecture(path, name)
  read = []
  monkeypatch.setattr(models.gguf_loader, "dequantize_tensor",
                      lambda tensor, *a: read.append(tensor.name))
  with pytest.raises(ModelFormatError) as err:
    load_gguf(path)
  message = str(err.value)
  assert repr(name) in message and f"{name}.gguf" in message
  for supported in ("llama", "qwen2", "qwen3", "Mistral"):
    assert supported in message, message
  assert read == []


def _hf_config(arch, **changes):
  config = json.loads(_model(arch).config.to_json_string())
  config.update(changes)
  return config


@pytest.mark.parametrize("model_type", ["gemma", "phi3", "qwen2_moe", None])
def test_unsupported_hf_model_type_lists_the_supported_ones(
    tmp_path, model_type, monkeypatch):
  directory = tmp_path / "ckpt"
  _model("qwen2").save_pretrained(directory, safe_serialization=True)
  config = _hf_config("qwen2", model_type=model_type)
  (directory / "config.json").write_text(json.dumps(config))
  read = []
  monkeypatch.setattr(models.safetensors_loader._SafetensorsFile, "get",
                      lambda self, name: read.append(name))
  with pytest.raises(ModelFormatError) as err:
    load_safetensors(directory)
  message = str(err.value)
  assert repr(model_type) in message and "config.json" in message
  assert "llama, mistral, qwen2, qwen3" in message
  assert read == []


def test_hf_configurations_outside_the_model_are_refused():
  with pytest.raises(ModelFormatError, match="attention_bias"):
    config_from_hf(_hf_config("qwen3", attention_bias=True))
  with pytest.raises(ModelFormatError, match="mlp_bias"):
    config_from_hf(_hf_config("llama", mlp_bias=True))
  with pytest.raises(ModelFormatError, match="sliding window of 1024"):
    config_from_hf(_hf_config("mistral"), max_position=2048)


def test_sliding_window_limits_max_position():
  assert config_from_hf(_hf_config("mistral")).max_position == 1024
  assert config_from_hf(_hf_config("mistral", sliding_window=None)
                        ).max_position == 4096
  # Qwen's window is off unless use_sliding_window says otherwise (and a
  # layer slides: those from max_window_layers on).
  off = _hf_config("qwen2", sliding_window=512, use_sliding_window=False,
                   layer_types=None, max_window_layers=0)
  assert config_from_hf(off).max_position == 4096
  on = dict(off, use_sliding_window=True)
  assert config_from_hf(on).max_position == 512
  assert config_from_hf(on, max_position=256).max_position == 256


def test_hf_settings_are_read_from_config_json():
  for arch in ARCHS:
    hf = _hf_config(arch)
    config = config_from_hf(hf)
    assert config.tie_word_embeddings == hf["tie_word_embeddings"], arch
    assert config.rms_norm_eps == hf["rms_norm_eps"], arch
    theta = (hf.get("rope_parameters") or {}).get("rope_theta",
                                                   hf.get("rope_theta"))
    assert config.rope_theta == theta, arch
  assert config_from_hf(_hf_config("qwen3")).head_dim == 32
