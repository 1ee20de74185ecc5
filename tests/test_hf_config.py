"""config.json read as transformers reads it (`models.hf_config`): RoPE
settings of either spelling, the defaults of fields a config leaves out
(max_position_embeddings, sliding window, KV heads, head_dim), which Qwen
layers slide, every EOS id, and a tied checkpoint that also stores a
different output matrix.  Tests that compare with transformers skip without
it; the expected values are asserted without it too."""

import json
import re

import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.requests import default_stop_ids
from models.config import LlamaConfig
from models.dense_reference import causal_mask, dense_forward
from models.errors import ModelFormatError
from models.hf_config import config_from_hf, load_hf_config
from models.safetensors_loader import load_safetensors
from tests.hf_arch_models import hf_model

_BASE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512)
_LLAMA3 = dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
               high_freq_factor=4.0, original_max_position_embeddings=64,
               rope_theta=10000.0)
_SCALING = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=128)


def _hf_config(tmp_path, hf: dict):
  """transformers' reading of `hf` as a checkpoint's config.json."""
  transformers = pytest.importorskip("transformers")
  (tmp_path / "config.json").write_text(json.dumps(hf))
  return transformers.AutoConfig.from_pretrained(tmp_path)


def _no_orig(params):
  return {k: v for k, v in params.items()
          if k != "original_max_position_embeddings"}


# Configs whose RoPE settings are spelled in more than one place.
_ROPE_CASES = {
    "llama3-without-original-max": dict(rope_parameters=_no_orig(_LLAMA3)),
    "top-level-theta-beside-the-dicts": dict(
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        rope_theta=500000.0),
    "rope-scaling-default-beside-llama3-parameters": dict(
        rope_parameters=_LLAMA3,
        rope_scaling=dict(rope_type="default", rope_theta=10000.0)),
    "rope-scaling-wins-whole": dict(rope_parameters=_LLAMA3,
                                    rope_scaling=_SCALING),
    "rope-scaling-without-theta-takes-top-level": dict(
        rope_theta=500000.0,
        rope_parameters=dict(rope_type="default", rope_theta=20000.0),
        rope_scaling=_no_orig(_SCALING)),
    "top-level-original-max-wins": dict(
        rope_parameters=_LLAMA3, original_max_position_embeddings=16),
    "v4-spelling": dict(rope_theta=500000.0, rope_scaling=_SCALING),
}


@pytest.mark.parametrize("case", list(_ROPE_CASES))
def test_rope_settings_match_transformers(tmp_path, case):
  hf = dict(_BASE, model_type="llama", **_ROPE_CASES[case])
  hf_config = _hf_config(tmp_path, hf)
  # What the rotary embedding does before it reads the settings (a
  # top-level original_max_position_embeddings is applied only there).
  hf_config.standardize_rope_params()
  theirs = hf_config.rope_parameters
  ours = config_from_hf(hf)
  assert ours.rope_theta == theirs["rope_theta"]
  if theirs["rope_type"] == "default":
    assert ours.rope_scaling is None
  else:
    s = ours.rope_scaling
    assert (s.factor, s.low_freq_factor, s.high_freq_factor,
            s.original_max_position) == (
                theirs["factor"], theirs["low_freq_factor"],
                theirs["high_freq_factor"],
                theirs["original_max_position_embeddings"])


# RoPE settings transformers cannot run either: refused, never read as
# plain RoPE over the whole head.
@pytest.mark.parametrize("settings, message", [
    (dict(rope_type=None, type="linear", factor=2.0), "rope type 'linear'"),
    (dict(_LLAMA3, partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.25),
     "partial_rotary_factor 0.25"),
    # transformers 5's settings keyed by layer type were read flat: no
    # rope_type, so plain RoPE at the top-level theta (the YaRN and the
    # theta of 1e6 dropped).
    (dict(full_attention=dict(rope_type="yarn", factor=4.0,
                              rope_theta=1e6)),
     r"keyed by layer type \(full_attention\)"),
    (dict(full_attention=dict(rope_type="default", rope_theta=1e6),
          sliding_attention=dict(rope_type="default", rope_theta=1e4)),
     r"\(full_attention, sliding_attention\)"),
])
def test_rope_settings_nothing_runs_are_refused(settings, message):
  hf = dict(_BASE, model_type="llama", rope_scaling=settings)
  with pytest.raises(ModelFormatError, match=message):
    config_from_hf(hf)


def test_null_rope_type_and_whole_head_factor_read_as_plain():
  hf = dict(_BASE, model_type="llama",
            rope_scaling=dict(rope_type=None, partial_rotary_factor=1.0))
  assert config_from_hf(hf).rope_scaling is None


def _logits(model, tokens):
  t = jnp.asarray([tokens], jnp.int32)
  return np.asarray(dense_forward(model, t, jnp.arange(len(tokens))[None],
                                  causal_mask(1, len(tokens))))[0]


@pytest.mark.parametrize("case", ["llama3-without-original-max",
                                  "top-level-theta-beside-the-dicts",
                                  "rope-scaling-wins-whole",
                                  "top-level-original-max-wins"])
def test_rope_settings_give_transformers_logits(tmp_path, case):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  model = hf_model("llama", rope_parameters=dict(_LLAMA3),
                   max_position_embeddings=512)
  model.save_pretrained(tmp_path, safe_serialization=True)
  hf = json.loads((tmp_path / "config.json").read_text())
  for name in ("rope_parameters", "rope_scaling", "rope_theta"):
    hf.pop(name, None)
  (tmp_path / "config.json").write_text(json.dumps(
      dict(hf, **_ROPE_CASES[case])))
  theirs = transformers.AutoModelForCausalLM.from_pretrained(
      tmp_path, dtype=torch.float32).eval()
  tokens = [int(t) for t in np.random.default_rng(2).integers(3, 256, 120)]
  with torch.no_grad():
    want = theirs(torch.tensor([tokens])).logits[0].numpy()
  _, ours = load_safetensors(tmp_path)
  np.testing.assert_allclose(_logits(ours, tokens), want, atol=1e-4)


# transformers 5's max_position_embeddings when config.json leaves it out.
_MAX_POSITION_DEFAULTS = {"llama": 2048, "mistral": 131072, "qwen2": 32768,
                          "qwen3": 32768}


def _without_max_position(model_type):
  hf = dict(_BASE, model_type=model_type, sliding_window=None)
  del hf["max_position_embeddings"]
  return hf


@pytest.mark.parametrize("model_type", list(_MAX_POSITION_DEFAULTS))
def test_left_out_max_position_takes_the_family_default(model_type):
  ours = config_from_hf(_without_max_position(model_type))
  assert ours.max_position == _MAX_POSITION_DEFAULTS[model_type]


@pytest.mark.parametrize("model_type", list(_MAX_POSITION_DEFAULTS))
def test_left_out_max_position_matches_transformers(tmp_path, model_type):
  hf = _without_max_position(model_type)
  theirs = _hf_config(tmp_path, hf).max_position_embeddings
  assert theirs == _MAX_POSITION_DEFAULTS[model_type]
  assert config_from_hf(hf).max_position == theirs


# (model_type, config.json changes, the window of transformers' sliding
# layers or None); _BASE has 2 layers.
_WINDOW_CASES = [
    pytest.param("mistral", {}, 4096, id="mistral-left-out"),
    pytest.param("mistral", dict(sliding_window=None), None,
                 id="mistral-null"),
    pytest.param("qwen2", {}, None, id="qwen2-off"),
    pytest.param("qwen2", dict(use_sliding_window=True, max_window_layers=0),
                 4096, id="qwen2-all-slide"),
    pytest.param("qwen3", dict(use_sliding_window=True, max_window_layers=0),
                 4096, id="qwen3-all-slide"),
    pytest.param("qwen2", dict(use_sliding_window=True, sliding_window=256,
                               max_window_layers=0), 256,
                 id="qwen2-all-slide-256"),
    # Only layer 1 slides: limited to the window all the same.
    pytest.param("qwen2", dict(use_sliding_window=True, max_window_layers=1),
                 4096, id="qwen2-last-slides"),
    pytest.param("qwen3", dict(use_sliding_window=True,
                               layer_types=["full_attention",
                                            "sliding_attention"]),
                 4096, id="qwen3-layer-types-last-slides"),
    # No layer slides: max_window_layers (28 left out) >= the 2 layers, or
    # layer_types all full, so full attention.
    pytest.param("qwen2", dict(use_sliding_window=True), None,
                 id="qwen2-none-slide-default-28"),
    pytest.param("qwen3", dict(use_sliding_window=True), None,
                 id="qwen3-none-slide-default-28"),
    pytest.param("qwen2", dict(use_sliding_window=True, max_window_layers=2),
                 None, id="qwen2-none-slide-2"),
    pytest.param("qwen3", dict(use_sliding_window=True, max_window_layers=0,
                               layer_types=["full_attention"] * 2), None,
                 id="qwen3-layer-types-all-full"),
    # transformers' Llama reads no window fields.
    pytest.param("llama", dict(use_sliding_window=True, sliding_window=256,
                               max_window_layers=0), None,
                 id="llama-no-window"),
]


def _window_config(model_type, changes):
  return dict(_BASE, model_type=model_type, max_position_embeddings=8192,
              **changes)


@pytest.mark.parametrize("model_type, changes, window", _WINDOW_CASES)
def test_sliding_layers_limit_max_position(model_type, changes, window):
  hf = _window_config(model_type, changes)
  ours = config_from_hf(hf)
  assert ours.max_position == (8192 if window is None else window)
  if window is not None:
    with pytest.raises(ModelFormatError,
                       match=f"sliding window of {window} tokens"):
      config_from_hf(hf, max_position=window + 1)
  else:
    assert config_from_hf(hf, max_position=10000).max_position == 10000


@pytest.mark.parametrize("model_type, changes, window", _WINDOW_CASES)
def test_sliding_window_matches_transformers(tmp_path, model_type, changes,
                                             window):
  pytest.importorskip("torch")
  hf = _window_config(model_type, changes)
  config = _hf_config(tmp_path, hf)
  if model_type == "mistral":
    theirs = config.sliding_window  # every layer's (MistralAttention)
  else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_config(config)
    windows = {getattr(layer.self_attn, "sliding_window", None)
               for layer in model.model.layers} - {None}
    assert len(windows) <= 1
    theirs = windows.pop() if windows else None
  assert theirs == window
  ours = config_from_hf(hf).max_position
  assert ours == (8192 if theirs is None else theirs)


@pytest.mark.parametrize("model_type, left_out, heads", [
    ("llama", "num_key_value_heads", 4),
    ("mistral", "num_key_value_heads", 16),
    ("qwen2", "num_key_value_heads", 32),
    ("qwen3", "num_key_value_heads", 32),
    ("qwen3", "head_dim", 4),
    ("mistral", "head_dim", 4),
])
def test_left_out_fields_take_transformers_defaults(tmp_path, model_type,
                                                    left_out, heads):
  hf = dict(_BASE, model_type=model_type, num_attention_heads=heads,
            hidden_size=16 * heads)
  hf.pop(left_out, None)
  theirs = _hf_config(tmp_path, hf)
  ours = config_from_hf(hf)
  assert ours.num_kv_heads == theirs.num_key_value_heads
  assert ours.head_dim == (getattr(theirs, "head_dim", None) or
                           theirs.hidden_size // theirs.num_attention_heads)


def test_a_left_out_field_whose_default_does_not_fit_says_so():
  hf = dict(_BASE, model_type="qwen2")
  del hf["num_key_value_heads"]
  with pytest.raises(ModelFormatError) as err:
    config_from_hf(hf)
  message = str(err.value)
  assert "multiple of num_kv_heads (32)" in message
  assert "transformers' qwen2 defaults: num_key_value_heads=32" in message


def test_mistral_without_kv_heads_gives_transformers_logits(tmp_path):
  torch = pytest.importorskip("torch")
  model = hf_model("mistral", hidden_size=128, num_attention_heads=16,
                   num_key_value_heads=8)
  model.save_pretrained(tmp_path, safe_serialization=True)
  hf = json.loads((tmp_path / "config.json").read_text())
  del hf["num_key_value_heads"]
  (tmp_path / "config.json").write_text(json.dumps(hf))
  tokens = list(range(3, 40))
  with torch.no_grad():
    want = model(torch.tensor([tokens])).logits[0].numpy()
  config, ours = load_safetensors(tmp_path)
  assert config.num_kv_heads == 8
  np.testing.assert_allclose(_logits(ours, tokens), want, atol=1e-4)


@pytest.mark.parametrize("model_type, ids", [
    ("llama", (1, 2)), ("mistral", (1, 2)), ("qwen2", (None, None)),
    ("qwen3", (None, None))])
def test_special_ids_left_out_take_transformers_defaults(model_type, ids):
  """transformers' Llama and Mistral configs default BOS to 1 and EOS to 2
  (Qwen's to none); before, a config.json without them stopped on no EOS
  id here while transformers stopped on 2.  null stays none."""
  hf = dict(_BASE, model_type=model_type, head_dim=16)
  config = config_from_hf(hf)
  assert (config.bos_token_id, config.eos_token_id) == ids
  nulls = config_from_hf(dict(hf, bos_token_id=None, eos_token_id=None))
  assert (nulls.bos_token_id, nulls.eos_token_id) == (None, None)


def test_every_eos_id_stops_generation(tmp_path):
  hf = dict(_BASE, eos_token_id=[2, 3])
  assert config_from_hf(hf).eos_token_id == (2, 3)
  assert config_from_hf(dict(hf, eos_token_id=[2])).eos_token_id == 2
  # Ids outside the vocabulary are left out, as a single one always was.
  assert config_from_hf(dict(hf, eos_token_id=[2, 999])).eos_token_id == 2
  both = config_from_hf(hf, generation={"eos_token_id": [3, 7]})
  assert both.eos_token_id == (2, 3, 7)
  assert default_stop_ids(None, both) == (2, 3, 7)
  assert hash(both) == hash(both.replace())
  # From a directory: generation_config.json's ids too.
  (tmp_path / "config.json").write_text(json.dumps(hf))
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": 9}))
  assert load_hf_config(str(tmp_path)).eos_token_id == (2, 3, 9)
  # A bad id there is that file's fault (it was blamed on config.json).
  (tmp_path / "generation_config.json").write_text(json.dumps(
      {"eos_token_id": "x"}))
  with pytest.raises(ModelFormatError, match="generation_config.json beside "
                     ".*eos_token_id 'x'"):
    load_hf_config(str(tmp_path))


def test_eos_tuple_is_checked():
  with pytest.raises(ValueError, match=r"eos_token_id must lie in \[0, 256\)"):
    LlamaConfig.tiny(eos_token_id=(2, 256))
  with pytest.raises(ValueError, match="non-empty tuple"):
    LlamaConfig.tiny(eos_token_id=())
  assert LlamaConfig.tiny(eos_token_id=(2, 5)).eos_token_id == (2, 5)


def _tied_checkpoint_with_lm_head(tmp_path, differ: bool):
  from safetensors.numpy import load_file, save_file
  model = hf_model("llama")  # tied
  model.save_pretrained(tmp_path, safe_serialization=True)
  path = str(tmp_path / "model.safetensors")
  tensors = load_file(path)
  embed = tensors["model.embed_tokens.weight"]
  tensors["lm_head.weight"] = (embed + 1.0 if differ else embed.copy())
  save_file(tensors, path, metadata={"format": "pt"})
  return model


def test_tied_checkpoint_with_a_different_lm_head_is_refused(tmp_path,
                                                              monkeypatch):
  import models.safetensors_loader as loader
  _tied_checkpoint_with_lm_head(tmp_path, differ=True)
  loaded = []
  monkeypatch.setattr(loader, "load_params",
                      lambda *args, **kwargs: loaded.append(1))
  with pytest.raises(ModelFormatError) as err:
    load_safetensors(tmp_path)
  message = str(err.value)
  for name in ("'lm_head.weight'", "'model.embed_tokens.weight'",
               "tie_word_embeddings"):
    assert name in message
  assert loaded == []  # refused before any weight reached the device


def test_tied_checkpoint_with_a_copy_of_the_embedding_loads(tmp_path):
  torch = pytest.importorskip("torch")
  model = _tied_checkpoint_with_lm_head(tmp_path, differ=False)
  config, ours = load_safetensors(tmp_path)
  assert config.tie_word_embeddings
  tokens = list(range(3, 30))
  with torch.no_grad():
    want = model(torch.tensor([tokens])).logits[0].numpy()
  np.testing.assert_allclose(_logits(ours, tokens), want, atol=1e-4)


@pytest.mark.parametrize("field, bad, good", [
    ("vocab_size", 256.5, 256), ("hidden_size", "64", 64),
    ("num_hidden_layers", True, 2), ("num_attention_heads", 4.0, 4),
    ("num_key_value_heads", 2.5, 2), ("intermediate_size", 128.9, 128),
    ("head_dim", 16.5, 16), ("max_position_embeddings", 512.5, 512),
    ("eos_token_id", 2.5, 2)])
def test_a_field_that_is_not_an_integer_is_refused_by_name(field, bad, good):
  """int() made 256.5 a vocabulary of 256 and read "64" as 64, where
  transformers' modules fail on both."""
  with pytest.raises(ModelFormatError,
                     match=rf"must be an integer, got {re.escape(repr(bad))}"):
    config_from_hf(dict(_BASE, **{field: bad}))
  assert config_from_hf(dict(_BASE, **{field: good})) is not None


@pytest.mark.parametrize("model_type, changes", [
    ("mistral", dict(sliding_window=64.5)),
    ("qwen2", dict(use_sliding_window=True, max_window_layers=1.5,
                   sliding_window=64)),
    ("llama", dict(rope_scaling=dict(_SCALING,
                                     original_max_position_embeddings=128.5)))])
def test_window_and_rope_fields_that_are_not_integers_are_refused(model_type,
                                                                  changes):
  with pytest.raises(ModelFormatError, match="must be an integer, got"):
    config_from_hf(dict(_BASE, model_type=model_type, **changes))
