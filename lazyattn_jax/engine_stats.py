"""The engine's counters (`LazyEngine.stats`), which the rounds fill."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class EngineStats:
  """Counters since the engine was built (or `reset_stats`).

  `prefill_tokens_computed` counts every token prefilled: documents, the
  preamble, requests' recomputed first pages and queries.
  `kv_pages_written_for_cached_docs` counts pages written per request from
  cached documents' KV (Block-Attention's copies; 0 in lazy mode).
  `generated_tokens` counts every token decoded after the first, in decode
  loops and, with decode during prefill, in mixed steps (`mixed_steps`);
  `decode_steps`, `decode_loop_tokens` and `decode_seconds` count the
  decode loops alone, so `decode_seconds / decode_steps` is a loop step's
  time and `decode_loop_tokens / decode_seconds` their rate.
  """
  prefill_tokens_computed: int = 0
  documents_prefilled: int = 0
  preambles_prefilled: int = 0
  kv_pages_written_for_cached_docs: int = 0
  peak_pages_used: int = 0
  decode_steps: int = 0
  generated_tokens: int = 0
  decode_seconds: float = 0.0  # wall time inside decode loops (device synced)
  decode_loop_tokens: int = 0
  mixed_steps: int = 0  # prefill calls that carried decode rows
