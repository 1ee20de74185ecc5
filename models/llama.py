"""Flax NNX Llama whose attention runs through the lazy attention contract.

Layer weights are stacked along a leading layer axis and the decoder blocks run
as one `jax.lax.scan`, so a 30-layer model traces and compiles one block, not
thirty.  The paged K/V pool travels through the scan as carry and is updated
in place: per layer, the step's new keys (rotated at their own position) and
values are scattered into their pages, then `pallas_kernels.lazy_attention`
attends over the pages with the raw (unrotated) queries.

The parameter layout (and random init) is in models/params.py.

Pure-function use (what the engine jits, with the pool donated):
  graphdef, state = split_model(model)
  step = jax.jit(functools.partial(forward, graphdef, impl="auto"),
                 donate_argnums=(2, 3))
  logits, k_cache, v_cache = step(state, tokens, k_cache, v_cache, inputs)
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from models.config import LlamaConfig
from models.paged_inputs import PagedAttentionInputs
from models.params import init_params, layer_param_names, param_shapes
from models.quantized_pool import (QuantizedPool, check_quantized_pool,
                                   write_quantized_rows)
from pallas_kernels.lazy_attention import (check_kv_pools, lazy_attention,
                                           plan_lazy_attention)
from pallas_kernels.rope import apply_rope


def kv_cache_shape(config: LlamaConfig, num_pages: int, page_size: int
                   ) -> tuple[int, int, int, int, int]:
  """Shape of the K (and V) pool: [K, L, num_pages, page_size, H]."""
  return (config.num_kv_heads, config.num_layers, num_pages, page_size,
          config.head_dim)


class DecoderLayers(nnx.Module):
  """All decoder blocks' weights, stacked on a leading layer axis [L, ...]."""

  def __init__(self, names: tuple[str, ...], arrays: Mapping[str, jax.Array]):
    self.names = tuple(names)  # models.params.layer_param_names(config)
    for name in self.names:
      setattr(self, name, nnx.Param(arrays[name]))

  def stacked(self) -> dict[str, jax.Array]:
    """The stacked arrays, keyed by parameter name (scan input)."""
    return {name: getattr(self, name)[...] for name in self.names}


def rms_norm(x, weight, eps: float, dtype):
  """HF LlamaRMSNorm: normalise in float32, cast, then scale."""
  x32 = x.astype(jnp.float32)
  variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
  normed = (x32 * jax.lax.rsqrt(variance + eps)).astype(dtype)
  return normed * weight.astype(dtype)


def _precision(dtype):
  # Float32 models are parity references: keep full float32 matmuls (no TF32).
  return (jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else
          jax.lax.Precision.DEFAULT)


def _project(x, w, dtype):
  return jnp.einsum("...i,io->...o", x, w.astype(dtype),
                    precision=_precision(dtype)).astype(dtype)


def _project_with_bias(x, w, b, dtype):
  # The bias joins the float32 accumulator, as in a fused matmul-plus-bias,
  # so a 16-bit model rounds once, not twice.
  out = jnp.einsum("...i,io->...o", x, w.astype(dtype),
                   precision=_precision(dtype),
                   preferred_element_type=jnp.float32)
  return (out + b.astype(jnp.float32)).astype(dtype)


def _attention_inputs(h, p, c: LlamaConfig, dtype):
  """Q [B,T,N,H], K and V [B,T,K,H] of one block, before RoPE: projections,
  plus biases (attention_bias) and per-head RMSNorm of Q and K (qk_norm)."""
  heads = {"q": c.num_heads, "k": c.num_kv_heads, "v": c.num_kv_heads}
  out = {}
  for name, num in heads.items():
    w = p[f"{name}_proj"]
    x = (_project_with_bias(h, w, p[f"{name}_bias"], dtype)
         if c.attention_bias else _project(h, w, dtype))
    out[name] = x.reshape(*h.shape[:-1], num, c.head_dim)
  if c.qk_norm:
    for name in ("q", "k"):
      out[name] = rms_norm(out[name], p[f"{name}_norm"], c.rms_norm_eps, dtype)
  return out["q"], out["k"], out["v"]


# attend(layer_index, q [B,T,N,H], k [B,T,K,H], v [B,T,K,H], carry)
#   -> (attention output [B,T,N,H], carry)
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, Any],
                    tuple[jax.Array, Any]]


def run_decoder_layers(layers: Mapping[str, jax.Array], x, carry,
                       attend: AttendFn, *, config: LlamaConfig, dtype,
                       unroll: int | bool = 1):
  """Scans the decoder blocks over the stacked weights.

  Args:
    layers: stacked layer weights (DecoderLayers.stacked()).
    x: [B, T, D] residual stream in `dtype`.
    carry: whatever `attend` threads through the layers (the paged pool).
    attend: the attention of one block; gets the raw projections.
    config: model config.
    dtype: compute dtype.
    unroll: passed to jax.lax.scan.

  Returns:
    (x [B, T, D], carry).
  """
  c = config
  batch, q_len, _ = x.shape

  def block(state, xs):
    x, carry = state
    layer_index, p = xs
    h = rms_norm(x, p["attn_norm"], c.rms_norm_eps, dtype)
    q, k, v = _attention_inputs(h, p, c, dtype)
    attn, carry = attend(layer_index, q, k, v, carry)
    attn = attn.astype(dtype).reshape(batch, q_len, c.num_heads * c.head_dim)
    x = x + _project(attn, p["o_proj"], dtype)
    h = rms_norm(x, p["mlp_norm"], c.rms_norm_eps, dtype)
    gated = jax.nn.silu(_project(h, p["gate_proj"], dtype)) * _project(
        h, p["up_proj"], dtype)
    x = x + _project(gated, p["down_proj"], dtype)
    return (x, carry), None

  layer_ids = jnp.arange(c.num_layers, dtype=jnp.int32)
  (x, carry), _ = jax.lax.scan(block, (x, carry), (layer_ids, dict(layers)),
                               unroll=unroll)
  return x, carry


class Llama(nnx.Module):
  """Llama-family decoder (embeddings, RMSNorm, GQA attention with RoPE,
  SwiGLU; Q/K/V biases and Q/K norms where the config has them).

  Args:
    config: the model's LlamaConfig.
    dtype: compute dtype (activations, K/V pool, attention).
    param_dtype: storage dtype of the weights.
    rngs: random initialisation (`nnx.Rngs(seed)`).
  """

  def __init__(self, config: LlamaConfig, *, dtype=jnp.float32,
               param_dtype=jnp.float32, rngs: nnx.Rngs):
    if not isinstance(config, LlamaConfig):
      raise ValueError(
          f"config must be a LlamaConfig, got {type(config).__name__}")
    self.config = config
    self.dtype = jnp.dtype(dtype)
    self.param_dtype = jnp.dtype(param_dtype)
    params = init_params(rngs.params(), config, self.param_dtype)
    self.embed_tokens = nnx.Param(params["embed_tokens"])
    self.layers = DecoderLayers(layer_param_names(config), params["layers"])
    self.final_norm = nnx.Param(params["final_norm"])
    if not config.tie_word_embeddings:
      self.lm_head = nnx.Param(params["lm_head"])

  # --- pieces shared with the dense reference ---------------------------------
  def embed(self, tokens) -> jax.Array:
    """[B, T] int32 -> [B, T, D] in the compute dtype."""
    return self.embed_tokens[...][tokens].astype(self.dtype)

  def output_logits(self, x) -> jax.Array:
    """Final RMSNorm and output projection; [..., D] -> float32 [..., V]."""
    x = rms_norm(x, self.final_norm[...], self.config.rms_norm_eps, self.dtype)
    precision = _precision(self.dtype)
    if self.config.tie_word_embeddings:
      return jnp.einsum("...d,vd->...v", x,
                        self.embed_tokens[...].astype(self.dtype),
                        precision=precision,
                        preferred_element_type=jnp.float32)
    return jnp.einsum("...d,dv->...v", x, self.lm_head[...].astype(self.dtype),
                      precision=precision, preferred_element_type=jnp.float32)

  # --- the paged forward pass -------------------------------------------------
  def __call__(self, tokens, k_cache, v_cache, inputs: PagedAttentionInputs,
               *, impl: str = "auto", logits_index=None, unroll: int | bool = 1,
               pool_as_bits: bool = False, embeddings=None,
               tensor_parallel=None):
    """One step over the paged pool: prefill (T > 1) or decode (T == 1).

    Args:
      tokens: int32[B, T] token ids (any id on padding rows).
      k_cache: key pool in the compute dtype, [K, L, num_pages, page_size, H];
        keys are stored rotated at their own position (`inputs.q_pos`).  Page
        ids are per layer, in [0, num_pages).  Heads first is what makes the
        pool zero-copy: it is viewed (a free reshape) as one
        [K, L * num_pages, P, H] page array and layer l uses pages
        l * num_pages + page, so the attention kernel reads the pool in place
        instead of a per-layer slice that XLA would copy every step.
      v_cache: same shape and dtype, values.  Either pool may instead be a
        float8 `models.quantized_pool.QuantizedPool` (both or neither): new
        K/V are quantized as they are written (per-page scales, re-scaled
        on later writes to a partly filled page) and the kernel dequantizes
        in registers.
      inputs: page metadata (models/paged_inputs.py).
      impl: attention implementation for `pallas_kernels.lazy_attention`.
      logits_index: optional int32[B]: return only row `logits_index[b]`'s
        logits ([B, V]) instead of every row's ([B, T, V]).
      unroll: layer-scan unroll factor (True unrolls fully).
      pool_as_bits: carry 16-bit pools through the layer scan as uint16 (see
        the comment in the code).
      embeddings: optional [B, T, D] input vectors used instead of the token
        embeddings (a learned preamble); `tokens` then only gives the shape.
      tensor_parallel: a `models.sharding.TensorParallel` when the weights
        and pools lie on a mesh by its rules: the KV write and the attention
        kernel then run per device on its heads (shard_map), the rest is
        partitioned by GSPMD from the weights' shardings.  None: one device.

    Returns:
      (logits float32 [B, T, V] or [B, V], k_cache, v_cache), the pools (of
      the type given) with this step's K/V written at (inputs.write_page,
      inputs.write_slot).
    """
    self._check_call(tokens, k_cache, v_cache, inputs, logits_index,
                     embeddings)
    c = self.config
    rope = c.rope
    num_kv_heads, num_layers, num_pages, page_size = k_cache.shape[:4]
    # Writes outside [0, num_pages) x [0, page_size) are dropped.  Point them
    # past the end explicitly: a scatter would wrap negative indices, and an
    # out-of-range page would land in another layer's pages.
    write_ok = ((inputs.write_page >= 0) & (inputs.write_page < num_pages) &
                (inputs.write_slot >= 0) & (inputs.write_slot < page_size))
    key_pos = jnp.maximum(inputs.q_pos, 0)
    # The kernel's per-batch metadata, made once and shared by every layer
    # (None for kernels that have none); layers read their pages at an offset
    # of the one page array, so the plan stays the same.
    layer_pool = jax.ShapeDtypeStruct(
        (c.num_kv_heads, num_pages, page_size, c.head_dim), k_cache.dtype)
    plan = plan_lazy_attention(
        jax.ShapeDtypeStruct(tokens.shape + (c.num_heads, c.head_dim),
                             self.dtype), layer_pool, inputs.page_table,
        inputs.page_pos, inputs.page_shift, inputs.page_len, inputs.q_pos,
        rope=rope, impl=impl)

    all_pages = num_layers * num_pages
    all_rows = all_pages * page_size
    page_shape = (num_kv_heads, all_pages, page_size, c.head_dim)
    # The scan carries each pool as [K, L*N*P, H] token rows, so a step's
    # writes are a plain row scatter (one index per token).  A scatter into
    # [K, L*N, P, H] by (page, slot) gave XLA GPU room to pick another layout
    # for the carried pool and copy it around the kernel call.
    row_shape = (num_kv_heads, all_rows, c.head_dim)
    # pool_as_bits: 16-bit float pools travel as their uint16 bit patterns.
    # XLA may widen a 16-bit float scatter to float32 (on CPU it does: four
    # pool-sized temporaries per step); an integer row scatter does not, at
    # the price of bitcasts XLA may or may not fold.
    pool_dtype = k_cache.dtype
    quantized = isinstance(k_cache, QuantizedPool)
    carried = (jnp.uint16 if pool_as_bits and
               jnp.dtype(pool_dtype).itemsize == 2 else pool_dtype)
    to_carry = lambda x: jax.lax.bitcast_convert_type(x, carried)
    to_pool = lambda x: jax.lax.bitcast_convert_type(x, pool_dtype)

    def write(pool, new_rows, rows):
      if quantized:  # pool: (float8 rows, scales [K, L*N])
        return write_quantized_rows(*pool, rows, new_rows, page_size)
      return pool.at[:, rows].set(to_carry(new_rows.astype(pool_dtype)),
                                  mode="drop")

    def page_view(pool, kv_heads):
      """The kernel's [K, L*N, P, H] pages (and scales [K, L*N])."""
      pages = (kv_heads,) + page_shape[1:]
      if quantized:
        return pool[0].reshape(pages), pool[1]
      return to_pool(pool).reshape(pages), None

    def write_and_attend(q, k, v, k_pool, v_pool, rows, offset, key_pos,
                         inputs, plan):
      # The KV heads here are this device's under tensor parallelism (all of
      # them on one device), so head counts come from the shapes.
      kv_heads = k.shape[2]
      # Float pools store the keys in their dtype; float8 pools quantize
      # the rotated float32 keys directly (one rounding, not two).
      k_rot = apply_rope(k, key_pos, rope)
      if not quantized:
        k_rot = k_rot.astype(pool_dtype)
      # [B, T, K, H] -> [K, B*T, H], one row per written token.
      k_rows = jnp.moveaxis(k_rot, 2, 0).reshape(kv_heads, -1, c.head_dim)
      v_rows = jnp.moveaxis(v, 2, 0).reshape(kv_heads, -1, c.head_dim)
      k_pool = write(k_pool, k_rows, rows)
      v_pool = write(v_pool, v_rows, rows)
      k_pages, k_scales = page_view(k_pool, kv_heads)
      v_pages, v_scales = page_view(v_pool, kv_heads)
      out = lazy_attention(q, k_pages, v_pages,
                           inputs.page_table, inputs.page_pos,
                           inputs.page_shift, inputs.page_len, inputs.q_pos,
                           rope=rope, impl=impl, page_offset=offset,
                           plan=plan, k_scales=k_scales, v_scales=v_scales)
      return out, k_pool, v_pool

    if tensor_parallel is not None:
      write_and_attend = tensor_parallel.attention_per_device(
          write_and_attend)

    def attend(layer, q, k, v, pools):
      k_pool, v_pool = pools
      offset = layer * num_pages
      rows = jnp.where(write_ok,
                       (inputs.write_page + offset) * page_size +
                       inputs.write_slot, all_rows).reshape(-1)
      out, k_pool, v_pool = write_and_attend(q, k, v, k_pool, v_pool, rows,
                                             offset, key_pos, inputs, plan)
      return out, (k_pool, v_pool)

    def to_rows(pool):  # the scan's carry
      if quantized:
        return (pool.pages.reshape(row_shape),
                pool.scales.reshape(num_kv_heads, all_pages))
      return to_carry(pool.reshape(row_shape))

    def from_rows(rows, like):
      if quantized:
        return QuantizedPool(pages=rows[0].reshape(like.shape),
                             scales=rows[1].reshape(like.scales.shape))
      return to_pool(rows).reshape(like.shape)

    pools = (to_rows(k_cache), to_rows(v_cache))
    x = self.embed(tokens) if embeddings is None else embeddings.astype(
        self.dtype)
    x, (k_out, v_out) = run_decoder_layers(
        self.layers.stacked(), x, pools, attend, config=c, dtype=self.dtype,
        unroll=unroll)
    if logits_index is not None:
      x = x[jnp.arange(x.shape[0]), logits_index]  # [B, D]
    logits = self.output_logits(x)
    k_out = from_rows(k_out, k_cache)
    v_out = from_rows(v_out, v_cache)
    if tensor_parallel is not None:
      # Logits whole on every device (every host reads them; sampling is
      # replicated); the pools keep their head split, so a donated pool
      # comes back with the sharding it went in with.
      logits = tensor_parallel.whole_logits(logits)
      k_out, v_out = (jax.tree.map(
          lambda x: tensor_parallel.constrain(x, P(tensor_parallel.axis)),
          pool) for pool in (k_out, v_out))
    return logits, k_out, v_out

  def _check_call(self, tokens, k_cache, v_cache, inputs, logits_index,
                  embeddings):
    c = self.config
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise ValueError(
          f"tokens must be int[B, T], got {tokens.shape} {tokens.dtype}")
    lead = (c.num_kv_heads, c.num_layers)
    if k_cache.ndim != 5 or (k_cache.shape[:2], k_cache.shape[4]) != (
        lead, c.head_dim):
      raise ValueError(
          f"k_cache must be [K, L, num_pages, page_size, H] = "
          f"[{lead[0]}, {lead[1]}, *, *, {c.head_dim}], got {k_cache.shape}")
    if isinstance(k_cache, QuantizedPool) or isinstance(v_cache,
                                                        QuantizedPool):
      check_quantized_pool(k_cache, "k_cache")
      check_quantized_pool(v_cache, "v_cache")
      check_kv_pools(k_cache.pages, v_cache.pages, k_cache.dtype,
                     names=("k_cache", "v_cache"), dtype_name="k_cache dtype")
    else:
      check_kv_pools(k_cache, v_cache, self.dtype,
                     names=("k_cache", "v_cache"),
                     dtype_name="the model's compute dtype")
    if not isinstance(inputs, PagedAttentionInputs):
      raise ValueError("inputs must be a PagedAttentionInputs, got "
                       f"{type(inputs).__name__}")
    for name in ("q_pos", "write_page", "write_slot"):
      arr = getattr(inputs, name)
      if arr.shape != tokens.shape:
        raise ValueError(f"inputs.{name} shape {arr.shape} must equal tokens "
                         f"shape {tokens.shape}")
    if embeddings is not None and embeddings.shape != tokens.shape + (
        c.hidden_size,):
      raise ValueError(f"embeddings shape {embeddings.shape} must be [B, T, D] "
                       f"= {tokens.shape + (c.hidden_size,)}")
    if logits_index is not None and logits_index.shape != tokens.shape[:1]:
      raise ValueError(f"logits_index shape {logits_index.shape} must be "
                       f"[B] = {tokens.shape[:1]}")


def split_model(model: Llama):
  """(graphdef, state) of a model; `nnx.merge(graphdef, state)` rebuilds it.

  The graphdef is static (hashable, carries the config and dtypes); the state
  is a pytree of parameter arrays to pass into jitted functions.
  """
  return nnx.split(model)


def forward(graphdef, state, tokens, k_cache, v_cache,
            inputs: PagedAttentionInputs, *, impl: str = "auto",
            logits_index=None, unroll: int | bool = 1, embeddings=None,
            tensor_parallel=None):
  """Pure-function `Llama.__call__` for jit (donate k_cache and v_cache;
  `tensor_parallel` static)."""
  return nnx.merge(graphdef, state)(tokens, k_cache, v_cache, inputs,
                                    impl=impl, logits_index=logits_index,
                                    unroll=unroll, embeddings=embeddings,
                                    tensor_parallel=tensor_parallel)


def llama_from_params(config: LlamaConfig, params: Mapping[str, Any], *,
                      dtype=jnp.float32, param_dtype=None) -> Llama:
  """Builds a Llama from a nested dict of arrays in the documented layout.

  No random initialisation happens (the module is built abstractly, then
  filled).  Arrays are converted to `param_dtype` (default: `dtype`).

  Raises:
    ValueError: a parameter is missing, unexpected, or has the wrong shape.
  """
  param_dtype = jnp.dtype(dtype if param_dtype is None else param_dtype)
  expected = param_shapes(config)

  def convert(expected_tree, given_tree, prefix):
    if set(given_tree) != set(expected_tree):
      missing = sorted(set(expected_tree) - set(given_tree))
      extra = sorted(set(given_tree) - set(expected_tree))
      raise ValueError(f"params{prefix}: missing {missing}, unexpected {extra}")
    out = {}
    for name, shape in expected_tree.items():
      if isinstance(shape, dict):
        out[name] = convert(shape, given_tree[name], f"{prefix}.{name}")
        continue
      value = given_tree[name]
      if tuple(value.shape) != tuple(shape):
        raise ValueError(f"params{prefix}.{name} has shape "
                         f"{tuple(value.shape)}, expected {tuple(shape)}")
      if isinstance(value, np.ndarray):
        value = np.asarray(value, param_dtype)  # one host-side conversion
      out[name] = jnp.asarray(value, param_dtype)
    return out

  arrays = convert(expected, params, "")
  abstract = nnx.eval_shape(lambda: Llama(
      config, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  nnx.replace_by_pure_dict(state, arrays)
  return nnx.merge(graphdef, state)
