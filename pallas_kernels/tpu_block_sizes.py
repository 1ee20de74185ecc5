"""Block sizes of the TPU (Pallas / Mosaic) lazy attention kernels.

Sizes are given in tokens and rounded to whole pages by the kernels.  The
defaults keep the double-buffered K/V blocks a few MiB, well inside the scoped
VMEM of every TPU generation (16 MiB on v4 / v5p), and the scalar-prefetched
page metadata inside SMEM (1 MiB on v4 and later).
"""

from __future__ import annotations

import dataclasses


class _PositiveSizes:
  """Checks that every field is a positive int; a field whose default is
  None may also be None (meaning: the kernel picks)."""

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if value is None and field.default is None:
        continue
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{type(self).__name__}.{field.name} must be a "
                         f"positive int, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TpuDecodeBlockSizes(_PositiveSizes):
  """Decode (T == 1): one program per (batch row, KV split), all KV heads.

  Attributes:
    kv_tokens_per_block: KV tokens fetched per DMA step (all KV heads).
    num_splits: fixed number of splits of a row's pages over programs, whose
      partial softmax states are merged afterwards; None picks one.
    max_splits: upper bound of the automatic choice (TensorCores per chip that
      can share one row: 2 on megacore chips).
    min_blocks_per_split: the automatic choice gives every split at least this
      many KV blocks.
    kv_buffer_bytes: VMEM budget of the double-buffered K and V blocks; the
      block shrinks (whole pages) to fit.
    max_metadata_bytes: SMEM budget of one kernel call's scalars (page
      metadata, float8 scales, per-program scalars); larger batches run as
      several kernel calls over batch chunks.
  """

  kv_tokens_per_block: int = 256
  num_splits: int | None = None
  max_splits: int = 2
  min_blocks_per_split: int = 4
  kv_buffer_bytes: int = 8 << 20
  max_metadata_bytes: int = 512 << 10


@dataclasses.dataclass(frozen=True)
class TpuPrefillBlockSizes(_PositiveSizes):
  """Prefill (T > 1): one program per (batch row, KV head, query tile).

  A query tile holds `q_tokens_per_block` tokens times the G query heads that
  share the KV head, so one fetch of K/V serves the whole group.

  Attributes:
    q_tokens_per_block: query tokens per tile (rounded to a multiple of 8).
    max_q_rows: cap on tokens x G rows per tile (the tile shrinks to fit).
    kv_tokens_per_block: KV tokens fetched per DMA step (one KV head).
    kv_buffer_bytes: VMEM budget of the double-buffered K and V blocks.
    max_metadata_bytes: SMEM budget of one kernel call's scalars (page
      metadata, float8 scales, two per query tile); larger batches run as
      several kernel calls over batch chunks.
  """

  q_tokens_per_block: int = 128
  max_q_rows: int = 512
  kv_tokens_per_block: int = 512
  kv_buffer_bytes: int = 8 << 20
  max_metadata_bytes: int = 512 << 10
