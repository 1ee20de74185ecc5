"""The engine's steps compile in two forms; a runner picks by platform."""

import jax
import jax.numpy as jnp
import pytest

from lazyattn_jax.config import RunnerConfig
from lazyattn_jax.step_jit import (DECODE_GPU_OPTIONS, GPU_WEIGHTS_IN_PLACE,
                                   StepJit, compile_options)


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


def test_compile_options_per_platform():
  assert compile_options("cpu", gpu_options=(("x", 1),)) == ()
  assert compile_options("gpu") == tuple(sorted(GPU_WEIGHTS_IN_PLACE.items()))
  assert compile_options("cuda", False, (("b", 2), ("a", 1))) == (("a", 1),
                                                                  ("b", 2))


def test_a_steps_own_gpu_options_join_the_in_place_form_only():
  own = (("xla_gpu_dot_merger_threshold_mb", 0),)
  step = StepJit(_layers_matmul, gpu_options=dict(own))
  in_place = tuple(sorted({**GPU_WEIGHTS_IN_PLACE, **dict(own)}.items()))
  assert step.gpu is step.form(in_place)
  assert step.for_platform("cuda") is step.gpu
  assert step.for_platform("cpu") is step.default
  # They were measured in the weights-in-place form: not added without it.
  assert step.for_platform("cuda", weights_in_place=False) is step.default
  # The runner's options still override them.
  assert compile_options("cuda", True,
                         (("xla_gpu_dot_merger_threshold_mb", 8),), own) == \
      tuple(sorted({**GPU_WEIGHTS_IN_PLACE,
                    "xla_gpu_dot_merger_threshold_mb": 8}.items()))


def test_the_decode_loop_alone_turns_the_dot_merger_off_on_gpu():
  from lazyattn_jax.mixed_step import _mixed_step
  from lazyattn_jax.model_runner import _decode_loop, _prefill_step
  assert dict(_decode_loop.gpu_options) == DECODE_GPU_OPTIONS
  assert _prefill_step.gpu_options == () and _mixed_step.gpu_options == ()
  assert _decode_loop.for_platform("cuda") is not _prefill_step.for_platform(
      "cuda")


def test_both_forms_compute_the_same_and_count_their_programs():
  # The GPU form's options are XLA debug options: they compile on CPU too.
  # A function of its own: jit's program cache is per function, and other
  # tests on this worker may have compiled _layers_matmul already.
  def own_matmul(w, x):
    return _layers_matmul(w, x)
  step = StepJit(own_matmul)
  w = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8)) * 0.3
  x = jnp.ones((2, 8))
  before = step._cache_size()
  a, b = step.default(w, x), step.gpu(w, x)
  assert step._cache_size() == before + 2
  assert jnp.allclose(a, b)
  assert jnp.allclose(step(w, x), a)
  assert set(GPU_WEIGHTS_IN_PLACE) == {"xla_gpu_enable_triton_gemm",
                                       "xla_gpu_enable_dynamic_slice_fusion"}


def test_extra_gpu_options_add_to_and_override_the_in_place_ones():
  step = StepJit(_layers_matmul)
  merged = step.for_platform("cuda", gpu_options=(
      ("xla_gpu_dot_merger_threshold_mb", 0),))
  assert merged is step.form({**GPU_WEIGHTS_IN_PLACE,
                              "xla_gpu_dot_merger_threshold_mb": 0}.items())
  assert merged not in (step.gpu, step.default)
  override = step.for_platform("cuda", gpu_options=(
      ("xla_gpu_enable_triton_gemm", True),))
  assert override is step.form((("xla_gpu_enable_triton_gemm", True),
                                ("xla_gpu_enable_dynamic_slice_fusion", True)))
  # Off GPU the extra options are ignored.
  assert step.for_platform("cpu", gpu_options=(("x", 1),)) is step.default
  w = jax.random.normal(jax.random.PRNGKey(0), (3, 8, 8)) * 0.3
  assert jnp.allclose(merged(w, jnp.ones((2, 8))),
                      step.default(w, jnp.ones((2, 8))))


def test_an_unknown_option_fails_the_compile():
  step = StepJit(_layers_matmul)
  with pytest.raises(Exception, match="No such compile option"):
    step.form((("xla_no_such_option", 1),))(jnp.ones((1, 2, 2)),
                                              jnp.ones((1, 2)))


@pytest.mark.parametrize("fields,match", [
    (dict(gpu_weights_in_place="yes"), "gpu_weights_in_place must be a bool"),
    (dict(gpu_xla_options={"a": 1}), "gpu_xla_options must be a tuple"),
    (dict(gpu_xla_options=(("a",),)), "gpu_xla_options must be a tuple"),
    (dict(gpu_xla_options=((1, 2),)), "gpu_xla_options must be a tuple"),
    (dict(gpu_xla_options=(("a", [1]),)), "gpu_xla_options must be a tuple"),
])
def test_bad_runner_settings_are_refused(fields, match):
  with pytest.raises(ValueError, match=match):
    RunnerConfig(**fields)


@pytest.mark.parametrize("text,want", [
    ("xla_gpu_dot_merger_threshold_mb=0", ("xla_gpu_dot_merger_threshold_mb", 0)),
    ("a=true", ("a", True)), ("a=False", ("a", False)), ("a=0.5", ("a", 0.5)),
    ("a=fast", ("a", "fast")),
])
def test_rag_serving_reads_xla_options(text, want):
  from benchmarks.rag_serving import parse_args
  assert parse_args(["--gpu-xla-option", text]).gpu_xla_option == [want]


def test_rag_serving_refuses_an_option_without_a_value(capsys):
  from benchmarks.rag_serving import parse_args
  with pytest.raises(SystemExit):
    parse_args(["--gpu-xla-option", "novalue"])
  assert "expected NAME=VALUE" in capsys.readouterr().err


def test_a_cpu_runner_runs_the_default_form():
  from flax import nnx
  from lazyattn_jax.model_runner import ModelRunner, _decode_loop
  from models.config import LlamaConfig
  from models.llama import Llama
  model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  runner = ModelRunner(model, RunnerConfig(), num_pages=4, page_size=8)
  assert runner.platform == "cpu"
  assert runner.compiled_form(_decode_loop) is _decode_loop.default


def test_a_gpu_runner_picks_each_steps_gpu_form(monkeypatch):
  """Without a GPU: a runner whose weights were on one picks, per step, the
  form `for_platform` gives (the decode loop's own options included)."""
  from flax import nnx
  from lazyattn_jax.model_runner import ModelRunner, _decode_loop, _prefill_step
  from models.config import LlamaConfig
  from models.llama import Llama
  model = Llama(LlamaConfig.tiny(), rngs=nnx.Rngs(0))
  extra = (("xla_gpu_autotune_level", 0),)
  runner = ModelRunner(model, RunnerConfig(gpu_xla_options=extra),
                       num_pages=4, page_size=8)
  monkeypatch.setattr(runner, "platform", "cuda")
  for step in (_decode_loop, _prefill_step):
    want = step.form(compile_options("cuda", True, extra, step.gpu_options))
    assert runner.compiled_form(step) is want
  decode = dict(compile_options("cuda", True, extra, _decode_loop.gpu_options))
  assert decode["xla_gpu_dot_merger_threshold_mb"] == 0


@pytest.mark.gpu
def test_on_a_gpu_both_forms_generate_the_same_tokens():
  """The engine on a GPU runs the weights-in-place form by default, and it
  generates what the default (Triton gemm) form does."""
  import dataclasses
  import numpy as np
  from flax import nnx
  from lazyattn_jax.model_runner import _decode_loop
  from lazyattn_jax.sampling import SamplingParams
  from models.config import LlamaConfig
  from models.llama import Llama
  from tests.test_engine import make_engine
  config = dataclasses.replace(LlamaConfig.tiny(), max_position=512)
  model_and_config = (Llama(config, rngs=nnx.Rngs(0)), config, "gpu")
  rng = np.random.default_rng(3)
  docs = [rng.integers(1, config.vocab_size, n).tolist() for n in (9, 14)]
  query = rng.integers(1, config.vocab_size, 6).tolist()
  sampling = SamplingParams(max_new_tokens=12, stop_token_ids=())
  results = {}
  for in_place in (True, False):
    engine = make_engine(model_and_config, gpu_weights_in_place=in_place)
    form = engine.runner.compiled_form(_decode_loop)
    assert form is (_decode_loop.gpu if in_place else _decode_loop.default)
    results[in_place] = engine.generate(query, docs, sampling)
    engine.close()
  a, b = results[True], results[False]
  assert a.token_ids == b.token_ids
  rel = (np.linalg.norm(a.first_logits - b.first_logits) /
         np.linalg.norm(b.first_logits))
  assert rel < 1e-4, rel
