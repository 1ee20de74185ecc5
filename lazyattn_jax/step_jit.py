"""How the engine's model steps are compiled: one jit per compile setting.

The model scans its decoder blocks over weights stacked on a layer axis.
On GPU, XLA's default Triton gemm fusions cannot read a layer's slice of
those stacked weights in place, so every step first copies each layer's
weight matrices (dynamic-slice memcpys that double the weights' memory
traffic; benchmarks/RESULTS.md, "The decode step").  Compiled with cuBLAS gemms and XLA's dynamic-slice fusion,
the gemm reads the slice where it lies and the copies go.

`StepJit` holds the two compiled forms of one step function and picks by
the platform the step runs on and `RunnerConfig.gpu_weights_in_place`; the
options are per compilation, so nothing else in the process changes.
"""

from __future__ import annotations

import jax

# XLA debug options of the GPU form (names as in XLA's DebugOptions).
GPU_WEIGHTS_IN_PLACE = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_dynamic_slice_fusion": True,
}
GPU_PLATFORMS = ("cuda", "rocm", "gpu")


class StepJit:
  """A step function jitted twice: as XLA compiles it by default, and with
  `GPU_WEIGHTS_IN_PLACE` for GPUs.

  Called directly (or `.lower`), it is the default form, as `jax.jit` of the
  function would be; `for_platform` picks the form a runner uses.
  """

  def __init__(self, fn, **jit_kwargs):
    self.default = jax.jit(fn, **jit_kwargs)
    self.gpu = jax.jit(fn, compiler_options=dict(GPU_WEIGHTS_IN_PLACE),
                       **jit_kwargs)
    self.__wrapped__ = fn
    self.__doc__ = fn.__doc__

  def for_platform(self, platform: str, weights_in_place: bool = True):
    """The form to run on `platform` ("cpu", "cuda", "tpu", ...)."""
    if weights_in_place and platform in GPU_PLATFORMS:
      return self.gpu
    return self.default

  def __call__(self, *args, **kwargs):
    return self.default(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self.default.lower(*args, **kwargs)

  def _cache_size(self) -> int:
    """Programs compiled by both forms."""
    return self.default._cache_size() + self.gpu._cache_size()


def step_jit(**jit_kwargs):
  """Decorator: `StepJit(fn, **jit_kwargs)`."""
  return lambda fn: StepJit(fn, **jit_kwargs)


def params_platform(params) -> str:
  """The platform of the devices holding a parameter pytree."""
  leaf = jax.tree_util.tree_leaves(params)[0]
  return next(iter(leaf.devices())).platform
