"""Where device time goes, read from a `jax.profiler` trace: the
communication share, and the ops that take the most time.

`jax.profiler.trace(dir, create_perfetto_trace=True)` writes
`dir/plugins/profile/<run>/*.trace.json.gz` (Chrome trace events).  Where a
device has its own process in the trace ("/device:GPU:0", "/device:TPU:0"),
its ops are read from the "XLA Ops" thread when there is one (HLO op names:
`all-reduce-start.3`, `fusion.12`, ...), else from its stream threads
(kernel names: NCCL kernels carry "nccl").  On CPU (tests) the ops are the
thunks on the host's XLA threads, and every device's are counted.

The share is the time inside collective ops over the time inside all ops:
a fraction of busy device time, not of wall time.  With collectives that
overlap compute on another stream, the two overlap in the sum as well.

`op_breakdown` groups the same ops by kind (the HLO name without its
numeric suffix: `fusion.12` and `fusion.7` are both `fusion`) and reports
the device's busy time against the span from its first op to its last, so
idle gaps (host work between compiled calls) show as span minus busy.

`benchmarks.idle_profile` says what the host did during those gaps; the
command prints all three.

  python -m benchmarks.comm_profile DIR [--device 0] [--top 15]
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re

_COLLECTIVE = re.compile(
    r"all-reduce|all-gather|reduce-scatter|all-to-all|collective-permute|"
    r"nccl|allreduce|allgather|reducescatter|sendrecv", re.IGNORECASE)
# Host-side bookkeeping in CPU traces (not ops), and control flow, whose
# span holds its body's ops (counted on their own).
_CPU_INFRA = re.compile(r"::|^end: |^Wait|Rendezvous|^Handle |^Allocate|^\[|"
                        r"ThreadpoolListener|^(while|conditional|call)(\.|$)")


def latest_trace(trace_dir: str) -> str:
  """The newest *.trace.json.gz under `trace_dir`."""
  paths = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                    recursive=True)
  if not paths:
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}")
  return max(paths, key=os.path.getmtime)


def _events(path: str) -> list[dict]:
  with gzip.open(path, "rt") as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def read_trace(trace_dir: str) -> list[dict]:
  """The events of the newest trace under `trace_dir`.  A caller running
  several analyses of one trace reads it once and passes `events=` to each
  (a traced serving run's file is large)."""
  return _events(latest_trace(trace_dir))


def _op_events(events: list[dict], device: int) -> tuple[str, list[dict]]:
  """(where the ops came from, complete events of one device's ops)."""
  names = {e["pid"]: e["args"]["name"] for e in events
           if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  done = [e for e in events if e.get("ph") == "X" and "dur" in e]
  pattern = re.compile(rf"/device:(GPU|TPU):{device}( |$)")
  device_pids = {pid for pid, name in names.items() if pattern.search(name)}
  if device_pids:
    mine = [e for e in done if e["pid"] in device_pids]
    ops = [e for e in mine
           if threads.get((e["pid"], e["tid"]), "") == "XLA Ops"]
    if ops:
      return "xla_ops", ops
    return "streams", [e for e in mine if "Stream" in threads.get(
        (e["pid"], e["tid"]), "")]
  cpu = re.compile(r"XLAPjRtCpuClient|XLAEigen")
  client = [e for e in done if cpu.search(threads.get((e["pid"], e["tid"]), ""))
            and not _CPU_INFRA.search(e["name"])]
  return "cpu_thunks", client


def communication_share(trace_dir: str, device: int = 0,
                        events=None) -> dict:
  """Time in collectives against time in all ops of one device (every
  device on CPU), from the newest trace under `trace_dir`.

  Returns a dict: source ("xla_ops", "streams" or "cpu_thunks"),
  comm_s, compute_s, comm_share, and the five collectives that took the
  longest (name, seconds).
  """
  if events is None:
    events = read_trace(trace_dir)
  source, ops = _op_events(events, device)
  comm, compute, by_name = 0.0, 0.0, {}
  for e in ops:
    seconds = float(e["dur"]) * 1e-6  # trace times are microseconds
    if _COLLECTIVE.search(e["name"]):
      comm += seconds
      by_name[e["name"]] = by_name.get(e["name"], 0.0) + seconds
    else:
      compute += seconds
  total = comm + compute
  top = sorted(by_name.items(), key=lambda kv: -kv[1])[:5]
  return dict(source=source, ops=len(ops), comm_s=comm, compute_s=compute,
              comm_share=comm / total if total else 0.0,
              top_collectives=[[n, s] for n, s in top])


_SUFFIX = re.compile(r"(\.\d+)+$")


def op_kind(name: str) -> str:
  """An op's name without its numeric suffix ("fusion.12" -> "fusion")."""
  return _SUFFIX.sub("", name)


def op_breakdown(trace_dir: str, device: int = 0, top: int = 15,
                 events=None) -> dict:
  """The busiest ops of one device (every device on CPU) in the newest
  trace under `trace_dir`.

  Returns a dict: source, ops, busy_s (sum of op durations), span_s (first
  op's start to last op's end), and `top` entries each of by_kind and
  by_op: [name, seconds, count], most time first.
  """
  if events is None:
    events = read_trace(trace_dir)
  source, ops = _op_events(events, device)
  by_kind, by_op = {}, {}
  for e in ops:
    seconds = float(e["dur"]) * 1e-6
    for table, key in ((by_kind, op_kind(e["name"])), (by_op, e["name"])):
      total, count = table.get(key, (0.0, 0))
      table[key] = (total + seconds, count + 1)
  busy = sum(s for s, _ in by_kind.values())
  span = 0.0
  if ops:
    start = min(float(e["ts"]) for e in ops)
    end = max(float(e["ts"]) + float(e["dur"]) for e in ops)
    span = (end - start) * 1e-6

  def ranked(table):
    rows = sorted(table.items(), key=lambda kv: -kv[1][0])[:top]
    return [[name, seconds, count] for name, (seconds, count) in rows]

  return dict(source=source, ops=len(ops), busy_s=busy, span_s=span,
              by_kind=ranked(by_kind), by_op=ranked(by_op))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("trace_dir")
  p.add_argument("--device", type=int, default=0)
  p.add_argument("--top", type=int, default=15)
  args = p.parse_args(argv)
  from benchmarks.idle_profile import idle_attribution  # it imports this
  events = read_trace(args.trace_dir)
  print(json.dumps(dict(
      communication_share(args.trace_dir, args.device, events),
      breakdown=op_breakdown(args.trace_dir, args.device, args.top, events),
      idle=idle_attribution(args.trace_dir, args.device, args.top,
                            events=events)),
      indent=2))


if __name__ == "__main__":
  main()
