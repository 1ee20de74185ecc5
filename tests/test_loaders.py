"""Weight loaders: GGUF round trip through gguf.GGUFWriter (every supported
tensor type, llama.cpp's Q/K permutation, Llama-3 rope_freqs), and HF
safetensors round trip through transformers (single file and sharded)."""

import functools
import json
import os

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.config import Llama3RopeScaling, LlamaConfig
from models.dense_reference import causal_mask, dense_forward
from models.errors import ModelFileNotFoundError, ModelFormatError
from models.gguf_loader import (llama_cpp_permute, llama_cpp_unpermute,
                                load_gguf, read_gguf_metadata)
from models.llama import Llama, llama_from_params, split_model
from models.safetensors_loader import config_from_hf, load_safetensors
from models.tokenizer import LlamaTokenizer
from tests.hf_fixtures import write_hf_checkpoint

Q = gguf.GGMLQuantizationType
TOKENS = [f"tok{i}" for i in range(256)]
TOKENS[3:8] = ["t", "o", "to", "k", "tok"]  # what MERGES make
MERGES = ["t o", "to k"]
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>"
                 "{{ m['content'] }}{% endfor %}")


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.lru_cache(maxsize=None)
def _source(tied: bool, scaling: bool = False):
  """(config, numpy params) of a random tiny Llama with random norms."""
  config = LlamaConfig.tiny(tie_word_embeddings=tied, bos_token_id=1,
                            eos_token_id=2)
  if scaling:
    config = config.replace(rope_theta=500000.0, head_dim=64, num_heads=2,
                            num_kv_heads=1, rope_scaling=Llama3RopeScaling(
                                factor=8.0, low_freq_factor=1.0,
                                high_freq_factor=4.0,
                                original_max_position=8192))
  model = Llama(config, rngs=nnx.Rngs(7))
  params = nnx.to_pure_dict(split_model(model)[1])
  params = {k: (v if k != "layers" else dict(v)) for k, v in params.items()}
  rng = np.random.default_rng(3)
  for name in ("attn_norm", "mlp_norm"):
    params["layers"][name] = 1 + 0.3 * rng.standard_normal(
        params["layers"][name].shape)
  params["final_norm"] = 1 + 0.3 * rng.standard_normal(config.hidden_size)
  params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
  return config, params


def _logits(config, params):
  model = llama_from_params(config, params)
  tokens = np.random.default_rng(0).integers(0, config.vocab_size, (1, 12))
  return np.asarray(dense_forward(model, jnp.asarray(tokens, jnp.int32),
                                  jnp.arange(12)[None], causal_mask(1, 12)))


def _llama3_rope_freqs(config) -> np.ndarray:
  """The per-frequency divisors convert_hf_to_gguf writes for Llama-3 RoPE."""
  s = config.rope_scaling
  base = 1.0 / config.rope_theta ** (
      np.arange(0, config.head_dim, 2, dtype=np.float32) / config.head_dim)
  divisors = []
  for freq in base:
    wavelen = 2 * np.pi / freq
    if wavelen < s.original_max_position / s.high_freq_factor:
      divisors.append(1.0)
    elif wavelen > s.original_max_position / s.low_freq_factor:
      divisors.append(s.factor)
    else:
      smooth = ((s.original_max_position / wavelen - s.low_freq_factor) /
                (s.high_freq_factor - s.low_freq_factor))
      divisors.append(1 / ((1 - smooth) / s.factor + smooth))
  return np.asarray(divisors, np.float32)


def write_llama_gguf(path, config, params, matrix_type, *, permute=True,
                     rope_freqs=None, uint_fields=None, replace=None,
                     float_fields=None, string_fields=None,
                     tokenizer_model="gpt2", merges=MERGES):
  """Writes `params` as llama.cpp would (HF [out, in] rows, Q/K permuted).

  `uint_fields`, `float_fields` and `string_fields` override or add
  metadata (key -> value; a float field takes an integer field's place),
  `tokenizer_model` and `merges` are the tokenizer's, and `replace` writes
  other float32 data (tensor name -> array) under a tensor's name: to make
  broken files.

  Returns the weights a correct loader must produce: each matrix quantized
  and dequantized by gguf itself, in our layout and row order.
  """
  writer = gguf.GGUFWriter(os.fspath(path), "llama")
  c = config
  fields = {"llama.block_count": c.num_layers,
            "llama.context_length": c.max_position,
            "llama.embedding_length": c.hidden_size,
            "llama.feed_forward_length": c.intermediate_size,
            "llama.attention.head_count": c.num_heads,
            "llama.attention.head_count_kv": c.num_kv_heads,
            "llama.rope.dimension_count": c.head_dim,
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2}
  fields.update(uint_fields or {})
  for key, value in fields.items():
    if key not in (float_fields or {}):  # a float field replaces it
      writer.add_uint32(key, value)
  if c.head_dim != c.hidden_size // c.num_heads:
    writer.add_uint32("llama.attention.key_length", c.head_dim)
    writer.add_uint32("llama.attention.value_length", c.head_dim)
  writer.add_float32("llama.rope.freq_base", c.rope_theta)
  writer.add_float32("llama.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
  for key, value in (float_fields or {}).items():
    writer.add_float32(key, value)
  for key, value in (string_fields or {}).items():
    writer.add_string(key, value)
  writer.add_string("tokenizer.ggml.model", tokenizer_model)
  writer.add_string("tokenizer.ggml.pre", "smollm")
  writer.add_array("tokenizer.ggml.tokens", TOKENS)
  writer.add_array("tokenizer.ggml.token_type", [3, 3, 3] + [1] * 253)
  writer.add_array("tokenizer.ggml.merges", list(merges))
  writer.add_bool("tokenizer.ggml.add_bos_token", False)
  writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)

  expected = {"layers": {}}

  def add(name, hf_rows, ours_transposed, heads=None):
    """hf_rows: [out, in] (or 1D); returns the dequantized weight."""
    stored = hf_rows if heads is None or not permute else llama_cpp_permute(
        hf_rows, heads)
    qtype = Q.F32 if hf_rows.ndim == 1 else matrix_type
    data = gguf.quants.quantize(np.ascontiguousarray(stored, np.float32),
                                qtype)
    if replace and name in replace:
      writer.add_tensor(name, np.asarray(replace[name], np.float32))
    else:
      writer.add_tensor(name, data, raw_dtype=qtype)
    back = gguf.quants.dequantize(data, qtype).reshape(hf_rows.shape)
    if heads is not None and permute:
      back = llama_cpp_unpermute(back, heads)
    return back.T if ours_transposed else back

  expected["embed_tokens"] = add("token_embd.weight", params["embed_tokens"],
                                 False)
  expected["final_norm"] = add("output_norm.weight", params["final_norm"],
                               False)
  if not c.tie_word_embeddings:
    expected["lm_head"] = add("output.weight", params["lm_head"].T, True)
  names = {"attn_norm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k",
           "v_proj": "attn_v", "o_proj": "attn_output", "mlp_norm": "ffn_norm",
           "gate_proj": "ffn_gate", "up_proj": "ffn_up",
           "down_proj": "ffn_down"}
  heads = {"q_proj": c.num_heads, "k_proj": c.num_kv_heads}
  for ours, theirs in names.items():
    per_layer = []
    for i in range(c.num_layers):
      weight = params["layers"][ours][i]
      is_norm = ours.endswith("norm")
      per_layer.append(add(f"blk.{i}.{theirs}.weight",
                           weight if is_norm else weight.T, not is_norm,
                           heads.get(ours)))
    expected["layers"][ours] = np.stack(per_layer)
  if rope_freqs is not None:
    writer.add_tensor("rope_freqs.weight", rope_freqs)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return expected


# The types gguf can quantize as well as dequantize; every other type it
# dequantizes is covered by random blocks in tests/test_gguf_quant_types.py.
MATRIX_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]


def _weight_error(expected, params):
  """Relative error of the stored matrices against the source weights."""
  pairs = [(expected["layers"][n], params["layers"][n])
           for n in expected["layers"] if not n.endswith("norm")]
  pairs.append((expected["embed_tokens"], params["embed_tokens"]))
  num = sum(np.sum((a - b) ** 2.0) for a, b in pairs)
  den = sum(np.sum(b ** 2.0) for _, b in pairs)
  return float(np.sqrt(num / den))


@pytest.mark.parametrize("matrix_type, tied", (
    [(t, False) for t in MATRIX_TYPES] + [(Q.F32, True), (Q.Q4_1, True)]),
    ids=lambda v: v.name if isinstance(v, Q) else ("tied" if v else "untied"))
def test_gguf_round_trip(tmp_path, matrix_type, tied):
  config, params = _source(tied)
  path = tmp_path / "tiny.gguf"
  expected = write_llama_gguf(path, config, params, matrix_type)
  loaded_config, model, metadata = load_gguf(path)
  # The file stores rms_norm_eps as float32.
  assert loaded_config.rms_norm_eps == pytest.approx(config.rms_norm_eps,
                                                     rel=1e-6)
  assert loaded_config.replace(rms_norm_eps=config.rms_norm_eps) == config
  loaded = nnx.to_pure_dict(split_model(model)[1])
  # The loader reproduces gguf's own dequantization, in HF row order.
  for name in ("embed_tokens", "final_norm") + (() if tied else ("lm_head",)):
    np.testing.assert_array_equal(loaded[name], expected[name], err_msg=name)
  for name, value in expected["layers"].items():
    np.testing.assert_array_equal(loaded["layers"][name], value, err_msg=name)
  ours = _logits(config, loaded)
  assert _rel(ours, _logits(config, expected)) < 1e-6
  # ... and that is the source model up to quantization error: in this
  # 2-layer random model the logits' relative error measured 3.4-3.9x the
  # weights' (F16 to Q4); a Q/K row-order mistake gives over 0.6.
  weight_error = _weight_error(expected, params)
  assert _rel(ours, _logits(config, params)) <= 5 * weight_error + 1e-6
  if matrix_type == Q.F32:
    assert weight_error == 0.0
  assert metadata.tokens == tuple(TOKENS)


def test_gguf_permutation_is_undone_not_ignored(tmp_path):
  config, params = _source(False)
  w = params["layers"]["q_proj"][0].T
  assert not np.array_equal(llama_cpp_permute(w, config.num_heads), w)
  np.testing.assert_array_equal(
      llama_cpp_unpermute(llama_cpp_permute(w, config.num_heads),
                          config.num_heads), w)
  # A file written without the permutation loads into a different model:
  # the loader does unpermute, and getting it wrong changes every position.
  write_llama_gguf(tmp_path / "raw.gguf", config, params, Q.F32,
                   permute=False)
  _, model, _ = load_gguf(tmp_path / "raw.gguf")
  wrong = _logits(config, nnx.to_pure_dict(split_model(model)[1]))
  assert _rel(wrong, _logits(config, params)) > 1e-2


def test_gguf_metadata_for_the_tokenizer(tmp_path):
  config, params = _source(True)
  write_llama_gguf(tmp_path / "m.gguf", config, params, Q.F32)
  md = read_gguf_metadata(tmp_path / "m.gguf")
  assert md.architecture == "llama"
  assert md.tokenizer_model == "gpt2" and md.tokenizer_pre == "smollm"
  assert md.tokens == tuple(TOKENS)
  assert md.merges == tuple(MERGES)
  assert md.token_types == tuple([3, 3, 3] + [1] * 253)
  assert (md.bos_token_id, md.eos_token_id) == (1, 2)
  assert md.add_bos_token is False
  assert md.chat_template == CHAT_TEMPLATE
  assert md.fields["llama.rope.freq_base"] == pytest.approx(10000.0)
  assert "tokenizer.ggml.tokens" not in md.fields
  everything = md.key_values()
  assert everything["tokenizer.ggml.tokens"] == TOKENS
  assert everything["tokenizer.ggml.merges"] == MERGES
  assert everything["tokenizer.chat_template"] == CHAT_TEMPLATE


@pytest.mark.parametrize("head_dim", [16, 64])
def test_gguf_llama3_rope_freqs_become_scaling(tmp_path, head_dim):
  config, params = _source(False, scaling=True)
  if head_dim != 64:
    config = config.replace(head_dim=16, num_heads=4, num_kv_heads=2)
    params = _source(False)[1]
  freqs = _llama3_rope_freqs(config)
  assert 1.0 < freqs.max() and (freqs > 1.0).sum() >= 2  # scaling is active
  write_llama_gguf(tmp_path / "l3.gguf", config, params, Q.F32,
                   rope_freqs=freqs)
  loaded_config, _, _ = load_gguf(tmp_path / "l3.gguf")
  assert loaded_config.rope_scaling is not None
  np.testing.assert_allclose(loaded_config.rope.inv_frequencies(head_dim),
                             config.rope.inv_frequencies(head_dim),
                             rtol=1e-6)
  # Divisors that no Llama-3 rule produces are refused, not misread.
  bad = freqs.copy()
  bad[0] = 3.0
  write_llama_gguf(tmp_path / "bad.gguf", config, params, Q.F32,
                   rope_freqs=bad)
  with pytest.raises(ValueError, match="rope_freqs"):
    load_gguf(tmp_path / "bad.gguf")


def test_gguf_missing_file_and_wrong_architecture(tmp_path):
  with pytest.raises(FileNotFoundError):
    load_gguf(tmp_path / "nope.gguf")
  writer = gguf.GGUFWriter(os.fspath(tmp_path / "gpt2.gguf"), "gpt2")
  writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match="architecture"):
    load_gguf(tmp_path / "gpt2.gguf")


# --- HF safetensors ----------------------------------------------------------
def _hf_model(tied: bool, llama3: bool):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  kwargs = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, max_position_embeddings=4096,
                rms_norm_eps=1e-5, tie_word_embeddings=tied,
                # Weights near LeCun scale: attention far from uniform, so a
                # position error shows in the logits.
                initializer_range=0.125, bos_token_id=1, eos_token_id=2)
  if llama3:
    kwargs.update(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=64))
  torch.manual_seed(0)
  model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kwargs))
  with torch.no_grad():
    for name, param in model.named_parameters():
      if name.endswith("norm.weight"):
        param.copy_(1 + 0.3 * torch.randn_like(param))
  return model.eval()


def _torch_logits(model, tokens):
  import torch
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


@pytest.mark.parametrize("tied, llama3, shard", [
    (False, True, None), (True, False, None), (False, False, "40KB")],
    ids=["llama3-rope", "tied", "sharded"])
def test_safetensors_round_trip(tmp_path, tied, llama3, shard):
  hf = _hf_model(tied, llama3)
  kwargs = {"max_shard_size": shard} if shard else {}
  hf.save_pretrained(tmp_path, safe_serialization=True, **kwargs)
  if shard:
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
  config, model = load_safetensors(tmp_path, dtype=jnp.float32)
  assert config.tie_word_embeddings == tied
  assert (config.rope_scaling is not None) == llama3
  tokens = np.random.default_rng(1).integers(0, 256, (2, 40))
  ours = dense_forward(model, jnp.asarray(tokens, jnp.int32),
                       jnp.broadcast_to(jnp.arange(40), (2, 40)),
                       causal_mask(2, 40))
  assert _rel(ours, _torch_logits(hf, tokens)) < 1e-4


def test_model_safetensors_wins_over_a_stale_index(tmp_path):
  """An unsharded save over a sharded one leaves the old index (and here its
  shards) beside model.safetensors; transformers loads model.safetensors,
  and so must we, not the old shards the index names."""
  import torch
  old = _hf_model(False, False)
  old.save_pretrained(tmp_path, safe_serialization=True,
                      max_shard_size="40KB")
  new = _hf_model(False, False)
  with torch.no_grad():
    for param in new.parameters():
      param.mul_(1.5)
  other = tmp_path / "other"
  new.save_pretrained(other, safe_serialization=True)
  (other / "model.safetensors").rename(tmp_path / "model.safetensors")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  _, model = load_safetensors(tmp_path, dtype=jnp.float32)
  tokens = np.random.default_rng(1).integers(0, 256, (1, 24))
  ours = dense_forward(model, jnp.asarray(tokens, jnp.int32),
                       jnp.arange(24)[None], causal_mask(1, 24))
  assert _rel(ours, _torch_logits(new, tokens)) < 1e-4


def test_safetensors_bfloat16_checkpoint(tmp_path):
  import torch
  hf = _hf_model(False, False).to(torch.bfloat16)
  hf.save_pretrained(tmp_path, safe_serialization=True)
  _, model = load_safetensors(tmp_path, dtype=jnp.float32)
  ours = nnx.to_pure_dict(split_model(model)[1])
  theirs = hf.model.layers[1].self_attn.k_proj.weight.detach().float().numpy()
  np.testing.assert_array_equal(ours["layers"]["k_proj"][1], theirs.T)
  _, model16 = load_safetensors(tmp_path, dtype=jnp.bfloat16)
  assert model16.embed_tokens[...].dtype == jnp.bfloat16


def test_config_from_hf_both_rope_spellings():
  base = dict(model_type="llama", vocab_size=100, hidden_size=64,
              num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, intermediate_size=128,
              max_position_embeddings=2048, eos_token_id=[2, 3])
  scaling = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                 original_max_position_embeddings=1024)
  v4 = config_from_hf(dict(base, rope_theta=500000.0,
                           rope_scaling=dict(scaling, rope_type="llama3")))
  v5 = config_from_hf(dict(base, rope_parameters=dict(
      scaling, rope_type="llama3", rope_theta=500000.0)))
  assert v4 == v5
  assert v4.rope_scaling == Llama3RopeScaling(8.0, 1.0, 4.0, 1024)
  assert v4.head_dim == 16 and v4.eos_token_id == (2, 3)
  plain = config_from_hf(dict(base, rope_theta=10000.0))
  assert plain.rope_scaling is None and plain.rope_theta == 10000.0
  # Both spellings: as in transformers 5, a non-empty rope_scaling is taken
  # whole (theta too: without one there, the top-level one or 10000).
  both = config_from_hf(dict(
      base, rope_parameters=dict(rope_type="default", rope_theta=500000.0),
      rope_scaling=dict(scaling, rope_type="llama3")))
  assert both == v4.replace(rope_theta=10000.0)
  assert config_from_hf(dict(
      base, rope_parameters=dict(scaling, rope_type="llama3"),
      rope_scaling=dict(rope_type="default"))) == plain
  assert config_from_hf(dict(
      base, rope_scaling={}, rope_parameters=dict(
          scaling, rope_type="llama3", rope_theta=500000.0))) == v4
  with pytest.raises(ValueError, match="linear"):
    config_from_hf(dict(base, rope_parameters=dict(rope_type="default"),
                        rope_scaling=dict(type="linear", factor=2.0)))
  with pytest.raises(ValueError, match="linear"):
    config_from_hf(dict(base, rope_parameters=dict(scaling, rope_type="llama3"),
                        rope_scaling=dict(type="linear", factor=2.0)))
  with pytest.raises(ValueError, match="yarn"):
    config_from_hf(dict(base, rope_scaling=dict(rope_type="yarn", factor=4.0)))
  with pytest.raises(ValueError, match="attention_bias"):
    config_from_hf(dict(base, attention_bias=True))
  with pytest.raises(ValueError, match="num_hidden_layers"):
    config_from_hf({k: v for k, v in base.items() if k != "num_hidden_layers"})


def test_safetensors_errors(tmp_path):
  with pytest.raises(FileNotFoundError):
    load_safetensors(tmp_path / "missing")
  (tmp_path / "config.json").write_text(json.dumps(dict(
      model_type="llama", vocab_size=8, hidden_size=64, num_hidden_layers=1,
      num_attention_heads=4, intermediate_size=32)))
  with pytest.raises(FileNotFoundError, match="safetensors"):
    load_safetensors(tmp_path)


# --- bad model files: one typed error, naming the file and what is wrong -----
def test_gguf_head_count_not_dividing_hidden_size_is_named(tmp_path):
  config, params = _source(True)
  # 64 / 10 is not a head width; rope.dimension_count stays 16.
  write_llama_gguf(tmp_path / "heads.gguf", config, params, Q.F32,
                   uint_fields={"llama.attention.head_count": 10,
                                "llama.attention.head_count_kv": 10})
  with pytest.raises(ModelFormatError) as err:
    load_gguf(tmp_path / "heads.gguf")
  message = str(err.value)
  assert "not divisible" in message and "partial RoPE" not in message
  assert "64" in message and "10" in message and "heads.gguf" in message


def test_gguf_wrong_layer_tensor_shape_names_the_tensor(tmp_path):
  config, params = _source(False)
  # Layer 1's Q projection with 48 output rows instead of 4 heads x 16.
  write_llama_gguf(tmp_path / "shape.gguf", config, params, Q.F32,
                   replace={"blk.1.attn_q.weight": np.zeros((48, 64))})
  # Shapes as GGUF lists them: [in, out].
  with pytest.raises(ModelFormatError,
                     match=r"shape\.gguf.*'blk\.1\.attn_q\.weight' has shape "
                           r"\[64, 48\].*expected \[64, 64\]"):
    load_gguf(tmp_path / "shape.gguf")


@pytest.mark.parametrize("keep", [0, 6, 35, 200, 3000, "all but 100"])
def test_truncated_gguf_is_a_model_format_error(tmp_path, keep):
  config, params = _source(True)
  write_llama_gguf(tmp_path / "whole.gguf", config, params, Q.Q8_0)
  data = (tmp_path / "whole.gguf").read_bytes()
  keep = len(data) - 100 if keep == "all but 100" else keep
  path = tmp_path / "cut.gguf"
  path.write_bytes(data[:keep])
  for read in (load_gguf, read_gguf_metadata, LlamaTokenizer.from_gguf):
    with pytest.raises(ModelFormatError, match=r"cut\.gguf"):
      read(path)


def test_garbage_gguf_is_a_model_format_error(tmp_path):
  path = tmp_path / "garbage.gguf"
  path.write_bytes(np.random.default_rng(0).bytes(5000))
  with pytest.raises(ModelFormatError, match=r"garbage\.gguf.*not a readable"):
    load_gguf(path)
  # Right magic, garbage after it.
  path.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(5000))
  with pytest.raises(ModelFormatError, match=r"garbage\.gguf"):
    load_gguf(path)
  with pytest.raises(ModelFileNotFoundError):
    load_gguf(tmp_path / "nope.gguf")


def test_gguf_missing_layer_is_a_model_format_error(tmp_path):
  config, params = _source(True)
  write_llama_gguf(tmp_path / "layers.gguf", config, params, Q.F32,
                   uint_fields={"llama.block_count": 3})
  with pytest.raises(ModelFormatError, match=r"missing tensors.*blk\.2\."):
    load_gguf(tmp_path / "layers.gguf")


def test_safetensors_wrong_layer_tensor_shape_names_the_tensor(tmp_path):
  config, params = _source(False)
  write_hf_checkpoint(tmp_path / "good", config, params)
  loaded_config, model = load_safetensors(tmp_path / "good")
  assert loaded_config == config
  np.testing.assert_array_equal(
      nnx.to_pure_dict(split_model(model)[1])["layers"]["k_proj"],
      params["layers"]["k_proj"])
  name = "model.layers.1.self_attn.k_proj.weight"
  write_hf_checkpoint(tmp_path / "bad", config, params,
                      replace={name: np.zeros((24, 64))})
  with pytest.raises(ModelFormatError,
                     match=rf"bad.*'{name}' has shape \[24, 64\].*expected "
                           r"\[32, 64\]"):
    load_safetensors(tmp_path / "bad")


def test_only_model_safetensors_is_read_beside_other_files(tmp_path):
  """Without an index, model.safetensors is the model (as transformers
  reads it); an old copy beside it does not replace its tensors."""
  config, params = _source(False)
  write_hf_checkpoint(tmp_path / "old", config, params,
                      replace={"model.embed_tokens.weight": np.zeros(
                          params["embed_tokens"].shape, np.float32)})
  write_hf_checkpoint(tmp_path / "ckpt", config, params)
  (tmp_path / "old" / "model.safetensors").rename(
      tmp_path / "ckpt" / "model_old.safetensors")
  _, model = load_safetensors(tmp_path / "ckpt")
  np.testing.assert_array_equal(model.embed_tokens[...],
                                params["embed_tokens"])


def test_a_tied_checkpoint_may_store_its_output_matrix(tmp_path):
  """A tied model may store a copy of its embedding as lm_head.weight (as
  torch checkpoints do); a different matrix there is refused, since
  transformers 4 ignores it and transformers 5 unties the model for it."""
  from safetensors.numpy import load_file, save_file
  config, params = _source(True)
  write_hf_checkpoint(tmp_path, config, params)
  tensors = load_file(tmp_path / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, tmp_path / "model.safetensors")
  loaded_config, model = load_safetensors(tmp_path)
  assert loaded_config.tie_word_embeddings
  np.testing.assert_array_equal(_logits(loaded_config, nnx.to_pure_dict(
      split_model(model)[1])), _logits(config, params))
  tensors["lm_head.weight"] = np.zeros_like(tensors["lm_head.weight"])
  save_file(tensors, tmp_path / "model.safetensors")
  with pytest.raises(ModelFormatError, match="tie_word_embeddings=true.*"
                     "'lm_head.weight', which differs from "
                     "'model.embed_tokens.weight'"):
    load_safetensors(tmp_path)


def _broken_weights(directory, case):
  path = directory / "model.safetensors"
  data = path.read_bytes()
  if case == "garbage":
    path.write_bytes(np.random.default_rng(0).bytes(3000))
  elif case == "empty":
    path.write_bytes(b"")
  elif case == "truncated":
    path.write_bytes(data[:len(data) // 2])
  elif case == "bad header json":
    path.write_bytes(data[:8] + b"{" * (len(data) - 8))


@pytest.mark.parametrize("case", ["garbage", "empty", "truncated",
                                  "bad header json", "no config.json",
                                  "bad config.json", "gpt2 architecture",
                                  "missing tensor", "bad shard index",
                                  "weights file is a directory",
                                  "index names the wrong shard",
                                  "a tensor in two files"])
def test_bad_safetensors_directory_is_a_model_format_error(tmp_path, case):
  config, params = _source(True)
  directory = tmp_path / "ckpt"
  write_hf_checkpoint(directory, config, params)
  if case == "missing tensor":
    from safetensors.numpy import load_file, save_file
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, directory / "model.safetensors")
  _broken_weights(directory, case)
  if case == "no config.json":
    (directory / "config.json").unlink()
  elif case == "bad config.json":
    (directory / "config.json").write_text("{not json")
  elif case == "gpt2 architecture":
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(
        dict(hf, model_type="gpt2")))
  elif case == "bad shard index":
    (directory / "model.safetensors").rename(directory / "shard.safetensors")
    (directory / "model.safetensors.index.json").write_text('{"no": 1}')
  elif case == "weights file is a directory":
    (directory / "model.safetensors").unlink()
    (directory / "model.safetensors").mkdir()
  elif case == "index names the wrong shard":
    from safetensors.numpy import load_file, save_file
    (directory / "model.safetensors").rename(directory / "shard.safetensors")
    names = list(load_file(directory / "shard.safetensors"))
    save_file({"other": np.zeros(2, np.float32)}, directory / "x.safetensors")
    weight_map = {name: "shard.safetensors" for name in names}
    weight_map["model.embed_tokens.weight"] = "x.safetensors"
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": weight_map}))
  elif case == "a tensor in two files":
    (directory / "model.safetensors").rename(directory / "a.safetensors")
    (directory / "b.safetensors").write_bytes(
        (directory / "a.safetensors").read_bytes())
  with pytest.raises(ModelFormatError) as err:
    load_safetensors(directory)
  assert str(directory) in str(err.value)
  want = {"missing tensor": "up_proj", "gpt2 architecture": "gpt2",
          "no config.json": "config.json", "bad config.json": "JSON",
          "bad shard index": "weight_map",
          "index names the wrong shard": "embed_tokens",
          "a tensor in two files": "in both a.safetensors and b.safetensors",
          }.get(case, "model.safetensors")
  assert want in str(err.value), str(err.value)
  if case == "no config.json":
    assert isinstance(err.value, FileNotFoundError)
