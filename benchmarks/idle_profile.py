"""Where a device waits on its host, read from a `jax.profiler` trace.

The device is idle between its ops; `benchmarks.comm_profile.op_breakdown`
reports how much (span minus busy).  This module says what the host was
doing meanwhile.  `jax.profiler.trace` records the Python interpreter's
calls (events named "$file.py:line function" on the host), so the idle
time can be sampled against the Python stack: every `step_us` of a gap
looks up the innermost frame of one of our own files (`own_files`) and the
innermost frame of any file, and the gap's time is summed per such pair.

The Python tracer slows the interpreter, so the absolute idle time of a
traced run is larger than an untraced one's; the shares between frames are
what this is for.  `python -m benchmarks.comm_profile DIR` prints it with
the op breakdown.
"""

from __future__ import annotations

import os
import re

from benchmarks.comm_profile import _op_events, read_trace

# Gap sizes (upper limits in microseconds): launch gaps between the kernels
# of one compiled program are a few microseconds; the host's work between
# programs is longer.
GAP_SIZES = ((50.0, "under 50 us"), (1000.0, "50 us to 1 ms"),
             (float("inf"), "1 ms or more"))
_FRAME = re.compile(r"^\$(?P<file>[^:]+):\d+ (?P<function>.+)$")


def own_files() -> frozenset[str]:
  """Basenames of the library's and the benchmarks' Python files."""
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  names = set()
  for package in ("lazyattn_jax", "benchmarks"):
    for _, _, files in os.walk(os.path.join(root, package)):
      names.update(f for f in files if f.endswith(".py"))
  return frozenset(names)


def _busy_intervals(ops) -> list[tuple[float, float]]:
  """The device's ops merged into disjoint (start, end) intervals, in us."""
  merged = []
  for start, end in sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"]))
                           for e in ops):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], end)
    else:
      merged.append([start, end])
  return [(s, e) for s, e in merged]


def _python_calls(events) -> list[tuple[float, float, str]]:
  """(start, end, name) of the host's traced Python calls, by start: the
  events named "$..." of the thread that has most of them (the main
  interpreter thread; its name is the executable's, "python3" or
  "python", so the thread is found by its events)."""
  by_thread = {}
  for e in events:
    if e.get("ph") == "X" and "dur" in e and e["name"].startswith("$"):
      by_thread.setdefault((e["pid"], e["tid"]), []).append(e)
  if not by_thread:
    return []
  main = max(by_thread.values(), key=len)
  calls = [(float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"])
           for e in main]
  calls.sort(key=lambda c: (c[0], -c[1]))
  return calls


def _stacks_at(calls, times):
  """For each of the sorted `times`, the names of the calls open then,
  outermost first (the calls nest: one interpreter thread)."""
  stacks, stack, i = [], [], 0
  for t in times:
    while i < len(calls) and calls[i][0] <= t:
      while stack and stack[-1][1] <= calls[i][0]:
        stack.pop()
      stack.append(calls[i])
      i += 1
    while stack and stack[-1][1] <= t:
      stack.pop()
    stacks.append([name for _, _, name in stack])
  return stacks


def _own_frame(stack, own) -> str:
  """The innermost frame of one of `own` files in a Python stack."""
  if not stack:
    return "(no Python call)"
  return next((name for name in reversed(stack)
               if (m := _FRAME.match(name)) and m["file"] in own),
              "(no frame of ours)")


def _label(stack, own) -> str:
  """"own frame > innermost frame" for one Python stack."""
  mine = _own_frame(stack, own)
  if not stack or mine == stack[-1]:
    return mine
  return f"{mine} > {stack[-1]}"


def idle_attribution(trace_dir: str, device: int = 0, top: int = 15,
                     step_us: float = 20.0, min_gap_us: float = 5.0,
                     own=None, events=None) -> dict:
  """The device's idle gaps in the newest trace under `trace_dir`, and the
  Python frames the host was in during them.

  Returns a dict: idle_s (gaps of at least `min_gap_us` between the first
  and the last op), gaps (their count), span_s, by_gap_size (count and
  seconds of the gaps in each of `GAP_SIZES`), by_own_frame (`top`
  entries [innermost frame of our files, seconds, share of idle]) and
  by_frame (the same per "own frame > innermost frame").
  """
  own = own_files() if own is None else own
  if events is None:
    events = read_trace(trace_dir)
  _, ops = _op_events(events, device)
  busy = _busy_intervals(ops)
  gaps = [(a_end, b_start) for (_, a_end), (b_start, _) in zip(busy, busy[1:])
          if b_start - a_end >= min_gap_us]
  times, weights = _samples(gaps, step_us)
  by_own, by_pair = {}, {}
  for stack, weight in zip(_stacks_at(_python_calls(events), times), weights):
    for table, key in ((by_own, _own_frame(stack, own)),
                       (by_pair, _label(stack, own))):
      table[key] = table.get(key, 0.0) + weight * 1e-6
  idle = sum(end - start for start, end in gaps) * 1e-6

  def ranked(table):
    rows = sorted(table.items(), key=lambda kv: -kv[1])[:top]
    return [[k, s, s / idle if idle else 0.0] for k, s in rows]

  return dict(idle_s=idle, gaps=len(gaps),
              span_s=(busy[-1][1] - busy[0][0]) * 1e-6 if busy else 0.0,
              by_gap_size=_by_gap_size(gaps),
              by_own_frame=ranked(by_own), by_frame=ranked(by_pair))


def _samples(gaps, step_us: float):
  """Sample times about `step_us` apart inside each gap, and the time each
  stands for (us)."""
  times, weights = [], []
  for start, end in gaps:
    samples = max(1, int((end - start) // step_us))
    width = (end - start) / samples
    times += [start + (k + 0.5) * width for k in range(samples)]
    weights += [width] * samples
  return times, weights


def _by_gap_size(gaps) -> dict:
  """{label: {gaps, seconds}} per `GAP_SIZES` class."""
  sizes = {label: dict(gaps=0, seconds=0.0) for _, label in GAP_SIZES}
  for start, end in gaps:
    label = next(label for limit, label in GAP_SIZES if end - start < limit)
    sizes[label]["gaps"] += 1
    sizes[label]["seconds"] += (end - start) * 1e-6
  return sizes
