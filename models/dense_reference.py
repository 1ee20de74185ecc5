"""Dense reference forward pass: the same weights, no pages, explicit mask.

Parity tests compare the paged/lazy path against this.  It shares the model's
projections (with Q/K/V biases and Q/K norms where the model has them), norms
and MLP (`run_decoder_layers`) but not its attention: here queries and keys
are rotated at the given positions and attend through a plain masked softmax
over the given sequence.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from models.llama import Llama, run_decoder_layers
from pallas_kernels.masked_softmax import masked_softmax
from pallas_kernels.rope import apply_rope


def dense_attention(q, k, v, positions, mask, rope, dtype, *,
                    logit_scale=None, logit_bias=None):
  """Masked GQA attention with RoPE at `positions`.

  Args:
    q: [B, T, N, H]; k, v: [B, T, K, H] raw projections.
    positions: int32[B, T] RoPE position of each token.
    mask: bool[B, T, T]; mask[b, t, s] lets query t see key s.
    rope: RopeConfig.
    dtype: compute dtype.
    logit_scale, logit_bias: optional float32 [B, T, T]; the scaled score
      of query t for key s becomes score * logit_scale + logit_bias before
      the softmax (read-time changes such as an attention temperature on
      some keys; `benchmarks/ape_probe.py`).

  Returns:
    [B, T, N, H] in `dtype`; rows that see nothing are zeros.
  """
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  group = num_heads // num_kv_heads
  q_rot = apply_rope(q, positions, rope)
  # Keys go through the compute dtype, as they would when stored in the pool.
  k_rot = apply_rope(k, positions, rope).astype(dtype)
  q_rot = q_rot.reshape(batch, q_len, num_kv_heads, group, head_dim)
  is_f32 = jnp.dtype(dtype) == jnp.float32
  precision = jax.lax.Precision.HIGHEST if is_f32 else jax.lax.Precision.DEFAULT
  if not is_f32:
    q_rot = q_rot.astype(dtype)
  scores = jnp.einsum("btkgh,bskh->bkgts", q_rot, k_rot, precision=precision,
                      preferred_element_type=jnp.float32) * (head_dim ** -0.5)
  if logit_scale is not None:
    scores = scores * logit_scale[:, None, None]
  if logit_bias is not None:
    scores = scores + logit_bias[:, None, None]
  visible = mask[:, None, None, :, :]
  weights = masked_softmax(scores, visible)
  out = jnp.einsum("bkgts,bskh->btkgh", weights.astype(v.dtype), v,
                   precision=precision, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(dtype)


def dense_forward(model: Llama, tokens, positions, mask, *,
                  embeddings=None) -> jax.Array:
  """Logits float32 [B, T, V] of `model` over `tokens` with an explicit mask.

  Args:
    model: a models.llama.Llama.
    tokens: int32[B, T].
    positions: int32[B, T] RoPE position of each token (e.g. contiguous
      logical positions with padding removed).
    mask: bool[B, T, T]; mask[b, t, s] lets token t attend to token s
      (causal: s <= t; block-diagonal over documents for lazy parity).
    embeddings: optional [B, T, D] input vectors used instead of the token
      embeddings (e.g. with a learned preamble's rows written in).
  """
  tokens = jnp.asarray(tokens)
  positions = jnp.asarray(positions, jnp.int32)
  mask = jnp.asarray(mask, bool)
  batch, q_len = tokens.shape
  if positions.shape != (batch, q_len):
    raise ValueError(f"positions shape {positions.shape} must equal tokens "
                     f"shape {tokens.shape}")
  if mask.shape != (batch, q_len, q_len):
    raise ValueError(f"mask shape {mask.shape} must be [B, T, T] = "
                     f"{(batch, q_len, q_len)}")
  width = model.config.hidden_size
  if embeddings is not None and embeddings.shape != (batch, q_len, width):
    raise ValueError(f"embeddings shape {embeddings.shape} must be [B, T, D] "
                     f"= {(batch, q_len, width)}")
  graphdef, state = nnx.split(model)
  return _dense_forward_jit(graphdef, state, tokens, positions, mask,
                            embeddings)


def dense_apply(graphdef, state, tokens, positions, mask, embeddings=None
                ) -> jax.Array:
  """`dense_forward` as a pure function of the model state (unchecked; for
  use inside jit and grad, e.g. distillation and fine-tuning)."""
  model = nnx.merge(graphdef, state)
  config, dtype = model.config, model.dtype

  def attend(layer, q, k, v, carry):
    del layer
    return dense_attention(q, k, v, positions, mask, config.rope, dtype), carry

  x = model.embed(tokens) if embeddings is None else embeddings.astype(dtype)
  x, _ = run_decoder_layers(model.layers.stacked(), x, (), attend,
                            config=config, dtype=dtype)
  return model.output_logits(x)


_dense_forward_jit = jax.jit(dense_apply, static_argnums=0)


def causal_mask(batch: int, length: int) -> jax.Array:
  """bool[B, T, T] lower-triangular mask."""
  tri = jnp.tril(jnp.ones((length, length), bool))
  return jnp.broadcast_to(tri, (batch, length, length))
