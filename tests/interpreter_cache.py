"""The Pallas interpreters compile each simulated thread's program once per
kernel call, not once per thread of each CTA.

jax's interpreters (Mosaic GPU's, and TPU's with several cores) run a
kernel's warpgroups as Python threads, and each thread of each CTA lowers
and compiles the same traced body afresh (`thread_map._run_jaxpr` goes
through `.trace().lower().compile()`, which no cache answers).  A small
prefill case of 8 CTAs x 3 warpgroups so compiled 24 times per call: about
two thirds of its time.  Here the compiled program is kept per jaxpr and
argument shapes, so a call compiles it once; the program and its results
are the same.  (Calling through `jax.jit` instead deadlocks: its dispatch
orders executions with ordered effects, and the threads wait on each other
at the kernel's barriers.)

Only for the test suite's speed.  Left alone where the installed jax lacks
the private function or its signature differs.
"""

from __future__ import annotations

import collections
import inspect
import threading

import jax
import jax.core as jax_core

# Compiled thread programs, most recent last: a kernel call's CTAs reuse
# one; a few calls' worth are kept.
_MAX_PROGRAMS = 8
_programs: collections.OrderedDict = collections.OrderedDict()
_lock = threading.Lock()


def _run(jaxpr, consts, *args):
  jax_core.eval_jaxpr(jaxpr, consts, *args)


def _run_jaxpr(jaxpr, consts, *args):
  """`thread_map._run_jaxpr`, with its compiled program kept per jaxpr and
  argument shapes (the key holds the jaxpr, so its id is not reused)."""
  key = (jaxpr, tuple((x.shape, str(x.dtype))
                      for x in jax.tree.leaves((consts, args))))
  with _lock:  # threads of one CTA wait for the first one's compile
    program = _programs.get(key)
    if program is None:
      program = jax.jit(_run, static_argnums=(0,)).trace(
          jaxpr, consts, *args).lower().compile()
      _programs[key] = program
      while len(_programs) > _MAX_PROGRAMS:
        _programs.popitem(last=False)
    else:
      _programs.move_to_end(key)
  program(consts, *args)


def enable() -> bool:
  """Routes the interpreters' thread programs through `_run_jaxpr` here;
  returns whether it could (the private module and function exist as
  expected)."""
  try:
    from jax._src.pallas.mosaic.interpret import thread_map  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  original = getattr(thread_map, "_run_jaxpr", None)
  if original is None:
    return False
  params = list(inspect.signature(original).parameters)
  if params[:2] != ["jaxpr", "consts"]:
    return False
  thread_map._run_jaxpr = _run_jaxpr  # pylint: disable=protected-access
  return True
