"""Sampling parameters and the jit-compatible token sampler.

Every row of a batch carries its own parameters as arrays, so requests with
different settings share one compiled decode step.  A row's random stream is
`fold_in(PRNGKey(seed), step)`: the same request with the same seed gives the
same tokens whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from lazyattn_jax.errors import InvalidRequestError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  """How to pick tokens.

  Integers must be Python or NumPy integers (not bools) and numbers finite;
  a bad field raises `InvalidRequestError` when the params are made.

  Attributes:
    max_new_tokens: generate at most this many tokens (>= 1).
    temperature: 0 means greedy (argmax); otherwise logits are divided by it.
    top_k: keep only the k most likely tokens (0 = no limit).
    top_p: nucleus sampling: keep the smallest set of tokens whose
      probability reaches top_p, in (0, 1].  Under either cut, tokens whose
      logit equals the last kept one's are kept too.
    seed: random seed of this request, any 64-bit integer.  Inside the
      int32 range it is the PRNG seed itself; seeds outside it are mixed
      down to 32 bits (`step_packing.seed_int32`), so two of those may,
      rarely, draw the same stream.
    stop_token_ids: generation stops after emitting any of these (the stop
      token is included in the output).  `None` means the model's defaults.
  """

  max_new_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  seed: int = 0
  stop_token_ids: Sequence[int] | None = None

  def __post_init__(self):
    # Every field is checked here, so a bad value is refused when the
    # request is made, never later inside a scheduling round.
    _set(self, "max_new_tokens", _integer("max_new_tokens", self.max_new_tokens,
                                          1, _INT32_MAX))
    _set(self, "top_k", _integer("top_k", self.top_k, 0, _INT32_MAX))
    _set(self, "seed", _integer("seed", self.seed, -2**63, 2**63 - 1))
    _set(self, "temperature", _real("temperature", self.temperature))
    _set(self, "top_p", _real("top_p", self.top_p))
    if not self.temperature >= 0:
      raise InvalidRequestError(
          f"temperature must be >= 0, got {self.temperature!r}")
    if not 0.0 < self.top_p <= 1.0:
      raise InvalidRequestError(f"top_p must lie in (0, 1], got {self.top_p!r}")
    if self.stop_token_ids is not None:
      # A mapping would give its keys, which are no one's stop ids.
      if isinstance(self.stop_token_ids,
                    (str, bytes, bytearray, Mapping)) or not (
          isinstance(self.stop_token_ids, Iterable)) or getattr(
              self.stop_token_ids, "ndim", None) == 0:  # a 0-d array
        raise InvalidRequestError(
            "stop_token_ids must be a sequence of token ids or None, got "
            f"{type(self.stop_token_ids).__name__}")
      _set(self, "stop_token_ids", tuple(
          _integer("stop_token_ids entry", t, 0, _INT32_MAX)
          for t in self.stop_token_ids))


_INT32_MAX = 2**31 - 1


def _set(params, name, value):
  object.__setattr__(params, name, value)


def _integer(name: str, value, low: int, high: int) -> int:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value,
                                                           numbers.Integral):
    raise InvalidRequestError(
        f"{name} must be an integer, got {type(value).__name__} {value!r}")
  if not low <= value <= high:
    raise InvalidRequestError(
        f"{name} must lie in [{low}, {high}], got {value!r}")
  return int(value)


def _real(name: str, value) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise InvalidRequestError(
        f"{name} must be a number, got {type(value).__name__} {value!r}")
  # The step takes it as float32, where a larger value is inf (and a
  # temperature of inf turns the padded vocabulary's -inf logits to NaN).
  if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX):
    raise InvalidRequestError(
        f"{name} must be finite as a float32 (|x| <= {_FLOAT32_MAX:.7g}), "
        f"got {value!r}")
  return float(value)


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def sample_tokens(logits, temperature, top_k, top_p, seed, step, *,
                  any_sampled: bool = True, vocab_limit: int | None = None):
  """Samples one token per row.

  Args:
    logits: float32[B, V].
    temperature: float32[B]; rows with 0 take the argmax.
    top_k: int32[B]; 0 = no limit.
    top_p: float32[B] in (0, 1].
    seed: int32[B] per-request seeds.
    step: int32[B] index of the token being generated (0 for the first).
    any_sampled: static; False promises that every temperature is 0, and
      the batch then takes the argmax with no sort.  The caller knows it on
      the host (`sampling_needs_sort`); deciding it in the program would
      take a conditional, which on GPU makes the host wait for the device.
    vocab_limit: static; ids from it on are never drawn (a model whose
      embedding has padding rows past its tokenizer's last token, as
      Qwen2's: no text could show them).  None: every id.

  Returns:
    int32[B] token ids.
  """
  if vocab_limit is not None and vocab_limit < logits.shape[-1]:
    ids = jnp.arange(logits.shape[-1])[None, :]
    logits = jnp.where(ids < vocab_limit, logits, -jnp.inf)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if not any_sampled:
    return greedy
  # Sampled rows always take the sorted path, so a row's tokens do not
  # depend on the rest of its batch.
  return jnp.where(temperature > 0,
                   _sample_sorted(logits, temperature, top_k, top_p, seed,
                                  step), greedy)


def sampling_needs_sort(temperature) -> bool:
  """Whether any row of the host array `temperature` samples (the
  `any_sampled` of `sample_tokens`)."""
  return bool(np.any(np.asarray(temperature) > 0))


def _sample_sorted(logits, temperature, top_k, top_p, seed, step):
  """One token per row drawn from its temperature-scaled logits cut to
  top-k and top-p (both prefix cuts of the sorted order)."""
  safe_temp = jnp.where(temperature > 0, temperature, 1.0)
  # From the row's maximum down, so a tiny temperature cannot push logits
  # to +inf (whose softmax is NaN, which drew the lowest such id).
  scaled = (logits - jnp.max(logits, axis=-1, keepdims=True)) / safe_temp[
      :, None]
  # The draw is made in vocabulary order, so each token meets the same
  # noise whatever its rank: near-equal logits that a rounding difference
  # reorders (another batch, another cache history) do not move the draw,
  # as they did when the noise followed the sorted order.
  masked = jnp.where(_kept_tokens(scaled, top_k, top_p), scaled, -jnp.inf)

  def draw(seed_b, step_b, row):
    key = jax.random.fold_in(jax.random.PRNGKey(seed_b), step_b)
    return jax.random.categorical(key, row)

  return jax.vmap(draw)(seed, step, masked).astype(jnp.int32)


def _kept_tokens(scaled, top_k, top_p):
  """bool[B, V], in vocabulary order: the tokens top-k and top-p keep of
  each row of `scaled` (float32[B, V], temperature applied).

  The cuts are found on the row's values sorted high to low, and each
  becomes a threshold: a token is kept when its value is at least the
  last kept value's.  Tokens tied with that value are all kept (as
  transformers' top-k keeps them), so no order among equal values
  decides, and no sort permutation has to be scattered back.
  """
  vocab = scaled.shape[-1]
  sorted_logits = -jnp.sort(-scaled, axis=-1)
  rank = jnp.arange(vocab)[None, :]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
  keep = rank < k[:, None]
  probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
  # Keep a token if the mass strictly before it is below top_p (so the first
  # token is always kept).  top_p 1 keeps every token: a float32 running sum
  # reaches 1 before the tail of a large vocabulary, which it would cut.
  mass_before = jnp.cumsum(probs, axis=-1) - probs
  keep = keep & ((mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0))
  # `keep` is a prefix of the sorted row: its length names the last value.
  last_kept = jnp.maximum(jnp.sum(keep, axis=-1, keepdims=True) - 1, 0)
  threshold = jnp.take_along_axis(sorted_logits, last_kept, axis=-1)
  return scaled >= threshold
