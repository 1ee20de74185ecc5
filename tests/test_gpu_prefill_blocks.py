"""The Mosaic GPU prefill with one step per KV block
(`MgpuBlockSizes.steps_by_block`: gpu_prefill_block_records.py,
gpu_prefill_mgpu_blocks.py).

On CPU: the block records against a per-block NumPy reading of the page
metadata, the CUDA lowering, the Mosaic GPU interpreter's parity on cases
whose blocks hold pages of several shifts (documents ending inside a
block, one shift coming back after another), a half-full page with NaN in
its unused slots and padding rows, and the argument checks.  On a GPU:
parity at the shapes of the segment-step kernel's GPU cases.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_prefill_block_records import (PrefillBlockLayout,
                                                      prefill_block_records)
from pallas_kernels.gpu_prefill_mgpu import (MgpuBlockSizes, lazy_prefill_mgpu,
                                             plan_prefill)
from pallas_kernels.gpu_prefill_mgpu_plan import segment_cos_sin
from pallas_kernels.testing import make_case
from tests.test_gpu_prefill_mgpu import (BENCH, LLAMA3, PLAIN, _call,
                                         _check, _doc_layout_case, _export,
                                         _specs, needs_interpreter)

BLOCKS = MgpuBlockSizes(steps_by_block=True)
BLOCKS64 = MgpuBlockSizes(block_kv=64, steps_by_block=True)


def _numpy_block_records(table, pos, shift, length, live, *, num_pages,
                         page_size, ppb):
  """Per block, the record PrefillBlockLayout describes, page by page."""
  layout = PrefillBlockLayout(ppb)
  batch, pages = table.shape
  blocks = -(-pages // ppb)
  out = np.zeros((batch, blocks, layout.width), np.int64)
  for b in range(batch):
    for blk in range(blocks):
      rec = out[b, blk]
      newest, last_shift, keys = -(2**31), 0, []
      for j in range(ppb):
        p = blk * ppb + j
        if p < pages:
          lim = int(length[b, p]) if live[b, p] else 0
          rec[layout.phys + j] = min(max(int(table[b, p]), 0), num_pages - 1)
          rec[layout.pos + j] = pos[b, p]
          rec[layout.shift + j] = shift[b, p]
        else:  # past M: dead, id and position 0
          lim = 0
        rec[layout.lim + j] = lim
        if lim:
          newest = max(newest, int(rec[layout.pos + j]) + lim - 1)
          last_shift = int(rec[layout.shift + j])
          keys.append(int(rec[layout.shift + j]))
      rec[layout.fixup] = any(rec[layout.lim + j] < page_size
                              for j in range(ppb))
      rec[layout.max_pos] = newest
      rec[layout.last_shift] = last_shift
      # One pass per distinct live shift: the others in page order, the
      # last live page's last.
      others = [k for i, k in enumerate(keys)
                if k != last_shift and k not in keys[:i]]
      rec[layout.passes] = len(others) + 1
      for j, k in enumerate(others + [last_shift]):
        rec[layout.pass_shift + j] = k
  return out


@pytest.mark.parametrize("ppb", [4, 8])
def test_block_records_match_the_page_metadata(ppb):
  rng = np.random.default_rng(ppb)
  lazy = make_case(rng, batch=3, q_len=30, num_heads=4, num_kv_heads=2,
                   head_dim=64, page_size=16, dtype=jnp.bfloat16,
                   docs_per_row=5, max_doc_len=200)
  table, pos, shift, length = (np.asarray(a) for a in lazy.args()[3:7])
  newest = np.asarray(lazy.q_pos).max(axis=1)
  live = (length > 0) & (pos <= newest[:, None])
  records = prefill_block_records(
      jnp.asarray(table), jnp.asarray(pos), jnp.asarray(shift),
      jnp.asarray(length), jnp.asarray(live),
      num_pages=lazy.k_pages.shape[1], page_size=16, pages_per_block=ppb)
  want = _numpy_block_records(table, pos, shift, length, live,
                              num_pages=lazy.k_pages.shape[1], page_size=16,
                              ppb=ppb)
  np.testing.assert_array_equal(np.asarray(records), want)
  layout = PrefillBlockLayout(ppb)
  # The case has blocks of several shifts (three, at 8 pages) and of one.
  passes = want[..., layout.passes]
  assert (passes == 1).any() and (passes > 1).any()
  assert passes.max() >= (3 if ppb == 8 else 2)
  # With cos / sin: the same fields, then those of the last live shift.
  cos_sin_of = functools.partial(segment_cos_sin, rope=LLAMA3, head_dim=64)
  with_cs = np.asarray(prefill_block_records(
      jnp.asarray(table), jnp.asarray(pos), jnp.asarray(shift),
      jnp.asarray(length), jnp.asarray(live),
      num_pages=lazy.k_pages.shape[1], page_size=16, pages_per_block=ppb,
      cos_sin_of=cos_sin_of))
  layout = PrefillBlockLayout(ppb, cos_sin_dim=64)
  assert with_cs.shape[-1] == layout.width
  np.testing.assert_array_equal(with_cs[..., :want.shape[-1]], want)
  cs = np.asarray(cos_sin_of(jnp.asarray(want[..., layout.last_shift])))
  np.testing.assert_array_equal(
      with_cs[..., layout.cos_sin:layout.cos_sin + 64],
      cs.view(np.int32).reshape(*cs.shape[:-2], 64))


def test_plan_steps_are_the_blocks_each_cta_sees():
  """n_steps: the blocks up to the last page the CTA's newest token block
  sees; the plan carries the turn chunks for the kernel's cos / sin."""
  pages, page_size = 40, 16
  page_pos = jnp.arange(pages, dtype=jnp.int32)[None] * page_size
  q_pos = jnp.arange(300, 300 + 256, dtype=jnp.int32)[None]
  plan = plan_prefill(jnp.arange(pages, dtype=jnp.int32)[None], page_pos,
                      jnp.zeros((1, pages), jnp.int32),
                      jnp.full((1, pages), page_size, jnp.int32), q_pos,
                      rope=PLAIN, group=1, head_dim=64, num_pages=pages,
                      page_size=page_size, block_sizes=BLOCKS64)
  # Token block t (64 rows, two per CTA) sees up to position
  # 300 + 64 t + 63, i.e. page (363 + 64 t) // 16; blocks of 4 pages.
  ends = [(363 + 64 * t) // 16 + 1 for t in range(4)]
  want = [max(-(-ends[2 * c] // 4), -(-ends[2 * c + 1] // 4))
          for c in range(2)]
  np.testing.assert_array_equal(np.asarray(plan.n_steps), [want])
  assert plan.records.shape == (1, 10, PrefillBlockLayout(4, 64).width)
  np.testing.assert_array_equal(np.asarray(plan.cos_sin),
                                PLAIN.turn_chunks(64)[:, :32])


@pytest.mark.parametrize("block_sizes", [
    BLOCKS, MgpuBlockSizes(steps_by_block=True, num_compute_wgs=1),
    MgpuBlockSizes(steps_by_block=True, schedule_barrier=False)],
    ids=["w2", "w1", "no_sched"])
def test_export_lowers_for_cuda(block_sizes):
  exported = _export(_specs(**BENCH), block_sizes)
  assert "mosaic_gpu" in exported.mlir_module()
  assert exported.out_avals[0].shape == (4, 512, 32, 128)


def test_argument_errors():
  with pytest.raises(ValueError, match="steps_by_block needs"):
    MgpuBlockSizes(steps_by_block=True, query_in_registers=False)
  with pytest.raises(ValueError, match="steps_by_block needs"):
    MgpuBlockSizes(steps_by_block=True, query_in_f32=True)
  specs = list(_specs(**BENCH))
  pages = jax.ShapeDtypeStruct(specs[1].shape, jnp.float8_e4m3fn)
  scales = jax.ShapeDtypeStruct(specs[1].shape[:2], jnp.float32)
  with pytest.raises(ValueError, match="float8 pages needs segment steps"):
    jax.eval_shape(lambda *a: lazy_prefill_mgpu(
        *a[:8], rope=LLAMA3, sm_scale=0.088, block_sizes=BLOCKS,
        k_scales=a[8], v_scales=a[9]),
        specs[0], pages, pages, *specs[3:], scales, scales)
  # A segment-step plan does not fit the block kernel.
  from pallas_kernels.gpu_prefill_mgpu import mgpu_prefill_kernel
  args = [jnp.zeros(s.shape, s.dtype) for s in _specs(**BENCH)]
  plan = plan_prefill(*args[3:8], rope=LLAMA3, group=4, head_dim=128,
                      num_pages=args[1].shape[1], page_size=16)
  q_rot = jnp.zeros((4, 512, 32, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="steps_by_block=True"):
    jax.eval_shape(lambda: mgpu_prefill_kernel(
        q_rot, args[1], args[2], plan, out_dtype=jnp.bfloat16,
        block_sizes=BLOCKS))


@needs_interpreter
def test_parity_interpret_documents_ending_inside_blocks():
  """Ragged documents: most of their ends fall inside a 64-key block, whose
  pages of the earlier document take a pass of their own; two rows."""
  lazy = make_case(np.random.default_rng(0), batch=2, q_len=7, num_heads=8,
                   num_kv_heads=2, head_dim=64, page_size=16,
                   dtype=jnp.bfloat16)
  plan = plan_prefill(*[jnp.asarray(a) for a in lazy.args()[3:]], rope=PLAIN,
                      group=4, head_dim=64, num_pages=lazy.k_pages.shape[1],
                      page_size=16, block_sizes=BLOCKS64)
  run = np.arange(plan.records.shape[1]) < np.asarray(plan.n_steps).max()
  passes = np.asarray(plan.records[..., PrefillBlockLayout(4).passes])
  assert (passes[:, run] > 1).any()
  _check(_call(lazy.args(), interpret=True, block_sizes=BLOCKS64), lazy,
         PLAIN)


@needs_interpreter
def test_parity_interpret_a_shift_that_comes_back():
  """One block holds pages of shifts A B A (a document's pages around
  another's): a pass for B, then one for A (its last live page); a
  half-full page (NaN in its unused slots) and padding rows."""
  lazy = _doc_layout_case(np.random.default_rng(3), num_docs=3, doc_len=64,
                          q_len=70, num_heads=2, num_kv_heads=2, head_dim=64,
                          page_size=16)
  # Pages 4..7 are document 1 (shift 64): give page 5 document 2's shift
  # and position range's neighbour, and page 6 a half-full page.
  lazy.page_shift[0, 5] = 128
  lazy.page_len[0, 6] = 9
  for pages in (lazy.k_pages, lazy.v_pages):
    pages[:, lazy.page_table[0, 6], 9:] = np.nan
  lazy.q_pos[0, -3:] = -1  # padding rows
  records = prefill_block_records(
      *[jnp.asarray(a) for a in lazy.args()[3:7]],
      jnp.asarray(lazy.page_len > 0), num_pages=lazy.k_pages.shape[1],
      page_size=16, pages_per_block=4)
  layout = PrefillBlockLayout(4)
  assert int(records[0, 1, layout.passes]) == 2
  assert int(records[0, 1, layout.last_shift]) == 64
  np.testing.assert_array_equal(
      records[0, 1, layout.pass_shift:layout.pass_shift + 2], [128, 64])
  _check(_call(lazy.args(), rope=LLAMA3, interpret=True,
               block_sizes=BLOCKS64), lazy, LLAMA3)


@pytest.mark.slow
@needs_interpreter
def test_parity_interpret_one_warpgroup_page8():
  """One warpgroup, 8-slot pages (16 pages a 128-key block), H 128."""
  lazy = make_case(np.random.default_rng(1), batch=2, q_len=40, num_heads=8,
                   num_kv_heads=2, head_dim=128, page_size=8,
                   dtype=jnp.bfloat16, base_position=60000)
  _check(_call(lazy.args(), rope=LLAMA3, interpret=True,
               block_sizes=MgpuBlockSizes(num_compute_wgs=1,
                                          steps_by_block=True)),
         lazy, LLAMA3)


GPU_CASES = [
    # (heads, head_dim, page_size, q_len, base_position, rope, block sizes)
    ((32, 8), 128, 16, 64, 0, PLAIN, BLOCKS),
    ((32, 8), 128, 16, 200, 2**20, LLAMA3, BLOCKS),
    ((9, 3), 64, 8, 37, 60000, PLAIN, BLOCKS),
    ((8, 8), 128, 16, 130, 0, LLAMA3,
     MgpuBlockSizes(num_compute_wgs=1, steps_by_block=True)),
    ((32, 8), 128, 16, 200, 2**20, LLAMA3, BLOCKS64),
    ((32, 8), 128, 16, 200, 2**20, LLAMA3,
     MgpuBlockSizes(schedule_barrier=False, steps_by_block=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: (
    f"{c[0][0]}-{c[0][1]}_H{c[1]}_p{c[2]}_T{c[3]}_base{c[4]}_{c[6]}"))
def test_parity_gpu(case):
  heads, head_dim, page_size, q_len, base, rope, block_sizes = case
  rng = np.random.default_rng(q_len + head_dim)
  lazy = make_case(rng, batch=3, q_len=q_len, num_heads=heads[0],
                   num_kv_heads=heads[1], head_dim=head_dim,
                   page_size=page_size, dtype=jnp.bfloat16,
                   docs_per_row=4, max_doc_len=300, base_position=base)
  out = jax.jit(lambda *a: lazy_prefill_mgpu(
      *a, rope=rope, sm_scale=jnp.float32(head_dim ** -0.5),
      block_sizes=block_sizes))(*[jnp.asarray(a) for a in lazy.args()])
  _check(out, lazy, rope)
