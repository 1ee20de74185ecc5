"""benchmarks.idle_profile: the device's idle time, attributed to the
Python frames the host was in."""

import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.idle_profile import _label, _stacks_at, idle_attribution


def _host_work(seconds):
  time.sleep(seconds)  # one traced call, however busy the machine is


def test_idle_time_is_attributed_to_the_host_work_between_calls(tmp_path):
  step = jax.jit(lambda x: jnp.tanh(x @ x))
  x = jnp.ones((128, 128), jnp.float32)
  np.asarray(step(x))  # compiled before the trace
  with jax.profiler.trace(str(tmp_path), create_perfetto_trace=True):
    for _ in range(4):
      x = step(x)
      np.asarray(x)
      _host_work(0.02)
    np.asarray(step(x))
  report = idle_attribution(str(tmp_path), own={"test_idle_profile.py"})
  assert report["gaps"] >= 4 and report["idle_s"] >= 0.06
  label, seconds, share = report["by_own_frame"][0]
  assert "_host_work" in label
  assert report["by_frame"][0][0].startswith(label)
  assert seconds >= 0.06 and share > 0.5


def test_stacks_follow_the_nesting_of_calls():
  calls = [(0.0, 10.0, "$a.py:1 outer"), (1.0, 4.0, "$b.py:2 inner"),
           (2.0, 3.0, "$c.py:3 leaf"), (5.0, 6.0, "$b.py:9 other")]
  stacks = _stacks_at(calls, [0.5, 2.5, 3.5, 5.5, 8.0, 11.0])
  assert stacks == [["$a.py:1 outer"],
                    ["$a.py:1 outer", "$b.py:2 inner", "$c.py:3 leaf"],
                    ["$a.py:1 outer", "$b.py:2 inner"],
                    ["$a.py:1 outer", "$b.py:9 other"],
                    ["$a.py:1 outer"], []]
  own = {"b.py"}
  assert _label(stacks[1], own) == "$b.py:2 inner > $c.py:3 leaf"
  assert _label(stacks[3], own) == "$b.py:9 other"
  assert _label(stacks[4], own) == "(no frame of ours) > $a.py:1 outer"
  assert _label([], own) == "(no Python call)"
