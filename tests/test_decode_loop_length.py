"""Decode loops that end at the first length-limited finish
(`SchedulerConfig.decode_loops_to_first_finish`): the loop length rule, the
same greedy tokens as fixed loops, and a short request that leaves (and a
waiting one that is admitted) rounds earlier."""

from __future__ import annotations

import numpy as np
import pytest

from lazyattn_jax.config import SchedulerConfig
from tests.test_engine import greedy, make_engine, model_and_config  # noqa: F401
from tests.test_engine import random_tokens


@pytest.mark.parametrize("left, steps", [
    (0, 1), (1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (8, 8), (9, 8), (50, 8)])
def test_loop_steps_reach_the_first_finish(left, steps):
  on = SchedulerConfig(decode_steps=8, decode_loops_to_first_finish=True)
  assert on.loop_steps(left) == steps
  assert SchedulerConfig(decode_steps=8).loop_steps(left) == 8


def test_loop_option_must_be_a_bool():
  with pytest.raises(ValueError,
                     match="decode_loops_to_first_finish must be a bool"):
    SchedulerConfig(decode_loops_to_first_finish=1)


def _serve(engine, vocab):
  """Two running requests (3 and 30 new tokens) and a third that waits for
  a free row.  Returns (results by name, the decode steps run when each
  finished)."""
  rng = np.random.default_rng(5)
  docs = [random_tokens(rng, n, vocab) for n in (7, 5)]
  ids = {"short": engine.submit(random_tokens(rng, 4, vocab), docs,
                                greedy(3)),
         "long": engine.submit(random_tokens(rng, 6, vocab), docs[::-1],
                               greedy(30)),
         "waiting": engine.submit(random_tokens(rng, 5, vocab), docs[:1],
                                  greedy(4))}
  results, finished_at = {}, {}
  while engine.has_work():
    for r in engine.step():
      results[r.request_id] = r
      finished_at[r.request_id] = engine.stats.decode_steps
  return ({n: results[i] for n, i in ids.items()},
          {n: finished_at[i] for n, i in ids.items()})


def test_loops_to_first_finish_keep_tokens_and_free_rows_sooner(
    model_and_config):
  _, config, _ = model_and_config
  fixed = make_engine(model_and_config, max_batch=2, decode_steps=16)
  fitted = make_engine(model_and_config, max_batch=2, decode_steps=16,
                       decode_loops_to_first_finish=True)
  plain, plain_steps = _serve(fixed, config.vocab_size)
  fitted_results, fitted_steps = _serve(fitted, config.vocab_size)
  for name in plain:
    assert fitted_results[name].finish_reason == "length"
    assert plain[name].finish_reason == "length"
    assert fitted_results[name].token_ids == plain[name].token_ids, name
  # "short" needs 2 decode tokens: its loop runs 2 steps, not 16, and
  # "waiting" (3 decode tokens) takes its row after them and runs a loop
  # of 4 steps; fixed loops run 16 steps each.
  assert (plain_steps["short"], fitted_steps["short"]) == (16, 2)
  assert (plain_steps["waiting"], fitted_steps["waiting"]) == (32, 6)
  assert fitted_steps["long"] < plain_steps["long"]


def test_serving_benchmark_passes_the_option():
  from benchmarks.rag_serving import build_model, make_engine
  from benchmarks.rag_serving_cli import parse_args
  args = parse_args(["--model", "tiny", "--decode-loops-to-first-finish"])
  config, model, dtype = build_model(args)
  engine = make_engine(args, config, model, dtype, "lazy", 64)
  assert engine.scheduler_config.decode_loops_to_first_finish
  plain = make_engine(parse_args(["--model", "tiny"]), config, model, dtype,
                      "lazy", 64)
  assert not plain.scheduler_config.decode_loops_to_first_finish
