"""What the GGUF and safetensors loaders share: the tensors a checkpoint of a
model must hold, a check of their names and shapes, and the streaming of
those tensors into `models.llama`'s parameter layout on the device.

Both formats store one tensor per layer and parameter, matrices as HF does
([out, in] rows in numpy order; GGUF lists the same dimensions fastest
first).  The model wants layers stacked and matrices as [in, out].
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from tqdm.auto import tqdm

from models.config import LlamaConfig
from models.errors import ModelFormatError
from models.params import (ATTENTION_BIAS_NAMES, LAYER_PARAM_NAMES,
                           QK_NORM_NAMES, is_matrix, layer_param_names,
                           param_shapes)

Shape = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CheckpointNames:
  """How a checkpoint format names a model's tensors.

  Attributes:
    embed_tokens, final_norm, lm_head: the tensors' names.
    layer_template: the name of a layer's tensor, with {i} for the layer
      index and {name} for the format's name of the parameter.
    layer_names: our name of every layer parameter (models.params, optional
      ones included) -> the format's name.
  """

  embed_tokens: str
  final_norm: str
  lm_head: str
  layer_template: str
  layer_names: Mapping[str, str]

  def __post_init__(self):
    every = LAYER_PARAM_NAMES + ATTENTION_BIAS_NAMES + QK_NORM_NAMES
    if set(self.layer_names) != set(every):
      raise ValueError(f"layer_names must name exactly {every}")

  def layer_tensor(self, param: str, layer: int) -> str:
    return self.layer_template.format(i=layer, name=self.layer_names[param])


def expected_shapes(config: LlamaConfig,
                    names: CheckpointNames) -> dict[str, Shape]:
  """Every tensor the checkpoint of `config` holds, with its stored shape
  (numpy order, matrices [out, in])."""
  shapes = param_shapes(config)
  expected = {names.embed_tokens: shapes["embed_tokens"],
              names.final_norm: shapes["final_norm"]}
  if not config.tie_word_embeddings:
    expected[names.lm_head] = shapes["lm_head"][::-1]
  for param in layer_param_names(config):
    per_layer = shapes["layers"][param][1:]
    stored = per_layer[::-1] if is_matrix(param) else per_layer
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
    raise ModelFormatError(f"{where}: unexpected tensors for this model's "
                           f"architecture and configuration: {unexpected[:8]}")
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


def load_params(config: LlamaConfig, names: CheckpointNames,
                load: Callable[[str], np.ndarray], *, param_dtype,
                progress: bool = False,
                description: str = "Loading weights",
                sharding=None) -> dict:
  """The parameter dict of `models.llama.llama_from_params`, on the device.

  Tensors are read one at a time and written straight into their place in
  device arrays of `param_dtype`, so the host holds about one tensor at a
  time (as `load` returns it), never the whole model: a big checkpoint needs
  host memory for its largest tensor, not for all of them.  Each write is
  waited for before the next tensor is read: dispatch is asynchronous, and a
  host array stays alive until the device has consumed it, so running ahead
  would pile up every tensor of a layer stack on the host.

  Args:
    config: the model (its tensors were checked with `check_tensors`).
    names: the checkpoint's tensor names.
    load: tensor name -> its values as a numpy array, [out, in] for matrices.
    param_dtype: the weights' dtype on the device.
    progress: show a progress bar (one step per tensor).
    description: the progress bar's label.
    sharding: a `models.sharding.TensorParallel`, or None for one device.
      With it, every tensor goes from the host straight into its shards
      (each device receives its slice only, and no device ever holds a
      whole stack), KV heads are repeated where it replicates them, and the
      dict is that of `sharding.model_config(config)`.
  """
  dtype = jnp.dtype(param_dtype)
  specs = None
  if sharding is not None:
    file_config, config = config, sharding.model_config(config)
    specs = sharding.param_specs(config)
  shapes = param_shapes(config)
  count = len(expected_shapes(config, names))
  with tqdm(total=count, desc=description, unit="tensor",
            disable=not progress) as bar:

    def read(name, param=None, spec=None, transposed=False):
      """The tensor as `load` gives it or, sharded, on the devices: KV heads
      repeated where they are replicated, and each device sent its slice
      of the tensor as stored (matrices transposed: [out, in])."""
      value = load(name)
      bar.update(1)
      if sharding is None:
        return value
      value = sharding.expand_kv_heads(param, value, file_config.num_kv_heads,
                                       axis=0)
      stored = P(*reversed(tuple(spec))) if transposed else spec
      return jax.device_put(value, sharding.sharding(stored))

    def table(name, key, transpose):
      spec = None if specs is None else specs[key]
      return _on_device(read(name, key, spec, transpose), dtype,
                        transpose).block_until_ready()

    params = {"embed_tokens": table(names.embed_tokens, "embed_tokens",
                                    False),
              "final_norm": table(names.final_norm, "final_norm", False)}
    if not config.tie_word_embeddings:
      params["lm_head"] = table(names.lm_head, "lm_head", True)  # -> [D, V]
    params["layers"] = {}
    for param in layer_param_names(config):
      spec = None if specs is None else specs["layers"][param]
      stack = jnp.zeros(shapes["layers"][param], dtype, device=(
          None if spec is None else sharding.sharding(spec)))
      layer_spec = None if spec is None else P(*tuple(spec)[1:])
      for i in range(config.num_layers):
        stack = _write_layer(stack, i,
                             read(names.layer_tensor(param, i), param,
                                  layer_spec, is_matrix(param)),
                             transpose=is_matrix(param)).block_until_ready()
      params["layers"][param] = stack
  return params


# Conversion and transposition run in XLA, on the device: numpy's strided
# transposing copy is far slower, and a 16-bit target never exists as float32
# on the host.
@functools.partial(jax.jit, static_argnames=("dtype", "transpose"))
def _on_device(value, dtype, transpose: bool):
  return (value.T if transpose else value).astype(dtype)


@functools.partial(jax.jit, donate_argnums=0, static_argnames="transpose")
def _write_layer(stack, layer, value, transpose: bool):
  """`stack` with `value` as layer `layer`, updated in place (donated)."""
  value = (value.T if transpose else value).astype(stack.dtype)
  return jax.lax.dynamic_update_index_in_dim(stack, value, layer, 0)
