"""lazyattn_jax: position-agnostic, zero-copy KV reuse for RAG.

The user-facing engine is `LazyEngine` (`LazyEngine.from_pretrained(...)`,
`generate`, `generate_batch`, `generate_stream`, `submit`/`step`) with
`SamplingParams`, `Request` and the settings `SchedulerConfig`,
`RunnerConfig`, `CacheConfig` and `QualityOptions` (answer-quality options
for independently encoded documents; `from_pretrained` turns on defaults).
The cache itself is a functional pytree
(`lazyattn_jax.cache_state`) with pure, jit-compatible transitions.  See
docs/design.md.
"""

from lazyattn_jax.cache_config import CacheConfig
from lazyattn_jax.config import RunnerConfig, SchedulerConfig
from lazyattn_jax.engine import EngineStats, LazyEngine
from lazyattn_jax.errors import (
    CacheCapacityError,
    EngineClosedError,
    InvalidOptionError,
    InvalidRequestError,
    LazyAttnError,
    RequestFailedError,
    ResultTakenError,
)
from lazyattn_jax.quality_options import QualityOptions
from lazyattn_jax.requests import GenerationResult, Request
from lazyattn_jax.sampling import SamplingParams

__all__ = [
    "CacheCapacityError",
    "CacheConfig",
    "EngineClosedError",
    "EngineStats",
    "GenerationResult",
    "InvalidOptionError",
    "InvalidRequestError",
    "LazyAttnError",
    "LazyEngine",
    "QualityOptions",
    "Request",
    "RequestFailedError",
    "ResultTakenError",
    "RunnerConfig",
    "SamplingParams",
    "SchedulerConfig",
]
