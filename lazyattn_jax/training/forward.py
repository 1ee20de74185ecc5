"""The differentiable dense forward that training runs, and its losses.

`models.dense_reference.dense_apply` computes logits for every row; a
training step only needs the answer's rows, and [B, T, V] float32 logits
of a 49k vocabulary are most of a step's memory.  `answer_logits` runs the
same pieces (the model's embeddings, its decoder blocks through
`run_decoder_layers`, the reference's masked attention, its output head)
and projects only the gathered rows.  `remat=True` recomputes each layer's
attention in the backward pass instead of keeping its [B, N, T, T] scores.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.dense_reference import dense_attention
from models.llama import run_decoder_layers


class ModelFunctions:
  """The pure functions of one model architecture over a parameter dict.

  Args:
    model: a models.llama.Llama; its graph (config, compute dtype) is kept,
      its weights are not.
  """

  def __init__(self, model):
    graphdef, state = nnx.split(model)
    self.graphdef = graphdef
    self._treedef = jax.tree.structure(state)
    self.config = model.config
    self.dtype = model.dtype

  # Equal architectures share compiled steps (the step builders are cached
  # on this object).
  def _key(self):
    return (self.graphdef, self._treedef)

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, ModelFunctions) and self._key() == other._key()

  def merge(self, params: dict):
    """The model with the arrays of the pure dict `params`.

    The state's pytree and a pure dict flatten in the same (sorted key)
    order, so the leaves go straight into the state's structure.
    """
    state = jax.tree.unflatten(self._treedef, jax.tree.leaves(params))
    return nnx.merge(self.graphdef, state)

  def embed(self, params, tokens, preamble_index, sink=None):
    """Token embeddings, with the sink's vectors at the preamble rows."""
    model = self.merge(params)
    x = model.embed(tokens)
    if sink is None:
      return x
    vectors = sink.astype(x.dtype)[jnp.maximum(preamble_index, 0)]
    return jnp.where((preamble_index >= 0)[..., None], vectors, x)

  def answer_logits(self, params, seq: dict, sink=None, *,
                    remat: bool = False, stored_preamble=None) -> jax.Array:
    """float32 [B, A, V] logits at `seq["rows"]` of the dense sequence
    (tokens, positions, mask, preamble_index; optional logit_scale and
    logit_bias for `dense_attention`), with `sink` [P, D] as the learned
    preamble's vectors if given.  `stored_preamble` (a
    `float8_preamble.Float8Preamble`) replaces the preamble's K/V rows by
    what the pool returns for them."""
    model = self.merge(params)
    positions, mask = seq["positions"], seq["mask"]
    config, dtype = self.config, self.dtype

    scale, bias = seq.get("logit_scale"), seq.get("logit_bias")

    def attention(q, k, v):
      return dense_attention(q, k, v, positions, mask, config.rope, dtype,
                             logit_scale=scale, logit_bias=bias)

    if remat:
      attention = jax.checkpoint(attention)

    def attend(layer, q, k, v, carry):
      del layer
      if stored_preamble is not None:
        k, v = stored_preamble(k, v, seq["preamble_index"], config.rope)
      return attention(q, k, v), carry

    x = self.embed(params, seq["tokens"], seq["preamble_index"], sink)
    x, _ = run_decoder_layers(model.layers.stacked(), x, (), attend,
                              config=config, dtype=dtype)
    x = jnp.take_along_axis(x, seq["rows"][..., None], axis=1)
    return model.output_logits(x)


def kl_and_ce(student_logits, teacher_logits, labels, weights):
  """Per-token-mean KL(teacher || student) and cross-entropy of the labels.

  Args:
    student_logits, teacher_logits: float32 [B, A, V].
    labels: int32 [B, A]; weights: float32 [B, A] (0 on padding).

  Returns:
    (kl, ce), each the weighted mean over answer tokens.
  """
  log_s = jax.nn.log_softmax(student_logits.astype(jnp.float32), axis=-1)
  log_t = jax.nn.log_softmax(teacher_logits.astype(jnp.float32), axis=-1)
  kl = jnp.sum(jnp.exp(log_t) * (log_t - log_s), axis=-1)
  ce = -jnp.take_along_axis(log_s, labels[..., None], axis=-1)[..., 0]
  total = jnp.maximum(jnp.sum(weights), 1.0)
  return jnp.sum(kl * weights) / total, jnp.sum(ce * weights) / total


def global_norm(tree) -> jax.Array:
  """The L2 norm of all of a pytree's leaves (optax renamed its own)."""
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                      for x in jax.tree.leaves(tree)))
