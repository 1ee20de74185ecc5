"""The learned document sink (lazyattn_jax/training/sink.py): training lowers
the distillation loss, the file round-trips, bad shapes are refused."""

import numpy as np
import pytest
from flax import nnx

from lazyattn_jax.training.data import SyntheticFacts
from lazyattn_jax.training.errors import SinkFormatError
from lazyattn_jax.training.model_io import from_model
from lazyattn_jax.training.optim import OptimizerConfig
from lazyattn_jax.training.sink import (SinkConfig, init_sink, init_tokens,
                                        train_sink)
from lazyattn_jax.training.sink_file import load_sink, save_sink
from models.llama import Llama
from tests.training_helpers import tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def trainable():
  return from_model(Llama(tiny_config(), rngs=nnx.Rngs(0)), tiny_tokenizer())


def test_training_lowers_the_held_out_distillation_loss(trainable):
  config = SinkConfig(preamble_len=4, steps=12, batch_size=4, eval_batches=2,
                      optimizer=OptimizerConfig(learning_rate=3e-2,
                                                warmup_steps=2))
  start = init_sink(trainable, 4)
  result = train_sink(trainable, SyntheticFacts(64, 3, seed=1), config,
                      progress=False)
  kl = result.eval_kl
  assert kl["trained_sink"] < 0.8 * kl["initial_sink"], kl
  assert result.sink.shape == (4, 64) and result.sink.dtype == np.float32
  assert not np.allclose(result.sink, start)
  assert [r["step"] for r in result.history.rows] == list(range(12))
  # The starting sink is the chat prefix's first token embeddings.
  ids = init_tokens(trainable.tokenizer, 4)
  assert tiny_tokenizer().decode(ids, skip_special_tokens=False).startswith(
      "<|im_start|>")
  np.testing.assert_array_equal(
      start, np.asarray(trainable.params["embed_tokens"])[ids])


def test_sink_file_round_trips(tmp_path):
  sink = np.random.default_rng(0).normal(size=(16, 64)).astype(np.float32)
  path = save_sink(tmp_path / "sink.safetensors", sink,
                   {"model_id": "gguf:x.gguf:1", "steps": 300})
  loaded, meta = load_sink(path, hidden_size=64, preamble_len=16)
  np.testing.assert_array_equal(loaded, sink)
  assert meta["model_id"] == "gguf:x.gguf:1" and meta["steps"] == "300"
  assert (meta["preamble_len"], meta["hidden_size"]) == ("16", "64")


def test_wrong_shapes_and_files_are_refused(tmp_path, trainable):
  with pytest.raises(SinkFormatError, match="non-empty"):
    save_sink(tmp_path / "a.safetensors", np.zeros((16,), np.float32))
  path = save_sink(tmp_path / "b.safetensors", np.zeros((8, 32), np.float32))
  with pytest.raises(SinkFormatError, match="hidden size 64"):
    load_sink(path, hidden_size=64)
  with pytest.raises(SinkFormatError, match="expected 16"):
    load_sink(path, preamble_len=16)
  from safetensors.numpy import save_file
  save_file({"sink": np.zeros((4, 64), np.float16)}, tmp_path / "h.st")
  with pytest.raises(SinkFormatError, match="float32"):
    load_sink(tmp_path / "h.st")
  save_file({"other": np.zeros((4, 64), np.float32)}, tmp_path / "o.st")
  with pytest.raises(SinkFormatError, match="one tensor 'sink'"):
    load_sink(tmp_path / "o.st")
  (tmp_path / "junk.st").write_bytes(b"\x05" * 40)
  with pytest.raises(SinkFormatError, match="not a readable"):
    load_sink(tmp_path / "junk.st")
  with pytest.raises(SinkFormatError, match="not found"):
    load_sink(tmp_path / "none.st")
  with pytest.raises(SinkFormatError, match="hidden size"):
    train_sink(trainable, SyntheticFacts(4), SinkConfig(preamble_len=4),
               sink=np.zeros((4, 32), np.float32), progress=False)


def test_command_line_help_and_a_bad_setting(capsys, tmp_path):
  from lazyattn_jax.training.sink import main
  with pytest.raises(SystemExit) as exit_:
    main(["--help"])
  out = capsys.readouterr().out
  assert exit_.value.code == 0 and "--preamble-len" in out
  assert "sink.safetensors" in out
  assert main(["--out", str(tmp_path), "--preamble-len", "0"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ["sink: error: preamble_len must lie in [1, 1024], got 0"]
