"""Timing of GPU kernel calls for the kernel benchmarks (benchmarks/kernels.py,
benchmarks/mgpu_prefill_check.py): chained calls in one jitted step, and
the perturbations that chain them."""

from __future__ import annotations

import math
import statistics
import time

import jax
import jax.numpy as jnp


# Seconds each sample first runs its own calls untimed (ChainTimer.sample):
# the H200 runs the attention kernels at its power cap, where the clock
# follows the power of the last tens of milliseconds of work
# (benchmarks/RESULTS.md, "The power cap and the order of samples").
SETTLE_S = 0.3


class ChainTimer:
  """Times fn(*args) per call, cycling over arg_sets; compiles once.

  perturb(args, zero) returns args made to depend on `zero`, an f32 scalar
  that is 0 at run time but computed from the previous call's output.  One
  jitted step calls fn once per set; steps are dispatched asynchronously back
  to back (a step is >= ~0.1 ms of device work at every measured shape, well
  above the dispatch cost), then synchronised.
  """

  def __init__(self, fn, arg_sets, perturb, *, target_total_s=0.15):

    def step(zero, sets):
      for args in sets:
        leaves = jax.tree.leaves(fn(*perturb(args, zero)))
        # Every output kept alive, one summed: a row of several outputs
        # pays the reduction a row of one does.
        used = jnp.sum(leaves[0].astype(jnp.float32)) + sum(
            leaf.ravel()[0].astype(jnp.float32) for leaf in leaves[1:])
        zero = zero + jnp.float32(0) * used
      return zero

    self.arg_sets = arg_sets
    self.step = jax.jit(step)
    self.zero = jnp.float32(0)
    jax.block_until_ready(self.step(self.zero, arg_sets))  # compile, warm up
    start = time.perf_counter()
    jax.block_until_ready(self.step(self.zero, arg_sets))
    per_step = time.perf_counter() - start
    self.steps = max(3, math.ceil(target_total_s / per_step))
    self.timed_window = None

  def sample(self, settle_s: float = 0.0):
    """Seconds per call, from one synchronised run of `steps` steps.

    `settle_s` > 0 first runs whole chains untimed until that long has
    passed.  Under a power cap the GPU's clock follows the power the recent
    work drew, so a sample taken right after another kernel's runs at that
    kernel's clock for tens of milliseconds; settling times each call at
    its own.
    """
    start = time.perf_counter()
    while time.perf_counter() - start < settle_s:  # whole chains, synced
      zero = self.zero
      for _ in range(self.steps):
        zero = self.step(zero, self.arg_sets)
      jax.block_until_ready(zero)
    zero = self.zero
    start, window_start = time.perf_counter(), time.monotonic()
    for _ in range(self.steps):
      zero = self.step(zero, self.arg_sets)
    jax.block_until_ready(zero)
    seconds = time.perf_counter() - start
    # The timed stretch, in time.monotonic() seconds (gpu_clock_log).
    self.timed_window = (window_start, time.monotonic())
    return seconds / (self.steps * len(self.arg_sets))


def time_per_call(fn, arg_sets, perturb, *, repeats=5, settle_s=SETTLE_S):
  """Median seconds per call of fn over repeats, each sample settled first
  (see ChainTimer)."""
  timer = ChainTimer(fn, arg_sets, perturb)
  return statistics.median(timer.sample(settle_s=settle_s)
                           for _ in range(repeats))


def time_pair(fn_a, sets_a, fn_b, sets_b, perturb, *, rounds=7,
              settle_s=SETTLE_S):
  """Medians for two functions timed in alternation (A B A B ...), so slow
  drifts of clock or temperature hit both alike; each sample settled
  first, so each runs at its own clock."""
  timer_a = ChainTimer(fn_a, sets_a, perturb)
  timer_b = ChainTimer(fn_b, sets_b, perturb)
  samples_a, samples_b = [], []
  for _ in range(rounds):
    samples_a.append(timer_a.sample(settle_s=settle_s))
    samples_b.append(timer_b.sample(settle_s=settle_s))
  return statistics.median(samples_a), statistics.median(samples_b)


def perturb_query(args, zero):
  q, *rest = args
  return (q + zero.astype(q.dtype), *rest)


def perturb_none(args, zero):
  """Leaves args as they are, to time a custom call (a Pallas kernel)
  alone: XLA cannot fuse `q + zero` into one, so perturb_query would add a
  separate pass over q to the time timed.  The chain stays ordered: each
  step's zero still depends on the step before."""
  del zero
  return args


def perturb_dependent_ops(count):
  """A chain perturbation for the kernel-alone rows that puts `count`
  tiny dependent XLA ops before each kernel: the plan's step counts pass
  through `count` reductions, each of the last one's result (XLA fuses
  elementwise work into a reduction's input, never one reduction into
  another, so each is a launch of its own).  Against the kernel-alone
  row, what one dependent launch costs a call: the floor of any plan made
  of XLA ops (the default prefill's whole call compiles to 7 fusions
  before its kernel)."""

  def perturb(args, zero):
    q_rot, k_pages, v_pages, plan = args
    n_steps = plan[0] + (zero > 1e30).astype(jnp.int32)  # + 0 at run time
    for _ in range(count):
      n_steps = n_steps + (jnp.max(n_steps) > 2**30).astype(jnp.int32)
    return q_rot, k_pages, v_pages, (n_steps, *plan[1:])

  return perturb


def perturb_lazy(args, zero):
  q, k, v, table, pos, shift, length, q_pos, *scales = args
  bump = (zero > 1e30).astype(jnp.int32)  # 0 at run time, unknown to XLA
  return (q + zero.astype(q.dtype), k, v, table, pos, shift, length,
          q_pos + bump, *scales)


def perturb_positions(args, zero):
  """perturb_lazy without the query: only q_pos takes the run-time zero.
  Every lazy call reads q_pos before its kernel (the query rotation, or the
  plan whose table the kernel rotates the query from), so the chain stays
  ordered, and a call that rotates the query inside its kernel is not
  charged a pass over q it does not make (q + 0 fuses into an XLA
  rotation, but stands alone before a custom call)."""
  q, k, v, table, pos, shift, length, q_pos, *scales = args
  bump = (zero > 1e30).astype(jnp.int32)  # 0 at run time, unknown to XLA
  return (q, k, v, table, pos, shift, length, q_pos + bump, *scales)


def perturb_paged(args, zero):
  q, k, v, table, lengths = args
  bump = (zero > 1e30).astype(jnp.int32)
  return (q + zero.astype(q.dtype), k, v, table, lengths + bump)
