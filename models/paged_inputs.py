"""What a forward pass needs to know about the paged KV pool.

The engine builds one `PagedAttentionInputs` per step; the model scatters the
step's new K/V into the pool and then attends through
`pallas_kernels.lazy_attention` with the page metadata.

Conventions (docs/design.md, "Kernel contract"):
- New keys are stored rotated at angle `q_pos` (a token's own position within
  the sequence it is encoded in: the position inside its document for a
  document prefill, its logical position for query and generated tokens, whose
  pages carry shift 0).
- `page_len` already counts the tokens written in this step, so a row sees
  itself.
- A write whose `write_page` is outside [0, num_pages) is dropped; padding
  rows use that (there is no reserved sentinel page).
"""

from __future__ import annotations

import dataclasses

import jax


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedAttentionInputs:
  page_table: jax.Array  # int32[B, M] physical page of each logical page
  page_pos: jax.Array  # int32[B, M] logical position of slot 0
  page_shift: jax.Array  # int32[B, M] logical position minus stored angle
  page_len: jax.Array  # int32[B, M] valid slots, including this step's writes
  q_pos: jax.Array  # int32[B, T] position of each row; -1 = padding
  write_page: jax.Array  # int32[B, T] physical page for this row's K/V
  write_slot: jax.Array  # int32[B, T] slot within write_page

  def replace(self, **changes) -> "PagedAttentionInputs":
    return dataclasses.replace(self, **changes)
