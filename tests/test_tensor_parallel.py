"""Tensor parallelism (issue 15).

The multi-device checks live in tests/multi_device and run here in one
subprocess that has 8 CPU devices (JAX fixes the device count when it
starts; this process has one).  The rest needs no second device: what
cannot be split is refused with a typed error before anything is placed,
one device stays exactly as it was, the command line's option, and the
benchmark's entry point (in its own 2-device subprocess).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from lazyattn_jax.errors import LazyAttnError, TensorParallelError
from lazyattn_jax.sharding import make_mesh, tensor_parallel_for
from models.config import LlamaConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _env(devices: int) -> dict:
  # Optimization level 0: the subprocesses compile many small programs and
  # run them once; LLVM's optimizations halve their time for nothing here.
  flags = (f"--xla_force_host_platform_device_count={devices} "
           "--xla_backend_optimization_level=0")
  return dict(os.environ, JAX_PLATFORMS="cpu",
              XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " " + flags))


def test_multi_device_checks_pass_on_eight_cpu_devices(pytestconfig):
  # The slow tier's cases run with --slow, as here; else they are
  # deselected, so that nothing in the subprocess may skip.
  tier = ["--slow"] if pytestconfig.getoption("--slow") else ["-m",
                                                              "not slow"]
  proc = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       "-p", "no:randomly", *tier, "tests/multi_device"], cwd=ROOT,
      env=_env(8), capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
  assert " passed" in proc.stdout and "skipped" not in proc.stdout


def _free_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_serve_one_engine_in_lockstep(tmp_path):
  """Two processes (jax.distributed over CPU, gloo collectives), one device
  each, one engine split over both; process 0 takes the requests (over
  several rounds, with a cancel and documents encoded ahead) and
  `Lockstep` replays its calls on process 1.  Answers equal one device's;
  both processes end with the same cache."""
  port = _free_port()
  env = dict(_env(1), XLA_FLAGS="--xla_backend_optimization_level=0")
  outs = [tmp_path / f"process{i}.json" for i in range(2)]
  procs = [subprocess.Popen(
      [sys.executable, "-m", "tests.multi_host_worker", str(i), str(port),
       str(outs[i])], cwd=ROOT, env=env, stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT, text=True) for i in range(2)]
  try:
    logs = [p.communicate(timeout=600)[0] for p in procs]
  finally:
    for p in procs:
      p.kill()
  for p, log in zip(procs, logs):
    assert p.returncode == 0, log[-4000:]
  leader, follower = (json.loads(out.read_text()) for out in outs)
  assert leader["devices"] == 2 and leader["local_devices"] == 1
  assert leader["results"] == follower["reference"]
  reasons = [reason for reason, _ in leader["results"].values()]
  assert reasons.count("cancelled") == 1 and reasons.count("length") == 4
  assert follower["rounds"] > 0
  assert follower["cache"] == leader["cache"]


# --- what cannot be split ----------------------------------------------------
SMOLLM2_SHAPE = LlamaConfig.tiny(num_heads=9, num_kv_heads=3,
                                 intermediate_size=1536, vocab_size=49152)


@pytest.mark.parametrize("config,devices,message", [
    (SMOLLM2_SHAPE, 2, r"9 query heads do not divide over 2 devices; device "
                       r"counts that fit this model: \[1, 3\]"),
    (SMOLLM2_SHAPE, 9, r"FFN width 1536 does not divide over 9 devices"),
    (LlamaConfig.tiny(num_heads=12, num_kv_heads=3), 2,
     r"3 KV heads cannot be split over 2 devices"),
    (LlamaConfig.tiny(num_heads=12, num_kv_heads=6), 4,
     r"6 KV heads cannot be split over 4 devices"),
    (LlamaConfig.tiny(num_heads=4, num_kv_heads=2), 8,
     r"4 query heads do not divide over 8 devices.*\[1, 2, 4\].*"
     r"data-parallel"),
])
def test_models_that_do_not_split_are_refused(config, devices, message):
  with pytest.raises(TensorParallelError, match=message):
    tensor_parallel_for(config, tensor_parallel=devices)


def test_the_counts_that_fit_follow_vocab_parallel():
  # With vocab_parallel=True they named 4 and 8, which the same call then
  # refused for the vocabulary of 250.
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, vocab_size=250)
  with pytest.raises(TensorParallelError,
                     match=r"counts that fit this model: \[1, 2\],"):
    tensor_parallel_for(config, tensor_parallel=3, vocab_parallel=True)
  with pytest.raises(TensorParallelError,
                     match=r"counts that fit this model: \[1, 2, 4, 8\],"):
    tensor_parallel_for(config, tensor_parallel=np.int64(3))  # as int 3


def test_typed_errors_for_bad_settings():
  tiny = LlamaConfig.tiny()
  odd_vocab = LlamaConfig.tiny(vocab_size=255)
  for bad in (0, -2, True, "2", 1.5):
    with pytest.raises(TensorParallelError, match="must be an int >= 1"):
      tensor_parallel_for(tiny, tensor_parallel=bad)
  with pytest.raises(TensorParallelError, match="vocabulary of 255 tokens"):
    tensor_parallel_for(odd_vocab, tensor_parallel=2, vocab_parallel=True)
  with pytest.raises(TensorParallelError, match="vocab_parallel must be"):
    tensor_parallel_for(tiny, tensor_parallel=2, vocab_parallel="yes")
  # The model fits two devices; this process has one.
  with pytest.raises(TensorParallelError, match="needs 2 devices; JAX sees 1"):
    tensor_parallel_for(tiny, tensor_parallel=2)
  with pytest.raises(TensorParallelError, match="needs 4 devices"):
    make_mesh(4)
  one = np.array(jax.devices()[:1])
  with pytest.raises(TensorParallelError, match="mesh's 'x' axis has 1"):
    tensor_parallel_for(tiny, mesh=Mesh(one, ("x",)), tensor_parallel=2)
  with pytest.raises(TensorParallelError, match="one-axis mesh"):
    tensor_parallel_for(tiny, mesh=Mesh(one.reshape(1, 1), ("dp", "x")))
  with pytest.raises(TensorParallelError, match="jax.sharding.Mesh"):
    tensor_parallel_for(tiny, mesh="tp")
  error = TensorParallelError("x")
  assert isinstance(error, LazyAttnError) and isinstance(error, ValueError)


def test_a_mesh_must_hold_every_process(monkeypatch):
  """Under jax.distributed every process runs the engine: a mesh of one
  process's devices left the other failing every request."""
  import types
  fake = [types.SimpleNamespace(process_index=p, platform="cpu")
          for p in (0, 0, 1, 1)]
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(TensorParallelError,
                     match=r"devices of process\(es\) \[0\] only, but 2 "
                     r"processes run the engine.*tensor_parallel=4"):
    make_mesh(2, devices=fake)


def test_vocab_parallel_auto_and_a_one_device_mesh():
  """auto splits the vocabulary only where it divides; a mesh of one device
  is a valid (trivial) split, tensor_parallel 1 is no split at all."""
  one = Mesh(np.array(jax.devices()[:1]), ("tp",))
  plan = tensor_parallel_for(LlamaConfig.tiny(vocab_size=255), mesh=one)
  assert plan.size == 1 and plan.kv_replicas == 1 and plan.vocab_parallel
  assert tensor_parallel_for(LlamaConfig.tiny(), tensor_parallel=1) is None
  assert tensor_parallel_for(LlamaConfig.tiny()) is None


def test_a_one_device_mesh_serves_like_no_mesh():
  """The shard_map path on a mesh of one device (the jax version's shard_map
  and its argument names) gives the plain engine's tokens."""
  from lazyattn_jax.engine import LazyEngine
  from models.llama import Llama
  from tests.test_engine import greedy, make_engine, random_tokens
  config = LlamaConfig.tiny(max_position=512)
  model = Llama(config, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  docs = [random_tokens(rng, n, config.vocab_size) for n in (7, 5)]
  query = random_tokens(rng, 4, config.vocab_size)
  plain = make_engine((model, config, "xla"))
  mesh = Mesh(np.array(jax.devices()[:1]), ("tp",))
  meshed = LazyEngine(config, model, plain.cache_config,
                      scheduler=plain.scheduler_config,
                      runner=plain.runner_config, mesh=mesh)
  assert meshed.tensor_parallel.size == 1
  assert meshed.state.k.sharding.spec == P("tp")
  want = plain.generate(query, docs, greedy(3))
  got = meshed.generate(query, docs, greedy(3))
  assert got.token_ids == want.token_ids
  np.testing.assert_allclose(got.first_logits, want.first_logits, atol=1e-5)


def test_from_pretrained_refuses_before_reading_weights(tmp_path, monkeypatch):
  from lazyattn_jax.engine import LazyEngine
  import models.safetensors_loader as loader
  from models.llama import Llama
  from tests.hf_fixtures import write_hf_checkpoint
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=4)
  params = nnx.to_pure_dict(nnx.state(Llama(config, rngs=nnx.Rngs(0)),
                                      nnx.Param))
  write_hf_checkpoint(tmp_path, config,
                      jax.tree_util.tree_map(np.asarray, params))

  def no_reading(*args, **kwargs):
    raise AssertionError("weights were read")

  monkeypatch.setattr(loader, "load_params", no_reading)
  with pytest.raises(TensorParallelError, match="8 query heads do not "
                                                "divide over 3 devices"):
    LazyEngine.from_pretrained(str(tmp_path), tensor_parallel=3,
                               progress=False)


def test_cli_tensor_parallel_option_errors_are_one_line(tmp_path):
  doc = tmp_path / "doc.txt"
  doc.write_text("The Orrin Bridge was built in 1887.", encoding="utf-8")
  for value, want in (("0", "--tensor-parallel must be >= 1"),
                      ("2", "9 query heads do not divide over 2 devices")):
    proc = subprocess.run(
        [sys.executable, "-m", "lazyattn_jax.cli", "rag", "--doc", str(doc),
         "--query", "Who built it?", "--tensor-parallel", value],
        capture_output=True, text=True, timeout=600, cwd=ROOT)
    errors = [line for line in proc.stderr.splitlines()
              if line.startswith("lazyattn: error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-2000:]
    assert want in errors[0]


# --- the benchmark ---------------------------------------------------------
def test_op_kind_drops_only_the_numeric_suffix():
  from benchmarks.comm_profile import op_kind
  assert op_kind("fusion.12") == "fusion"
  assert op_kind("all-reduce-start.3.1") == "all-reduce-start"
  assert op_kind("loop_multiply_fusion") == "loop_multiply_fusion"
  assert op_kind("cublas-gemm.2") == "cublas-gemm"


def test_benchmark_refuses_device_counts_it_cannot_use_in_one_line():
  """Every count is checked before the first run: heads that do not
  divide, and more devices than JAX sees, after a count that works."""
  for counts, want in (("1,3", "--tensor-parallel 3: 8 query heads do not "
                                "divide over 3 devices"),
                       ("1,4", "--tensor-parallel 4: ")):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.tensor_parallel", "--model",
         "tiny", "--tensor-parallel", counts, "--no-progress"], cwd=ROOT,
        env=_env(2), capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and want in lines[-1], lines


@pytest.mark.slow
def test_benchmark_runs_one_and_two_devices_side_by_side(tmp_path):
  out = tmp_path / "tp.json"
  cmd = [sys.executable, "-m", "benchmarks.tensor_parallel", "--model", "tiny",
         "--tensor-parallel", "1,2", "--profile-dir", str(tmp_path / "prof"),
         "--num-docs", "12", "--docs-per-request", "2", "--doc-len", "16",
         "--query-len", "4", "--output-len", "4", "--num-requests", "6",
         "--concurrency", "2", "--max-batch", "2", "--decode-steps", "2",
         "--cache-fraction", "1.0", "--add-working-pages", "--page-size", "8",
         "--out", str(out), "--no-progress"]
  proc = subprocess.run(cmd, cwd=ROOT, env=_env(2), capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-4000:]
  report = json.loads(out.read_text())
  assert report["devices"] == 2
  runs = {r["tensor_parallel"]: r for r in report["runs"]}
  assert set(runs) == {1, 2}
  for n, r in runs.items():
    assert r["mode"] == "lazy" and r["requests"] == 6
    assert r["decode_step_s"] > 0 and r["throughput_tok_s"] > 0
    assert r["compiles_during_measurement"] == 0
    profile = r["profile"]
    assert profile["decode_steps_traced"] > 0
    assert 0.0 <= profile["comm_share"] <= 1.0
    # One device has nothing to communicate; two all-reduce every layer.
    assert (profile["comm_s"] > 0) == (n == 2)
    # The op breakdown: ops grouped by kind, with their time and count.
    assert profile["busy_s_per_step"] > 0 and profile["span_s_per_step"] > 0
    kinds = profile["top_kinds"]
    assert kinds and all(not name[-1].isdigit() for name, _, _ in kinds)
    assert all(seconds > 0 and count > 0 for _, seconds, count in kinds)
    assert kinds == sorted(kinds, key=lambda row: -row[1])
  assert runs[2]["weights_gb_per_device"] < runs[1]["weights_gb_per_device"]
  assert runs[1]["decode_step_speedup"] == 1.0
  # The same weights and trace at both counts: the same documents hit.
  assert runs[1]["doc_hit_rate"] == runs[2]["doc_hit_rate"]


def test_benchmark_keeps_the_counts_measured_before_a_pool_too_small(
    tmp_path, monkeypatch, capsys):
  """A count whose memory-sized pool cannot hold a request ends the run;
  the counts measured before it go into the report (they were only in
  stderr)."""
  from benchmarks import tensor_parallel
  real, sizes = tensor_parallel.pool_pages, []

  def pool_pages(*args):
    pages, option = real(*args)
    sizes.append(pages if not sizes else 1)
    return sizes[-1], option

  monkeypatch.setattr(tensor_parallel, "pool_pages", pool_pages)
  out = tmp_path / "tp.json"
  with pytest.raises(SystemExit) as exit_info:
    tensor_parallel.main([
        "--model", "tiny", "--tensor-parallel", "1,1",
        "--pool-memory-fraction", "0.5", "--num-docs", "8",
        "--docs-per-request", "2", "--doc-len", "16", "--query-len", "4",
        "--output-len", "2", "--num-requests", "2", "--warmup-requests", "1",
        "--concurrency", "2", "--max-batch", "2", "--decode-steps", "2",
        "--cache-fraction", "1.0", "--add-working-pages", "--page-size", "8",
        "--out", str(out), "--no-progress"])
  assert exit_info.value.code == 2
  report = json.loads(out.read_text())
  assert [r["tensor_parallel"] for r in report["runs"]] == [1]
  assert report["error"].startswith("--tensor-parallel 1: ")
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("benchmarks.tensor_parallel: error: "
                            "--tensor-parallel 1: ")
