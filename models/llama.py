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
from models.paged_pool import PoolAccess
from models.quantized_pool import QuantizedPool, check_quantized_pool
from pallas_kernels.lazy_attention import check_kv_pools, plan_lazy_attention


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
    pool = PoolAccess.of(k_cache, pool_as_bits=pool_as_bits)
    writable = pool.writable(inputs.write_page, inputs.write_slot)
    key_pos = jnp.maximum(inputs.q_pos, 0)
    plan = self.attention_plan(tokens.shape, k_cache, inputs, impl)

    def write_and_attend(q, k, v, k_pool, v_pool, rows, offset, key_pos,
                         inputs, plan):
      k_pool, v_pool = pool.write_kv(k, v, key_pos, k_pool, v_pool, rows,
                                     c.rope)
      out = pool.attend(q, k_pool, v_pool, inputs, offset, plan, rope=c.rope,
                        impl=impl)
      return out, k_pool, v_pool

    if tensor_parallel is not None:
      write_and_attend = tensor_parallel.attention_per_device(
          write_and_attend)

    def attend(layer, q, k, v, pools):
      offset = layer * pool.num_pages
      rows = pool.write_rows(writable, inputs.write_page, inputs.write_slot,
                             offset)
      out, k_pool, v_pool = write_and_attend(q, k, v, *pools, rows, offset,
                                             key_pos, inputs, plan)
      return out, (k_pool, v_pool)

    pools = (pool.to_rows(k_cache), pool.to_rows(v_cache))  # the scan's carry
    x = self.embed(tokens) if embeddings is None else embeddings.astype(
        self.dtype)
    x, (k_out, v_out) = run_decoder_layers(
        self.layers.stacked(), x, pools, attend, config=c, dtype=self.dtype,
        unroll=unroll)
    if logits_index is not None:
      x = x[jnp.arange(x.shape[0]), logits_index]  # [B, D]
    logits = self.output_logits(x)
    return finish_outputs(logits, pool.from_rows(k_out, k_cache),
                          pool.from_rows(v_out, v_cache), tensor_parallel)

  def attention_plan(self, q_shape, k_cache, inputs, impl):
    """The kernel's per-batch metadata for queries of shape [B, T] (plus
    heads) against `inputs`, made once and shared by every layer (None for
    kernels that have none); layers read their pages at an offset of the
    one page array, so the plan stays the same."""
    c = self.config
    num_pages, page_size = k_cache.shape[2:4]
    layer_pool = jax.ShapeDtypeStruct(
        (c.num_kv_heads, num_pages, page_size, c.head_dim), k_cache.dtype)
    return plan_lazy_attention(
        jax.ShapeDtypeStruct(tuple(q_shape) + (c.num_heads, c.head_dim),
                             self.dtype), layer_pool, inputs.page_table,
        inputs.page_pos, inputs.page_shift, inputs.page_len, inputs.q_pos,
        rope=c.rope, impl=impl)

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


def finish_outputs(logits, k_out, v_out, tensor_parallel):
  """(logits, k_out, v_out) as a forward pass returns them.  Under tensor
  parallelism the logits are made whole on every device (every host reads
  them; sampling is replicated) and the pools keep their head split, so a
  donated pool comes back with the sharding it went in with."""
  if tensor_parallel is not None:
    logits = tensor_parallel.whole_logits(logits)
    k_out, v_out = (jax.tree.map(
        lambda x: tensor_parallel.constrain(x, P(tensor_parallel.axis)),
        pool) for pool in (k_out, v_out))
  return logits, k_out, v_out


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
