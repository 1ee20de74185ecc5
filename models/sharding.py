"""Tensor parallelism of `models.llama.Llama`: where each parameter and the
KV pool lie on a one-axis device mesh, and the per-device attention region.

Megatron-style rules (params in models/params.py's [in, out] layout):

| parameter | shape | PartitionSpec |
|---|---|---|
| embed_tokens | [V, D] | P(tp, None) vocab-parallel, or P() |
| layers.q_proj, k_proj, v_proj | [L, D, heads*H] | P(None, None, tp): output columns, whole heads |
| layers.q_bias, k_bias, v_bias | [L, heads*H] | P(None, tp): as their columns |
| layers.o_proj | [L, N*H, D] | P(None, tp, None): input rows |
| layers.gate_proj, up_proj | [L, D, I] | P(None, None, tp): output columns |
| layers.down_proj | [L, I, D] | P(None, tp, None): input rows |
| layers.attn_norm, mlp_norm, q_norm, k_norm, final_norm | | P(): replicated |
| lm_head | [D, V] | P(None, tp) vocab-parallel, or P() |
| KV pool | [K, L, pages, P, H] | P(tp): each device its KV heads' pages |

Only the KV write and the attention kernel run per device, under
`shard_map` (`TensorParallel.attention_per_device`): a Pallas kernel is an
opaque custom call that GSPMD cannot partition.  Everything else is plain
jit code that GSPMD partitions from the parameters' shardings; with these
rules it inserts one all-reduce after each row-parallel projection (o_proj,
down_proj) and, vocab-parallel, one after the embedding lookup and an
all-gather of the logits.

With fewer KV heads than devices, each KV head is replicated `kv_replicas`
times (`model_config`, `expand_kv_heads`): the model then has K * r KV
heads, query head n reading copy n // (N / (K * r)) of its own KV head, which
is the same function.  Each device holds one KV head; the pool holds r
copies of every key and value.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from models.config import LlamaConfig
from models.params import param_shapes

__all__ = ["TensorParallel", "shard_map", "KV_HEAD_PARAMS"]

# Parameters whose output columns are KV heads (repeated when KV heads are).
KV_HEAD_PARAMS = ("k_proj", "v_proj", "k_bias", "v_bias")
_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW_PARALLEL = ("o_proj", "down_proj")
_COLUMN_BIASES = ("q_bias", "k_bias", "v_bias")


def shard_map(f: Callable, *, mesh: Mesh, in_specs, out_specs) -> Callable:
  """`jax.shard_map` without replication checks, on jax versions with and
  without it (`jax.experimental.shard_map.shard_map` before jax 0.7).

  The checks are off because a Pallas call inside has no replication rule
  (the argument is `check_vma` in new jax, `check_rep` in old).
  """
  new = getattr(jax, "shard_map", None)
  if new is not None:
    names = inspect.signature(new).parameters
    check = {"check_vma": False} if "check_vma" in names else (
        {"check_rep": False} if "check_rep" in names else {})
    return new(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **check)
  from jax.experimental.shard_map import shard_map as old  # jax < 0.7
  return old(f, mesh, in_specs, out_specs, check_rep=False)


@dataclasses.dataclass(frozen=True)
class TensorParallel:
  """How a model lies on a mesh (hashable: a static argument of the jitted
  steps).  Made and checked by `lazyattn_jax.sharding.plan_tensor_parallel`.

  Attributes:
    mesh: the devices; tensor parallelism runs over `axis`, every other
      axis of the mesh has size 1.
    axis: the mesh axis the heads, FFN columns and vocabulary are split on.
    kv_replicas: copies of each KV head (r > 1 when there are fewer KV heads
      than devices; the model then has K * r KV heads).
    vocab_parallel: shard the embedding and LM head over the vocabulary
      (else they are replicated).
  """

  mesh: Mesh
  axis: str = "tp"
  kv_replicas: int = 1
  vocab_parallel: bool = True

  @property
  def size(self) -> int:
    """Devices the model is split over."""
    return int(self.mesh.shape[self.axis])

  # --- the model on the mesh -------------------------------------------------
  def model_config(self, config: LlamaConfig) -> LlamaConfig:
    """The config of the model as it runs: K * kv_replicas KV heads."""
    if self.kv_replicas == 1:
      return config
    return config.replace(num_kv_heads=config.num_kv_heads * self.kv_replicas)

  def param_specs(self, config: LlamaConfig) -> dict[str, Any]:
    """PartitionSpec of every parameter of `Llama(config)` (nested like
    `models.params.param_shapes`; `config` as the model runs)."""
    t = self.axis
    vocab = t if self.vocab_parallel else None

    def layer_spec(name):
      if name in _COLUMN_PARALLEL:
        return P(None, None, t)
      if name in _ROW_PARALLEL:
        return P(None, t, None)
      if name in _COLUMN_BIASES:
        return P(None, t)
      return P()  # norms

    shapes = param_shapes(config)
    specs = {"embed_tokens": P(vocab, None), "final_norm": P(),
             "layers": {name: layer_spec(name) for name in shapes["layers"]}}
    if "lm_head" in shapes:
      specs["lm_head"] = P(None, vocab)
    return specs

  def param_shardings(self, config: LlamaConfig) -> dict[str, Any]:
    """`param_specs` as NamedShardings on the mesh."""
    return jax.tree_util.tree_map(self.sharding, self.param_specs(config),
                                  is_leaf=lambda x: isinstance(x, P))

  def sharding(self, spec: P) -> NamedSharding:
    return NamedSharding(self.mesh, spec)

  @property
  def replicated(self) -> NamedSharding:
    """Every device holds all of it (page tables, tokens, logits)."""
    return NamedSharding(self.mesh, P())

  @property
  def pool_sharding(self) -> NamedSharding:
    """The KV pool [K, L, pages, P, H], split over its KV heads."""
    return NamedSharding(self.mesh, P(self.axis))

  # --- KV heads replicated ----------------------------------------------------
  def expand_kv_heads(self, name: str, value, num_kv_heads: int,
                      axis: int = -1):
    """`value` (numpy or jax) of parameter `name` with each of its
    `num_kv_heads` heads along `axis` repeated kv_replicas times, in place
    (heads h*r .. h*r+r-1 are copies of head h); other parameters as given.
    """
    if self.kv_replicas == 1 or name not in KV_HEAD_PARAMS:
      return value
    xp = np if isinstance(value, np.ndarray) else jnp
    axis = axis % value.ndim
    shape = value.shape
    heads = value.reshape(shape[:axis] + (num_kv_heads, -1) + shape[axis + 1:])
    out = xp.repeat(heads, self.kv_replicas, axis=axis)
    return out.reshape(shape[:axis] + (shape[axis] * self.kv_replicas,) +
                       shape[axis + 1:])

  def expand_params(self, config: LlamaConfig,
                    params: Mapping[str, Any]) -> dict[str, Any]:
    """A parameter dict of `config` as the dict of `model_config(config)`
    (KV heads repeated; arrays of other parameters are the same objects)."""
    layers = {name: self.expand_kv_heads(name, value, config.num_kv_heads)
              for name, value in params["layers"].items()}
    return {**params, "layers": layers}

  # --- per-device regions ---------------------------------------------------
  def attention_per_device(self, fn: Callable) -> Callable:
    """`fn(q, k, v, k_pool, v_pool, *replicated) -> (out, k_pool, v_pool)`
    run on each device with that device's heads: q [B, T, N, H] and k, v
    [B, T, K, H] split on their head axis (so a KV group's query heads are
    on the device of its KV head), the pools on axis 0, the other
    arguments (page metadata, write rows, plan) whole on every device."""
    heads = P(None, None, self.axis, None)
    pool = P(self.axis)

    @functools.wraps(fn)
    def run(q, k, v, k_pool, v_pool, *replicated):
      in_specs = (heads, heads, heads, pool, pool) + (P(),) * len(replicated)
      return shard_map(fn, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(heads, pool, pool))(
                           q, k, v, k_pool, v_pool, *replicated)
    return run

  def pools_per_device(self, fn: Callable) -> Callable:
    """`fn(k_pool, v_pool, *replicated) -> (k_pool, v_pool)` run on each
    device over its KV heads' pages (pools split on axis 0)."""
    pool = P(self.axis)

    @functools.wraps(fn)
    def run(k_pool, v_pool, *replicated):
      in_specs = (pool, pool) + (P(),) * len(replicated)
      return shard_map(fn, mesh=self.mesh, in_specs=in_specs,
                       out_specs=(pool, pool))(k_pool, v_pool, *replicated)
    return run

  def whole_logits(self, logits):
    """Logits [..., V] made whole on every device.  Vocab-parallel, each
    device first computes its slice of the vocabulary, then the slices are
    gathered: asked only for whole logits, GSPMD gathers the LM head instead
    (V x D weights rather than B x V logits)."""
    if self.vocab_parallel:
      logits = self.constrain(logits,
                              P(*(None,) * (logits.ndim - 1), self.axis))
    return self.constrain(logits, P())

  def constrain(self, x, spec: P):
    """`x` with its sharding fixed to `spec` on the mesh (inside jit)."""
    return jax.lax.with_sharding_constraint(x, self.sharding(spec))
