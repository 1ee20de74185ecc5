"""The parameters of `models.llama.Llama`: their layout and random init.

Parameter layout (the pure dict of `nnx.split(model)[1]`), matrices as
[in, out] so that a projection is `x @ w`:
  embed_tokens            [V, D]
  layers.attn_norm        [L, D]
  layers.q_proj           [L, D, N*H]
  layers.k_proj           [L, D, K*H]
  layers.v_proj           [L, D, K*H]
  layers.o_proj           [L, N*H, D]
  layers.mlp_norm         [L, D]
  layers.gate_proj        [L, D, I]
  layers.up_proj          [L, D, I]
  layers.down_proj        [L, I, D]
  final_norm              [D]
  lm_head                 [D, V]   (absent when tie_word_embeddings)
and, only in models that have them (absent otherwise, so a Llama's
parameters and compiled graph do not change):
  layers.q_bias           [L, N*H]  (attention_bias)
  layers.k_bias           [L, K*H]
  layers.v_bias           [L, K*H]
  layers.q_norm           [L, H]    (qk_norm)
  layers.k_norm           [L, H]

Loaders build this dict from a checkpoint (`models.weights`) and hand it to
`models.llama.llama_from_params`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import LlamaConfig

# The layer parameters of every model; layer_param_names(config) adds the
# optional ones.
LAYER_PARAM_NAMES = ("attn_norm", "q_proj", "k_proj", "v_proj", "o_proj",
                     "mlp_norm", "gate_proj", "up_proj", "down_proj")
ATTENTION_BIAS_NAMES = ("q_bias", "k_bias", "v_bias")
QK_NORM_NAMES = ("q_norm", "k_norm")


def layer_param_names(config: LlamaConfig) -> tuple[str, ...]:
  """The names of `config`'s per-layer parameters, in a fixed order."""
  names = LAYER_PARAM_NAMES
  if config.attention_bias:
    names += ATTENTION_BIAS_NAMES
  if config.qk_norm:
    names += QK_NORM_NAMES
  return names


def is_matrix(name: str) -> bool:
  """Whether a parameter is a projection matrix ([in, out] here, [out, in]
  in checkpoints); the others (norms, biases) are vectors per layer."""
  return name.endswith("_proj")


def is_norm(name: str) -> bool:
  """Whether a parameter is an RMSNorm weight (initialised to ones)."""
  return name.endswith("norm")


def param_shapes(config: LlamaConfig) -> dict[str, Any]:
  """Nested dict of the parameter shapes of `Llama(config)`."""
  c = config
  L, D, I = c.num_layers, c.hidden_size, c.intermediate_size
  q_width, kv_width = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
  shapes = {
      "embed_tokens": (c.vocab_size, D),
      "layers": {
          "attn_norm": (L, D),
          "q_proj": (L, D, q_width),
          "k_proj": (L, D, kv_width),
          "v_proj": (L, D, kv_width),
          "o_proj": (L, q_width, D),
          "mlp_norm": (L, D),
          "gate_proj": (L, D, I),
          "up_proj": (L, D, I),
          "down_proj": (L, I, D),
      },
      "final_norm": (D,),
  }
  if c.attention_bias:
    shapes["layers"].update(q_bias=(L, q_width), k_bias=(L, kv_width),
                            v_bias=(L, kv_width))
  if c.qk_norm:
    shapes["layers"].update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
  if not c.tie_word_embeddings:
    shapes["lm_head"] = (D, c.vocab_size)
  return shapes


@functools.partial(jax.jit, static_argnums=(1, 2))
def init_params(key: jax.Array, config: LlamaConfig, param_dtype) -> dict:
  """Random parameters of `Llama(config)` (pure dict) from one PRNG key.

  LeCun-normal projections (std = fan_in^-1/2): activations keep unit scale,
  so a random model's logits are far from uniform and parity tests can see
  errors.  Biases are standard normal (the scale of a projection's output),
  so that tests see them.  Norm weights are ones.  Each layer's matrices and
  biases are cut from one normal draw inside a map over layers, and the
  embedding/output tables from one more: XLA compiles two random-number
  programs instead of one per parameter shape (which costs seconds per model
  on CPU), and peak memory stays one layer above the parameters.
  """
  c = config
  shapes = param_shapes(config)
  fan_in = {"q_proj": c.hidden_size, "k_proj": c.hidden_size,
            "v_proj": c.hidden_size, "o_proj": c.num_heads * c.head_dim,
            "gate_proj": c.hidden_size, "up_proj": c.hidden_size,
            "down_proj": c.intermediate_size, "embed_tokens": c.hidden_size,
            "lm_head": c.hidden_size, "q_bias": 1, "k_bias": 1, "v_bias": 1}
  names = layer_param_names(config)

  def cut(flat, named_shapes):
    out, offset = {}, 0
    for name, shape in named_shapes.items():
      size = int(np.prod(shape))
      out[name] = (flat[offset:offset + size].reshape(shape) *
                   jnp.asarray(fan_in[name] ** -0.5, param_dtype))
      offset += size
    return out

  drawn = {name: shapes["layers"][name][1:] for name in names
           if not is_norm(name)}
  per_layer = sum(int(np.prod(shape)) for shape in drawn.values())

  def one_layer(layer_key):
    return cut(jax.random.normal(layer_key, (per_layer,), param_dtype), drawn)

  layer_key, table_key = jax.random.split(key)
  layers = jax.lax.map(one_layer, jax.random.split(layer_key, c.num_layers))
  for name in names:
    if is_norm(name):
      layers[name] = jnp.ones(shapes["layers"][name], param_dtype)
  tables = {name: shapes[name] for name in ("embed_tokens", "lm_head")
            if name in shapes}
  table_size = sum(int(np.prod(shape)) for shape in tables.values())
  params = cut(jax.random.normal(table_key, (table_size,), param_dtype),
               tables)
  params["layers"] = {name: layers[name] for name in names}
  params["final_norm"] = jnp.ones(shapes["final_norm"], param_dtype)
  return params
