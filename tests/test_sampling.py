"""The jit-compatible sampler: greedy rows, sampled rows, and the
all-greedy batch that skips the vocabulary sort."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lazyattn_jax.sampling import sample_tokens, sampling_needs_sort
from tests.jaxpr_helpers import primitives

VOCAB = 64


def _logits(batch, seed=0):
  return jax.random.normal(jax.random.PRNGKey(seed), (batch, VOCAB)) * 3.0


def _params(batch, temperature=0.0, top_k=0, top_p=1.0):
  return (jnp.full((batch,), temperature, jnp.float32),
          jnp.full((batch,), top_k, jnp.int32),
          jnp.full((batch,), top_p, jnp.float32),
          jnp.arange(batch, dtype=jnp.int32), jnp.zeros((batch,), jnp.int32))


def test_a_greedy_batch_takes_the_argmax():
  logits = _logits(5)
  tokens = jax.jit(sample_tokens)(logits, *_params(5))
  np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def test_a_sampled_row_does_not_depend_on_its_batch():
  logits = _logits(4)
  temperature, top_k, top_p, seed, step = _params(4, temperature=1.0,
                                                   top_k=10, top_p=0.9)
  together = sample_tokens(logits, temperature, top_k, top_p, seed, step)
  # Row 2 alone, and row 2 beside greedy rows: the same token.
  alone = sample_tokens(logits[2:3], temperature[2:3], top_k[2:3],
                        top_p[2:3], seed[2:3], step[2:3])
  greedy_rows = np.array([0, 1, 3])
  mixed_temperature = temperature.at[greedy_rows].set(0.0)
  mixed = sample_tokens(logits, mixed_temperature, top_k, top_p, seed, step)
  assert int(alone[0]) == int(together[2]) == int(mixed[2])
  greedy = np.argmax(logits, axis=-1)
  np.testing.assert_array_equal(np.asarray(mixed)[greedy_rows],
                                greedy[greedy_rows])


@pytest.mark.parametrize("top_k,top_p", [(2, 1.0), (0, 1e-6), (1, 1.0)])
def test_top_k_and_top_p_bound_the_draws(top_k, top_p):
  logits = jnp.tile(_logits(1), (200, 1))
  temperature, k, p, _, step = _params(200, temperature=2.0, top_k=top_k,
                                       top_p=top_p)
  seeds = jnp.arange(200, dtype=jnp.int32)
  tokens = np.asarray(jax.jit(sample_tokens)(logits, temperature, k, p, seeds,
                                             step))
  order = np.argsort(-np.asarray(logits[0]))
  allowed = order[:2] if top_k == 2 else order[:1]
  assert set(tokens.tolist()) <= set(allowed.tolist())
  if top_k == 2:  # a temperature of 2 over 200 seeds draws both
    assert len(set(tokens.tolist())) == 2


def test_an_all_greedy_batch_sorts_nothing_and_nothing_branches():
  """`any_sampled=False` (the host saw no sampling row) is an argmax with no
  sort; either way the sampler has no conditional, which on GPU would make
  the host wait for the device in every step."""
  logits, params = _logits(3), _params(3)
  greedy = jax.make_jaxpr(functools.partial(sample_tokens, any_sampled=False))(
      logits, *params)
  sampled = jax.make_jaxpr(sample_tokens)(logits, *params)
  assert "sort" not in primitives(greedy.jaxpr)
  assert "sort" in primitives(sampled.jaxpr)
  for closed in (greedy, sampled):
    assert not {"cond", "while"} & primitives(closed.jaxpr)
  temperature = np.zeros((3,), np.float32)
  np.testing.assert_array_equal(
      sample_tokens(logits, temperature, *params[1:], any_sampled=False),
      np.argmax(np.asarray(logits), axis=-1))
  assert not sampling_needs_sort(temperature)
  assert sampling_needs_sort(np.array([0.0, 0.7, 0.0], np.float32))


@pytest.mark.parametrize("temperature", [1e-3, 1e-20, 1e-37, 1e-44])
def test_a_tiny_temperature_draws_the_argmax(temperature):
  """logits / T overflowed to +inf for several ids; their softmax was NaN
  and the draw fell to the lowest of them (id 3 here, not 10)."""
  logits = jnp.zeros((1, VOCAB)).at[0, 10].set(45.0).at[0, 3].set(40.0)
  params = _params(1, temperature=temperature)
  assert int(sample_tokens(logits, *params)[0]) == 10


@pytest.mark.parametrize("temperature", [0.0, 1.0, 50.0])
def test_ids_past_the_vocab_limit_are_never_drawn(temperature):
  """A padded embedding (Qwen2: 151,936 rows, 151,665 tokens) has ids no
  text shows; drawn, they failed the request's text.  Here the padding ids
  hold the largest logits."""
  logits = _logits(64).at[:, 50:].add(30.0)
  params = _params(64, temperature=temperature)
  tokens = np.asarray(jax.jit(functools.partial(
      sample_tokens, vocab_limit=50))(logits, *params))
  assert tokens.max() < 50
  want = np.argmax(np.asarray(logits)[:, :50], axis=-1)
  if temperature == 0.0:
    np.testing.assert_array_equal(tokens, want)
  unlimited = np.asarray(sample_tokens(logits, *params))
  assert (unlimited >= 50).any()  # the padding is drawn without the limit


@pytest.mark.parametrize("field,value", [("temperature", 1e39),
                                         ("temperature", 3.5e38),
                                         ("top_p", 1e39)])
def test_values_past_float32_are_refused(field, value):
  """The step takes temperature as float32: 1e39 became inf there, and
  (-inf - max) / inf made every padded-vocabulary row NaN, so each draw
  was token 0 whatever the seed."""
  from lazyattn_jax.errors import InvalidRequestError
  from lazyattn_jax.sampling import SamplingParams
  with pytest.raises(InvalidRequestError, match=f"{field} must be finite as "
                     "a float32"):
    SamplingParams(**{field: value})
  assert SamplingParams(temperature=3.4e38).temperature == 3.4e38


def test_a_rounding_difference_in_the_logits_does_not_move_a_seeded_draw():
  """The same seeded request read its documents from a cache that another
  history had filled (encoded beside other documents), so its logits
  differed by 2e-6, and its first token differed: the noise followed the
  sorted order, which the rounding had reshuffled among near-equal logits
  (6 of 256 draws changed on a flat 49,152-token row).  Here the two
  likeliest tokens swap places under a 2e-6 nudge: with the noise in
  sorted order, every draw that took one of them took the other."""
  rows = 256
  row = np.linspace(-4.0, 0.0, VOCAB).astype(np.float32)
  row[[10, 50]] = 2.0
  nudged = row.copy()
  nudged[50] += 2e-6  # token 50 now ranks first, where the tie put 10
  params = (jnp.full((rows,), 0.8, jnp.float32), jnp.zeros((rows,),
                                                             jnp.int32),
            jnp.ones((rows,), jnp.float32),
            jnp.arange(rows, dtype=jnp.int32), jnp.zeros((rows,), jnp.int32))
  draws = np.asarray(sample_tokens(jnp.asarray(np.tile(row, (rows, 1))),
                                   *params))
  nudged_draws = np.asarray(sample_tokens(
      jnp.asarray(np.tile(nudged, (rows, 1))), *params))
  assert 100 < np.isin(draws, [10, 50]).sum() < rows  # the seeds spread
  assert (draws != nudged_draws).sum() == 0


def test_top_p_one_keeps_every_token_of_a_large_vocabulary():
  """The float32 running sum of a 152k-token row reaches 1 before its
  tail, and top_p 1 (no cut, the default) dropped those tokens."""
  from lazyattn_jax.sampling import _kept_tokens
  vocab = 151_936  # Qwen2's
  row = np.random.default_rng(1).normal(size=vocab) * 3.0  # 3,280 dropped
  scaled = jnp.asarray(np.stack([row, row]), jnp.float32)
  top_p = jnp.array([1.0, 0.5], jnp.float32)
  kept = np.asarray(_kept_tokens(scaled, jnp.zeros((2,), jnp.int32), top_p))
  assert kept[0].all()
  assert 0 < kept[1].sum() < vocab  # a cut below 1 still cuts


def _kept_by_rank(row, top_k, top_p):
  """float64 reference: the top-k, then top-p prefix of the row sorted high
  to low, as a set of token ids (the row's values all distinct)."""
  order = np.argsort(-row, kind="stable")
  k = len(row) if top_k <= 0 else min(top_k, len(row))
  values = row[order[:k]].astype(np.float64)
  probs = np.exp(values - values.max())
  probs /= probs.sum()
  mass_before = np.cumsum(probs) - probs
  n = k if top_p >= 1.0 else max(1, int((mass_before < top_p).sum()))
  return set(order[:n].tolist())


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (5, 1.0),
                                         (0, 0.3), (0, 0.9), (7, 0.5),
                                         (64, 0.99), (100, 0.6)])
def test_kept_tokens_match_the_sorted_prefix(top_k, top_p):
  from lazyattn_jax.sampling import _kept_tokens
  rows = np.asarray(_logits(16, seed=3))
  kept = np.asarray(_kept_tokens(
      jnp.asarray(rows), jnp.full((16,), top_k, jnp.int32),
      jnp.full((16,), top_p, jnp.float32)))
  for row, mask in zip(rows, kept):
    assert set(np.flatnonzero(mask).tolist()) == _kept_by_rank(
        row, top_k, top_p)


def test_tokens_tied_at_the_cut_are_all_kept_whatever_their_order():
  """A cut that falls inside a run of equal values keeps the whole run (as
  transformers' top-k does), so which of them an argsort ranks first
  cannot decide the draw."""
  from lazyattn_jax.sampling import _kept_tokens
  row = np.full((VOCAB,), -5.0, np.float32)
  row[[3, 40, 17]] = 2.0  # three tokens tied at the top
  row[9] = 4.0
  scaled = jnp.asarray(np.stack([row, row[::-1]]))
  kept = np.asarray(_kept_tokens(scaled, jnp.full((2,), 2, jnp.int32),
                                 jnp.ones((2,), jnp.float32)))
  assert set(np.flatnonzero(kept[0]).tolist()) == {3, 9, 17, 40}
  assert set(np.flatnonzero(kept[1]).tolist()) == {
      VOCAB - 1 - i for i in (3, 9, 17, 40)}
