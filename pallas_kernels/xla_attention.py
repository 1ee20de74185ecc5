"""Pure-XLA implementation of the lazy attention contract (the CPU path).

On CPU there is no Pallas backend, so this path favours what XLA does well:
one gather of the logical pages, one rotation of the gathered keys by their
page shift (R(s) k), and a dense masked softmax against R(q_pos) q.  Scores
are identical to the contract because <R(a - s) q, k> = <R(a) q, R(s) k>.
float8 pages are dequantized right after the gather, so only the gathered
logical pages are ever widened.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import is_quantized
from pallas_kernels.masked_softmax import masked_softmax
from pallas_kernels.rope import RopeConfig, apply_rope


def lazy_attention_xla(q, k_pages, v_pages, page_table, page_pos, page_shift,
                       page_len, q_pos, *, rope: RopeConfig, sm_scale,
                       k_scales=None, v_scales=None):
  """Same arguments and result as `pallas_kernels.lazy_attention`."""
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  num_logical_pages = page_table.shape[1]
  kv_len = num_logical_pages * page_size

  slot = jnp.arange(page_size, dtype=jnp.int32)
  slot_valid = (slot[None, None, :] < page_len[:, :, None]).reshape(batch, kv_len)
  slot_pos = (page_pos[:, :, None] + slot[None, None, :]).reshape(batch, kv_len)
  slot_shift = jnp.broadcast_to(page_shift[:, :, None],
                                page_shift.shape + (page_size,)).reshape(
                                    batch, kv_len)

  # [K, B, M, Sp, H] -> [B, S, K, H]
  k = jnp.moveaxis(k_pages[:, page_table], 0, -2).reshape(
      batch, kv_len, num_kv_heads, head_dim)
  v = jnp.moveaxis(v_pages[:, page_table], 0, -2).reshape(
      batch, kv_len, num_kv_heads, head_dim)
  if is_quantized(k_pages.dtype):
    # Power-of-two scales: exact in q's dtype (kv_quant.py).
    k = _dequantize_gathered(k, k_scales, page_table, page_size, q.dtype)
    v = _dequantize_gathered(v, v_scales, page_table, page_size, q.dtype)
  k = apply_rope(k, slot_shift, rope)  # float32, now at logical angle
  v = jnp.where(slot_valid[:, :, None, None], v, jnp.zeros((), v.dtype))

  q_rot = apply_rope(q, jnp.maximum(q_pos, 0), rope)
  q_rot = q_rot.reshape(batch, q_len, num_kv_heads, group, head_dim)
  precision = (jax.lax.Precision.HIGHEST if q.dtype == jnp.float32
               else jax.lax.Precision.DEFAULT)
  if q.dtype != jnp.float32:
    # Match the kernels: scores from operands in the input dtype, f32 accumulate.
    q_rot, k = q_rot.astype(q.dtype), k.astype(q.dtype)
  scores = jnp.einsum("btkgh,bskh->btkgs", q_rot, k, precision=precision,
                      preferred_element_type=jnp.float32)
  scores = scores * jnp.asarray(sm_scale, jnp.float32)

  visible = (slot_valid[:, None, :] &
             (slot_pos[:, None, :] <= q_pos[:, :, None]) &
             (q_pos[:, :, None] >= 0))[:, :, None, None, :]  # [B,T,1,1,S]
  weights = masked_softmax(scores, visible)
  out = jnp.einsum("btkgs,bskh->btkgh", weights.astype(v.dtype), v,
                   precision=precision, preferred_element_type=jnp.float32)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)


def _dequantize_gathered(x, scales, page_table, page_size, dtype):
  """Gathered float8 rows [B, S, K, H] times their page's scale, in dtype."""
  batch, kv_len, num_kv_heads, _ = x.shape
  row_scale = jnp.moveaxis(scales[:, page_table], 0, -1)  # [B, M, K]
  row_scale = jnp.repeat(row_scale, page_size, axis=1)  # [B, S, K]
  return (x.astype(jnp.float32) * row_scale[..., None]).astype(dtype)
