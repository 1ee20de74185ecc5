"""The answer-quality options `from_pretrained` turns on by default: first-page
recompute in lazy and block modes, and the shipped learned sink for the
model it was trained for (the embedded SmolLM2)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from lazyattn_jax.errors import InvalidOptionError
from lazyattn_jax.quality_options import (QualityOptions, default_quality,
                                          shipped_sink_for, with_fields)

SMOLLM2_ID = "gguf:SmolLM2-135M-Instruct.Q4_1.gguf:98362432"


def test_defaults_per_mode_and_model():
  assert default_quality(False, SMOLLM2_ID) == QualityOptions()
  assert default_quality(True, "another model") == QualityOptions(
      recompute=True)
  ours = default_quality(True, SMOLLM2_ID)
  assert ours.preamble == "sink" and ours.recompute
  assert ours.sink.shape == (16, 576)
  assert shipped_sink_for("another model") is None


def test_given_fields_replace_the_defaults():
  base = default_quality(True, SMOLLM2_ID)
  # A new preamble replaces the sink whole.
  chat = with_fields(base, {"preamble": "chat"})
  assert chat.preamble == "chat" and chat.sink is None and chat.recompute
  none = with_fields(base, {"preamble": None})
  assert none == QualityOptions(recompute=True)
  # Turning recompute off keeps the sink, and drops a default k.
  assert with_fields(base, {"recompute": False}).sink is not None
  assert with_fields(QualityOptions(recompute=True, recompute_tokens=32),
                     {"recompute": False}) == QualityOptions()
  own = np.ones((2, 576), np.float32)
  mine = with_fields(base, {"sink": own})
  assert mine.preamble == "sink" and mine.sink.shape == (2, 576)
  assert with_fields(base, {}) is base


def test_tiny_model_gets_recompute_only(tiny_dir):
  from lazyattn_jax.engine import LazyEngine
  common = dict(impl="xla", num_pages=64, progress=False, max_batch=1)
  assert LazyEngine.from_pretrained(tiny_dir, **common).quality == \
      QualityOptions(recompute=True)
  assert LazyEngine.from_pretrained(tiny_dir, mode="block", **common
                                    ).quality.recompute
  for off in (dict(quality=None), dict(quality=QualityOptions()),
              dict(recompute=False), dict(mode="full"), dict(mode="prefix")):
    engine = LazyEngine.from_pretrained(tiny_dir, **off, **common)
    assert not engine.quality.enabled, off
  tokens = LazyEngine.from_pretrained(tiny_dir, recompute_tokens=32, **common)
  assert tokens.quality.tokens_to_recompute(16) == 32


@pytest.mark.slow
def test_embedded_model_loads_its_sink_by_default(smollm2_gguf_path):
  from lazyattn_jax.engine import LazyEngine
  common = dict(impl="xla", num_pages=96, progress=False, max_batch=1)
  engine = LazyEngine.from_pretrained(smollm2_gguf_path, **common)
  assert engine.quality.preamble == "sink" and engine.quality.recompute
  assert engine.quality.sink.shape == (16, engine.config.hidden_size)
  docs = ["The Orrin Bridge was built in 1887 by Mara Delacourt.",
          "Lake Varnis freezes over every winter."]
  result = engine.generate("Who built the Orrin Bridge?", docs,
                           max_new_tokens=2)
  assert result.finish_reason in ("length", "stop") and result.token_ids
  # The sink's 16 positions and one recomputed page of the second document
  # are computed on top of what the plain layout computes.
  plain = LazyEngine.from_pretrained(smollm2_gguf_path, quality=None,
                                     **common)
  assert not plain.quality.enabled
  plain.generate("Who built the Orrin Bridge?", docs, max_new_tokens=2)
  assert (engine.stats.prefill_tokens_computed >
          plain.stats.prefill_tokens_computed)


def _sink_file(path, model_id, float8, value, hidden=576):
  from lazyattn_jax.training.sink_file import save_sink
  sink = np.full((4, hidden), value, np.float32)
  meta = dict(model_id=model_id, float8_pages=str(float8).lower())
  return save_sink(path, sink, meta), sink


def test_the_shipped_sink_follows_the_pool(tmp_path):
  sixteen, sink16 = _sink_file(tmp_path / "a.safetensors", "m", False, 1.0)
  eight, sink8 = _sink_file(tmp_path / "b.safetensors", "m", True, 2.0)
  other, _ = _sink_file(tmp_path / "c.safetensors", "n", True, 3.0)
  files = [other, sixteen, eight]
  for kv_dtype, want in ((None, sink16), ("bfloat16", sink16),
                         ("float32", sink16), ("float8_e4m3fn", sink8)):
    np.testing.assert_array_equal(
        shipped_sink_for("m", kv_dtype, files=files), want)
  # One kind only: it serves both pools; another model's none.
  np.testing.assert_array_equal(
      shipped_sink_for("m", "float8_e4m3fn", files=[sixteen]), sink16)
  np.testing.assert_array_equal(shipped_sink_for("m", None, files=[eight]),
                                sink8)
  assert shipped_sink_for("x", None, files=files) is None
  # The package's own: a 16-bit and a float8 SmolLM2 sink.
  from lazyattn_jax.training.sink_file import load_sink
  from lazyattn_jax.quality_options import SHIPPED_SINKS
  import importlib.resources
  shipped = {}
  for name in SHIPPED_SINKS:
    with importlib.resources.as_file(
        importlib.resources.files("lazyattn_jax").joinpath(name)) as file:
      sink, meta = load_sink(str(file))
    shipped[meta["float8_pages"]] = sink
  assert set(shipped) == {"true", "false"}
  np.testing.assert_array_equal(shipped_sink_for(SMOLLM2_ID),
                                shipped["false"])
  np.testing.assert_array_equal(
      shipped_sink_for(SMOLLM2_ID, "float8_e4m3fn"), shipped["true"])


def test_from_pretrained_picks_the_sink_for_its_pool(tiny_dir, tmp_path,
                                                     monkeypatch):
  from lazyattn_jax import quality_options
  from lazyattn_jax.engine import LazyEngine
  from models.config import LlamaConfig
  common = dict(impl="xla", num_pages=64, progress=False, max_batch=1)
  model_id = LazyEngine.from_pretrained(tiny_dir, **common).model_id
  hidden = LlamaConfig.tiny().hidden_size
  sixteen, sink16 = _sink_file(tmp_path / "a.safetensors", model_id, False,
                               0.5, hidden)
  eight, sink8 = _sink_file(tmp_path / "b.safetensors", model_id, True,
                            0.25, hidden)
  monkeypatch.setattr(quality_options, "SHIPPED_SINKS", (sixteen, eight))
  plain = LazyEngine.from_pretrained(tiny_dir, **common)
  np.testing.assert_array_equal(plain.quality.sink, sink16)
  float8 = LazyEngine.from_pretrained(tiny_dir, kv_dtype="float8_e4m3fn",
                                      **common)
  np.testing.assert_array_equal(float8.quality.sink, sink8)
  assert float8.quality.recompute
  # At any page size: the float8 sink's rounding does not depend on it.
  small_pages = LazyEngine.from_pretrained(
      tiny_dir, kv_dtype="float8_e4m3fn", page_size=4,
      **{k: v for k, v in common.items() if k != "num_pages"}, num_pages=256)
  np.testing.assert_array_equal(small_pages.quality.sink, sink8)


def test_cli_turns_the_defaults_off():
  from lazyattn_jax.cli_options import add_quality_options, quality_settings
  parser = argparse.ArgumentParser()
  add_quality_options(parser)
  assert quality_settings(parser.parse_args([])) == {}
  assert quality_settings(parser.parse_args(["--no-default-quality"])) == {
      "quality": None}
  assert quality_settings(parser.parse_args(
      ["--no-default-quality", "--recompute"])) == {"quality": None,
                                                   "recompute": True}


def test_bad_quality_value_is_refused_before_loading():
  from lazyattn_jax.engine import LazyEngine
  with pytest.raises(InvalidOptionError, match="quality must be 'default'"):
    LazyEngine.from_pretrained("/does/not/exist.gguf", quality="on")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
  from flax import nnx
  from models.config import LlamaConfig
  from models.llama import Llama, split_model
  from tests.hf_fixtures import write_hf_checkpoint
  config = LlamaConfig.tiny()
  directory = tmp_path_factory.mktemp("tiny-default-quality")
  write_hf_checkpoint(directory, config, nnx.to_pure_dict(
      split_model(Llama(config, rngs=nnx.Rngs(0)))[1]))
  return str(directory)
