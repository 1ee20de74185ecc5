"""Engine settings: frozen configs, checked when made, routed by name."""

from __future__ import annotations

import dataclasses

import pytest

from lazyattn_jax.config import RunnerConfig, SchedulerConfig, split_settings
from lazyattn_jax.engine import LazyEngine
from tests.test_engine import make_engine, model_and_config  # noqa: F401


@pytest.mark.parametrize("config,fields,match", [
    (SchedulerConfig, dict(max_batch=0), "max_batch"),
    (SchedulerConfig, dict(decode_steps=True), "decode_steps"),
    (SchedulerConfig, dict(max_prefill_tokens=1.5), "max_prefill_tokens"),
    (SchedulerConfig, dict(first_token_group_tokens=0),
     "first_token_group_tokens"),
    (SchedulerConfig, dict(prefill_tokens_per_step=-3),
     "prefill_tokens_per_step"),
    (RunnerConfig, dict(impl="bogus"), "impl must be one of"),
    (RunnerConfig, dict(pool_as_bits=1), "pool_as_bits"),
    (RunnerConfig, dict(decode_layer_unroll=0), "decode_layer_unroll"),
])
def test_bad_settings_are_refused_when_made(config, fields, match):
  with pytest.raises(ValueError, match=match):
    config(**fields)


def test_configs_are_frozen_and_hashable():
  config = SchedulerConfig()
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.max_batch = 3
  assert hash(config) == hash(SchedulerConfig())
  assert SchedulerConfig(first_token_group_tokens=None).group_tokens == 8192


def test_interactive_settings_and_their_overrides():
  from lazyattn_jax.config import INTERACTIVE_SETTINGS
  config = SchedulerConfig.interactive()
  assert config.decode_during_prefill and config.decode_loops_to_first_finish
  assert (config.max_prefill_tokens, config.group_tokens,
          config.prefill_chunk_tokens) == (1024, 4096, 1024)
  assert config == SchedulerConfig(**INTERACTIVE_SETTINGS)
  assert not SchedulerConfig().decode_during_prefill  # plain by default
  mine = SchedulerConfig.interactive(decode_during_prefill=False,
                                     max_batch=4)
  assert (mine.decode_during_prefill, mine.max_batch,
          mine.max_prefill_tokens) == (False, 4, 1024)
  with pytest.raises(ValueError, match="max_prefill_tokens must be an int"):
    SchedulerConfig.interactive(max_prefill_tokens=0)
  with pytest.raises(TypeError, match="no_such_field"):
    SchedulerConfig.interactive(no_such_field=1)
  with pytest.raises(TypeError):  # read-only, so no engine changes it
    INTERACTIVE_SETTINGS["max_prefill_tokens"] = 1


def test_split_settings_routes_each_setting_to_its_config():
  scheduler, runner = split_settings(None, RunnerConfig(pool_as_bits=True),
                                     dict(max_batch=3, impl="xla"))
  assert scheduler == SchedulerConfig(max_batch=3)
  assert runner == RunnerConfig(impl="xla", pool_as_bits=True)
  with pytest.raises(TypeError, match=r"unknown engine settings \['max_bach'\]"):
    split_settings(None, None, dict(max_bach=3))


def test_from_pretrained_checks_settings_before_loading():
  # A bad setting fails at once, without fetching or loading any model.
  with pytest.raises(ValueError, match="impl must be one of"):
    LazyEngine.from_pretrained("/does/not/exist.gguf", impl="bogus")
  with pytest.raises(ValueError, match="mode must be one of"):
    LazyEngine.from_pretrained("/does/not/exist.gguf", mode="lazzy")
  with pytest.raises(TypeError, match="unknown engine settings") as info:
    LazyEngine.from_pretrained("/does/not/exist.gguf", max_bach=2)
  # The list of known settings holds every keyword it takes, the answer-
  # quality fields included (they were left out).
  for name in ("max_batch", "impl", "preamble", "sink", "recompute",
               "recompute_tokens"):
    assert f"'{name}'" in str(info.value)


def test_a_cache_that_does_not_match_the_model_is_refused(model_and_config):
  model, config, _ = model_and_config
  engine = make_engine(model_and_config)
  cache = dataclasses.replace(engine.cache_config, head_dim=8)
  with pytest.raises(ValueError, match=r"cache_config.head_dim=8 \(the model's "
                                       r"is 16\)"):
    LazyEngine(config, model, cache)
