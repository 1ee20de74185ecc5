"""The mixed step (decode rows and a prefill chunk in one pass) at tensor
parallel 2 against one device: the same logits, tokens and pool."""

from __future__ import annotations

import numpy as np
from flax import nnx

from lazyattn_jax.cache_state import CacheConfig
from lazyattn_jax.config import split_settings
from lazyattn_jax.engine import LazyEngine
from lazyattn_jax.layout import PageRow, PrefillTokens
from lazyattn_jax.sampling import SamplingParams
from models.config import LlamaConfig
from models.llama import Llama
from tests.multi_device import needs_devices

PAGE = 4
CONFIG = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, max_position=512)
# As the engine tests at tensor parallel (tests/multi_device/test_tp_engine):
# the row-parallel projections sum their partial products in another order.
TOL = 1e-4


def _engine(model, tp, num_pages, **settings):
  """A float32 engine on CONFIG (XLA attention) with these scheduler and
  runner settings."""
  cache = CacheConfig(num_pages=num_pages, page_size=PAGE,
                      num_layers=CONFIG.num_layers,
                      num_kv_heads=CONFIG.num_kv_heads,
                      head_dim=CONFIG.head_dim, dtype="float32", max_docs=16,
                      max_pages_per_doc=8)
  scheduler, runner = split_settings(None, None, dict(impl="xla",
                                                      **settings))
  return LazyEngine(CONFIG, model, cache, scheduler=scheduler, runner=runner,
                    tensor_parallel=tp)


def _live_engine(model, tp):
  """An engine after one round with two requests decoding."""
  engine = _engine(model, tp, 32, max_batch=2, decode_steps=1)
  rng = np.random.default_rng(3)
  sampling = SamplingParams(max_new_tokens=8, temperature=0.0,
                            stop_token_ids=())
  for n in (7, 10):
    engine.submit(rng.integers(1, CONFIG.vocab_size, 5).tolist(),
                  [rng.integers(1, CONFIG.vocab_size, n).tolist()], sampling)
  engine.step()
  return engine


def test_mixed_step_at_tensor_parallel_2_matches_one_device():
  needs_devices(2)
  model = Llama(CONFIG, rngs=nnx.Rngs(0))
  results = []
  for tp in (None, 2):
    engine = _live_engine(model, tp)
    decoding = engine.scheduler.decoding()
    assert len(decoding) == 2
    state = engine.rounds.state
    free = np.flatnonzero(np.asarray(state.page_refcount) == 0)[:2].tolist()
    tokens = np.random.default_rng(4).integers(1, CONFIG.vocab_size,
                                               6).tolist()
    row = PageRow()
    row.add_run(free, 0, 0, len(tokens), PAGE)
    plan = PrefillTokens()
    plan.add(tokens, 0, free, 0, PAGE)
    state, *out = engine.runner.mixed_step(
        state, decoding, 2, [row], [plan],
        [SamplingParams(temperature=0.0)], [True])
    engine.rounds.state = state
    results.append((out, np.asarray(state.k), np.asarray(state.v), free))
    engine.close()
  (one, k_one, v_one, free_one), (two, k_two, v_two, free_two) = results
  assert free_one == free_two
  decode_logits, nxt, done, prefill_logits, first = one
  np.testing.assert_allclose(two[0], decode_logits, rtol=TOL, atol=TOL)
  np.testing.assert_allclose(two[3], prefill_logits, rtol=TOL, atol=TOL)
  for got, want in zip((two[1], two[2], two[4]), (nxt, done, first)):
    np.testing.assert_array_equal(got, want)
  assert first.tolist() == [int(np.argmax(prefill_logits[0]))]
  for got, want in ((k_two, k_one), (v_two, v_one)):
    np.testing.assert_allclose(got, want, rtol=TOL, atol=TOL)
  # The chunk's pages were free (zeros) and now hold its keys.
  assert np.abs(k_one[:, :, free_one[0]]).min(axis=-1).all()


def _riding_tokens(model, tp):
  """Greedy tokens of A (running) and four requests served in four
  first-token groups of one round, with decode during prefill: the
  riders change twice within the round (tests/test_decode_during_prefill.py
  on one device)."""
  engine = _engine(model, tp, 64, max_batch=8, decode_steps=2,
                   first_token_group_tokens=10, decode_during_prefill=True)
  rng = np.random.default_rng(8)
  tokens = lambda n: rng.integers(1, CONFIG.vocab_size, n).tolist()
  sampling = lambda n: SamplingParams(max_new_tokens=n, temperature=0.0,
                                      stop_token_ids=())
  ids = [engine.submit(tokens(5), [tokens(10)], sampling(12))]
  engine.step()
  ids += [engine.submit(tokens(4), [tokens(10)], sampling(5))
          for _ in range(4)]
  results = {}
  while engine.has_work():
    results.update({r.request_id: r for r in engine.step()})
  engine.close()
  return [results[i].token_ids for i in ids]


def test_riders_changing_within_a_round_at_tensor_parallel_2():
  needs_devices(2)
  model = Llama(CONFIG, rngs=nnx.Rngs(0))
  assert _riding_tokens(model, 2) == _riding_tokens(model, None)
