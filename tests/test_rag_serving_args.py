"""Option checks of the benchmark command lines built on rag_serving
(rag_serving_cli, rag_serving_checks, tensor_parallel) and the closed
loop they share: a bad value is a one-line usage error (exit 2) before any
work starts, and nothing runs for ever or loses a finished run."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from benchmarks import rag_serving, rag_serving_checks, tensor_parallel
from benchmarks.rag_serving_cli import parse_args
from tests.usage_errors import assert_refused


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency must be >= 1, got 0"),
    (["--output-len", "0"], "--output-len must be >= 1"),
    (["--num-docs", "0"], "--num-docs must be >= 1"),
    (["--doc-len", "0"], "--doc-len must be >= 1"),
    (["--query-len", "0"], "--query-len must be >= 1"),
    (["--max-batch", "0"], "--max-batch must be >= 1"),
    (["--decode-steps", "0"], "--decode-steps must be >= 1"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--max-prefill-tokens", "0"], "--max-prefill-tokens must be >= 1"),
    (["--sink-len", "0"], "--sink-len must be >= 1"),
    (["--page-size", "-8"], "--page-size must be >= 1"),
    (["--cache-pages", "-5"], "--cache-pages must be finite and >= 0, got -5"),
    (["--rate", "-1"], "--rate must be finite and >= 0"),
    (["--group-tokens", "-1"], "--group-tokens must be finite and >= 0"),
    # NaN passed `< 0` (a rate of NaN spun for ever); inf was written to
    # the report as Infinity, which JSON has not.
    (["--rate", "nan"], "--rate must be finite and >= 0, got nan"),
    (["--rate", "inf"], "--rate must be finite and >= 0, got inf"),
    (["--zipf", "nan"], "--zipf must be finite and >= 0, got nan"),
    (["--cache-fraction", "inf"], "--cache-fraction must be finite and > 0"),
    (["--cache-fraction", "nan"], "--cache-fraction must be finite and > 0"),
    (["--sweep-rates", "1,inf"], "--sweep-rates values must be finite and "
                                 ">= 0, got 'inf'"),
    (["--sweep-cache-fractions", "inf"], "--sweep-cache-fractions values "
                                         "must be finite and > 0"),
    (["--impl", "bogus"], "--impl must be one of"),
    (["--kv-dtype", "float8"], "--kv-dtype must be among"),
    (["--kv-dtypes", "bfloat16"], "--kv-dtypes bfloat16 does not match "
                                  "--model tiny's compute dtype"),
    (["--kv-dtypes", "float8_e4m3fn,float8"], "got 'float8'"),
    (["--num-docs", "4", "--docs-per-request", "8"],
     "--docs-per-request 8 is more than --num-docs 4"),
    (["--sweep-rates", "1,abc"], "--sweep-rates takes comma-separated "
                                 "numbers, got 'abc'"),
    (["--sweep-rates", "-2"], "--sweep-rates values must be finite and >= 0"),
    (["--sweep-cache-fractions", "0"], "--sweep-cache-fractions values "
                                       "must be finite and > 0"),
    (["--modes", ""], "--modes names no mode"),
    (["--modes", ","], "--modes names no mode"),
])
def test_bad_values_are_one_line_usage_errors(capsys, argv, message):
  assert_refused(capsys, parse_args, argv, message)


def test_good_values_pass():
  args = parse_args(["--kv-dtypes", "float8_e4m3fn", "--sweep-rates", "0,2.5",
                     "--impl", "xla", "--kv-dtype", "float32"])
  assert args.kv_dtypes == ["float8_e4m3fn"] and args.sweep_rates == "0,2.5"


def test_merge_refuses_a_report_and_missing_files(capsys, tmp_path):
  report = tmp_path / "r.json"
  report.write_text(json.dumps(dict(runs=[], sweeps={}), indent=2))
  assert_refused(capsys, parse_args, ["--merge", str(report)],
           "line 1 is not a run's row")
  assert_refused(capsys, parse_args, ["--merge", str(tmp_path / "no.jsonl")],
           "--merge cannot read")
  rows = tmp_path / "a.partial.jsonl"
  rows.write_text(json.dumps(dict(kind="base", mode="lazy")) + "\n")
  assert parse_args(["--merge", str(rows)]).merge == [str(rows)]


class _FakeEngine:
  """Finishes each request one step after it is submitted."""

  def __init__(self):
    self.in_flight, self.steps = [], 0

  def submit(self, query, docs, sampling, arrival_time=None):
    self.in_flight.append(query)

  def has_work(self):
    return bool(self.in_flight)

  def step(self):
    self.steps += 1
    assert self.steps < 100, "the loop spins"
    done, self.in_flight = self.in_flight, []
    return done


@pytest.mark.parametrize("concurrency", [0, 1, 3])
def test_closed_loop_never_spins_with_nothing_in_flight(concurrency):
  trace = rag_serving.Trace([[1]], [([i + 1], [0]) for i in range(5)], None)
  args = argparse.Namespace(output_len=1, concurrency=concurrency)
  results, _ = rag_serving.run_trace(_FakeEngine(), trace, args)
  assert sorted(results) == [[i + 1] for i in range(5)]


def test_an_open_loop_window_starts_at_the_first_arrival():
  """Before: the clock started at trace time 0, a gap of about 1 / rate
  before the first request arrived, which lowered every open-loop
  throughput."""
  import time
  trace = rag_serving.Trace([[1]], [([i + 1], [0]) for i in range(3)],
                            np.array([0.3, 0.3, 0.3]))
  args = argparse.Namespace(output_len=1, concurrency=0)
  started = time.perf_counter()
  results, seconds = rag_serving.run_trace(_FakeEngine(), trace, args)
  assert len(results) == 3
  assert seconds < 0.1 < time.perf_counter() - started


DOC_EXAMPLE = ["--model", "tiny", "--num-docs", "24", "--num-requests", "16"]


def _tiny_hidden_size():
  from models.config import LlamaConfig
  return LlamaConfig.tiny().hidden_size


def test_largest_request_counts_block_copies():
  args = parse_args(DOC_EXAMPLE)
  hidden = _tiny_hidden_size()
  # 4 documents of 2 pages, 1 page of query + answer; block copies too.
  assert rag_serving_checks.largest_request_pages(args, "lazy", hidden) == 9
  assert rag_serving_checks.largest_request_pages(args, "block", hidden) == 17
  pools = rag_serving_checks.planned_pools(args, None, "float32", 16)
  error = rag_serving_checks.pool_error(args, hidden, pools)
  assert error.startswith("mode block: the largest request needs 17 pages "
                          "but the pool has 16; raise --cache-fraction")


def test_docstring_example_fits_and_a_pool_too_small_stops_before_any_run(
    capsys, monkeypatch):
  line = [l for l in rag_serving.__doc__.splitlines()
          if "--num-docs 24" in l][0]
  assert "--cache-fraction 0.5" in rag_serving.__doc__
  args = parse_args(DOC_EXAMPLE + ["--cache-fraction", "0.5"])
  pages = rag_serving.cache_pages_for(args, args.cache_fraction)
  assert rag_serving_checks.pool_error(
      args, _tiny_hidden_size(),
      rag_serving_checks.planned_pools(args, None, "float32", pages)) is None
  assert line
  ran = []
  monkeypatch.setattr(rag_serving, "run_mode", lambda *a, **k: ran.append(a))
  assert_refused(capsys, rag_serving.main, DOC_EXAMPLE + ["--no-progress"],
           "mode block: the largest request needs 17 pages")
  assert not ran


def test_tensor_parallel_refuses_rag_serving_options_it_does_not_run(capsys):
  assert_refused(capsys, tensor_parallel.parse_args,
           ["--model", "tiny", "--sweep-rates", "5", "--kv-dtypes",
            "float8_e4m3fn", "--decode-during-prefill-only"],
           "--sweep-rates, --kv-dtypes, --decode-during-prefill-only: "
           "options of benchmarks.rag_serving that")
  assert_refused(capsys, tensor_parallel.parse_args,
           ["--model", "tiny", "--sink-len", "4"],
           "--sink-len: options of benchmarks.rag_serving that "
           "benchmarks.tensor_parallel does not run")
  args = tensor_parallel.parse_args(["--model", "tiny", "--num-docs", "24"])
  assert args.num_docs == 24
  assert "are refused" in tensor_parallel.__doc__


# 2 documents of 1 page and 64 + 64 tokens of query and answer (the paper
# load's): tensor_parallel's lazy requests need 10 pages.
TP_SMALL = ["--model", "tiny", "--tensor-parallel", "1", "--num-docs", "12",
            "--docs-per-request", "2", "--doc-len", "16", "--no-progress"]


def _no_engine(monkeypatch):
  ran = []
  monkeypatch.setattr(rag_serving, "make_engine",
                      lambda *a, **k: ran.append(a) or 1 / 0)
  return ran


def test_tensor_parallel_checks_a_pool_sized_from_device_memory(
    capsys, monkeypatch):
  """Once the weights are placed and the pages known, before any run."""
  config, _ = tensor_parallel.model_config("tiny")
  per_page = (2 * config.num_layers * config.num_kv_heads * 16 *
              config.head_dim * 4)  # float32 pages of 16 tokens
  monkeypatch.setattr(tensor_parallel, "_free_bytes",
                      lambda devices: 12 * per_page)
  ran = _no_engine(monkeypatch)
  assert_refused(capsys, tensor_parallel.main,
           TP_SMALL + ["--pool-memory-fraction", "0.5"],
           "--tensor-parallel 1: mode lazy: the largest request needs 10 "
           "pages but the pool has 6; raise --pool-memory-fraction")
  assert not ran


def test_tensor_parallel_checks_the_pool_it_falls_back_to(capsys,
                                                         monkeypatch):
  """Where JAX cannot say the free memory (CPU) the pool is
  --cache-fraction's even with --pool-memory-fraction: checked too."""
  ran = _no_engine(monkeypatch)
  assert_refused(capsys, tensor_parallel.main,
           TP_SMALL + ["--pool-memory-fraction", "0.5", "--cache-pages", "4"],
           "--tensor-parallel 1: mode lazy: the largest request needs 10 "
           "pages but the pool has 4; raise --cache-fraction or "
           "--cache-pages")
  assert not ran


def test_tensor_parallel_without_decode_steps_still_writes_its_report(
    tmp_path, monkeypatch, capsys):
  out = tmp_path / "tp.json"

  def run_one(args, config, dtype, n, measured, warm, cache_warmer):
    return [dict(mode="lazy", tensor_parallel=n, decode_step_s=None,
                 decode_tok_s=0.0, throughput_tok_s=10.0, ttft_p50_s=0.1,
                 weights_gb_per_device=0.0, kv_pool_gb_per_device=0.0,
                 cache_pages=8)]
  monkeypatch.setattr(tensor_parallel, "run_one", run_one)
  tensor_parallel.main(["--model", "tiny", "--tensor-parallel", "1",
                        "--num-docs", "12", "--docs-per-request", "2",
                        "--doc-len", "16", "--output-len", "1",
                        "--cache-fraction", "1.0", "--out", str(out)])
  row = json.loads(out.read_text())["runs"][0]
  assert row["decode_step_s"] is None and row["decode_step_speedup"] is None
  assert "no decode step ran" in capsys.readouterr().err
