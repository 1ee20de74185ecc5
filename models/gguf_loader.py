"""Load a llama.cpp GGUF Llama: config, dequantized weights, tokenizer data.

Through the `gguf` package (GGUFReader and gguf.quants.dequantize).  Two things
llama.cpp's converter (convert_hf_to_gguf.py) does to Llama weights are undone
here:
- attn_q / attn_k rows are permuted per head for llama.cpp's interleaved RoPE
  (`reshape(n_head, 2, rows_per_head // 2, cols).swapaxes(1, 2)`); this model
  uses the HF `rotate_half` layout, so the permutation is inverted, otherwise
  every position would be wrong;
- Llama-3 RoPE scaling is written as a `rope_freqs.weight` tensor of
  per-frequency divisors instead of metadata; it is turned back into
  Llama-3 scaling parameters and checked against the formula.

The header (metadata, tokenizer data) is read by `models.gguf_metadata`;
`GgufMetadata` and `read_gguf_metadata` are importable from here too.
"""

from __future__ import annotations

import os

import gguf
import jax.numpy as jnp
import numpy as np

from models.config import Llama3RopeScaling, LlamaConfig
from models.errors import ModelFormatError
from models.gguf_metadata import GgufMetadata, open_gguf, read_gguf_metadata
from models.llama import Llama, llama_from_params
from models.weights import (CheckpointNames, build_params, check_tensors,
                            expected_shapes)

__all__ = ["GgufMetadata", "SUPPORTED_TENSOR_TYPES", "dequantize_tensor",
           "llama_cpp_permute", "llama_cpp_unpermute", "load_gguf",
           "read_gguf_metadata"]

SUPPORTED_TENSOR_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
)

_GGUF_NAMES = CheckpointNames(
    embed_tokens="token_embd.weight", final_norm="output_norm.weight",
    lm_head="output.weight", layer_template="blk.{i}.{name}.weight",
    layer_names=("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output",
                 "ffn_norm", "ffn_gate", "ffn_up", "ffn_down"))
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


def _check_tensor_type(tensor) -> gguf.GGMLQuantizationType:
  qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
  if qtype not in SUPPORTED_TENSOR_TYPES:
    supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
    raise ModelFormatError(f"GGUF tensor {tensor.name!r} has type "
                           f"{qtype.name}; supported types are {supported}")
  return qtype


def dequantize_tensor(tensor) -> np.ndarray:
  """float32 numpy array of a GGUF tensor, in numpy (row-major) shape.

  Raises:
    ModelFormatError: the tensor type is not one of SUPPORTED_TENSOR_TYPES.
  """
  qtype = _check_tensor_type(tensor)
  # GGUF lists dimensions fastest-first; numpy wants them slowest-first.
  shape = tuple(int(d) for d in reversed(tensor.shape))
  # A plain in-memory copy: dequantizing straight from the reader's memmap
  # pays numpy's memmap bookkeeping on every block slice (several x slower).
  values = gguf.quants.dequantize(np.array(tensor.data), qtype)
  return np.asarray(values, np.float32).reshape(shape)


def _llama3_scaling_from_rope_freqs(freq_divisors: np.ndarray, head_dim: int,
                                    theta: float, original_max_position: int,
                                    path: str) -> Llama3RopeScaling | None:
  """Recovers Llama-3 scaling parameters from llama.cpp's rope_freqs tensor.

  The Llama-3 rule only depends on original_max_position / low_freq_factor
  and original_max_position / high_freq_factor, so original_max_position is
  fixed (from metadata or 8192) and the two factors are fitted to the
  smoothly interpolated frequencies (or take Llama-3's 1 and 4 when fewer
  than two frequencies are interpolated); the result is then verified
  against the tensor.
  """
  divisors = np.asarray(freq_divisors, np.float64).reshape(-1)
  if divisors.shape != (head_dim // 2,):
    raise ModelFormatError(f"{path}: rope_freqs.weight has {divisors.size} "
                           f"entries, expected head_dim / 2 = {head_dim // 2}")
  factor = float(divisors.max())
  if np.allclose(divisors, 1.0, rtol=0, atol=1e-6):
    return None
  base = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2.0 * np.pi / base
  tol = 1e-5 * factor
  smoothed = (divisors > 1.0 + tol) & (divisors < factor - tol)
  low, high = 1.0, 4.0
  if factor > 1.0 and smoothed.sum() >= 2:
    # 1/divisor = (1 - s)/factor + s  =>  s; and s (high - low) + low = orig/wl.
    s = (1.0 / divisors[smoothed] - 1.0 / factor) / (1.0 - 1.0 / factor)
    a = np.stack([1.0 - s, s], axis=1)
    (low, high), *_ = np.linalg.lstsq(
        a, original_max_position / wavelen[smoothed], rcond=None)
  try:
    scaling = Llama3RopeScaling(
        factor=factor, low_freq_factor=float(low),
        high_freq_factor=float(high),
        original_max_position=int(original_max_position))
    config = LlamaConfig(vocab_size=1, hidden_size=head_dim, num_layers=1,
                         num_heads=1, num_kv_heads=1, head_dim=head_dim,
                         intermediate_size=1, rope_theta=theta,
                         rope_scaling=scaling)
    fitted = config.rope.inv_frequencies(head_dim)
  except ValueError as e:
    raise ModelFormatError(f"{path}: rope_freqs.weight is not Llama-3 RoPE "
                           f"scaling ({e})") from e
  if not np.allclose(fitted, base / divisors, rtol=1e-5, atol=0):
    raise ModelFormatError(f"{path}: rope_freqs.weight does not match Llama-3 "
                           "RoPE scaling; this frequency scaling is not "
                           "supported")
  return scaling


def _config_from_gguf(metadata: GgufMetadata, tensors: dict, path: str,
                      max_position: int | None) -> LlamaConfig:
  arch = metadata.architecture
  if arch != "llama":
    raise ModelFormatError(f"{path}: general.architecture is {arch!r}; only "
                           "'llama' GGUF files are supported")
  fields = metadata.fields

  def get(key, default=None, required=False):
    value = fields.get(f"{arch}.{key}", default)
    if required and value is None:
      raise ModelFormatError(f"{path}: GGUF metadata lacks {arch}.{key}")
    return value

  def single(key, value):
    if isinstance(value, list):  # per-layer arrays: only uniform ones work
      if len(set(value)) != 1:
        raise ModelFormatError(f"{path}: {arch}.{key} varies per layer "
                               f"({value}); not supported")
      value = value[0]
    return int(value)

  hidden = int(get("embedding_length", required=True))
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
  head_dim = int(hidden // num_heads if key_length is None else key_length)
  value_dim = int(get("attention.value_length", head_dim))
  if value_dim != head_dim:
    raise ModelFormatError(f"{path}: key_length {head_dim} != value_length "
                           f"{value_dim}; not supported")
  rope_dims = get("rope.dimension_count")
  if rope_dims is not None and int(rope_dims) != head_dim:
    raise ModelFormatError(
        f"{path}: partial RoPE ({arch}.rope.dimension_count = {rope_dims}, "
        f"head_dim {head_dim}) is not supported")
  theta = float(get("rope.freq_base", 10000.0))
  scaling_type = get("rope.scaling.type")
  if scaling_type not in (None, "none", ""):
    raise ModelFormatError(f"{path}: {arch}.rope.scaling.type = "
                           f"{scaling_type!r} is not supported (plain and "
                           "Llama-3 RoPE are)")
  context_length = int(get("context_length", 8192))
  rope_scaling = None
  if _ROPE_FREQS in tensors:
    rope_scaling = _llama3_scaling_from_rope_freqs(
        dequantize_tensor(tensors[_ROPE_FREQS]), head_dim, theta,
        int(get("rope.scaling.original_context_length", 8192)), path)
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
      num_layers=int(get("block_count", required=True)),
      num_heads=num_heads,
      num_kv_heads=num_kv_heads,
      head_dim=head_dim,
      intermediate_size=single("feed_forward_length",
                               get("feed_forward_length", required=True)),
      rope_theta=theta,
      rope_scaling=rope_scaling,
      rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
      tie_word_embeddings=_GGUF_NAMES.lm_head not in tensors,
      max_position=int(max_position or context_length),
      bos_token_id=token_id(metadata.bos_token_id),
      eos_token_id=token_id(metadata.eos_token_id),
  )


def _params_from_gguf(config: LlamaConfig, tensors: dict, path: str,
                      progress: bool) -> dict:
  expected = expected_shapes(config, _GGUF_NAMES)
  check_tensors({name: tuple(int(d) for d in reversed(t.shape))
                 for name, t in tensors.items() if name != _ROPE_FREQS},
                expected, path, gguf_order=True)
  for tensor in tensors.values():  # refuse before dequantizing anything
    _check_tensor_type(tensor)
  # convert_hf_to_gguf permutes the Q and K rows for llama.cpp's RoPE.
  permuted = {}
  for i in range(config.num_layers):
    permuted[_GGUF_NAMES.layer_tensor("q_proj", i)] = config.num_heads
    permuted[_GGUF_NAMES.layer_tensor("k_proj", i)] = config.num_kv_heads

  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=len(tensors), desc="Loading GGUF weights", unit="tensor")

  def load(name):
    value = dequantize_tensor(tensors[name])
    if name in permuted:
      value = llama_cpp_unpermute(value, permuted[name])
    if bar is not None:
      bar.update(1)
    return value

  params = build_params(config, _GGUF_NAMES, load)
  if bar is not None:
    bar.update(int(_ROPE_FREQS in tensors))
    bar.close()
  return params


def load_gguf(path, *, dtype=jnp.float32, param_dtype=None,
              max_position: int | None = None, progress: bool = False
              ) -> tuple[LlamaConfig, Llama, GgufMetadata]:
  """Loads a llama.cpp GGUF Llama file.

  Args:
    path: the .gguf file.
    dtype: compute dtype of the model.
    param_dtype: storage dtype of the weights (default: `dtype`).
    max_position: overrides the context length from the metadata.
    progress: show a progress bar while dequantizing.

  Returns:
    (config, model, metadata): the LlamaConfig read from the metadata, a
    models.llama.Llama holding the dequantized weights, and the metadata
    (tokenizer vocabulary, merges, special ids, chat template).

  Raises:
    ModelFormatError: a corrupted or truncated file, not a Llama GGUF file,
      a missing, unexpected or wrongly shaped tensor, an unsupported tensor
      type or configuration; the message names the file and the tensor or
      field (ModelFileNotFoundError, also a FileNotFoundError: no such file).
  """
  path = os.fspath(path)
  reader, metadata = open_gguf(path)
  tensors = {t.name: t for t in reader.tensors}
  try:
    config = _config_from_gguf(metadata, tensors, path, max_position)
  except ModelFormatError:
    raise
  except (ValueError, TypeError) as e:  # LlamaConfig's checks, odd values
    raise ModelFormatError(f"{path}: unsupported model configuration: {e}"
                           ) from e
  params = _params_from_gguf(config, tensors, path, progress)
  model = llama_from_params(config, params, dtype=dtype,
                            param_dtype=param_dtype)
  return config, model, metadata
