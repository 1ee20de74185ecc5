"""How the engine's model steps are compiled: one jit per compile setting.

The model scans its decoder blocks over weights stacked on a layer axis.
On GPU, XLA's default Triton gemm fusions cannot read a layer's slice of
those stacked weights in place, so every step first copies each layer's
weight matrices (dynamic-slice memcpys that double the weights' memory
traffic; benchmarks/RESULTS.md, "The decode step").  Compiled with cuBLAS
gemms and XLA's dynamic-slice fusion, the gemm reads the slice where it
lies and the copies go.

`StepJit` holds the compiled forms of one step function (one per set of
XLA options) and picks by the platform the step runs on and the runner's
settings (`RunnerConfig.gpu_weights_in_place`, `gpu_xla_options`); the
options are per compilation, so nothing else in the process changes.

A step may add options of its own to that GPU form.  The decode loop turns
off XLA's dot merger: it joins each layer's Q, K and V projections into one
gemm by concatenating their weights, which a decode step of a few rows pays
for on every step (a copy of the three matrices), while a prefill's large
gemms gain from it.
"""

from __future__ import annotations

import jax

# XLA debug options of the GPU form (names as in XLA's DebugOptions).
GPU_WEIGHTS_IN_PLACE = {
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_enable_dynamic_slice_fusion": True,
}
GPU_PLATFORMS = ("cuda", "rocm", "gpu")
# Added to the decode loop's GPU form (see the module docstring).
DECODE_GPU_OPTIONS = {"xla_gpu_dot_merger_threshold_mb": 0}


class StepJit:
  """A step function jitted once per set of XLA compile options: none (as
  XLA compiles it by default), `GPU_WEIGHTS_IN_PLACE` for GPUs with the
  step's own `gpu_options`, and any extra GPU options a runner asks for
  (`RunnerConfig.gpu_xla_options`).

  Called directly (or `.lower`), it is the default form, as `jax.jit` of the
  function would be; `for_platform` picks the form a runner uses.
  """

  def __init__(self, fn, gpu_options=(), **jit_kwargs):
    self._fn = fn
    self.gpu_options = tuple(sorted(dict(gpu_options).items()))
    self._jit_kwargs = jit_kwargs
    self._forms = {(): jax.jit(fn, **jit_kwargs)}
    self.__wrapped__ = fn
    self.__doc__ = fn.__doc__

  @property
  def default(self):
    return self._forms[()]

  @property
  def gpu(self):
    """The GPU form with no runner options."""
    return self.for_platform("gpu")

  def form(self, options):
    """The jit compiled with these (name, value) XLA options."""
    key = tuple(sorted(dict(options).items()))
    if key not in self._forms:
      self._forms[key] = jax.jit(self._fn, compiler_options=dict(key),
                                 **self._jit_kwargs)
    return self._forms[key]

  def for_platform(self, platform: str, weights_in_place: bool = True,
                   gpu_options=()):
    """The form to run on `platform` (`compile_options`)."""
    return self.form(compile_options(platform, weights_in_place,
                                     gpu_options, self.gpu_options))

  def __call__(self, *args, **kwargs):
    return self.default(*args, **kwargs)

  def lower(self, *args, **kwargs):
    return self.default.lower(*args, **kwargs)

  def _cache_size(self) -> int:
    """Programs compiled by every form."""
    return sum(f._cache_size() for f in self._forms.values())


def compile_options(platform: str, weights_in_place: bool = True,
                    gpu_options=(), step_options=()) -> tuple:
  """The XLA options, as sorted (name, value) pairs, of a step on
  `platform` ("cpu", "cuda", "tpu", ...).  None off GPU.  On GPU: the
  weights-in-place options and the step's own `step_options` (both left
  out when `weights_in_place` is off; the step's options were measured in
  that form), then the runner's `gpu_options`, which add to and override
  them."""
  if platform not in GPU_PLATFORMS:
    return ()
  base = ({**GPU_WEIGHTS_IN_PLACE, **dict(step_options)} if weights_in_place
          else {})
  return tuple(sorted({**base, **dict(gpu_options)}.items()))


def step_jit(gpu_options=(), **jit_kwargs):
  """Decorator: `StepJit(fn, gpu_options, **jit_kwargs)`."""
  return lambda fn: StepJit(fn, gpu_options, **jit_kwargs)


def params_platform(params) -> str:
  """The platform of the devices holding a parameter pytree."""
  leaf = jax.tree_util.tree_leaves(params)[0]
  return next(iter(leaf.devices())).platform
