"""What the GGUF and safetensors loaders share: the tensors a Llama
checkpoint must hold, a check of their names and shapes, and the stacking
into `models.llama`'s parameter layout.

Both formats store one tensor per layer and parameter, matrices as HF does
([out, in] rows in numpy order; GGUF lists the same dimensions fastest
first).  The model wants layers stacked and matrices as [in, out].
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig
from models.errors import ModelFormatError
from models.params import LAYER_PARAM_NAMES, param_shapes

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointNames:
  """How a checkpoint format names a Llama's tensors.

  Attributes:
    embed_tokens, final_norm, lm_head: the tensors' names.
    layer_template: the name of a layer's tensor, with {i} for the layer
      index and {name} for the format's name of the parameter.
    layer_names: the format's names of LAYER_PARAM_NAMES, in that order.
  """

  embed_tokens: str
  final_norm: str
  lm_head: str
  layer_template: str
  layer_names: tuple[str, ...]

  def __post_init__(self):
    if len(self.layer_names) != len(LAYER_PARAM_NAMES):
      raise ValueError(f"layer_names must name {LAYER_PARAM_NAMES}")

  def layer_tensor(self, param: str, layer: int) -> str:
    name = self.layer_names[LAYER_PARAM_NAMES.index(param)]
    return self.layer_template.format(i=layer, name=name)


def expected_shapes(config: LlamaConfig,
                    names: CheckpointNames) -> dict[str, Shape]:
  """Every tensor the checkpoint of `config` holds, with its stored shape
  (numpy order, matrices [out, in])."""
  shapes = param_shapes(config)
  expected = {names.embed_tokens: shapes["embed_tokens"],
              names.final_norm: shapes["final_norm"]}
  if not config.tie_word_embeddings:
    expected[names.lm_head] = shapes["lm_head"][::-1]
  for param in LAYER_PARAM_NAMES:
    per_layer = shapes["layers"][param][1:]
    stored = per_layer if _is_norm(param) else per_layer[::-1]
    for i in range(config.num_layers):
      expected[names.layer_tensor(param, i)] = stored
  return expected


def check_tensors(found: Mapping[str, Shape], expected: Mapping[str, Shape],
                  where: str, *, gguf_order: bool = False):
  """Raises ModelFormatError unless `found` holds exactly the `expected`
  tensors, each of its expected shape.

  Args:
    found: tensor name -> stored shape (numpy order) of what the file holds.
    expected: the same, of what it should hold (`expected_shapes`).
    where: the file or directory, for the message.
    gguf_order: spell shapes fastest dimension first, as GGUF tools do.
  """
  unexpected = sorted(set(found) - set(expected))
  if unexpected:
    raise ModelFormatError(f"{where}: unexpected tensors for a Llama model: "
                           f"{unexpected[:8]}")
  missing = sorted(set(expected) - set(found))
  if missing:
    raise ModelFormatError(f"{where}: missing tensors: {missing[:8]}")
  show = lambda shape: list(shape[::-1] if gguf_order else shape)
  for name, shape in expected.items():
    if tuple(found[name]) != tuple(shape):
      raise ModelFormatError(
          f"{where}: tensor {name!r} has shape {show(found[name])}, expected "
          f"{show(shape)}{' (GGUF order)' if gguf_order else ''} for this "
          "model's configuration")


@jax.jit
def _swap_last_axes(x):
  return jnp.swapaxes(x, -1, -2)


def build_params(config: LlamaConfig, names: CheckpointNames,
                 load: Callable[[str], np.ndarray]) -> dict:
  """The parameter dict of `models.llama.llama_from_params`.

  Args:
    config: the model (its tensors were checked with `check_tensors`).
    names: the checkpoint's tensor names.
    load: tensor name -> its values as a numpy array, [out, in] for matrices.
  """
  params = {"embed_tokens": load(names.embed_tokens),
            "final_norm": load(names.final_norm)}
  if not config.tie_word_embeddings:
    params["lm_head"] = _swap_last_axes(load(names.lm_head))  # -> [D, V]
  params["layers"] = {}
  for param in LAYER_PARAM_NAMES:
    # Stack contiguous [out, in] rows on the host (a plain copy), transpose
    # to [in, out] in XLA: numpy's strided transposing copy is far slower.
    stacked = np.stack([load(names.layer_tensor(param, i))
                        for i in range(config.num_layers)])
    params["layers"][param] = (stacked if _is_norm(param) else
                               _swap_last_axes(stacked))
  return params


def _is_norm(param: str) -> bool:
  return param.endswith("norm")
