"""Exporting trained weights as a Hugging Face safetensors directory.

The directory holds config.json, model.safetensors (HF Llama / Qwen2 /
Qwen3 parameter names, matrices [out, in], one tensor per layer) and the
tokenizer files (`tokenizer_export`), which is what
`models.safetensors_loader` and so `LazyEngine.from_pretrained(path)` read
back, and what transformers reads too.  The tensor names come from the
loader itself, so export and load cannot drift apart.  A model trained
after a learned sink also gets that sink (`trained_quality.SINK_FILE`),
which `from_pretrained` serves it after.

model.safetensors is written one tensor at a time: the host holds one
layer's matrix, never the whole model.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import jax
import ml_dtypes
import numpy as np

from lazyattn_jax.trained_quality import SINK_FILE
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.sink_file import save_sink
from lazyattn_jax.training.tokenizer_export import export_tokenizer
from models.params import is_matrix, layer_param_names
# The loader's own name table: what it reads is what is written here.
from models.safetensors_loader import _HF_NAMES
from models.weights import expected_shapes

EXPORT_DTYPES = {"float32": ("F32", np.float32),
                 "bfloat16": ("BF16", ml_dtypes.bfloat16),
                 "float16": ("F16", np.float16)}
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM"}


def model_type(config) -> str:
  """The HF model_type of a LlamaConfig (Mistral exports as llama: without
  a sliding window they are the same model)."""
  if config.qk_norm:
    return "qwen3"
  return "qwen2" if config.attention_bias else "llama"


def hf_config(config, torch_dtype: str = "float32") -> dict:
  """config.json of a models.config.LlamaConfig."""
  c = config
  kind = model_type(c)
  out = {"model_type": kind, "architectures": [_ARCHITECTURES[kind]],
         "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
         "num_hidden_layers": c.num_layers,
         "num_attention_heads": c.num_heads,
         "num_key_value_heads": c.num_kv_heads, "head_dim": c.head_dim,
         "intermediate_size": c.intermediate_size,
         "rope_theta": c.rope_theta, "rms_norm_eps": c.rms_norm_eps,
         "tie_word_embeddings": c.tie_word_embeddings,
         "max_position_embeddings": c.max_position, "hidden_act": "silu",
         "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
         "torch_dtype": torch_dtype}
  if c.rope_scaling is not None:
    s = c.rope_scaling
    out["rope_scaling"] = {
        "rope_type": "llama3", "factor": s.factor,
        "low_freq_factor": s.low_freq_factor,
        "high_freq_factor": s.high_freq_factor,
        "original_max_position_embeddings": s.original_max_position}
  return out


def _tensor_sources(config, params):
  """HF name -> a function giving its numpy value ([out, in] matrices)."""
  names = _HF_NAMES
  host = lambda x: np.asarray(jax.device_get(x))
  out = {names.embed_tokens: lambda: host(params["embed_tokens"]),
         names.final_norm: lambda: host(params["final_norm"])}
  if not config.tie_word_embeddings:
    out[names.lm_head] = lambda: host(params["lm_head"]).T
  for param in layer_param_names(config):
    for i in range(config.num_layers):
      def layer(param=param, i=i):
        value = host(params["layers"][param][i])
        return value.T if is_matrix(param) else value
      out[names.layer_tensor(param, i)] = layer
  return out


def write_safetensors(path: str, config, params, dtype: str = "float32",
                      metadata: dict | None = None):
  """Writes `params` (models.params layout) as one HF safetensors file."""
  if dtype not in EXPORT_DTYPES:
    raise TrainingInputError(f"export dtype must be one of "
                             f"{', '.join(EXPORT_DTYPES)}, got {dtype!r}")
  tag, np_dtype = EXPORT_DTYPES[dtype]
  shapes = expected_shapes(config, _HF_NAMES)
  sources = _tensor_sources(config, params)
  width = np.dtype(np_dtype).itemsize
  header, offset = {}, 0
  for name in sorted(sources):
    size = int(np.prod(shapes[name])) * width
    header[name] = {"dtype": tag, "shape": list(shapes[name]),
                    "data_offsets": [offset, offset + size]}
    offset += size
  header["__metadata__"] = {"format": "pt", **{
      str(k): str(v) for k, v in (metadata or {}).items()}}
  blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
  blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(blob)))
    f.write(blob)
    for name in sorted(sources):
      value = np.ascontiguousarray(sources[name]().astype(np_dtype))
      if value.shape != tuple(shapes[name]):
        raise TrainingInputError(f"parameter {name} has shape {value.shape}, "
                                 f"expected {tuple(shapes[name])}")
      f.write(value.tobytes())


def export_model(directory, config, params, tokenizer=None, *,
                 dtype: str = "float32", metadata: dict | None = None,
                 sink=None) -> str:
  """Writes config.json, model.safetensors, (if given) the tokenizer files
  and (if given) a learned sink into `directory`; returns it.

  The export is written into a temporary sibling (DIRECTORY.tmp-<pid>) and
  swapped into place at the end, so `directory` always holds a complete
  export (the previous one until the new one is whole), or is absent for
  an instant during the swap; a crash, a full disk or a Ctrl-C while
  writing leaves the previous export untouched.  `directory` is replaced
  as a whole: nothing else should live in it.

  Args:
    config: the model's LlamaConfig.
    params: its parameters (pure dict, models.params layout).
    tokenizer: its LlamaTokenizer, or None.
    dtype: tensor dtype in the file: float32, bfloat16 or float16.
    metadata: strings for the safetensors header (what trained it).
    sink: [P, D] learned preamble vectors the model was trained after,
      written as `trained_quality.SINK_FILE` (the `sink_file` format), for
      `from_pretrained` to serve the model after them; None: none.
  """
  directory = os.fspath(directory)
  # Without a trailing separator the temporary name is a sibling, not a
  # child; abspath also gives "." a real parent to hold the sibling.
  target = os.path.abspath(directory)
  parent = os.path.dirname(target)
  os.makedirs(parent, exist_ok=True)
  staging = f"{target}.tmp-{os.getpid()}"
  shutil.rmtree(staging, ignore_errors=True)  # a crashed export's leftovers
  try:
    os.makedirs(staging)
    write_safetensors(os.path.join(staging, "model.safetensors"), config,
                      params, dtype, metadata)
    with open(os.path.join(staging, "config.json"), "w",
              encoding="utf-8") as f:
      json.dump(hf_config(config, dtype), f, indent=2)
    if tokenizer is not None:
      export_tokenizer(tokenizer, staging)
    if sink is not None:
      save_sink(os.path.join(staging, SINK_FILE), sink,
                dict(written_by="lazyattn finetune"))
    _swap_in(staging, target)
  except BaseException:
    # KeyboardInterrupt included: a second Ctrl-C must not leave a
    # half-written copy beside the good export.
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return directory


def _swap_in(staging: str, target: str):
  """Replaces the directory `target` with `staging` (same parent): the old
  one is renamed aside, the new one renamed in, then the old one removed.
  Renames within one directory are atomic, so `target` is missing only
  between the two renames."""
  if not os.path.lexists(target):
    os.rename(staging, target)
    return
  old = f"{target}.old-{os.getpid()}"
  shutil.rmtree(old, ignore_errors=True)
  os.rename(target, old)
  try:
    os.rename(staging, target)
  except BaseException:
    os.rename(old, target)  # put the previous export back
    raise
  shutil.rmtree(old, ignore_errors=True)
