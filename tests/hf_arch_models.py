"""Random small models of every supported architecture, built by HF
transformers, and the GGUF file llama.cpp's converter would make of them.

- `hf_model(arch)`: a random HF model (torch, float32) with random norm
  weights, Q/K norm weights and biases (HF initialises those to ones and
  zeros, which would hide a missing or misplaced one).
- `write_gguf_like_llama_cpp(path, model, ...)`: the same weights as a GGUF
  file written with the `gguf` package's writer and its own tensor-name map
  (`gguf.get_tensor_name_map`), Q/K rows permuted where llama.cpp permutes
  them (its llama family, which Mistral is converted to), any tensor type:
  quantized by gguf, or random blocks for types gguf cannot quantize.
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from models.gguf_loader import llama_cpp_permute, llama_cpp_unpermute

Q = gguf.GGMLQuantizationType

ARCHS = ("llama", "mistral", "qwen2", "qwen3")

_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, max_position_embeddings=4096,
               rms_norm_eps=1e-5, hidden_act="silu",
               # Weights near LeCun scale: attention far from uniform, so a
               # position error shows in the logits.
               initializer_range=0.125, bos_token_id=1, eos_token_id=2)
# Each architecture with what sets it apart (and tied embeddings in some).
_SPECIFIC = {
    "llama": dict(tie_word_embeddings=True, rope_theta=500000.0),
    # A window longer than any test sequence, so HF's sliding-window mask and
    # full attention agree; the loader limits max_position to it.
    "mistral": dict(tie_word_embeddings=False, rope_theta=1000000.0,
                    sliding_window=1024),
    "qwen2": dict(tie_word_embeddings=True, rope_theta=1000000.0),
    # head_dim 32 != hidden / heads, as in real Qwen3 models.
    "qwen3": dict(tie_word_embeddings=False, rope_theta=1000000.0,
                  head_dim=32),
}
_HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"),
               "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
               "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
# llama.cpp converts Mistral checkpoints to its llama architecture.
_GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA,
              "mistral": gguf.MODEL_ARCH.LLAMA,
              "qwen2": gguf.MODEL_ARCH.QWEN2,
              "qwen3": gguf.MODEL_ARCH.QWEN3}


def hf_model(arch: str, seed: int = 0, **overrides):
  """A random HF causal LM of `arch`, float32, in eval mode; `overrides`
  replace config fields."""
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  config_class, model_class = _HF_CLASSES[arch]
  fields = {**_COMMON, **_SPECIFIC[arch], **overrides}
  config = getattr(transformers, config_class)(**fields)
  torch.manual_seed(seed)
  model = getattr(transformers, model_class)(config)
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight"):
        param.copy_(1 + 0.3 * torch.randn_like(param))
      elif name.endswith(".bias"):
        param.copy_(torch.randn_like(param))
  return model.eval()


def hf_tensors(model) -> dict[str, np.ndarray]:
  """The model's checkpoint tensors by HF name, float32 numpy (tied output
  weights left out, as save_pretrained leaves them out)."""
  tensors = {name: value.detach().float().numpy()
             for name, value in model.state_dict().items()}
  if model.config.tie_word_embeddings:
    tensors.pop("lm_head.weight", None)
  return tensors


def write_gguf_like_llama_cpp(path, model, arch: str, *,
                              matrix_type=Q.F32, tensor_types=None,
                              random_blocks: np.random.Generator | None = None,
                              metadata=None) -> dict[str, np.ndarray | None]:
  """Writes `model` as convert_hf_to_gguf would, with metadata from its
  config.

  Args:
    path: the .gguf file to write.
    model: an HF model from `hf_model`.
    arch: its architecture.
    matrix_type: the type of every 2D tensor (1D ones stay F32, as
      llama.cpp keeps them).
    tensor_types: GGUF tensor name -> type, overriding `matrix_type`.
    random_blocks: with a generator, quantized tensors hold random blocks
      (`random_blocks_of`) instead of gguf's quantization of the weights;
      types gguf cannot quantize always do.
    metadata: more key/value metadata (e.g. the tokenizer's), by GGUF key.

  Returns:
    HF tensor name -> the values a correct loader must produce: gguf's
    dequantization of the stored bytes, in HF row order (None where gguf
    cannot dequantize the type).
  """
  c = model.config
  gguf_arch = _GGUF_ARCH[arch]
  writer = gguf.GGUFWriter(os.fspath(path), gguf.MODEL_ARCH_NAMES[gguf_arch])
  writer.add_name(f"tiny random {arch}")
  writer.add_block_count(c.num_hidden_layers)
  writer.add_context_length(c.max_position_embeddings)
  writer.add_embedding_length(c.hidden_size)
  writer.add_feed_forward_length(c.intermediate_size)
  writer.add_head_count(c.num_attention_heads)
  writer.add_head_count_kv(c.num_key_value_heads)
  writer.add_layer_norm_rms_eps(c.rms_norm_eps)
  writer.add_rope_freq_base(_rope_theta(c))
  writer.add_bos_token_id(c.bos_token_id)
  writer.add_eos_token_id(c.eos_token_id)
  head_dim = getattr(c, "head_dim", None) or (c.hidden_size //
                                              c.num_attention_heads)
  if arch == "qwen3":  # the converter writes head_dim where config has one
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
  if gguf_arch == gguf.MODEL_ARCH.LLAMA:
    writer.add_rope_dimension_count(head_dim)
  for key, value in (metadata or {}).items():
    _add_metadata(writer, key, value)
  name_map = gguf.get_tensor_name_map(gguf_arch, c.num_hidden_layers)
  rng = random_blocks or np.random.default_rng(0)
  expected = {}
  for hf_name, value in hf_tensors(model).items():
    name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    assert name is not None, hf_name
    heads = (_permuted_heads(hf_name, c)
             if gguf_arch == gguf.MODEL_ARCH.LLAMA else None)
    stored = value if heads is None else llama_cpp_permute(value, heads)
    qtype = (tensor_types or {}).get(
        name, matrix_type if value.ndim == 2 else Q.F32)
    data = _encode(stored, qtype, rng if random_blocks or not _can_quantize(
        qtype) else None)
    writer.add_tensor(name, data, raw_dtype=qtype)
    try:
      back = gguf.quants.dequantize(data, qtype).reshape(value.shape)
    except NotImplementedError:
      expected[hf_name] = None
      continue
    expected[hf_name] = (back if heads is None else
                         llama_cpp_unpermute(back, heads))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return expected


def random_blocks_of(shape, qtype, rng: np.random.Generator) -> np.ndarray:
  """Random block bytes for a tensor of numpy shape `shape` (rows of whole
  blocks), redrawn block by block until gguf dequantizes every block to
  finite values (random scale bytes may spell inf or NaN).  Types gguf
  cannot dequantize keep their first draw."""
  block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
  blocks = int(np.prod(shape)) // block_size
  data = rng.integers(0, 256, (blocks, type_size), dtype=np.uint8)
  for _ in range(100):
    try:
      with np.errstate(all="ignore"):  # inf and NaN are expected here
        values = gguf.quants.dequantize(data, qtype).reshape(blocks, -1)
    except NotImplementedError:
      break
    bad = ~np.isfinite(values).all(axis=1)
    if not bad.any():
      break
    data[bad] = rng.integers(0, 256, (int(bad.sum()), type_size),
                             dtype=np.uint8)
  else:
    raise AssertionError(f"could not draw finite {qtype.name} blocks")
  return data.reshape(*shape[:-1], -1)


def _can_quantize(qtype) -> bool:
  try:
    gguf.quants.quantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][0]),
                                  np.float32), qtype)
  except NotImplementedError:
    return False
  return True


def _encode(value, qtype, rng):
  if qtype in (Q.F32, Q.F16) or rng is None:
    return gguf.quants.quantize(np.ascontiguousarray(value, np.float32), qtype)
  return random_blocks_of(value.shape, qtype, rng)


def _add_metadata(writer, key, value):
  if isinstance(value, str):
    writer.add_string(key, value)
  elif isinstance(value, bool):
    writer.add_bool(key, value)
  elif isinstance(value, int):
    writer.add_uint32(key, value)
  elif isinstance(value, float):
    writer.add_float32(key, value)
  else:
    writer.add_array(key, list(value))


def _permuted_heads(hf_name: str, config) -> int | None:
  if hf_name.endswith(("q_proj.weight", "q_proj.bias")):
    return config.num_attention_heads
  if hf_name.endswith(("k_proj.weight", "k_proj.bias")):
    return config.num_key_value_heads
  return None


def _rope_theta(config) -> float:
  parameters = getattr(config, "rope_parameters", None) or {}
  return float(parameters.get("rope_theta",
                              getattr(config, "rope_theta", 10000.0)))
