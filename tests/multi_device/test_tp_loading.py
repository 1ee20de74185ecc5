"""Loading with tensor_parallel=N: every tensor reaches the devices as its
shards, each parameter ends up with its Megatron PartitionSpec, KV heads are
repeated where they are replicated, the pool is split over KV heads, and
random weights are made on their devices."""

from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import models.weights
from lazyattn_jax.engine import LazyEngine
from lazyattn_jax.sharding import random_model, tensor_parallel_for
from models.config import LlamaConfig
from models.llama import Llama
from tests.hf_fixtures import write_hf_checkpoint
from tests.multi_device import needs_devices

T = "tp"
# The rules, written out here rather than taken from models.sharding.
EXPECTED = {
    "embed_tokens": P(T, None), "final_norm": P(), "lm_head": P(None, T),
    "layers": {"attn_norm": P(), "mlp_norm": P(),
               "q_proj": P(None, None, T), "k_proj": P(None, None, T),
               "v_proj": P(None, None, T), "o_proj": P(None, T, None),
               "gate_proj": P(None, None, T), "up_proj": P(None, None, T),
               "down_proj": P(None, T, None), "q_bias": P(None, T),
               "k_bias": P(None, T), "v_bias": P(None, T), "q_norm": P(),
               "k_norm": P()}}
SETTINGS = dict(num_pages=20, page_size=4, max_batch=2, decode_steps=4,
                progress=False)


def _checkpoint(tmp_path, config, model_type="llama", seed=0):
  params = nnx.to_pure_dict(nnx.state(Llama(config, rngs=nnx.Rngs(seed)),
                                      nnx.Param))
  params = jax.tree_util.tree_map(np.asarray, params)
  directory = tmp_path / model_type
  write_hf_checkpoint(directory, config, params)
  hf = json.loads((directory / "config.json").read_text())
  (directory / "config.json").write_text(json.dumps(dict(
      hf, model_type=model_type)))
  return directory, params


@pytest.fixture
def shard_watch(monkeypatch):
  """Records the sharding of every array the loader writes into a layer
  stack, and of every stack, as they go by."""
  seen = []
  write = models.weights._write_layer

  def watched(stack, layer, value, transpose):
    seen.append((stack.sharding, getattr(value, "sharding", None)))
    return write(stack, layer, value, transpose=transpose)

  monkeypatch.setattr(models.weights, "_write_layer", watched)
  return seen


def _generate(engine, config):
  rng = np.random.default_rng(5)
  docs = [rng.integers(1, config.vocab_size, n).tolist() for n in (9, 6)]
  return engine.generate(rng.integers(1, config.vocab_size, 4).tolist(), docs,
                         max_new_tokens=4, temperature=0.0, stop_token_ids=())


def test_safetensors_loads_into_shards(tmp_path, shard_watch, engine_impl):
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, max_position=512)
  directory, params = _checkpoint(tmp_path, config)
  engine = LazyEngine.from_pretrained(str(directory), tensor_parallel=2,
                                      impl=engine_impl, **SETTINGS)
  mesh = engine.tensor_parallel.mesh
  assert mesh.size == 2 and engine.tensor_parallel.kv_replicas == 1
  # Every layer tensor arrived split over both devices (a stack and a
  # tensor never whole on one device), replicated ones on both.
  assert shard_watch and all(
      len(x.device_set) == 2 for pair in shard_watch for x in pair)
  shard_watch.clear()
  loaded = nnx.to_pure_dict(engine.runner.params)

  def check(name, array, spec, want):
    assert array.sharding.spec == spec, name
    assert array.sharding.mesh == mesh, name
    np.testing.assert_array_equal(np.asarray(array), want, err_msg=name)

  for name in ("embed_tokens", "final_norm", "lm_head"):
    check(name, loaded[name], EXPECTED[name], params[name])
  for name, array in loaded["layers"].items():
    check(name, array, EXPECTED["layers"][name], params["layers"][name])
  # The pool: K = 4 heads, 2 per device, every page of every layer.
  k = engine.state.k
  assert k.sharding.spec == P(T)
  assert {s.data.shape for s in k.addressable_shards} == {
      (2,) + k.shape[1:]}
  memory = engine.memory
  assert memory["weights_bytes_per_device"] < memory["weights_bytes"]
  one = LazyEngine.from_pretrained(str(directory), impl=engine_impl,
                                   **SETTINGS)
  got, want = _generate(engine, config), _generate(one, config)
  assert got.token_ids == want.token_ids


def test_qwen2_with_fewer_kv_heads_than_devices(tmp_path, engine_impl):
  """Qwen2 (Q/K/V biases), 2 KV heads on 4 devices: each KV head and its
  bias are loaded twice, one copy per device; answers are one device's."""
  needs_devices(4)
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=2, max_position=512,
                            attention_bias=True)
  directory, params = _checkpoint(tmp_path, config, "qwen2", seed=3)
  engine = LazyEngine.from_pretrained(str(directory), tensor_parallel=4,
                                      impl=engine_impl, **SETTINGS)
  assert engine.tensor_parallel.kv_replicas == 2
  assert engine.cache_config.num_kv_heads == 4
  assert engine.config.num_kv_heads == 2  # the checkpoint's model
  layers = nnx.to_pure_dict(engine.runner.params)["layers"]
  head = config.head_dim
  for name, axis in (("k_proj", 2), ("v_proj", 2), ("k_bias", 1),
                     ("v_bias", 1)):
    assert layers[name].sharding.spec == EXPECTED["layers"][name]
    stored = params["layers"][name]
    heads = stored.reshape(stored.shape[:axis] + (2, head))
    want = np.repeat(heads, 2, axis=axis).reshape(
        stored.shape[:axis] + (4 * head,))
    np.testing.assert_array_equal(np.asarray(layers[name]), want)
  one = LazyEngine.from_pretrained(str(directory), impl=engine_impl,
                                   **SETTINGS)
  got, want = _generate(engine, config), _generate(one, config)
  assert got.token_ids == want.token_ids
  np.testing.assert_allclose(got.first_logits, want.first_logits, rtol=1e-4,
                             atol=1e-4)


def test_random_weights_are_made_on_their_devices():
  """The benchmark's random model: each parameter drawn straight into its
  shards, the same values at any device count."""
  needs_devices(4)
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=2, max_position=512)
  one = nnx.to_pure_dict(nnx.state(random_model(
      config, None, dtype="float32", seed=4), nnx.Param))
  tp = tensor_parallel_for(config, tensor_parallel=4)
  four = nnx.to_pure_dict(nnx.state(random_model(
      config, tp, dtype="float32", seed=4), nnx.Param))
  np.testing.assert_array_equal(np.asarray(four["embed_tokens"]),
                                np.asarray(one["embed_tokens"]))
  assert four["embed_tokens"].sharding.spec == EXPECTED["embed_tokens"]
  for name, array in four["layers"].items():
    assert array.sharding.spec == EXPECTED["layers"][name], name
    want = np.asarray(one["layers"][name])
    if name in ("k_proj", "v_proj"):  # 2 KV heads, each on 2 devices
      want = np.repeat(want.reshape(want.shape[:2] + (2, -1)), 2,
                       axis=2).reshape(array.shape)
    np.testing.assert_array_equal(np.asarray(array), want, err_msg=name)
