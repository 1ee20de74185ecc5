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
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import gguf
import jax
import jax.numpy as jnp
import numpy as np

from models.config import Llama3RopeScaling, LlamaConfig
from models.llama import LAYER_PARAM_NAMES, Llama, llama_from_params

SUPPORTED_TENSOR_TYPES = (
    gguf.GGMLQuantizationType.F32,
    gguf.GGMLQuantizationType.F16,
    gguf.GGMLQuantizationType.BF16,
    gguf.GGMLQuantizationType.Q8_0,
    gguf.GGMLQuantizationType.Q4_0,
    gguf.GGMLQuantizationType.Q4_1,
)

# GGUF per-block tensor name -> (our stacked name, transpose to [in, out]?).
_BLOCK_TENSORS = {
    "attn_norm": ("attn_norm", False),
    "attn_q": ("q_proj", True),
    "attn_k": ("k_proj", True),
    "attn_v": ("v_proj", True),
    "attn_output": ("o_proj", True),
    "ffn_norm": ("mlp_norm", False),
    "ffn_gate": ("gate_proj", True),
    "ffn_up": ("up_proj", True),
    "ffn_down": ("down_proj", True),
}
# Large tokenizer arrays, kept out of GgufMetadata.fields.
_TOKENIZER_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                     "tokenizer.ggml.merges", "tokenizer.ggml.scores")


@dataclasses.dataclass(frozen=True)
class GgufMetadata:
  """What a GGUF file says besides its tensors.

  Attributes:
    path: the file.
    architecture: `general.architecture` (e.g. "llama").
    name: `general.name`, if present.
    tokenizer_model: `tokenizer.ggml.model` ("gpt2" for byte-level BPE,
      "llama" for SentencePiece).
    tokenizer_pre: `tokenizer.ggml.pre` (pre-tokenizer name, e.g. "smollm").
    tokens: the vocabulary, index = token id.
    token_types: per-token type (1 normal, 2 unknown, 3 control,
      4 user-defined, 5 unused, 6 byte), if present.
    merges: BPE merges ("a b" strings), if present.
    scores: SentencePiece scores, if present.
    bos_token_id, eos_token_id, unknown_token_id, padding_token_id: ids.
    add_bos_token, add_eos_token, add_space_prefix: tokenizer flags.
    chat_template: Jinja chat template, if present.
    fields: every other key/value (scalars, strings, small arrays as lists).
  """

  path: str
  architecture: str
  name: str | None
  tokenizer_model: str | None
  tokenizer_pre: str | None
  tokens: tuple[str, ...]
  token_types: tuple[int, ...] | None
  merges: tuple[str, ...] | None
  scores: tuple[float, ...] | None
  bos_token_id: int | None
  eos_token_id: int | None
  unknown_token_id: int | None
  padding_token_id: int | None
  add_bos_token: bool | None
  add_eos_token: bool | None
  add_space_prefix: bool | None
  chat_template: str | None
  fields: dict[str, Any]

  def key_values(self) -> dict[str, Any]:
    """Every key/value of the file under its GGUF key, tokenizer arrays
    included: what `models.tokenizer.LlamaTokenizer.from_gguf_metadata`
    takes, so a caller of `load_gguf` need not parse the file again."""
    values = dict(self.fields)
    for key, value in (("tokenizer.ggml.tokens", self.tokens),
                       ("tokenizer.ggml.token_type", self.token_types),
                       ("tokenizer.ggml.merges", self.merges),
                       ("tokenizer.ggml.scores", self.scores)):
      if value:
        values[key] = list(value)
    return values


def _field_value(field) -> Any:
  """Python value of a GGUF key/value field (strings decoded, arrays listed)."""
  if not field.types:
    return None
  main = field.types[0]
  if main == gguf.GGUFValueType.ARRAY:
    if field.types[-1] == gguf.GGUFValueType.STRING:
      return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    if not field.data:
      return []
    return np.concatenate([field.parts[i] for i in field.data]).tolist()
  if main == gguf.GGUFValueType.STRING:
    return bytes(field.parts[-1]).decode("utf-8")
  return field.parts[-1].tolist()[0]


def _open(path) -> gguf.GGUFReader:
  path = os.fspath(path)
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file not found: {path}")
  try:
    return gguf.GGUFReader(path)
  except (ValueError, OSError) as e:
    raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _metadata_from_reader(reader: gguf.GGUFReader, path: str) -> GgufMetadata:
  values = {}
  for key, field in reader.fields.items():
    if key.startswith("GGUF."):
      continue  # file-format bookkeeping (version, counts)
    values[key] = _field_value(field)

  def optional_tuple(key):
    value = values.get(key)
    return None if value is None else tuple(value)

  def optional_int(key):
    value = values.get(key)
    return None if value is None else int(value)

  def optional_bool(key):
    value = values.get(key)
    return None if value is None else bool(value)

  architecture = values.get("general.architecture")
  if not isinstance(architecture, str):
    raise ValueError(f"{path}: GGUF metadata lacks general.architecture")
  tokens = values.get("tokenizer.ggml.tokens")
  return GgufMetadata(
      path=path,
      architecture=architecture,
      name=values.get("general.name"),
      tokenizer_model=values.get("tokenizer.ggml.model"),
      tokenizer_pre=values.get("tokenizer.ggml.pre"),
      tokens=tuple(tokens) if tokens is not None else (),
      token_types=optional_tuple("tokenizer.ggml.token_type"),
      merges=optional_tuple("tokenizer.ggml.merges"),
      scores=optional_tuple("tokenizer.ggml.scores"),
      bos_token_id=optional_int("tokenizer.ggml.bos_token_id"),
      eos_token_id=optional_int("tokenizer.ggml.eos_token_id"),
      unknown_token_id=optional_int("tokenizer.ggml.unknown_token_id"),
      padding_token_id=optional_int("tokenizer.ggml.padding_token_id"),
      add_bos_token=optional_bool("tokenizer.ggml.add_bos_token"),
      add_eos_token=optional_bool("tokenizer.ggml.add_eos_token"),
      add_space_prefix=optional_bool("tokenizer.ggml.add_space_prefix"),
      chat_template=values.get("tokenizer.chat_template"),
      fields={k: v for k, v in values.items() if k not in _TOKENIZER_ARRAYS},
  )


def read_gguf_metadata(path) -> GgufMetadata:
  """Reads a GGUF file's metadata (tokenizer included) without its tensors."""
  path = os.fspath(path)
  return _metadata_from_reader(_open(path), path)


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


def dequantize_tensor(tensor) -> np.ndarray:
  """float32 numpy array of a GGUF tensor, in numpy (row-major) shape.

  Raises:
    ValueError: the tensor type is not one of SUPPORTED_TENSOR_TYPES.
  """
  qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
  if qtype not in SUPPORTED_TENSOR_TYPES:
    supported = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
    raise ValueError(f"GGUF tensor {tensor.name!r} has type {qtype.name}; "
                     f"supported types are {supported}")
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
    raise ValueError(f"{path}: rope_freqs.weight has {divisors.size} entries, "
                     f"expected head_dim / 2 = {head_dim // 2}")
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
    raise ValueError(f"{path}: rope_freqs.weight is not Llama-3 RoPE scaling "
                     f"({e})") from e
  if not np.allclose(fitted, base / divisors, rtol=1e-5, atol=0):
    raise ValueError(f"{path}: rope_freqs.weight does not match Llama-3 RoPE "
                     "scaling; this frequency scaling is not supported")
  return scaling


def _config_from_gguf(metadata: GgufMetadata, tensors: dict, path: str,
                      max_position: int | None) -> LlamaConfig:
  arch = metadata.architecture
  if arch != "llama":
    raise ValueError(f"{path}: general.architecture is {arch!r}; only 'llama' "
                     "GGUF files are supported")
  fields = metadata.fields

  def get(key, default=None, required=False):
    value = fields.get(f"{arch}.{key}", default)
    if required and value is None:
      raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}")
    return value

  def single(key, value):
    if isinstance(value, list):  # per-layer arrays: only uniform ones work
      if len(set(value)) != 1:
        raise ValueError(f"{path}: {arch}.{key} varies per layer ({value}); "
                         "not supported")
      value = value[0]
    return int(value)

  hidden = int(get("embedding_length", required=True))
  num_heads = single("attention.head_count",
                     get("attention.head_count", required=True))
  num_kv_heads = single("attention.head_count_kv",
                        get("attention.head_count_kv", num_heads))
  head_dim = int(get("attention.key_length", hidden // num_heads))
  value_dim = int(get("attention.value_length", head_dim))
  if value_dim != head_dim:
    raise ValueError(f"{path}: key_length {head_dim} != value_length "
                     f"{value_dim}; not supported")
  rope_dims = get("rope.dimension_count")
  if rope_dims is not None and int(rope_dims) != head_dim:
    raise ValueError(f"{path}: partial RoPE ({arch}.rope.dimension_count = "
                     f"{rope_dims}, head_dim {head_dim}) is not supported")
  theta = float(get("rope.freq_base", 10000.0))
  scaling_type = get("rope.scaling.type")
  if scaling_type not in (None, "none", ""):
    raise ValueError(f"{path}: {arch}.rope.scaling.type = {scaling_type!r} "
                     "is not supported (plain and Llama-3 RoPE are)")
  context_length = int(get("context_length", 8192))
  rope_scaling = None
  if "rope_freqs.weight" in tensors:
    rope_scaling = _llama3_scaling_from_rope_freqs(
        dequantize_tensor(tensors["rope_freqs.weight"]), head_dim, theta,
        int(get("rope.scaling.original_context_length", 8192)), path)
  embed = tensors.get("token_embd.weight")
  if embed is None:
    raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
  vocab_size = int(embed.shape[1])  # GGUF shape is [D, V]
  if metadata.tokens and len(metadata.tokens) != vocab_size:
    raise ValueError(f"{path}: token list has {len(metadata.tokens)} entries "
                     f"but token_embd.weight has {vocab_size} rows")

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
      tie_word_embeddings="output.weight" not in tensors,
      max_position=int(max_position or context_length),
      bos_token_id=token_id(metadata.bos_token_id),
      eos_token_id=token_id(metadata.eos_token_id),
  )


@jax.jit
def _swap_last_axes(x):
  return jnp.swapaxes(x, -1, -2)


def _params_from_gguf(config: LlamaConfig, tensors: dict, path: str,
                      progress: bool) -> dict:
  expected = {"token_embd.weight", "output_norm.weight", "rope_freqs.weight"}
  if not config.tie_word_embeddings:
    expected.add("output.weight")
  for i in range(config.num_layers):
    expected.update(f"blk.{i}.{name}.weight" for name in _BLOCK_TENSORS)
  unexpected = sorted(set(tensors) - expected)
  if unexpected:
    raise ValueError(f"{path}: unexpected tensors for a Llama model: "
                     f"{unexpected[:8]}")
  missing = sorted(expected - set(tensors) - {"rope_freqs.weight"})
  if missing:
    raise ValueError(f"{path}: missing tensors: {missing[:8]}")

  bar = None
  if progress:
    from tqdm.auto import tqdm
    bar = tqdm(total=len(tensors), desc="Loading GGUF weights", unit="tensor")

  def load(name):
    value = dequantize_tensor(tensors[name])
    if bar is not None:
      bar.update(1)
    return value

  params = {"embed_tokens": load("token_embd.weight"),
            "final_norm": load("output_norm.weight")}
  if not config.tie_word_embeddings:
    params["lm_head"] = _swap_last_axes(load("output.weight"))  # -> [D, V]
  per_layer = {name: [] for name in LAYER_PARAM_NAMES}
  for i in range(config.num_layers):
    for gguf_name, (ours, transpose) in _BLOCK_TENSORS.items():
      value = load(f"blk.{i}.{gguf_name}.weight")
      if gguf_name == "attn_q":
        value = llama_cpp_unpermute(value, config.num_heads)
      elif gguf_name == "attn_k":
        value = llama_cpp_unpermute(value, config.num_kv_heads)
      per_layer[ours].append(value)
  if bar is not None:
    bar.update(int("rope_freqs.weight" in tensors))
    bar.close()
  params["layers"] = {}
  for gguf_name, (ours, transpose) in _BLOCK_TENSORS.items():
    # Stack contiguous [out, in] rows on the host (a plain copy), transpose
    # to [in, out] in XLA: numpy's strided transposing copy is far slower.
    stacked = np.stack(per_layer.pop(ours))
    params["layers"][ours] = (_swap_last_axes(stacked) if transpose else
                              stacked)
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
    FileNotFoundError: no such file.
    ValueError: not a Llama GGUF file, an unsupported tensor type (the
      message names the tensor and type) or configuration.
  """
  path = os.fspath(path)
  reader = _open(path)
  metadata = _metadata_from_reader(reader, path)
  tensors = {t.name: t for t in reader.tensors}
  config = _config_from_gguf(metadata, tensors, path, max_position)
  params = _params_from_gguf(config, tensors, path, progress)
  model = llama_from_params(config, params, dtype=dtype,
                            param_dtype=param_dtype)
  return config, model, metadata
