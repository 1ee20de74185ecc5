"""benchmarks.idle_profile: the device's idle time, attributed to the
Python frames the host was in."""

import gzip
import json
import subprocess
import sys

import pytest

from benchmarks.idle_profile import _label, _stacks_at, idle_attribution


# Traced in a fresh interpreter, so no earlier test's state is in it.
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


def test_a_real_trace_has_the_idle_gaps_of_the_host_work(tmp_path):
  script = tmp_path / "traced_run.py"
  script.write_text(_TRACED_RUN)
  subprocess.run([sys.executable, str(script), str(tmp_path / "trace")],
                 check=True, timeout=300)
  report = idle_attribution(str(tmp_path / "trace"), own={"traced_run.py"})
  assert report["gaps"] >= 4 and report["idle_s"] >= 0.06
  # The four 20 ms sleeps are gaps of a millisecond or more.
  sizes = report["by_gap_size"]
  assert sizes["1 ms or more"]["gaps"] >= 4
  assert sizes["1 ms or more"]["seconds"] >= 0.08
  assert sum(v["seconds"] for v in sizes.values()) == pytest.approx(
      report["idle_s"])
  label, seconds, share = report["by_own_frame"][0]
  assert "_host_work" in label and share > 0.5


def _write_trace(directory, events):
  path = directory / "plugins" / "profile" / "run" / "host.trace.json.gz"
  path.parent.mkdir(parents=True)
  meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/host:CPU")),
          # The interpreter's thread is named after the executable.
          dict(ph="M", name="thread_name", pid=1, tid=10,
               args=dict(name="python3")),
          dict(ph="M", name="thread_name", pid=1, tid=11,
               args=dict(name="python3")),
          dict(ph="M", name="thread_name", pid=1, tid=20,
               args=dict(name="tf_XLAEigen/1"))]
  with gzip.open(path, "wt") as f:
    json.dump(dict(traceEvents=meta + [
        dict(ph="X", pid=1, tid=tid, name=name, ts=ts, dur=dur)
        for tid, name, ts, dur in events]), f)


def test_idle_gaps_are_sized_and_attributed_to_the_open_python_calls(
    tmp_path):
  ops = [(20, "fusion.1", 0, 10), (20, "fusion.2", 30, 10),
         (20, "fusion.3", 1040, 10)]
  python = [(10, "$run.py:1 main", 0, 2000),
            (10, "$run.py:5 host_work", 12, 16), (10, "$time sleep", 13, 14),
            (10, "$run.py:5 host_work", 45, 980),
            (10, "$other.py:9 helper", 1036, 3),
            # Another Python thread (fewer calls) is not the main one.
            (11, "$run.py:7 watcher", 0, 2000)]
  _write_trace(tmp_path, ops + python)
  report = idle_attribution(str(tmp_path), own={"run.py"})
  assert report["gaps"] == 2
  assert report["idle_s"] == pytest.approx(1020e-6)
  assert report["span_s"] == pytest.approx(1050e-6)
  assert report["by_gap_size"]["under 50 us"] == dict(
      gaps=1, seconds=pytest.approx(20e-6))
  assert report["by_gap_size"]["50 us to 1 ms"] == dict(gaps=0, seconds=0.0)
  assert report["by_gap_size"]["1 ms or more"]["gaps"] == 1
  own = dict((label, seconds) for label, seconds, _ in report["by_own_frame"])
  # Samples every 20 us: the 1 ms gap's last sample (1030 us) falls after
  # host_work ended, in main; every other sample is in host_work.
  assert own["$run.py:5 host_work"] == pytest.approx(20e-6 + 980e-6)
  assert own["$run.py:1 main"] == pytest.approx(20e-6)
  pairs = dict((label, seconds) for label, seconds, _ in report["by_frame"])
  assert pairs["$run.py:5 host_work > $time sleep"] == pytest.approx(20e-6)
  assert pairs["$run.py:5 host_work"] == pytest.approx(980e-6)


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


def test_comm_profiles_command_prints_the_idle_time_too(tmp_path, capsys):
  from benchmarks import comm_profile
  _write_trace(tmp_path, [(20, "fusion.1", 0, 10), (20, "fusion.2", 30, 10),
                          (10, "$run.py:5 host_work", 5, 30)])
  comm_profile.main([str(tmp_path)])
  report = json.loads(capsys.readouterr().out)
  assert report["breakdown"]["busy_s"] == pytest.approx(20e-6)
  assert report["idle"]["idle_s"] == pytest.approx(20e-6)
  assert report["idle"]["by_frame"][0][0] == (
      "(no frame of ours) > $run.py:5 host_work")
