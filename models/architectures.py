"""The model families the loaders accept, and what each one means for the
weights.

All of them are the same decoder (`models.llama.Llama`); they differ in two
optional parts and in how llama.cpp stores them:

| family | HF `model_type` | GGUF `general.architecture` | Q/K/V bias | Q/K norm | llama.cpp Q/K row permutation |
|---|---|---|---|---|---|
| llama (Llama 2 and 3, SmolLM) | llama | llama | no | no | yes |
| mistral | mistral | llama (llama.cpp converts Mistral as llama) | no | no | yes |
| qwen2 (Qwen2, Qwen2.5) | qwen2 | qwen2 | yes | no | no |
| qwen3 | qwen3 | qwen3 | no | yes | no |

llama.cpp permutes the Q and K rows of the architectures whose RoPE it runs
interleaved (its "llama" family); Qwen2 and Qwen3 run its NeoX RoPE, which is
the HF `rotate_half` layout, so their rows are stored as in HF.
"""

from __future__ import annotations

import dataclasses

from models.errors import ModelFormatError

__all__ = ["Architecture", "ARCHITECTURES", "architecture_from_gguf",
           "architecture_from_hf", "supported_gguf_architectures"]


@dataclasses.dataclass(frozen=True)
class Architecture:
  """One supported model family.

  Attributes:
    name: the family ("llama", "mistral", "qwen2", "qwen3").
    attention_bias: Q, K and V projections have biases.
    qk_norm: Q and K go through a per-head RMSNorm before RoPE.
    llama_cpp_permuted: llama.cpp's converter permutes the Q/K rows (and
      biases) of this family for its interleaved RoPE.
  """

  name: str
  attention_bias: bool = False
  qk_norm: bool = False
  llama_cpp_permuted: bool = False


ARCHITECTURES = {
    "llama": Architecture("llama", llama_cpp_permuted=True),
    "mistral": Architecture("mistral", llama_cpp_permuted=True),
    "qwen2": Architecture("qwen2", attention_bias=True),
    "qwen3": Architecture("qwen3", qk_norm=True),
}
# llama.cpp writes Mistral checkpoints as "llama"; there is no "mistral" GGUF
# architecture.  Loaded as llama, a Mistral file is the same model.
_GGUF_ARCHITECTURES = {"llama": ARCHITECTURES["llama"],
                       "qwen2": ARCHITECTURES["qwen2"],
                       "qwen3": ARCHITECTURES["qwen3"]}


def architecture_from_hf(model_type, path: str) -> Architecture:
  """The family of an HF `config.json`'s `model_type`.

  Raises:
    ModelFormatError: an unsupported model type; the message lists the
      supported ones.
  """
  found = ARCHITECTURES.get(model_type) if isinstance(model_type, str) else None
  if found is None:
    raise ModelFormatError(
        f"{path}: model_type {model_type!r} is not supported; supported "
        f"model types: {', '.join(ARCHITECTURES)}")
  return found


def supported_gguf_architectures() -> str:
  """The GGUF `general.architecture` names this project loads, listed."""
  return ", ".join(_GGUF_ARCHITECTURES)


def architecture_from_gguf(name, path: str) -> Architecture:
  """The family of a GGUF file's `general.architecture`.

  Raises:
    ModelFormatError: an unsupported architecture; the message lists the
      supported ones.
  """
  found = _GGUF_ARCHITECTURES.get(name) if isinstance(name, str) else None
  if found is None:
    raise ModelFormatError(
        f"{path}: general.architecture is {name!r}, which is not supported; "
        f"supported GGUF architectures: {supported_gguf_architectures()} "
        "(Mistral files are 'llama')")
  return found
