"""The Flax Llama: paged forward pass against the dense reference, pool writes,
tied embeddings, config validation (CPU, XLA attention path)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import Llama3RopeScaling, LlamaConfig
from models.dense_reference import causal_mask, dense_forward
from models.llama import (Llama, forward, kv_cache_shape, llama_from_params,
                          rms_norm, split_model)
from pallas_kernels.rope import apply_rope
from tests.hf_fixtures import contiguous_paged_inputs, greedy_generate_paged

PAGE = 4


@functools.lru_cache(maxsize=None)
def _jitted_forward(graphdef):
  return jax.jit(functools.partial(forward, graphdef, impl="xla"))


def paged(model, tokens, k_pool, v_pool, inputs, **kwargs):
  """Jitted model(tokens, k_pool, v_pool, inputs, impl="xla") (no donation)."""
  graphdef, state = split_model(model)
  return _jitted_forward(graphdef)(state, tokens, k_pool, v_pool, inputs,
                                   **kwargs)


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _random_norms(model, seed=1):
  """Same model with random (non-unit) RMSNorm weights, so norms matter."""
  graphdef, state = split_model(model)
  params = nnx.to_pure_dict(state)
  rng = np.random.default_rng(seed)
  for name in params["layers"]:
    if not name.endswith("norm"):
      continue
    shape = params["layers"][name].shape
    params["layers"][name] = 1.0 + 0.3 * rng.standard_normal(shape)
  params["final_norm"] = 1.0 + 0.3 * rng.standard_normal(
      params["final_norm"].shape)
  return llama_from_params(model.config, params, dtype=model.dtype)


def _ragged_batch(model, lengths, seed=0):
  """Prefill of ragged rows through shuffled pages of a NaN-filled pool."""
  lengths = np.asarray(lengths)
  batch, q_len = len(lengths), int(lengths.max())
  pages_per_row = -(-q_len // PAGE)
  num_pages = batch * pages_per_row + 3  # spare pages must stay untouched
  rng = np.random.default_rng(seed)
  page_table = rng.permutation(num_pages)[:batch * pages_per_row].reshape(
      batch, pages_per_row).astype(np.int32)
  inputs = contiguous_paged_inputs(page_table, lengths, np.zeros(batch),
                                   q_len, PAGE)
  shape = kv_cache_shape(model.config, num_pages, PAGE)
  pool = jnp.full(shape, jnp.nan, model.dtype)
  tokens = jnp.asarray(rng.integers(0, model.config.vocab_size,
                                    (batch, q_len)), jnp.int32)
  return tokens, pool, inputs, page_table


CONFIGS = {
    "plain": LlamaConfig.tiny(),
    # Small original_max_position so that scaling changes the frequencies
    # that matter at these lengths.
    "llama3": LlamaConfig.tiny(rope_theta=500000.0, rope_scaling=(
        Llama3RopeScaling(factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position=64))),
    "tied": LlamaConfig.tiny(tie_word_embeddings=True, num_kv_heads=1),
    # Qwen2's Q/K/V biases (random in our init) and Qwen3's Q/K norms.
    "biases": LlamaConfig.tiny(attention_bias=True),
    "qk_norm": LlamaConfig.tiny(qk_norm=True, head_dim=32),
}


# One batch shape for most tests, so that each program compiles once.
LENGTHS = (13, 6, 9)


@functools.lru_cache(maxsize=None)
def _model(name: str) -> Llama:
  """A random model of CONFIGS[name] with random norm weights (cached)."""
  return _random_norms(Llama(CONFIGS[name], rngs=nnx.Rngs(0)))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_paged_prefill_matches_dense_causal(name):
  model = _model(name)
  lengths = LENGTHS
  tokens, pool, inputs, _ = _ragged_batch(model, lengths)
  logits, _, _ = paged(model, tokens, pool, pool, inputs)
  q_len = tokens.shape[1]
  positions = jnp.broadcast_to(jnp.arange(q_len, dtype=jnp.int32),
                               tokens.shape)
  ref = dense_forward(model, tokens, positions, causal_mask(3, q_len))
  assert logits.shape == (3, q_len, model.config.vocab_size)
  assert logits.dtype == jnp.float32
  for b, n in enumerate(lengths):
    assert _rel(logits[b, :n], ref[b, :n]) < 1e-5, (name, b)
  # The logits are not trivially flat: the check above can fail.
  assert float(jnp.std(ref[0, -1])) > 0.3


def test_logits_index_selects_rows():
  model = _model("plain")
  lengths = LENGTHS
  tokens, pool, inputs, _ = _ragged_batch(model, lengths, seed=1)
  full, _, _ = paged(model, tokens, pool, pool, inputs)
  last = jnp.asarray(lengths, jnp.int32) - 1
  picked, _, _ = paged(model, tokens, pool, pool, inputs, logits_index=last)
  assert picked.shape == (3, model.config.vocab_size)
  np.testing.assert_allclose(picked, full[jnp.arange(3), last], rtol=1e-6,
                             atol=1e-6)


def test_writes_land_in_pages_and_padding_writes_nothing():
  model = _model("plain")
  config = model.config
  lengths = np.array(LENGTHS)
  tokens, pool, inputs, page_table = _ragged_batch(model, lengths, seed=3)
  num_pages = pool.shape[2]
  # Padding rows of row 1: some say write_page -1, some num_pages; neither
  # may land anywhere (-1 must not wrap around to the last page, num_pages
  # must not reach the next layer's pages in the one-page-array view).
  write_page = np.asarray(inputs.write_page).copy()
  write_page[1, 9:] = num_pages
  inputs = inputs.replace(write_page=jnp.asarray(write_page))
  _, k_pool, v_pool = paged(model, tokens, pool, pool, inputs)
  # The pool is [K, L, ...]; compare in [L, K, ...] order.
  k_pool = np.asarray(k_pool).swapaxes(0, 1)
  v_pool = np.asarray(v_pool).swapaxes(0, 1)

  written = np.zeros((num_pages, PAGE), bool)
  for b, n in enumerate(lengths):
    for t in range(n):
      written[page_table[b, t // PAGE], t % PAGE] = True
  for pool_out in (k_pool, v_pool):
    finite = np.isfinite(pool_out).all(axis=(0, 1, 4))
    nan = np.isnan(pool_out).all(axis=(0, 1, 4))
    np.testing.assert_array_equal(finite, written)
    np.testing.assert_array_equal(nan, ~written)

  # Layer 0's K and V, recomputed by hand: rotated at the token's position.
  p = model.layers.stacked()
  h = rms_norm(model.embed(tokens), p["attn_norm"][0], config.rms_norm_eps,
               jnp.float32)
  k = (h @ p["k_proj"][0]).reshape(3, -1, config.num_kv_heads,
                                   config.head_dim)
  v = (h @ p["v_proj"][0]).reshape(3, -1, config.num_kv_heads,
                                   config.head_dim)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
  k_rot = np.asarray(apply_rope(k, positions, config.rope))
  for b, n in enumerate(lengths):
    for t in range(n):
      page, slot = page_table[b, t // PAGE], t % PAGE
      np.testing.assert_allclose(k_pool[0, :, page, slot], k_rot[b, t],
                                 rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(v_pool[0, :, page, slot], v[b, t],
                                 rtol=1e-5, atol=1e-5)


def test_prefill_then_decode_matches_dense():
  model = _model("llama3")
  config = model.config
  prompt = list(np.random.default_rng(4).integers(0, config.vocab_size, 9))
  prompt_logits, generated, step_logits = greedy_generate_paged(
      model, prompt, 6, page_size=PAGE)
  sequence = jnp.asarray([prompt + generated], jnp.int32)
  total = sequence.shape[1]
  ref = dense_forward(model, sequence, jnp.arange(total)[None],
                      causal_mask(1, total))[0]
  assert _rel(prompt_logits, ref[:len(prompt)]) < 1e-5
  # step i's logits belong to position len(prompt) - 1 + i
  assert _rel(step_logits, ref[len(prompt) - 1:total - 1]) < 1e-5
  assert generated == [int(t) for t in jnp.argmax(
      ref[len(prompt) - 1:total - 1], axis=-1)]


def test_jitted_pure_forward_with_donation():
  model = _model("plain")
  tokens, pool, inputs, _ = _ragged_batch(model, LENGTHS, seed=5)
  expected, k_expected, _ = paged(model, tokens, pool, pool, inputs)
  graphdef, state = split_model(model)
  step = jax.jit(functools.partial(forward, graphdef, impl="xla"),
                 donate_argnums=(2, 3))
  logits, k_pool, v_pool = step(state, tokens, pool.copy(), pool.copy(),
                                inputs)
  np.testing.assert_allclose(logits, expected, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.isnan(k_pool), np.isnan(k_expected))
  assert v_pool.shape == pool.shape


def test_tied_embeddings_use_the_embedding_table():
  tied = _model("tied")
  untied_config = tied.config.replace(tie_word_embeddings=False)
  params = nnx.to_pure_dict(split_model(tied)[1])
  assert "lm_head" not in params
  untied_params = dict(params, lm_head=np.asarray(params["embed_tokens"]).T)
  untied = llama_from_params(untied_config, untied_params)
  assert "lm_head" in nnx.to_pure_dict(split_model(untied)[1])
  tokens = jnp.asarray([[3, 17, 200, 5, 9]], jnp.int32)
  args = (jnp.arange(5)[None], causal_mask(1, 5))
  np.testing.assert_allclose(dense_forward(tied, tokens, *args),
                             dense_forward(untied, tokens, *args), rtol=1e-6,
                             atol=1e-6)
  # A different head gives different logits (the comparison can fail).
  other = llama_from_params(untied_config, dict(
      untied_params, lm_head=np.asarray(untied_params["lm_head"])[:, ::-1]))
  assert _rel(dense_forward(other, tokens, *args),
              dense_forward(tied, tokens, *args)) > 0.1


def test_dense_reference_block_diagonal_mask_isolates_documents():
  model = _model("plain")
  rng = np.random.default_rng(8)
  doc_a, doc_b = rng.integers(0, 256, 5), rng.integers(0, 256, 4)
  tokens = jnp.asarray([np.concatenate([doc_a, doc_b])], jnp.int32)
  doc_id = np.array([0] * 5 + [1] * 4)
  causal = np.tril(np.ones((9, 9), bool))
  mask = jnp.asarray((causal & (doc_id[:, None] == doc_id[None, :]))[None])
  # Doc b at positions 5..8 inside the block-diagonal pass equals doc b alone
  # at positions 5..8 (keys rotated at their logical positions).
  logits = dense_forward(model, tokens, jnp.arange(9)[None], mask)
  alone = dense_forward(model, jnp.asarray([doc_b], jnp.int32),
                        jnp.arange(5, 9)[None], causal_mask(1, 4))
  assert _rel(logits[0, 5:], alone[0]) < 1e-5
  alone_a = dense_forward(model, jnp.asarray([doc_a], jnp.int32),
                          jnp.arange(5)[None], causal_mask(1, 5))
  assert _rel(logits[0, :5], alone_a[0]) < 1e-5


def test_bfloat16_paged_forward_close_to_dense():
  model = Llama(LlamaConfig.tiny(), dtype=jnp.bfloat16,
                param_dtype=jnp.bfloat16, rngs=nnx.Rngs(9))
  tokens, pool, inputs, _ = _ragged_batch(model, (13, 13, 13))
  logits, k_pool, _ = paged(model, tokens, pool, pool, inputs)
  assert k_pool.dtype == jnp.bfloat16 and logits.dtype == jnp.float32
  ref = dense_forward(model, tokens, jnp.broadcast_to(jnp.arange(13), (3, 13)),
                      causal_mask(3, 13))
  assert _rel(logits, ref) < 3e-2


def test_call_rejects_bad_pool_and_inputs():
  model = _model("plain")
  tokens, pool, inputs, _ = _ragged_batch(model, LENGTHS)
  with pytest.raises(ValueError, match="k_cache dtype"):
    model(tokens, pool.astype(jnp.bfloat16), pool.astype(jnp.bfloat16),
          inputs, impl="xla")
  with pytest.raises(ValueError, match="k_cache must be"):
    model(tokens, pool[:1], pool[:1], inputs, impl="xla")
  with pytest.raises(ValueError, match="inputs.q_pos"):
    model(tokens, pool, pool, inputs.replace(q_pos=inputs.q_pos[:, :2]),
          impl="xla")
  with pytest.raises(ValueError, match="logits_index"):
    model(tokens, pool, pool, inputs, impl="xla",
          logits_index=jnp.zeros((2,), jnp.int32))
  with pytest.raises(ValueError, match=r"\[K, L"):
    model(tokens, pool[:1], pool[:1], inputs, impl="xla")
  # A layers-first pool ([L, K, ...]) is refused, not read with the axes
  # swapped (the tied model has K=1, L=2, so the two orders differ).
  tied = _model("tied")
  tokens, pool, inputs, _ = _ragged_batch(tied, LENGTHS)
  layers_first = pool.swapaxes(0, 1)
  assert layers_first.shape != pool.shape
  with pytest.raises(ValueError, match=r"\[K, L"):
    tied(tokens, layers_first, layers_first, inputs, impl="xla")


@pytest.mark.parametrize("changes, field", [
    (dict(num_kv_heads=3), "num_heads"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(num_layers=-1), "num_layers"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(head_dim=15), "head_dim"),
    (dict(rope_theta=1.0), "rope_theta"),
    (dict(rms_norm_eps=0.0), "rms_norm_eps"),
    (dict(eos_token_id=256), "eos_token_id"),
    (dict(attention_bias=1), "attention_bias"),
    (dict(qk_norm="yes"), "qk_norm"),
    (dict(rope_scaling=(8.0, 1.0, 4.0, 8192)), "rope_scaling"),
    (dict(rope_scaling=Llama3RopeScaling(factor=8.0, low_freq_factor=4.0,
                                         high_freq_factor=1.0)),
     "rope_scaling"),
])
def test_config_validation_names_the_field(changes, field):
  with pytest.raises(ValueError, match=field):
    LlamaConfig.tiny(**changes)


def test_presets():
  tiny = LlamaConfig.tiny()
  assert (tiny.vocab_size, tiny.hidden_size, tiny.num_layers, tiny.num_heads,
          tiny.num_kv_heads, tiny.head_dim) == (256, 64, 2, 4, 2, 16)
  big = LlamaConfig.llama3_8b()
  assert (big.vocab_size, big.hidden_size, big.num_layers, big.num_heads,
          big.num_kv_heads, big.head_dim, big.intermediate_size) == (
              128256, 4096, 32, 32, 8, 128, 14336)
  rope = big.rope
  assert (rope.theta, rope.factor, rope.low_freq_factor, rope.high_freq_factor,
          rope.original_max_position) == (500000.0, 8.0, 1.0, 4.0, 8192)
  assert big.max_position == 8192 and big.rms_norm_eps == 1e-5
  assert hash(big) == hash(LlamaConfig.llama3_8b())  # usable as a static arg
  # The 8B shape initialises abstractly (no memory) with the right sizes.
  abstract = nnx.eval_shape(lambda: Llama(big, dtype=jnp.bfloat16,
                                          param_dtype=jnp.bfloat16,
                                          rngs=nnx.Rngs(0)))
  sizes = [x.size for x in jax.tree.leaves(nnx.state(abstract))]
  assert 8.0e9 < sum(sizes) < 8.1e9


def test_random_init_is_seeded():
  a = nnx.to_pure_dict(split_model(Llama(LlamaConfig.tiny(),
                                         rngs=nnx.Rngs(11)))[1])
  b = nnx.to_pure_dict(split_model(Llama(LlamaConfig.tiny(),
                                         rngs=nnx.Rngs(11)))[1])
  c = nnx.to_pure_dict(split_model(Llama(LlamaConfig.tiny(),
                                         rngs=nnx.Rngs(12)))[1])
  np.testing.assert_array_equal(a["layers"]["q_proj"], b["layers"]["q_proj"])
  assert not np.array_equal(a["layers"]["q_proj"], c["layers"]["q_proj"])


def test_llama_from_params_rejects_wrong_shapes():
  params = nnx.to_pure_dict(split_model(Llama(LlamaConfig.tiny(),
                                              rngs=nnx.Rngs(0)))[1])
  bad = dict(params, final_norm=np.ones(3, np.float32))
  with pytest.raises(ValueError, match="final_norm"):
    llama_from_params(LlamaConfig.tiny(), bad)
  missing = {k: v for k, v in params.items() if k != "lm_head"}
  with pytest.raises(ValueError, match="lm_head"):
    llama_from_params(LlamaConfig.tiny(), missing)


def test_optional_parameters_exist_only_where_configured():
  from models.params import LAYER_PARAM_NAMES
  layers = lambda config: set(nnx.to_pure_dict(split_model(
      _model(config))[1])["layers"])
  assert layers("plain") == set(LAYER_PARAM_NAMES)
  assert layers("biases") == set(LAYER_PARAM_NAMES) | {"q_bias", "k_bias",
                                                       "v_bias"}
  assert layers("qk_norm") == set(LAYER_PARAM_NAMES) | {"q_norm", "k_norm"}
  shapes = nnx.to_pure_dict(split_model(_model("qk_norm"))[1])["layers"]
  assert shapes["q_norm"].shape == (2, 32)
