"""benchmarks.idle_profile: the device's idle time, attributed to the
Python frames the host was in."""

import subprocess
import sys

import pytest

from benchmarks.idle_profile import _label, _stacks_at, idle_attribution


# Traced in a fresh interpreter: inside the full suite's workers the
# profiler's Python tracer recorded no calls (after some earlier test in the
# same process; which one was not found), so the trace is taken apart.
_TRACED_RUN = """
import sys, time
import jax, jax.numpy as jnp, numpy as np

def _host_work(seconds):
  time.sleep(seconds)  # one traced call, however busy the machine is

step = jax.jit(lambda x: jnp.tanh(x @ x))
x = jnp.ones((128, 128), jnp.float32)
np.asarray(step(x))  # compiled before the trace
options = jax.profiler.ProfileOptions()
options.python_tracer_level = 1
with jax.profiler.trace(sys.argv[1], create_perfetto_trace=True,
                        profiler_options=options):
  for _ in range(4):
    x = step(x)
    np.asarray(x)
    _host_work(0.02)
  np.asarray(step(x))
"""


def test_idle_time_is_attributed_to_the_host_work_between_calls(tmp_path):
  script = tmp_path / "traced_run.py"
  script.write_text(_TRACED_RUN)
  subprocess.run([sys.executable, str(script), str(tmp_path / "trace")],
                 check=True, timeout=300)
  report = idle_attribution(str(tmp_path / "trace"), own={"traced_run.py"})
  assert report["gaps"] >= 4 and report["idle_s"] >= 0.06
  label, seconds, share = report["by_own_frame"][0]
  assert "_host_work" in label
  assert report["by_frame"][0][0].startswith(label)
  assert seconds >= 0.06 and share > 0.5
  # The four 20 ms sleeps are gaps of a millisecond or more.
  sizes = report["by_gap_size"]
  assert sizes["1 ms or more"]["gaps"] >= 4
  assert sizes["1 ms or more"]["seconds"] >= 0.08
  assert sum(v["seconds"] for v in sizes.values()) == pytest.approx(
      report["idle_s"])


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
