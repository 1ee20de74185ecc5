"""The training order: which samples, and which layout, at every step.

Everything here is a pure function of (seed, step), so an interrupted run
that resumes at step s sees exactly the batches an uninterrupted run sees,
without replaying the steps before s.

Samples are read epoch by epoch in a permutation drawn from (seed, epoch).
A sample the batch builder cannot use (too long) is replaced by a draw from
(seed, step, slot, attempt).  The slots that use full attention instead of
the engine's layout are drawn from (seed, step): floor(share * batch) of
them, plus one more with probability frac(share * batch), so any share is
honoured on average and a share times batch that is whole is exact in
every batch.

A seed is any 64-bit integer (as `SamplingParams.seed`); numpy's
generators take only non-negative entropy, so `seed_entropy` maps it to
one, the same way every time.
"""

from __future__ import annotations

import functools
import numbers

import numpy as np

from lazyattn_jax.training.errors import TrainingInputError

_FULL_STREAM, _RETRY_STREAM = 1, 2  # separate random streams per purpose
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


def seed_entropy(seed: int) -> int:
  """`seed` as the non-negative entropy numpy's generators take.

  Seeds >= 0 stay as they are, so existing runs keep their order; a
  negative seed becomes seed + 2**64 (two's complement), which no seed in
  [SEED_MIN, SEED_MAX] >= 0 reaches, so distinct seeds stay distinct."""
  return int(seed) % 2**64


def check_seed(seed, name: str = "seed") -> int:
  """`seed` as an int in [SEED_MIN, SEED_MAX], the range SamplingParams
  takes.

  Raises:
    TrainingInputError: not an integer (bools included), or out of range.
  """
  if isinstance(seed, (bool, np.bool_)) or not isinstance(
      seed, numbers.Integral):
    raise TrainingInputError(f"{name} must be an integer, got "
                             f"{type(seed).__name__} {seed!r}")
  if not SEED_MIN <= seed <= SEED_MAX:
    raise TrainingInputError(f"{name} must lie in [{SEED_MIN}, {SEED_MAX}], "
                             f"got {seed}")
  return int(seed)


@functools.lru_cache(maxsize=4)
def _permutation(seed: int, epoch: int, size: int) -> np.ndarray:
  return np.random.default_rng([seed_entropy(seed), 0, epoch]).permutation(
      size)


def sample_indices(seed: int, step: int, batch_size: int,
                   size: int) -> list[int]:
  """Indices into a source of `size` samples for the batch of `step`."""
  first = step * batch_size
  out = []
  for i in range(first, first + batch_size):
    epoch, position = divmod(i, size)
    out.append(int(_permutation(seed, epoch, size)[position]))
  return out


def replacement_index(seed: int, step: int, slot: int, attempt: int,
                      size: int) -> int:
  """The sample to try in place of an unusable one (attempt 1, 2, ...)."""
  rng = np.random.default_rng([seed_entropy(seed), _RETRY_STREAM, step,
                               slot, attempt])
  return int(rng.integers(size))


def full_attention_slots(seed: int, step: int, batch_size: int,
                         share: float) -> np.ndarray:
  """bool[batch_size]: the slots of step `step` laid out with plain causal
  full attention (the rest use the engine's lazy layout)."""
  rng = np.random.default_rng([seed_entropy(seed), _FULL_STREAM, step])
  whole, frac = divmod(share * batch_size, 1.0)
  count = int(whole) + int(rng.random() < frac)
  slots = np.zeros(batch_size, bool)
  slots[rng.permutation(batch_size)[:count]] = True
  return slots
