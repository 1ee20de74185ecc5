"""benchmarks/page_contiguity.py: the share of a serving run's KV blocks
whose pages are consecutive (the blocks the Mosaic GPU kernels copy whole),
counted on the tiny model on CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import page_contiguity
from lazyattn_jax.layout import PageRow
from tests.usage_errors import assert_refused


def test_block_tally_counts_consecutive_blocks_of_each_row():
  tally = page_contiguity.BlockTally(block_pages=4)
  whole = PageRow(table=[8, 9, 10, 11, 20, 21, 22, 23])  # two blocks, both
  split = PageRow(table=[8, 9, 30, 31, 5])  # neither; the last is short
  tally.add_rows([whole, split, PageRow()])
  assert (tally.consecutive, tally.blocks) == (2, 4)
  assert tally.share == 0.5


def test_cached_documents_consecutive_reads_the_document_table():
  class State:  # the CacheState fields it reads
    doc_valid = np.array([True, True, False, True])
    doc_num_pages = np.array([3, 2, 3, 1])
    doc_pages = np.array([[4, 5, 6], [9, 7, -1], [1, 2, 3], [0, -1, -1]])
  assert page_contiguity.cached_documents_consecutive(State()) == (2, 3)


def test_tiny_run_counts_every_decoded_block(tmp_path, capsys):
  """Documents of one 128-key block each (8 pages of 16) in a pool that
  never evicts, so each is consecutive; each row's last block holds its one
  private page and the padding after it, so it is not: 4 of 5 blocks."""
  out = tmp_path / "contiguity.json"
  page_contiguity.main([
      "--model", "tiny", "--num-docs", "12", "--doc-len", "128",
      "--docs-per-request", "4", "--query-len", "8", "--output-len", "8",
      "--concurrency", "4", "--max-batch", "4", "--num-requests", "6",
      "--warm-cache-requests", "4", "--cache-pages", "400",
      "--decode-steps", "4", "--modes", "lazy", "--out", str(out)])
  report = json.loads(out.read_text())
  assert report == json.loads(capsys.readouterr().out)
  assert report["block_pages"] == 8
  assert report["blocks_seen"] > 0 and report["blocks_seen"] % 5 == 0
  assert report["consecutive_blocks"] == report["blocks_seen"] * 4 // 5
  assert report["consecutive_documents"] == report["cached_documents"] > 0


def test_more_than_one_mode_isassert_refused(capsys):
  assert_refused(capsys, page_contiguity.main,
           ["--model", "tiny", "--modes", "lazy,block"],
           "--modes takes one mode here, got 'lazy,block'")


@pytest.mark.parametrize("argv", [
    ["--warmup-requests", "4"], ["--kv-dtypes", "float8_e4m3fn"],
    ["--quality-runs", "sink"], ["--sink-len", "4"], ["--sweep-rates", "1"],
    ["--sweep-cache-fractions", "0.5"], ["--decode-during-prefill-runs"],
    ["--decode-during-prefill-only"], ["--skip-base"],
    ["--plot-dir", "plots"], ["--profile-replay-dir", "prof"]])
def test_rag_serving_options_it_never_runs_areassert_refused(capsys, argv):
  """Each was accepted and ignored: the run was not the one asked for."""
  assert_refused(capsys, page_contiguity.parse_args, ["--modes", "lazy"] + argv,
           f"{argv[0]}: options of benchmarks.rag_serving that "
           "benchmarks.page_contiguity does not run; leave them out")


def test_refused_options_are_named_together_and_in_the_docstring(capsys,
                                                                 tmp_path):
  rows = tmp_path / "a.partial.jsonl"
  rows.write_text(json.dumps(dict(kind="base", mode="lazy")) + "\n")
  assert_refused(capsys, page_contiguity.parse_args,
           ["--modes", "lazy", "--sink-len", "4", "--merge", str(rows)],
           "--sink-len, --merge: options of benchmarks.rag_serving that")
  for name in page_contiguity.NOT_RUN_HERE:
    flag = "--" + name.replace("_", "-")
    if not name.startswith(("sweep_", "decode_during_prefill_")):
      assert flag in page_contiguity.__doc__, flag
  assert "are refused" in page_contiguity.__doc__
  # What it runs stays accepted.
  args = page_contiguity.parse_args(
      ["--modes", "block", "--rate", "2", "--warm-cache-requests", "3",
       "--no-progress", "--eviction", "lru", "--impl", "xla"])
  assert (args.mode_list, args.rate, args.eviction) == (["block"], 2.0, "lru")


def test_a_pool_too_small_stops_before_any_run(capsys, monkeypatch):
  """4 documents of 2 pages and a page of query and answer: 9 pages."""
  ran = []
  monkeypatch.setattr(page_contiguity.rag_serving, "make_engine",
                      lambda *a, **k: ran.append(a))
  assert_refused(capsys, page_contiguity.main,
           ["--model", "tiny", "--modes", "lazy", "--cache-pages", "4"],
           "mode lazy: the largest request needs 9 pages but the pool has "
           "4; raise --cache-fraction or --cache-pages")
  assert not ran
