"""Loading a model for training: float32 master weights as a pure dict, the
architecture in the compute dtype, the tokenizer, and what identifies the
weights (the engine's model id and a SHA-256 of the files)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from lazyattn_jax.file_digest import update_from_file
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.forward import ModelFunctions
from models.llama import Llama

COMPUTE_DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass
class TrainableModel:
  """A model ready for training.

  Attributes:
    config: its LlamaConfig.
    functions: the pure forward in the compute dtype (ModelFunctions).
    params: float32 weights, a pure dict in models.params' layout.
    tokenizer: its LlamaTokenizer (None: the model has none).
    model_id: the engine's id of the weights ("gguf:name:size", "hf:path").
    sha256: hash of the weight files (and config.json of a directory).
    source: the path that was loaded.
  """
  config: object
  functions: ModelFunctions
  params: dict
  tokenizer: object
  model_id: str
  sha256: str
  source: str


def model_signature(trainable) -> dict:
  """What identifies the model's architecture and sizes, JSON-able: its
  config and every weight's shape.  A run's record holds it, so a resume
  with another model is refused even where the weights carry no file
  hash (`from_model`), e.g. the same architecture at another size.

  A dataclass config records only the fields that differ from their
  defaults: a field added to the config later, with a default that keeps
  the old behaviour, leaves the signatures of existing runs unchanged."""
  config = trainable.config
  fields = (_changed_fields(config) if dataclasses.is_dataclass(config)
            else dict(vars(config)))
  shapes = {jax.tree_util.keystr(path): list(jnp.shape(leaf)) for path, leaf
            in jax.tree_util.tree_leaves_with_path(trainable.params)}
  return json.loads(json.dumps(dict(architecture=type(config).__name__,
                                    config=fields, shapes=shapes),
                               default=str))


def _changed_fields(config) -> dict:
  """`config`'s fields without a default or set to another value."""
  changed = {}
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    if field.default is not dataclasses.MISSING:
      default = field.default
    elif field.default_factory is not dataclasses.MISSING:
      default = field.default_factory()
    else:
      default = dataclasses.MISSING
    if default is dataclasses.MISSING or value != default:
      changed[field.name] = (dataclasses.asdict(value)
                             if dataclasses.is_dataclass(value) else value)
  return changed


def functions_for(config, dtype) -> ModelFunctions:
  """ModelFunctions of `config` in compute `dtype` (no weights allocated)."""
  abstract = nnx.eval_shape(lambda: Llama(
      config, dtype=jnp.dtype(dtype), param_dtype=jnp.float32,
      rngs=nnx.Rngs(0)))
  return ModelFunctions(abstract)


def check_dtype(dtype: str) -> str:
  if str(dtype) not in COMPUTE_DTYPES:
    raise TrainingInputError(f"dtype must be one of {', '.join(COMPUTE_DTYPES)}"
                             f", got {dtype!r}")
  return str(dtype)


def files_sha256(path) -> str:
  """SHA-256 of a model file, or of a directory's config.json and
  *.safetensors files in name order."""
  path = pathlib.Path(path)
  files = [path] if path.is_file() else sorted(
      [p for p in path.glob("*.safetensors")] + [path / "config.json"])
  digest = hashlib.sha256()
  for file in files:
    update_from_file(digest, file)
  return digest.hexdigest()


def load_trainable(name_or_path: str, dtype: str = "float32", *,
                   progress: bool = True) -> TrainableModel:
  """Loads what `LazyEngine.from_pretrained` loads ("smollm2-135m-instruct",
  a .gguf file or a safetensors directory) for training.

  Raises:
    TrainingInputError: a bad dtype.
    and what lazyattn_jax.loading.load_model raises for a bad model.
  """
  from lazyattn_jax.default_model import resolve_model_path
  from lazyattn_jax.loading import load_model
  dtype = check_dtype(dtype)
  path = resolve_model_path(name_or_path)
  loaded = load_model(str(path), "float32", progress)
  params = nnx.to_pure_dict(nnx.state(loaded.model))
  return TrainableModel(loaded.config, functions_for(loaded.config, dtype),
                        params, loaded.tokenizer, loaded.model_id,
                        files_sha256(path), str(path))


def from_model(model, tokenizer, dtype: str = "float32",
               model_id: str = "in-memory") -> TrainableModel:
  """A TrainableModel around an in-memory models.llama.Llama (tests,
  notebooks); its weights are copied to float32."""
  dtype = check_dtype(dtype)
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32),
                        nnx.to_pure_dict(nnx.state(model)))
  return TrainableModel(model.config, functions_for(model.config, dtype),
                        params, tokenizer, model_id, "", model_id)
