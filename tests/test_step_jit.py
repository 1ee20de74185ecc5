"""The engine's steps compile in two forms; a runner picks by platform."""

import jax
import jax.numpy as jnp
import pytest

from lazyattn_jax.config import RunnerConfig
from lazyattn_jax.step_jit import GPU_WEIGHTS_IN_PLACE, StepJit


def _layers_matmul(w, x):
  def body(x, w_l):
    return jnp.tanh(x @ w_l), None
  return jax.lax.scan(body, x, w)[0]


def test_forms_by_platform_and_setting():
  step = StepJit(_layers_matmul)
  assert step.for_platform("cuda") is step.gpu
  assert step.for_platform("rocm") is step.gpu
  assert step.for_platform("cpu") is step.default
  assert step.for_platform("tpu") is step.default
  assert step.for_platform("cuda", weights_in_place=False) is step.default


def test_both_forms_compute_the_same_and_count_their_programs():
  # The GPU form's options are XLA debug options: they compile on CPU too.
  step = StepJit(_layers_matmul)
  w = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8)) * 0.3
  x = jnp.ones((2, 8))
  before = step._cache_size()
  a, b = step.default(w, x), step.gpu(w, x)
  assert step._cache_size() == before + 2
  assert jnp.allclose(a, b)
  assert jnp.allclose(step(w, x), a)
  assert set(GPU_WEIGHTS_IN_PLACE) == {"xla_gpu_enable_triton_gemm",
                                       "xla_gpu_enable_dynamic_slice_fusion"}


def test_the_runner_setting_must_be_a_bool():
  with pytest.raises(ValueError, match="gpu_weights_in_place must be a bool"):
    RunnerConfig(gpu_weights_in_place="yes")


def test_a_cpu_runner_runs_the_default_form():
  from flax import nnx
  from lazyattn_jax.model_runner import ModelRunner, _decode_loop
  from models.config import LlamaConfig
  from models.llama import Llama
  model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  runner = ModelRunner(model, RunnerConfig(), num_pages=4, page_size=8)
  assert runner.platform == "cpu"
  assert runner.compiled_form(_decode_loop) is _decode_loop.default
