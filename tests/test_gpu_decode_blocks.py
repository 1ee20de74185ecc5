"""The Mosaic GPU decode with one step per KV block
(`MgpuDecodeBlockSizes.steps_by_block`, gpu_decode_block_plan.py): its
records, its CUDA lowering, and parity in the Mosaic GPU interpreter where
shifts change inside a block; on a GPU (`@pytest.mark.gpu`), parity with
the reference and the float64 truth."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_decode_block_plan import (BlockRecordLayout,
                                                   block_flags)
from pallas_kernels.gpu_decode_mgpu import lazy_decode_mgpu, plan_decode
from tests.mgpu_prefill_helpers import (_check, _doc_layout_case,
                                        needs_interpreter)
from tests.rope_configs import LLAMA3, PLAIN
from tests.test_gpu_decode_mgpu import (_call, _ragged_case, _specs,
                                        check_export, two_document_plan)

BLOCKS = MgpuDecodeBlockSizes(steps_by_block=True)
ROPE_IN_KERNEL = MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True)
# The records read by the kernel (tests/test_gpu_decode_page_fields.py).
FIELDS = MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True,
                              fields_in_kernel=True)
# A block's first rotation before its K copy is waited for.
ROTATE_AHEAD = MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True,
                                    rotate_ahead=True)
# A rotation's cos / sin computed one value a thread.
COMPACT = MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=True,
                               compact_cos_sin=True)


def test_block_records():
  """One record per block of pages, each page with its own shift; dead
  pages (empty, after q_pos) hold no slots; steps end at the last live
  page's block; padding rows have none."""
  plan = two_document_plan(MgpuDecodeBlockSizes(block_kv=64,
                                                steps_by_block=True))
  layout = BlockRecordLayout(4)
  rec = np.asarray(plan.records)
  assert rec.shape == (2, 2, layout.width)
  assert np.asarray(plan.n_steps).tolist() == [2, 0]
  field = lambda name: rec[0, :, getattr(layout, name):
                           getattr(layout, name) + 4].tolist()
  assert field("lim") == [[16, 16, 16, 16], [5, 0, 0, 0]]
  assert field("shift") == [[0, 0, 0, 48], [48, 0, 0, 0]]
  assert field("phys") == [[5, 6, 7, 1], [2, 3, 0, 0]]
  assert rec.shape[-1] == 32  # four fields of 4 pages, padded to 128 bytes
  # The kernel's flags from the record: a page not fully valid, the newest
  # valid key position.
  flags = [block_flags(rec[0, b], layout, 16) for b in range(2)]
  assert [(bool(f), int(m)) for f, m in flags] == [(False, 63), (True, 68)]
  assert int(layout.segment(None, 0, 1)) == 4  # first page of a block
  cos_sin = np.asarray(plan.cos_sin)  # per page, whole blocks
  assert cos_sin.shape == (2, 8, 2, 32)
  np.testing.assert_allclose(cos_sin[0, 3, 0, 0], np.cos(48.0), atol=1e-6)
  np.testing.assert_allclose(cos_sin[0, 2, 0, 0], 1.0)


@pytest.mark.parametrize("case", [
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3, BLOCKS),
    (2, 9, 3, 64, 8, 30, jnp.float16, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, kv_splits=3, steps_by_block=True)),
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3,
     MgpuDecodeBlockSizes(block_kv=64, persistent=True, steps_by_block=True)),
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3, ROPE_IN_KERNEL),
    (2, 9, 3, 64, 8, 30, jnp.float16, PLAIN,
     MgpuDecodeBlockSizes(block_kv=64, persistent=True, steps_by_block=True,
                          rope_in_kernel=True)),
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3, ROTATE_AHEAD),
    (64, 32, 8, 128, 16, 512, jnp.bfloat16, LLAMA3, COMPACT),
    (2, 9, 3, 64, 8, 30, jnp.float16, PLAIN,
     dataclasses.replace(COMPACT, block_kv=64, rotate_ahead=True)),
], ids=["bench", "small_splits3", "bench_persistent", "bench_rope_in_kernel",
        "small_persistent_rope_in_kernel", "bench_rotate_ahead",
        "bench_compact_cos_sin", "small_compact_cos_sin_rotate_ahead"])
def test_export_lowers_for_cuda(case):
  check_export(case)


def test_rope_in_kernel_plan_has_no_cos_sin():
  """The plan leaves the cos / sin to the kernel (a [B, M, 2, 0]
  placeholder), and the setting needs steps by block."""
  args = [jnp.zeros(s.shape, s.dtype)
          for s in _specs(2, 8, 2, 64, 40, 16, 10)]
  plan = plan_decode(*args[3:], rope=PLAIN, head_dim=64, num_pages=40,
                     page_size=16, block_sizes=ROPE_IN_KERNEL)
  assert plan.cos_sin.shape == (2, 16, 2, 0)
  with pytest.raises(ValueError, match="rope_in_kernel needs steps_by_block"):
    MgpuDecodeBlockSizes(rope_in_kernel=True)


@pytest.mark.parametrize("plan_sizes,call_sizes,message", [
    (MgpuDecodeBlockSizes(), BLOCKS,
     "plan was made with steps_by_block=False"),
    (None, MgpuDecodeBlockSizes(), "plan was made with steps_by_block=True"),
    (MgpuDecodeBlockSizes(block_kv=64, steps_by_block=True),
     MgpuDecodeBlockSizes(block_kv=64), "made with steps_by_block=True"),
    (BLOCKS, ROPE_IN_KERNEL, "plan was made with rope_in_kernel=False"),
    (ROPE_IN_KERNEL, BLOCKS, "plan was made with rope_in_kernel=True"),
    (FIELDS, ROPE_IN_KERNEL, "plan was made with fields_in_kernel=True"),
    (ROPE_IN_KERNEL, FIELDS, "plan was made with fields_in_kernel=False"),
])
def test_a_plan_of_other_block_sizes_is_refused(plan_sizes, call_sizes,
                                                message):
  """Block and segment records can have the same width (64-key blocks
  of 16-token pages): the planned call tells them apart by their shapes."""
  from pallas_kernels.gpu_decode_mgpu import lazy_decode_mgpu_planned
  args = [jnp.zeros(s.shape, s.dtype)
          for s in _specs(2, 8, 2, 64, 64, 16, 16)]
  q, k, v, *metadata, q_pos = args
  plan = plan_decode(*metadata, q_pos, rope=PLAIN, head_dim=64, num_pages=64,
                     page_size=16, block_sizes=plan_sizes)
  with pytest.raises(ValueError, match=message):
    lazy_decode_mgpu_planned(q, k, v, q_pos, plan, rope=PLAIN, sm_scale=0.1,
                             block_sizes=call_sizes)


def test_float8_pages_are_refused():
  from pallas_kernels.gpu_decode_mgpu import mosaic_decode_unsupported
  reason = mosaic_decode_unsupported((1, 1, 8, 128), jnp.bfloat16,
                                     (2, 4, 16, 128), jnp.float8_e4m3fn,
                                     BLOCKS)
  assert "steps_by_block needs 16-bit pages" in reason


def test_persistent_at_128_keys_does_not_fit():
  """Two f32 query tiles, the 128-key ring and the block's scores are more
  shared memory than an SM has at H 128."""
  from pallas_kernels.gpu_decode_mgpu import mosaic_decode_unsupported
  reason = mosaic_decode_unsupported(
      (1, 1, 32, 128), jnp.bfloat16, (8, 4, 16, 128), jnp.bfloat16,
      MgpuDecodeBlockSizes(persistent=True, steps_by_block=True,
                           rope_in_kernel=True))
  assert "bytes of shared memory" in reason and "block_kv 64" in reason


@needs_interpreter
@pytest.mark.parametrize("persistent,rope_in_kernel", [
    pytest.param(False, False, marks=pytest.mark.slow),
    pytest.param(True, False, marks=pytest.mark.slow),
    # The default form's ragged case in the default tier is the one with
    # the records read by the kernel (test_gpu_decode_page_fields.py): the
    # same kernel path after the records, which both tests check.
    pytest.param(False, True, marks=pytest.mark.slow)],
                         ids=["cta-per-item", "persistent", "rope-in-kernel"])
def test_parity_interpret_ragged(persistent, rope_in_kernel):
  """Documents shorter than a page, so shifts change inside blocks (and
  back: one physical document read at two shifts); an empty page; NaN in
  every unused page and padding slot; a padding row; two KV splits, so a
  split starts inside a document."""
  lazy = _ragged_case(0, batch=3, num_heads=8, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_doc_len=150)
  assert (lazy.page_len[lazy.page_len > 0] < 16).any()
  bs = MgpuDecodeBlockSizes(block_kv=64, kv_splits=2, persistent=persistent,
                            num_ctas=3, steps_by_block=True,
                            rope_in_kernel=rope_in_kernel)
  _check(_call(lazy, rope=PLAIN, block_sizes=bs, interpret=True), lazy, PLAIN)


def _documents_far_out(seed, *, num_docs, doc_len, head_dim=64):
  """Documents (pages of 8) of one row, decoded at q_pos past them,
  everything moved 2^20 positions out."""
  lazy = _doc_layout_case(np.random.default_rng(seed), num_docs=num_docs,
                          doc_len=doc_len, q_len=1, num_heads=4,
                          num_kv_heads=2, head_dim=head_dim, page_size=8)
  base = 2**20
  return dataclasses.replace(lazy, q_pos=lazy.q_pos + base,
                             page_pos=lazy.page_pos + base,
                             page_shift=lazy.page_shift + base)


@needs_interpreter
@pytest.mark.parametrize("rope_in_kernel", [
    pytest.param(False, marks=pytest.mark.slow), True])
def test_parity_interpret_documents_across_blocks_llama3(rope_in_kernel):
  """Whole-page documents of 9 pages of 8 at shifts up to 2^20: each block
  of 8 pages holds the end of one document and the start of the next."""
  lazy = _documents_far_out(1, num_docs=3, doc_len=72)
  bs = MgpuDecodeBlockSizes(block_kv=64, kv_splits=2, steps_by_block=True,
                            rope_in_kernel=rope_in_kernel)
  _check(_call(lazy, rope=LLAMA3, block_sizes=bs, interpret=True), lazy,
         LLAMA3)


@needs_interpreter
def test_rotate_ahead_interpret_documents_of_whole_blocks():
  """Documents of one 64-key block each (shifts up to 2^20): every block's
  rotation is done ahead, before its K copy is waited for; two splits, so
  a split's first block rotates ahead too."""
  lazy = _documents_far_out(2, num_docs=4, doc_len=64)
  bs = dataclasses.replace(ROTATE_AHEAD, block_kv=64, kv_splits=2)
  _check(_call(lazy, rope=LLAMA3, block_sizes=bs, interpret=True), lazy,
         LLAMA3)


@needs_interpreter
@pytest.mark.slow
def test_rotate_ahead_is_bit_for_bit_the_rotation_after_the_wait():
  """The ragged case (shifts changing inside blocks and at their starts, an
  empty page, a padding row, two splits): the same output, bit for bit, as
  the rotation after the wait."""
  lazy = _ragged_case(0, batch=3, num_heads=8, num_kv_heads=2, head_dim=64,
                      page_size=16, dtype=jnp.bfloat16, max_doc_len=150)
  bs = dataclasses.replace(ROTATE_AHEAD, block_kv=64, kv_splits=2)
  ahead = _interpreted(lazy, PLAIN, bs)
  np.testing.assert_array_equal(
      ahead, _interpreted(lazy, PLAIN,
                          dataclasses.replace(bs, rotate_ahead=False)))
  _check(ahead, lazy, PLAIN)


def _interpreted(lazy, rope, block_sizes):
  """The decode's output in the Mosaic GPU interpreter, as float32."""
  return np.asarray(_call(lazy, rope=rope, block_sizes=block_sizes,
                          interpret=True).astype(jnp.float32))


@needs_interpreter
@pytest.mark.parametrize("head_dim,rotate_ahead", [(64, False), (128, True)])
def test_compact_cos_sin_is_bit_for_bit_the_per_column_cos_sin(
    head_dim, rotate_ahead):
  """Documents of 24 keys at shifts up to 2^20, so shifts change inside
  64-key blocks and at their starts; two splits.  The cos / sin computed one
  value a thread (two rows of H/2 at H 128, four at H 64) give the same
  output, bit for bit, as each thread computing its columns."""
  lazy = _documents_far_out(5, num_docs=5, doc_len=24, head_dim=head_dim)
  bs = dataclasses.replace(COMPACT, block_kv=64, kv_splits=2,
                           rotate_ahead=rotate_ahead)
  compact = _interpreted(lazy, LLAMA3, bs)
  np.testing.assert_array_equal(
      compact, _interpreted(lazy, LLAMA3,
                            dataclasses.replace(bs, compact_cos_sin=False)))
  _check(compact, lazy, LLAMA3)


def test_compact_cos_sin_needs_the_rope_in_the_kernel():
  with pytest.raises(ValueError,
                     match="compact_cos_sin needs rope_in_kernel=True"):
    MgpuDecodeBlockSizes(steps_by_block=True, compact_cos_sin=True)


@pytest.mark.parametrize("fields,rope_in_kernel", [(True, True),
                                                   (False, False)])
def test_rotate_ahead_needs_the_rope_in_the_kernel_and_the_plan_records(
    fields, rope_in_kernel):
  with pytest.raises(ValueError, match="rotate_ahead needs rope_in_kernel"):
    MgpuDecodeBlockSizes(steps_by_block=True, rope_in_kernel=rope_in_kernel,
                         fields_in_kernel=fields, rotate_ahead=True)


@pytest.mark.gpu
@pytest.mark.parametrize("block_sizes", [
    BLOCKS, MgpuDecodeBlockSizes(block_kv=64, kv_splits=3,
                                 steps_by_block=True),
    MgpuDecodeBlockSizes(block_kv=64, persistent=True, num_ctas=7,
                         kv_splits=2, steps_by_block=True),
    ROPE_IN_KERNEL, FIELDS, ROTATE_AHEAD,
    dataclasses.replace(ROTATE_AHEAD, block_kv=64, kv_splits=3), COMPACT,
    dataclasses.replace(COMPACT, fields_in_kernel=True, block_kv=64)],
                         ids=["default", "k64_splits3", "persistent",
                              "rope_in_kernel", "fields_in_kernel",
                              "rotate_ahead", "rotate_ahead_k64_splits3",
                              "compact_cos_sin", "compact_cos_sin_fields"])
def test_parity_gpu(block_sizes):
  lazy = _ragged_case(144, batch=5, num_heads=32, num_kv_heads=8,
                      head_dim=128, page_size=16, dtype=jnp.bfloat16,
                      docs_per_row=4, max_doc_len=300, base_position=2**20)
  out = jax.jit(lambda *a: lazy_decode_mgpu(
      *a, rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=block_sizes))(*[jnp.asarray(a) for a in lazy.args()])
  _check(out, lazy, LLAMA3)


@pytest.mark.gpu
def test_matches_the_segment_steps_on_the_benchmark_layout():
  """16 documents of 512 tokens at their own shifts: the same result as
  the default decode's segment steps."""
  lazy = _doc_layout_case(np.random.default_rng(3), num_docs=16, doc_len=512,
                          q_len=1, num_heads=32, num_kv_heads=8,
                          head_dim=128, page_size=16)
  args = [jnp.asarray(a) for a in lazy.args()]
  call = lambda bs: np.asarray(lazy_decode_mgpu(
      *args, rope=LLAMA3, sm_scale=jnp.float32(128 ** -0.5),
      block_sizes=bs).astype(jnp.float32))
  segments = call(MgpuDecodeBlockSizes())
  for sizes in (BLOCKS, ROPE_IN_KERNEL, FIELDS, ROTATE_AHEAD, COMPACT):
    np.testing.assert_allclose(call(sizes), segments, rtol=2e-2, atol=2e-2)
    _check(call(sizes), lazy, LLAMA3)
  # The same cos / sin, computed one value a thread: the same output.
  np.testing.assert_array_equal(call(COMPACT), call(ROPE_IN_KERNEL))
