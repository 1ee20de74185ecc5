"""Tensor-parallel serving: the mesh, the checks, and placing a model and its
KV pool on it (docs/design.md, "More than one device").

One `jax.sharding.Mesh` over the devices (every host's, after
`jax.distributed.initialize()`).  Weights are split Megatron-style and the
KV pool over its KV heads by the rules of `models.sharding`; page tables and
the cache's tables stay whole (the host-side scheduler runs identically
everywhere).  `tensor_parallel_for` turns the engine's arguments into a
`models.sharding.TensorParallel` (or None: one device, nothing changes),
refusing with `TensorParallelError` what cannot be split.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from lazyattn_jax.cache_config import CacheConfig
from lazyattn_jax.errors import TensorParallelError
from models.config import LlamaConfig
from models.params import is_norm, param_shapes
from models.sharding import KV_HEAD_PARAMS, TensorParallel

__all__ = ["TensorParallel", "make_mesh", "memory_per_device", "place_model",
           "place_cache_config", "random_model", "tensor_parallel_for"]

TP_AXIS = "tp"


def make_mesh(tensor_parallel: int, devices=None) -> Mesh:
  """A one-axis ("tp") mesh over the first `tensor_parallel` devices of
  `devices` (default `jax.devices()`: every process's, in process order)."""
  devices = list(jax.devices() if devices is None else devices)
  _check_count(tensor_parallel)
  if tensor_parallel > len(devices):
    raise TensorParallelError(
        f"tensor_parallel={tensor_parallel} needs {tensor_parallel} devices; "
        f"JAX sees {len(devices)} ({devices[0].platform})")
  chosen = devices[:tensor_parallel]
  held = sorted({d.process_index for d in chosen})
  if len(held) < jax.process_count():
    # Every process runs the engine; one whose devices the mesh lacks fails
    # every request (its arrays are not addressable there).
    raise TensorParallelError(
        f"tensor_parallel={tensor_parallel} takes devices of process(es) "
        f"{held} only, but {jax.process_count()} processes run the engine: "
        f"the mesh must hold devices of every process (tensor_parallel="
        f"{len(devices)} takes them all)")
  return Mesh(np.array(chosen), (TP_AXIS,))


def _mesh_axis(mesh: Mesh) -> str:
  """The mesh's tensor-parallel axis: its only axis of size > 1, or "tp"."""
  if not isinstance(mesh, Mesh):
    raise TensorParallelError(
        f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if len(mesh.axis_names) == 1:
    return mesh.axis_names[0]
  others = [name for name in mesh.axis_names
            if name != TP_AXIS and mesh.shape[name] > 1]
  if TP_AXIS in mesh.axis_names and not others:
    return TP_AXIS
  raise TensorParallelError(
      f"mesh {dict(mesh.shape)}: tensor parallelism needs a one-axis mesh, or "
      f"one whose only axis of size > 1 is named {TP_AXIS!r}")


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def tensor_parallel_for(config: LlamaConfig, *, mesh: Mesh | None = None,
                        tensor_parallel: int | None = None,
                        vocab_parallel: bool | None = None
                        ) -> TensorParallel | None:
  """The split of `config` over `mesh` (or a mesh of `tensor_parallel`
  devices); None for one device (tensor_parallel None or 1, no mesh).

  KV heads: with K >= devices, K must divide by the device count; with
  fewer, the device count must divide by K (each KV head is then
  replicated devices / K times), and query heads by the device count.
  `vocab_parallel`: True shards the embedding and LM head over the
  vocabulary (which must divide by the device count), False replicates
  them, None shards when it divides.

  Raises:
    TensorParallelError: naming the counts that do not divide and the
      device counts that would work.
  """
  if tensor_parallel is not None:
    _check_count(tensor_parallel)
    tensor_parallel = int(tensor_parallel)
  if mesh is None:
    if tensor_parallel is None or tensor_parallel == 1:
      return None
    n = tensor_parallel
  else:
    axis = _mesh_axis(mesh)
    n = int(mesh.shape[axis])
    if tensor_parallel is not None and tensor_parallel != n:
      raise TensorParallelError(
          f"tensor_parallel={tensor_parallel} but the mesh's {axis!r} axis "
          f"has {n} devices")
  # The model is checked before the devices: whether it splits at all is
  # the first thing to know, and it needs no devices to say.
  vocab_parallel = _check_fits(config, n, vocab_parallel)
  if mesh is None:
    mesh, axis = make_mesh(n), TP_AXIS
  return TensorParallel(mesh=mesh, axis=axis,
                        kv_replicas=max(1, n // config.num_kv_heads),
                        vocab_parallel=vocab_parallel)


def _check_count(tensor_parallel):
  if (isinstance(tensor_parallel, bool) or
      not isinstance(tensor_parallel, (int, np.integer))
      or tensor_parallel < 1):
    raise TensorParallelError(
        f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")


def _check_fits(config: LlamaConfig, n: int, vocab_parallel) -> bool:
  """Raises TensorParallelError unless `config` splits over `n` devices;
  returns whether the vocabulary is split."""
  c = config
  heads, kv = c.num_heads, c.num_kv_heads
  fits = [d for d in _divisors(heads) if (d % kv == 0 or kv % d == 0) and
          c.intermediate_size % d == 0 and
          (vocab_parallel is not True or c.vocab_size % d == 0)]
  hint = (f"; device counts that fit this model: {fits}, or serve it with "
          "one engine per device group (data-parallel replicas)")
  if heads % n:
    raise TensorParallelError(
        f"{heads} query heads do not divide over {n} devices{hint}")
  if kv % n and n % kv:
    raise TensorParallelError(
        f"{kv} KV heads cannot be split over {n} devices (neither count "
        f"divides the other, so KV heads can be neither split nor "
        f"replicated evenly){hint}")
  if c.intermediate_size % n:
    raise TensorParallelError(
        f"the FFN width {c.intermediate_size} does not divide over {n} "
        f"devices{hint}")
  if vocab_parallel is None:
    return c.vocab_size % n == 0
  if not isinstance(vocab_parallel, bool):
    raise TensorParallelError(
        f"vocab_parallel must be True, False or None, got {vocab_parallel!r}")
  if vocab_parallel and c.vocab_size % n:
    raise TensorParallelError(
        f"the vocabulary of {c.vocab_size} tokens does not divide over {n} "
        "devices; pass vocab_parallel=False to replicate the embedding and "
        "LM head")
  return vocab_parallel


def place_cache_config(cache_config: CacheConfig,
                       tp: TensorParallel | None) -> CacheConfig:
  """The pool's config on the mesh: K * kv_replicas heads, split over them."""
  if tp is None:
    return cache_config
  return dataclasses.replace(
      cache_config, num_kv_heads=cache_config.num_kv_heads * tp.kv_replicas,
      pool_sharding=tp.pool_sharding)


def place_model(model, config: LlamaConfig, tp: TensorParallel | None):
  """`model` (a Llama of `config`) with its weights on the mesh by `tp`'s
  rules (and KV heads repeated where `tp` replicates them).

  A model already placed (from `from_pretrained(..., tensor_parallel=N)`)
  comes back as it is; an in-memory model is copied shard by shard from
  where it lies, so it must fit where it is now.
  """
  if tp is None:
    return model
  from flax import nnx
  from models.llama import llama_from_params
  target = tp.model_config(config)
  if model.config not in (config, target):
    raise TensorParallelError(
        f"the model's config ({model.config}) is neither the engine's "
        f"config nor its tensor-parallel form ({target})")
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  if model.config != target:
    params = tp.expand_params(config, params)
  shardings = tp.param_shardings(target)
  leaves = jax.tree_util.tree_leaves(params)
  wanted = jax.tree_util.tree_leaves(shardings)
  if model.config == target and all(
      getattr(x, "sharding", None) == s for x, s in zip(leaves, wanted)):
    return model
  params = jax.device_put(params, shardings)
  return llama_from_params(target, params, dtype=model.dtype,
                           param_dtype=model.param_dtype)


def random_model(config: LlamaConfig, tp: TensorParallel | None, *,
                 dtype=jnp.bfloat16, param_dtype=None, seed: int = 0):
  """A Llama of `config` with random weights made on their devices.

  Each parameter is drawn by its own jitted program whose output sharding
  is the parameter's, so no device (and not the host) ever holds the whole
  model: a model larger than one device's memory can be made.  The values
  depend only on `seed`, not on the device count (JAX's partitionable
  threefry), so a benchmark compares one model at several splits.
  Same scales as `models.params.init_params` (LeCun-normal projections,
  standard-normal biases, unit norms); the draws differ.
  """
  from models.llama import llama_from_params
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  target = config if tp is None else tp.model_config(config)
  shapes = param_shapes(config)
  out_shardings = (None if tp is None else tp.param_shardings(target))
  fan_in = {"o_proj": config.num_heads * config.head_dim,
            "down_proj": config.intermediate_size}
  params, index = {"layers": {}}, 0
  for group, names in (("", [k for k in shapes if k != "layers"]),
                       ("layers", list(shapes["layers"]))):
    for name in names:
      shape = shapes[group][name] if group else shapes[name]
      sharding = None
      if out_shardings is not None:
        sharding = (out_shardings[group][name] if group else
                    out_shardings[name])
      scale = (1.0 if name.endswith("_bias") else
               fan_in.get(name, config.hidden_size) ** -0.5)
      value = _draw(seed, index, shape, param_dtype, is_norm(name), scale,
                    name, config.num_kv_heads, tp, sharding)
      (params[group] if group else params)[name] = value
      index += 1
  return llama_from_params(target, params, dtype=dtype,
                           param_dtype=param_dtype)


def _draw(seed, index, shape, dtype, ones, scale, name, num_kv_heads, tp,
          sharding):
  @functools.partial(jax.jit, out_shardings=sharding)
  def draw():
    if ones:
      value = jnp.ones(shape, dtype)
    else:
      key = jax.random.fold_in(jax.random.key(seed), index)
      value = jax.random.normal(key, shape, dtype) * jnp.asarray(scale, dtype)
    if tp is not None and name in KV_HEAD_PARAMS:
      value = tp.expand_kv_heads(name, value, num_kv_heads)
    return value
  return draw()


def _bytes_by_device(arrays) -> dict:
  """{device: bytes the arrays take on it} over this process's devices (a
  replicated array counts on each)."""
  used: dict = {}
  for x in jax.tree_util.tree_leaves(arrays):
    for shard in x.addressable_shards:
      used[shard.device] = used.get(shard.device, 0) + shard.data.nbytes
  return used


def _per_device_bytes(arrays) -> int:
  """Bytes the arrays take on their fullest device (of this process)."""
  return max(_bytes_by_device(arrays).values(), default=0)


def memory_per_device(tp: TensorParallel | None, params, state) -> dict:
  """For `LazyEngine.memory` under tensor parallelism: bytes of the weights
  and of the pool on the fullest device (replicated weights and KV head
  copies count on every device that holds them); {} on one device."""
  if tp is None:
    return {}
  pool = 0 if state is None else _per_device_bytes((state.k, state.v))
  return {"weights_bytes_per_device": _per_device_bytes(params),
          "kv_pool_bytes_per_device": pool}


def memory_report(tp: TensorParallel | None, params, state) -> dict:
  """`LazyEngine.memory`: device bytes of the weights and of the pool (K and
  V, 0 without a pool), summed over the devices that hold them, and under
  tensor parallelism `memory_per_device`."""
  weights = sum(_bytes_by_device(params).values())
  pool = 0 if state is None else sum(
      _bytes_by_device((state.k, state.v)).values())
  return {"weights_bytes": int(weights), "kv_pool_bytes": int(pool),
          **memory_per_device(tp, params, state)}
