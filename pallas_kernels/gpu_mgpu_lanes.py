"""What the Mosaic GPU plan kernels (gpu_prefill_plan_kernel.py,
gpu_decode_plan_kernel.py) share: one warpgroup a CTA in Lane semantics
(scalar code per thread, arrays of one value a lane), launched so that the
attention kernel after them may start while they run.  Design:
docs/kernels.md.
"""

from __future__ import annotations

from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.gpu_mgpu_parts import interpreter_params

LANES = 128  # one warpgroup: one value a thread


def lanes_cast(interpret: bool):
  """x -> x laid out one value a lane (WG_STRIDED over the 128 threads), the
  layout the kernels' loads and reductions assume; the identity in the
  interpreter, which has no layouts."""
  if interpret:
    return lambda x: x
  layout = plgpu.Layout.WG_STRIDED((LANES,), vec_size=1)
  return lambda x: plgpu.layout_cast(x, layout)


def wants_plan_kernel(plan_in_kernel: bool | None, interpret: bool) -> bool:
  """A block-size setting's `plan_in_kernel`: None (the default) takes the
  plan kernel on the GPU and not when interpreting (the interpreted kernel
  is slow); True / False force it."""
  return (not interpret) if plan_in_kernel is None else plan_in_kernel


def start_plan_grid(*, dependent_launch: bool, interpret: bool):
  """At a plan kernel's start, with `dependent_launch`: the attention kernel
  after it may launch now (it waits for this grid before reading), and this
  grid waits for the one before it before any read."""
  if dependent_launch and not interpret:
    plgpu.griddepcontrol_launch_dependents()
    plgpu.griddepcontrol_wait()


def lane_kernel(body, *, out_type, grid, grid_names, interpret: bool):
  """`plgpu.kernel` of one warpgroup a CTA in Lane semantics (jax 0.10's
  default; 0.11 defaults to Warpgroup semantics, under which a select with
  a scalar predicate and a boolean vector's conversion to int32 do not
  lower); in the Mosaic GPU interpreter with `interpret`."""
  return plgpu.kernel(
      body, out_type=out_type, grid=grid, grid_names=grid_names,
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Lane),
      **({"interpret": interpreter_params()} if interpret else {}))
