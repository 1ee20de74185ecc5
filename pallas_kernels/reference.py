"""Plain jnp reference of the lazy attention contract.

The contract: docs/design.md, 'Kernel contract'.

Written for readability, not speed: it rotates every query row separately for
every logical page, exactly as the contract states the score.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.kv_quant import dequantize_pages, is_quantized
from pallas_kernels.masked_softmax import masked_softmax
from pallas_kernels.rope import RopeConfig, cos_sin_from_chunks, rotate_half


def lazy_attention_reference(q, k_pages, v_pages, page_table, page_pos,
                             page_shift, page_len, q_pos, *, rope: RopeConfig,
                             sm_scale=None, k_scales=None, v_scales=None):
  """Deferred-RoPE paged attention, reference semantics.

  Args:
    q: [B, T, N, H] raw (unrotated) query projections.
    k_pages: [K, P_total, S_page, H] keys stored rotated at their stored angle.
    v_pages: [K, P_total, S_page, H] values.
    page_table: int32[B, M] physical page of each logical page.
    page_pos: int32[B, M] logical position of slot 0 of each logical page.
    page_shift: int32[B, M] logical position minus stored angle.
    page_len: int32[B, M] valid slots per page (0 = unused page).
    q_pos: int32[B, T] logical position of each query row; -1 = padding.
    rope: frequencies.
    sm_scale: softmax scale; defaults to 1/sqrt(H).
    k_scales, v_scales: float32 [K, P_total] scales of float8_e4m3fn pages
      (pallas_kernels/kv_quant.py); the pages are dequantized to float32
      first, so this is the contract on the dequantized pages.

  Returns:
    [B, T, N, H] in q.dtype; padding rows and rows with no visible key are 0.
    B == 0 or T == 0 gives that empty array, and M == 0 raises ValueError,
    as `lazy_attention` does.
  """
  batch, q_len, num_heads, head_dim = q.shape
  num_kv_heads, _, page_size, _ = k_pages.shape
  group = num_heads // num_kv_heads
  num_logical_pages = page_table.shape[1]
  if not num_logical_pages:
    raise ValueError(f"page_table must be [B={batch}, M] with M >= 1 logical "
                     f"pages, got shape {page_table.shape}")
  if not batch or not q_len:
    return jnp.zeros(q.shape, q.dtype)
  if sm_scale is None:
    sm_scale = head_dim ** -0.5
  if is_quantized(k_pages.dtype):
    k_pages = dequantize_pages(k_pages, k_scales)
    v_pages = dequantize_pages(v_pages, v_scales)

  # Gather logical pages: [B, M, Sp, K, H] -> [B, M*Sp, K, H].
  k = jnp.moveaxis(k_pages[:, page_table], 0, -2).astype(jnp.float32)
  v = jnp.moveaxis(v_pages[:, page_table], 0, -2).astype(jnp.float32)
  k = k.reshape(batch, num_logical_pages * page_size, num_kv_heads, head_dim)
  v = v.reshape(batch, num_logical_pages * page_size, num_kv_heads, head_dim)

  # Rotate each query row once per logical page, by q_pos - page_shift.
  chunks = jnp.asarray(rope.turn_chunks(head_dim))
  angle_pos = q_pos[:, :, None] - page_shift[:, None, :]  # [B, T, M]
  cos, sin = cos_sin_from_chunks(angle_pos[..., None], chunks)  # [B,T,M,H]
  qf = q.astype(jnp.float32)[:, :, None]  # [B, T, 1, N, H]
  q_m = qf * cos[:, :, :, None] + rotate_half(qf) * sin[:, :, :, None]
  q_m = q_m.reshape(batch, q_len, num_logical_pages, num_kv_heads, group,
                    head_dim)

  k_paged = k.reshape(batch, num_logical_pages, page_size, num_kv_heads,
                      head_dim)
  scores = jnp.einsum("btmkgh,bmskh->btkgms", q_m, k_paged,
                      precision=jax.lax.Precision.HIGHEST) * sm_scale
  scores = scores.reshape(batch, q_len, num_kv_heads, group, -1)

  slot = jnp.arange(page_size)
  slot_valid = slot[None, None, :] < page_len[:, :, None]  # [B, M, Sp]
  slot_pos = page_pos[:, :, None] + slot[None, None, :]  # [B, M, Sp]
  visible = (slot_valid[:, None] &
             (slot_pos[:, None] <= q_pos[:, :, None, None]) &
             (q_pos[:, :, None, None] >= 0))  # [B, T, M, Sp]
  visible = visible.reshape(batch, q_len, 1, 1, -1)

  weights = masked_softmax(scores, visible)
  # Padding slots may hold garbage (even NaN): zero them so 0 * NaN cannot leak.
  v = jnp.where(slot_valid.reshape(batch, -1)[:, :, None, None], v, 0.0)
  out = jnp.einsum("btkgs,bskh->btkgh", weights, v,
                   precision=jax.lax.Precision.HIGHEST)
  return out.reshape(batch, q_len, num_heads, head_dim).astype(q.dtype)
