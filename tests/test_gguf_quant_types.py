"""GGUF tensor types: every type gguf can dequantize loads, equal to gguf's
own dequantization of the same bytes; a type it cannot is refused, naming the
tensor and the type, before anything is read; big files stream tensor by
tensor into the target dtype.

The files are written with the gguf writer like llama.cpp's converter
(tests/hf_arch_models.py): a Llama, so the Q/K rows of the quantized tensors
are permuted too, with every matrix holding random blocks of the type under
test (redrawn until every block dequantizes to finite values).
"""

from __future__ import annotations

import functools
import gc
import tracemalloc

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import models.gguf_loader
from models.errors import ModelFormatError
from models.gguf_loader import load_gguf, supported_tensor_types
from models.llama import split_model
from tests.hf_arch_models import hf_model, write_gguf_like_llama_cpp
from tests.hf_fixtures import as_hf_tensors

Q = gguf.GGMLQuantizationType
# The types of common GGUF files (Q4_K_M mixes Q4_K and Q6_K), and all the
# rest gguf dequantizes.
LOADABLE = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K,
            Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS,
            Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ4_NL, Q.IQ4_XS,
            Q.TQ1_0, Q.TQ2_0, Q.MXFP4, Q.NVFP4]
# Types gguf (0.19) has no dequantization for: llama.cpp's intermediate
# quantizations and plain integers.
UNLOADABLE = [Q.Q8_1, Q.Q8_K, Q.I32, Q.F64]
# Every row a whole number of 256-element blocks (K- and IQ-quants).
SHAPE = dict(vocab_size=256, hidden_size=256, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@functools.lru_cache(maxsize=None)
def _llama(**overrides):
  return hf_model("llama", seed=1, **{**SHAPE, **overrides})


def _loaded_as_hf(model) -> dict[str, np.ndarray]:
  return as_hf_tensors(nnx.to_pure_dict(split_model(model)[1]))


def test_every_type_here_is_one_gguf_dequantizes():
  supported = supported_tensor_types()
  assert set(LOADABLE) | {Q.F32} <= set(supported)
  assert not set(UNLOADABLE) & set(supported)


@pytest.mark.parametrize("qtype", LOADABLE, ids=lambda t: t.name)
def test_loaded_weights_equal_gguf_dequantize(tmp_path, qtype):
  model = _llama()
  path = tmp_path / f"{qtype.name}.gguf"
  expected = write_gguf_like_llama_cpp(
      path, model, "llama", matrix_type=qtype,
      random_blocks=np.random.default_rng(int(qtype)))
  _, loaded, _ = load_gguf(path)
  ours = _loaded_as_hf(loaded)
  assert set(ours) == set(expected)
  for name, want in expected.items():
    assert np.isfinite(want).all(), name
    np.testing.assert_array_equal(ours[name], want, err_msg=name)
  # Random blocks, not the model's weights: the check would pass on a
  # loader that ignored the file otherwise.
  assert not np.array_equal(expected["model.layers.0.mlp.up_proj.weight"],
                            model.model.layers[0].mlp.up_proj.weight
                            .detach().numpy())


def test_bfloat16_target_is_the_dequantized_values_rounded(tmp_path):
  path = tmp_path / "q4k.gguf"
  expected = write_gguf_like_llama_cpp(path, _llama(), "llama",
                                       matrix_type=Q.Q4_K,
                                       random_blocks=np.random.default_rng(0))
  _, loaded, _ = load_gguf(path, dtype=jnp.bfloat16)
  ours = _loaded_as_hf(loaded)
  for name, want in expected.items():
    assert ours[name].dtype == jnp.bfloat16, name
    np.testing.assert_array_equal(ours[name],
                                  want.astype(jnp.bfloat16), err_msg=name)


@pytest.mark.parametrize("qtype", UNLOADABLE, ids=lambda t: t.name)
def test_a_type_gguf_cannot_dequantize_is_refused_before_any_read(
    tmp_path, qtype, monkeypatch):
  path = tmp_path / "bad.gguf"
  bad = "blk.1.ffn_down.weight"  # the last layer: found before reading
  write_gguf_like_llama_cpp(path, _llama(), "llama", matrix_type=Q.Q8_0,
                            tensor_types={bad: qtype})
  read = []
  real = models.gguf_loader.dequantize_tensor
  monkeypatch.setattr(models.gguf_loader, "dequantize_tensor",
                      lambda tensor, *a: read.append(tensor.name) or
                      real(tensor, *a))
  with pytest.raises(ModelFormatError) as err:
    load_gguf(path)
  message = str(err.value)
  assert f"'{bad}'" in message and qtype.name in message, message
  assert "bad.gguf" in message and "Q4_K" in message  # lists what works
  assert read == []  # nothing dequantized, nothing on the device


def test_big_file_streams_tensor_by_tensor(tmp_path):
  """Host memory while loading stays a few tensors' worth (the one being
  dequantized, gguf's temporaries, the one before it), far below a float32
  copy of the model or of one parameter's layer stack.  tracemalloc sees
  numpy's allocations; the device arrays (XLA's own, even on CPU) are not
  counted."""
  model = _llama(num_hidden_layers=8, vocab_size=512, intermediate_size=512)
  path = tmp_path / "big.gguf"
  write_gguf_like_llama_cpp(path, model, "llama", matrix_type=Q.Q4_K)
  float32_model = 4 * sum(p.numel() for p in model.parameters())
  largest = 4 * max(p.numel() for p in model.parameters())
  load_gguf(path, dtype=jnp.bfloat16)  # compiles (which allocates too)
  gc.collect()
  tracemalloc.start()
  try:
    _, loaded, _ = load_gguf(path, dtype=jnp.bfloat16)
    _, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
  assert loaded.layers.down_proj[...].dtype == jnp.bfloat16
  assert float32_model > 8 * 4 * largest  # 8 layers of >= 4 such tensors
  assert peak < 6 * largest, (peak, largest, float32_model)


def test_progress_bar_counts_every_tensor(tmp_path, capsys):
  model = _llama()
  path = tmp_path / "q4k.gguf"
  write_gguf_like_llama_cpp(path, model, "llama", matrix_type=Q.Q4_K)
  load_gguf(path, progress=True)
  tensors = len(model.state_dict()) - 1  # the tied output is not stored
  err = capsys.readouterr().err
  assert "Loading GGUF weights" in err
  assert f"{tensors}/{tensors}" in err, err
