"""The engine's settings: what the scheduler decides and how the model runs.

Both are frozen and hashable, so an engine's settings cannot change under it
and can key a compile cache.  `split_settings` routes keyword settings (as
`LazyEngine.from_pretrained(..., max_batch=8, impl="xla")` takes them) to the
config that owns each one.
"""

from __future__ import annotations

import dataclasses
import types

from pallas_kernels.lazy_attention import IMPLS
from pallas_kernels.sizes import next_power_of_two


def _check_int(owner: str, name: str, value, minimum: int = 1,
               optional: bool = False):
  if optional and value is None:
    return
  if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
    allowed = " or None" if optional else ""
    raise ValueError(f"{owner}.{name} must be an int >= {minimum}{allowed}, "
                     f"got {value!r}")


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
  """How requests are admitted, grouped and decoded.

  Attributes:
    max_batch: most requests in flight (decode always runs this many rows).
    decode_steps: decode steps per compiled loop between scheduling points;
      requests join and leave only between loops.
    max_prefill_tokens: token budget of one prefill call (rows x length).
    prefill_tokens_per_step: stop admitting new requests in a scheduling
      step once their prefill work (missing documents plus own tokens)
      reaches this many tokens, so a burst of arrivals is prefilled over
      several steps with decode loops in between (None: admit all that fit).
    first_token_group_tokens: modes with a document step serve a round's
      requests cheapest first, in groups that each encode about this many
      new document tokens before their queries run.  Smaller groups give
      earlier first tokens for more, smaller prefill calls (None: one
      prefill call's worth, `max_prefill_tokens`).  benchmarks/RESULTS.md
      measures the trade-off.
    decode_during_prefill: the running requests decode one token in every
      prefill call of a round (document encoding and query prefill), in
      one mixed step (`lazyattn_jax/mixed_step.py`), instead of waiting
      for the round's prefill to end.  Off by default, where the most
      tokens/s matter; `SchedulerConfig.interactive()` (whose settings
      `lazyattn serve` starts from) turns it on with the settings that go
      with it (benchmarks/RESULTS.md, "The mixed step"; docs/design.md,
      "Mixed steps").
    decode_loops_to_first_finish: a decode loop runs only as many steps
      as the running request closest to its `max_new_tokens` still needs,
      rounded up to a power of two (at most `decode_steps`), so a request
      that reaches its limit leaves, and a waiting one is admitted, at the
      end of that loop instead of up to `decode_steps` steps later.  Tokens
      that requests decode during prefill then shorten their loops too.
      One decode program per loop length.  Off by default: no faster
      without `decode_during_prefill`, whose riders finish at different
      times (with it, 4% more tokens/s and 22% lower TTFT on the H200;
      benchmarks/RESULTS.md, "The mixed step").
    prefill_chunk_tokens: documents and requests' own prefill (queries,
      recomputed pages, full mode's prompts) longer than this go in chunks
      of at most this many tokens, in successive prefill calls, so no call
      holds a whole long prompt (with `decode_during_prefill`, running
      requests decode in each).  A chunk is at most `max_prefill_tokens`
      too, so a call keeps its budget (`chunk_tokens`).  Prefix mode keeps
      prompts whole (a request may read what an earlier one of its round
      writes).  None: no chunks.
  """

  max_batch: int = 16
  decode_steps: int = 8
  max_prefill_tokens: int = 8192
  prefill_tokens_per_step: int | None = None
  first_token_group_tokens: int | None = None
  decode_during_prefill: bool = False
  decode_loops_to_first_finish: bool = False
  prefill_chunk_tokens: int | None = None

  def __post_init__(self):
    for name in ("max_batch", "decode_steps", "max_prefill_tokens"):
      _check_int("SchedulerConfig", name, getattr(self, name))
    for name in ("prefill_tokens_per_step", "first_token_group_tokens",
                 "prefill_chunk_tokens"):
      _check_int("SchedulerConfig", name, getattr(self, name), optional=True)
    for name in ("decode_during_prefill", "decode_loops_to_first_finish"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"SchedulerConfig.{name} must be a bool, got "
                         f"{getattr(self, name)!r}")

  @classmethod
  def interactive(cls, **overrides) -> "SchedulerConfig":
    """The settings for online serving, where time to first token
    matters: `INTERACTIVE_SETTINGS` (decode during prefill in calls of at
    most 1,024 tokens, first-token groups of 4,096, decode loops to the
    first finish), then `overrides` (fields by name).

    On the H200 at the paper-like load they give a TTFT p50 38-39% below the
    plain rounds' at TPOT p50 under 20 ms, for 5-6% fewer tokens/s
    (benchmarks/RESULTS.md, "The mixed step").  `lazyattn serve` starts
    from them, with `from_pretrained`'s `max_batch` of 8 in place of the
    16 here; `SchedulerConfig()` keeps the plain rounds (most tokens/s).
    """
    return cls(**{**INTERACTIVE_SETTINGS, **overrides})

  @property
  def chunk_tokens(self) -> int | None:
    """The prefill chunk size in effect: `prefill_chunk_tokens`, at most
    one call's budget `max_prefill_tokens` (None: no chunks)."""
    if self.prefill_chunk_tokens is None:
      return None
    return min(self.prefill_chunk_tokens, self.max_prefill_tokens)

  @property
  def group_tokens(self) -> int:
    """The first-token group size in effect."""
    return self.first_token_group_tokens or self.max_prefill_tokens

  def loop_steps(self, fewest_tokens_left: int) -> int:
    """Steps of the next decode loop, where the running request closest to
    its limit may generate `fewest_tokens_left` more tokens."""
    if not self.decode_loops_to_first_finish:
      return self.decode_steps
    return min(self.decode_steps,
               next_power_of_two(max(1, fewest_tokens_left)))


# `SchedulerConfig.interactive()`'s fields.  Chunks of 1,024 tokens keep a
# long document or prompt from holding one call (and the riders) whole;
# at the measured load (512-token documents) they split nothing.
INTERACTIVE_SETTINGS = types.MappingProxyType(dict(
    decode_during_prefill=True,
    max_prefill_tokens=1024,
    first_token_group_tokens=4096,
    decode_loops_to_first_finish=True,
    prefill_chunk_tokens=1024,
))


@dataclasses.dataclass(frozen=True)
class RunnerConfig:
  """How the model steps are compiled and run.

  Attributes:
    impl: attention implementation, one of `pallas_kernels.lazy_attention.IMPLS`
      ("auto" picks by backend: Pallas kernels on GPU and TPU, XLA on CPU).
    pool_as_bits: carry a 16-bit pool through the model's layer loop as
      uint16 bit patterns (keeps XLA from widening the KV write scatter to
      float32), and float8 pages as uint8.  On CPU pools always travel as
      bits: XLA CPU widened a bfloat16 scatter to float32 and a float8 one
      to float16 over the whole pool around every write.
    decode_layer_unroll: unroll factor of the layer loop inside the decode
      loop (True: fully unrolled; faster steps, longer compiles).
    gpu_weights_in_place: on GPU, compile the steps with cuBLAS gemms that
      read each layer's slice of the stacked weights in place, instead of
      XLA's Triton gemm fusions, which copy it first
      (lazyattn_jax/step_jit.py).  No effect on other platforms.
    gpu_xla_options: more XLA compile options for the steps on GPU, as
      (name, value) pairs of XLA's DebugOptions, e.g.
      (("xla_gpu_dot_merger_threshold_mb", 0),); they override the
      weights-in-place ones.  An unknown name fails the first compile.
  """

  impl: str = "auto"
  pool_as_bits: bool = False
  decode_layer_unroll: int | bool = 1
  gpu_weights_in_place: bool = True
  gpu_xla_options: tuple = ()

  def __post_init__(self):
    if self.impl not in IMPLS:
      raise ValueError(f"RunnerConfig.impl must be one of {IMPLS}, got "
                       f"{self.impl!r}")
    if not isinstance(self.pool_as_bits, bool):
      raise ValueError("RunnerConfig.pool_as_bits must be a bool, got "
                       f"{self.pool_as_bits!r}")
    if not isinstance(self.gpu_weights_in_place, bool):
      raise ValueError("RunnerConfig.gpu_weights_in_place must be a bool, "
                       f"got {self.gpu_weights_in_place!r}")
    if not isinstance(self.gpu_xla_options, tuple) or not all(
        isinstance(o, tuple) and len(o) == 2 and isinstance(o[0], str) and
        isinstance(o[1], (bool, int, float, str)) for o in self.gpu_xla_options):
      raise ValueError("RunnerConfig.gpu_xla_options must be a tuple of "
                       "(name, bool/int/float/str value) pairs, got "
                       f"{self.gpu_xla_options!r}")
    if self.decode_layer_unroll is not True:
      _check_int("RunnerConfig", "decode_layer_unroll",
                 self.decode_layer_unroll)


def split_settings(scheduler: SchedulerConfig | None,
                   runner: RunnerConfig | None, settings: dict, *,
                   also_known: tuple[str, ...] = ()
                   ) -> tuple[SchedulerConfig, RunnerConfig]:
  """Applies keyword settings to the config that owns each of them.

  Raises TypeError naming a setting that neither config has; its list of
  known settings adds `also_known` (those the caller took out before).
  """
  scheduler = scheduler or SchedulerConfig()
  runner = runner or RunnerConfig()
  owned = {}
  for config in (scheduler, runner):
    names = {f.name for f in dataclasses.fields(config)}
    owned[id(config)] = {k: v for k, v in settings.items() if k in names}
  unknown = sorted(set(settings) - set().union(*map(set, owned.values())))
  if unknown:
    known = sorted([f.name for c in (scheduler, runner)
                    for f in dataclasses.fields(c)] + list(also_known))
    raise TypeError(f"unknown engine settings {unknown}; known: {known}")
  return (dataclasses.replace(scheduler, **owned[id(scheduler)]),
          dataclasses.replace(runner, **owned[id(runner)]))
