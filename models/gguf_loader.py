"""Load a llama.cpp GGUF model: config, dequantized weights, tokenizer data.

The architectures are those of `models.architectures` (llama, which Mistral
files are too, qwen2 and qwen3).  Every tensor type that
`gguf.quants.dequantize` can dequantize loads (F32, F16, BF16, the legacy,
K-, IQ- and TQ-quants, MXFP4, ...); the `gguf` package does all the
dequantization.  Tensors stream one at a time into device arrays of the
target dtype (`models.weights.load_params`).

Two things llama.cpp's converter (convert_hf_to_gguf.py) does to llama-family
weights are undone here:
- attn_q / attn_k rows are permuted per head for llama.cpp's interleaved RoPE
  (`reshape(n_head, 2, rows_per_head // 2, cols).swapaxes(1, 2)`); this model
  uses the HF `rotate_half` layout, so the permutation is inverted, otherwise
  every position would be wrong (Qwen2 and Qwen3 are stored unpermuted);
- Llama-3 RoPE scaling is written as a `rope_freqs.weight` tensor of
  per-frequency divisors instead of metadata; it is turned back into
  Llama-3 scaling parameters and checked against the formula.

The header (metadata, tokenizer data) is read by `models.gguf_metadata`;
`GgufMetadata` and `read_gguf_metadata` are importable from here too.
"""

from __future__ import annotations

import functools
import os

import gguf
import jax.numpy as jnp
import numpy as np

from models.architectures import (Architecture, architecture_from_gguf,
                                  supported_gguf_architectures)
from models.config import LlamaConfig, whole_number
from models.errors import ModelFormatError
from models.gguf_metadata import GgufMetadata, open_gguf, read_gguf_metadata
from models.gguf_rope_freqs import llama3_scaling_from_rope_freqs
from models.llama import Llama, llama_from_params
from models.weights import (CheckpointNames, check_tensors, expected_shapes,
                            load_params)

__all__ = ["GgufMetadata", "dequantize_tensor", "llama_cpp_permute",
           "llama_cpp_unpermute", "load_gguf", "read_gguf_metadata",
           "supported_tensor_types"]

_GGUF_NAMES = CheckpointNames(
    embed_tokens="token_embd.weight", final_norm="output_norm.weight",
    lm_head="output.weight", layer_template="blk.{i}.{name}",
    layer_names={
        "attn_norm": "attn_norm.weight", "q_proj": "attn_q.weight",
        "k_proj": "attn_k.weight", "v_proj": "attn_v.weight",
        "o_proj": "attn_output.weight", "mlp_norm": "ffn_norm.weight",
        "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight",
        "down_proj": "ffn_down.weight", "q_bias": "attn_q.bias",
        "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
        "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight"})
# Llama-3 RoPE scaling, where present; read into the config, not a weight.
_ROPE_FREQS = "rope_freqs.weight"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """The Q/K row permutation convert_hf_to_gguf applies (HF -> llama.cpp).

  Within each head, rows [x_0 .. x_{h/2-1}, y_0 .. y_{h/2-1}] (rotate_half
  pairs) become interleaved [x_0, y_0, x_1, y_1, ...].
  """
  rows = weight.shape[0]
  return (weight.reshape(num_heads, 2, rows // num_heads // 2,
                         *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


def llama_cpp_unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
  """Inverse of `llama_cpp_permute` (llama.cpp -> HF rotate_half layout)."""
  rows = weight.shape[0]
  return (weight.reshape(num_heads, rows // num_heads // 2, 2,
                         *weight.shape[1:])
          .swapaxes(1, 2).reshape(weight.shape))


@functools.lru_cache(maxsize=None)
def _can_dequantize(qtype: gguf.GGMLQuantizationType) -> bool:
  # Asked of the gguf package itself, on one zero block: what it supports
  # grows with its version, and a type it lacks raises NotImplementedError.
  type_size = gguf.GGML_QUANT_SIZES[qtype][1]
  try:
    gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
  except NotImplementedError:
    return False
  return True


def supported_tensor_types() -> tuple[gguf.GGMLQuantizationType, ...]:
  """The GGUF tensor types this loader reads: every type the installed
  `gguf` package can dequantize."""
  return tuple(t for t in gguf.GGMLQuantizationType
               if t in gguf.GGML_QUANT_SIZES and _can_dequantize(t))


def _check_tensor_type(tensor, path: str) -> gguf.GGMLQuantizationType:
  try:
    qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
  except ValueError:
    raise ModelFormatError(f"{path}: GGUF tensor {tensor.name!r} has unknown "
                           f"type number {int(tensor.tensor_type)}") from None
  if qtype not in gguf.GGML_QUANT_SIZES or not _can_dequantize(qtype):
    supported = ", ".join(t.name for t in supported_tensor_types())
    raise ModelFormatError(
        f"{path}: GGUF tensor {tensor.name!r} has type {qtype.name}, which "
        f"the gguf package (version {_gguf_version()}) cannot dequantize; "
        f"supported types: {supported}")
  return qtype


def _gguf_version() -> str:
  from importlib.metadata import PackageNotFoundError, version
  try:
    return version("gguf")
  except PackageNotFoundError:
    return "unknown"


def dequantize_tensor(tensor, path: str = "GGUF file") -> np.ndarray:
  """float32 numpy array of a GGUF tensor, in numpy (row-major) shape.

  Args:
    tensor: a `gguf.ReaderTensor`.
    path: the file, for error messages.

  Raises:
    ModelFormatError: gguf cannot dequantize the tensor's type (the message
      names the tensor and its type).
  """
  qtype = _check_tensor_type(tensor, path)
  # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
  shape = tuple(int(d) for d in reversed(tensor.shape))
  # A plain in-memory copy: dequantizing straight from the reader's memmap
  # pays numpy's memmap bookkeeping on every block slice (several x slower).
  values = gguf.quants.dequantize(np.array(tensor.data), qtype)
  return np.asarray(values, np.float32).reshape(shape)


def _config_from_gguf(metadata: GgufMetadata, family: Architecture,
                      tensors: dict, path: str,
                      max_position: int | None) -> LlamaConfig:
  arch = metadata.architecture  # the metadata keys' prefix
  fields = metadata.fields

  def get(key, default=None, required=False):
    value = fields.get(f"{arch}.{key}", default)
    if required and value is None:
      raise ModelFormatError(f"{path}: GGUF metadata lacks {arch}.{key}")
    return value

  def integer(key, value):
    try:
      return whole_number(value, f"{arch}.{key}")
    except ValueError as e:
      raise ModelFormatError(f"{path}: {e}") from None

  def single(key, value):
    if isinstance(value, list):  # per-layer arrays: only uniform ones work
      if len(set(value)) != 1:
        raise ModelFormatError(f"{path}: {arch}.{key} varies per layer "
                               f"({value}); not supported")
      value = value[0]
    return integer(key, value)

  experts = get("expert_count")
  if experts not in (None, 0):
    raise ModelFormatError(
        f"{path}: {arch}.expert_count = {experts}: mixture-of-experts models "
        f"are not supported (dense {supported_gguf_architectures()} are)")
  hidden = integer("embedding_length",
                   get("embedding_length", required=True))
  num_heads = single("attention.head_count",
                     get("attention.head_count", required=True))
  num_kv_heads = single("attention.head_count_kv",
                        get("attention.head_count_kv", num_heads))
  key_length = get("attention.key_length")
  if key_length is None and (num_heads <= 0 or hidden % num_heads):
    # Without key_length the head width is hidden / heads; a remainder means
    # the file is inconsistent, whatever the other fields say.
    raise ModelFormatError(
        f"{path}: the hidden size ({arch}.embedding_length = {hidden}) is not "
        f"divisible by the head count ({arch}.attention.head_count = "
        f"{num_heads}), and {arch}.attention.key_length is not given")
  head_dim = (hidden // num_heads if key_length is None else
              integer("attention.key_length", key_length))
  value_dim = integer("attention.value_length",
                      get("attention.value_length", head_dim))
  if value_dim != head_dim:
    raise ModelFormatError(f"{path}: key_length {head_dim} != value_length "
                           f"{value_dim}; not supported")
  rope_dims = get("rope.dimension_count")
  if (rope_dims is not None and
      integer("rope.dimension_count", rope_dims) != head_dim):
    raise ModelFormatError(
        f"{path}: partial RoPE ({arch}.rope.dimension_count = {rope_dims}, "
        f"head_dim {head_dim}) is not supported")
  theta = float(get("rope.freq_base", 10000.0))
  scaling_type = get("rope.scaling.type")
  if scaling_type not in (None, "none", ""):
    raise ModelFormatError(f"{path}: {arch}.rope.scaling.type = "
                           f"{scaling_type!r} is not supported (plain and "
                           "Llama-3 RoPE are)")
  # llama.cpp applies a factor as linear scaling whatever the type says,
  # "none" included.
  for key in ("rope.scaling.factor", "rope.scale_linear"):
    factor = get(key)
    if factor not in (None, 0, 1, 0.0, 1.0):
      raise ModelFormatError(
          f"{path}: {arch}.{key} = {factor} asks for linear RoPE scaling, "
          "which is not supported (plain and Llama-3 RoPE are)")
  context_length = integer("context_length", get("context_length", 8192))
  rope_scaling = None
  if _ROPE_FREQS in tensors:
    rope_scaling = llama3_scaling_from_rope_freqs(
        dequantize_tensor(tensors[_ROPE_FREQS], path), head_dim, theta,
        integer("rope.scaling.original_context_length",
                get("rope.scaling.original_context_length", 8192)), path)
  embed = tensors.get(_GGUF_NAMES.embed_tokens)
  if embed is None:
    raise ModelFormatError(f"{path}: GGUF file has no "
                           f"{_GGUF_NAMES.embed_tokens} tensor")
  vocab_size = int(embed.shape[1])  # GGUF shape is [D, V]
  if metadata.tokens and len(metadata.tokens) != vocab_size:
    raise ModelFormatError(f"{path}: token list has {len(metadata.tokens)} "
                           f"entries but {_GGUF_NAMES.embed_tokens} has "
                           f"{vocab_size} rows")

  def token_id(value):
    return value if value is not None and 0 <= value < vocab_size else None

  return LlamaConfig(
      vocab_size=vocab_size,
      hidden_size=hidden,
      num_layers=integer("block_count", get("block_count", required=True)),
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      intermediate_size=single("feed_forward_length",
                               get("feed_forward_length", required=True)),
      rope_theta=theta,
      rope_scaling=rope_scaling,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings=_GGUF_NAMES.lm_head not in tensors,
      max_position=(whole_number(max_position, "max_position")
                    if max_position else context_length),
      bos_token_id=token_id(metadata.bos_token_id),
      eos_token_id=token_id(metadata.eos_token_id),
      attention_bias=family.attention_bias,
      qk_norm=family.qk_norm,
  )


def _params_from_gguf(config: LlamaConfig, family: Architecture,
                      tensors: dict, path: str, param_dtype,
                      progress: bool, sharding=None) -> dict:
  expected = expected_shapes(config, _GGUF_NAMES)
  check_tensors({name: tuple(int(d) for d in reversed(t.shape))
                 for name, t in tensors.items() if name != _ROPE_FREQS},
                expected, path, gguf_order=True)
  # convert_hf_to_gguf permutes the Q and K rows for llama.cpp's RoPE.
  permuted = {}
  if family.llama_cpp_permuted:
    for i in range(config.num_layers):
      permuted[_GGUF_NAMES.layer_tensor("q_proj", i)] = config.num_heads
      permuted[_GGUF_NAMES.layer_tensor("k_proj", i)] = config.num_kv_heads

  def load(name):
    value = dequantize_tensor(tensors[name], path)
    if name in permuted:
      value = llama_cpp_unpermute(value, permuted[name])
    return value

  return load_params(config, _GGUF_NAMES, load, param_dtype=param_dtype,
                     progress=progress, description="Loading GGUF weights",
                     sharding=sharding)


def load_gguf(path, *, dtype=jnp.float32, param_dtype=None,
              max_position: int | None = None, progress: bool = False,
              sharding=None, before_weights=None
              ) -> tuple[LlamaConfig, Llama, GgufMetadata]:
  """Loads a llama.cpp GGUF file of a supported architecture.

  Everything is checked before any tensor is read (the architecture, every
  tensor's type, the configuration, every tensor's name and shape); then the
  tensors are dequantized one at a time, straight into device arrays of
  `param_dtype`.

  Args:
    path: the .gguf file.
    dtype: compute dtype of the model.
    param_dtype: storage dtype of the weights (default: `dtype`).
    max_position: overrides the context length from the metadata.
    progress: show a progress bar while dequantizing.
    sharding: as for `models.safetensors_loader.load_safetensors`: the
      file's config -> a `models.sharding.TensorParallel` or None; each
      device then receives only its shard of every tensor.
    before_weights: called with the metadata once every check has passed,
      before any tensor is read (a caller's own checks, such as building
      the tokenizer); what it raises propagates.

  Returns:
    (config, model, metadata): the LlamaConfig read from the metadata, a
    models.llama.Llama holding the dequantized weights, and the metadata
    (tokenizer vocabulary, merges, special ids, chat template).

  Raises:
    ModelFormatError: a corrupted or truncated file, an unsupported
      architecture (the message lists the supported ones), a tensor type the
      gguf package cannot dequantize (the message names the tensor and its
      type), a missing, unexpected or wrongly shaped tensor, an unsupported
      configuration; the message names the file and the tensor or field
      (ModelFileNotFoundError, also a FileNotFoundError: no such file).
  """
  path = os.fspath(path)
  reader, metadata = open_gguf(path)
  family = architecture_from_gguf(metadata.architecture, path)
  tensors = {t.name: t for t in reader.tensors}
  for tensor in tensors.values():  # refuse before dequantizing anything
    _check_tensor_type(tensor, path)
  try:
    config = _config_from_gguf(metadata, family, tensors, path, max_position)
  except ModelFormatError:
    raise
  except (ValueError, TypeError) as e:  # LlamaConfig's checks, odd values
    raise ModelFormatError(f"{path}: unsupported model configuration: {e}"
                           ) from e
  if before_weights is not None:
    before_weights(metadata)
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  placement = sharding(config) if sharding is not None else None
  params = _params_from_gguf(config, family, tensors, path, param_dtype,
                             progress, placement)
  model = llama_from_params(
      config if placement is None else placement.model_config(config),
      params, dtype=dtype, param_dtype=param_dtype)
  return config, model, metadata
