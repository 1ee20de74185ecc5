"""The Mosaic GPU decode's block steps with the records read by the kernel
from the page metadata (`MgpuDecodeBlockSizes.fields_in_kernel`,
gpu_decode_page_fields.py): the plan, the record view against the block
records made in XLA, CUDA lowering, parity in the Mosaic GPU interpreter.
Refusals of a plan of another form and the GPU parity cases are in
tests/test_gpu_decode_blocks.py."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_decode_block_plan import (BlockRecordLayout,
                                                  block_records)
from pallas_kernels.gpu_decode_page_fields import (FIELD_CHUNK,
                                                   PageFieldsLayout,
                                                   PageFieldsRecord,
                                                   plan_fields)
from tests.mgpu_prefill_helpers import _check, needs_interpreter
from tests.rope_configs import LLAMA3, PLAIN
from tests.test_gpu_decode_blocks import FIELDS
from tests.test_gpu_decode_mgpu import _call, _ragged_case, check_export


def _metadata(rng, batch, logical, page_size, num_pages):
  """Random page metadata with dead pages (empty, or after q_pos), ids out
  of the pool in dead entries, and a padding row."""
  table = rng.integers(0, num_pages, (batch, logical)).astype(np.int32)
  pos = np.sort(rng.integers(0, 4000, (batch, logical)), axis=1)
  length = rng.integers(0, page_size + 1, (batch, logical)).astype(np.int32)
  length[:, -3:] = 0  # a dead tail
  table[:, -1] = num_pages + 7  # dead entries may hold any id
  shift = rng.integers(-2000, 2000, (batch, logical)).astype(np.int32)
  q_pos = np.full((batch, 1), 3000, np.int32)
  q_pos[-1] = -1  # padding row
  return [jnp.asarray(a, jnp.int32) for a in (table, pos, shift, length,
                                              q_pos)]


@pytest.mark.parametrize("logical,ppb", [(40, 4), (64, 8), (10, 2)])
def test_the_record_view_reads_the_block_records(logical, ppb):
  """Through `PageFieldsRecord`, a step's fields in its copied chunk read
  as the block records that XLA makes (liveness applied), and the plan's
  step counts are theirs."""
  rng = np.random.default_rng(logical)
  page_size, num_pages = 16, 50
  table, pos, shift, length, q_pos = _metadata(rng, 3, logical, page_size,
                                               num_pages)
  row = q_pos[:, 0]
  live = (length > 0) & (pos <= row[:, None]) & (row[:, None] >= 0)
  records, n_steps, _ = block_records(table, pos, shift, length, live,
                                      num_pages=num_pages,
                                      page_size=page_size,
                                      pages_per_block=ppb)
  steps, fields = plan_fields(table, pos, shift, length, live,
                              pages_per_block=ppb)
  np.testing.assert_array_equal(steps, n_steps)
  assert all(f.shape[1] % FIELD_CHUNK == 0 for f in fields)
  layout, block = PageFieldsLayout(ppb), BlockRecordLayout(ppb)
  fields = [np.asarray(f) for f in fields]
  for b in range(3):
    for step in range(records.shape[1]):
      # The slot as the producer fills it: each field's chunk of the step.
      chunk = step // layout.blocks_per_chunk * FIELD_CHUNK
      slot = np.concatenate([f[b, chunk:chunk + FIELD_CHUNK]
                             for f in fields])
      rec = PageFieldsRecord(slot, jnp.int32(step), row[b], layout)
      for name in ("pos", "lim", "shift"):
        got = [int(rec[getattr(layout, name) + j]) for j in range(ppb)]
        want = records[b, step, getattr(block, name):
                       getattr(block, name) + ppb].tolist()
        assert got == want, (b, step, name)


def test_fields_need_the_rope_in_the_kernel():
  with pytest.raises(ValueError, match="fields_in_kernel needs rope_in_kernel"):
    MgpuDecodeBlockSizes(steps_by_block=True, fields_in_kernel=True)


@pytest.mark.parametrize("case", [
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3, FIELDS),
    (2, 9, 3, 64, 8, 30, jnp.float16, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, kv_splits=3, steps_by_block=True,
                          rope_in_kernel=True, fields_in_kernel=True)),
], ids=["bench", "small_splits3"])
def test_export_lowers_for_cuda(case):
  check_export(case)


@needs_interpreter
# CI time: an opt-in path (fields_in_kernel); its record view, its refusals
# and its export for cuda stay in the fast tier.
@pytest.mark.slow
def test_parity_interpret_ragged():
  """Documents shorter than a page, so shifts change inside blocks; an
  empty page; NaN in every unused page and padding slot; a padding row;
  two KV splits; pages not a whole number of field chunks."""
  lazy = _ragged_case(0, batch=2, num_heads=4, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_doc_len=150)
  assert lazy.page_table.shape[1] % FIELD_CHUNK
  bs = MgpuDecodeBlockSizes(block_kv=64, kv_splits=2, steps_by_block=True,
                            rope_in_kernel=True, fields_in_kernel=True)
  _check(_call(lazy, rope=PLAIN, block_sizes=bs, interpret=True), lazy, PLAIN)


def test_fields_of_partial_chunks_are_refused():
  """The kernel copies whole 128-byte chunks of each field: fields not
  made by `plan_fields` (not whole chunks, or of different shapes) are
  refused with a message, before any kernel is built."""
  from pallas_kernels.gpu_decode_page_fields import check_fields
  table = jnp.zeros((2, 40), jnp.int32)
  with pytest.raises(ValueError, match="whole chunks of 32"):
    check_fields((table,) * 4)
  with pytest.raises(ValueError, match="four arrays of one shape"):
    check_fields((jnp.zeros((2, 32), jnp.int32),) * 3
                 + (jnp.zeros((2, 64), jnp.int32),))


def test_shared_memory_counts_the_field_chunks():
  """A record slot holds four 128-byte chunks: 1.5 KB more than the
  default form at two stages, which still fits at 128-key steps and H 128."""
  from pallas_kernels.gpu_decode_block_sizes import mgpu_decode_smem_bytes
  from pallas_kernels.gpu_decode_mgpu import mosaic_decode_unsupported
  from tests.test_gpu_decode_blocks import ROPE_IN_KERNEL
  extra = (mgpu_decode_smem_bytes(FIELDS, 128, page_size=16)
           - mgpu_decode_smem_bytes(ROPE_IN_KERNEL, 128, page_size=16))
  assert extra == 2 * 2 * 3 * 128
  assert mosaic_decode_unsupported((64, 1, 32, 128), jnp.bfloat16,
                                   (8, 4096, 16, 128), jnp.bfloat16,
                                   FIELDS) is None
