"""The Mosaic kernels' step records (gpu_prefill_mgpu_plan.step_records)
and the counts they come from (gpu_segment_counts) against a plain loop
over segments and blocks, on random page metadata:
dead pages, partial pages, shifts that change inside a block, rows of
more than one prefix-sum block (gpu_common.prefix_sum).  And worked
cases: one row's step records, a plan's units and steps
(gpu_prefill_mgpu.plan_prefill), and records that carry their segment's
cos / sin."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.gpu_common import prefix_sum
from pallas_kernels.gpu_prefill_mgpu import MgpuBlockSizes
from pallas_kernels.gpu_prefill_mgpu_plan import (INT32_MAX, INT32_MIN,
                                                  RecordLayout, max_steps,
                                                  step_records)
from pallas_kernels.gpu_segment_counts import (BLOCKS_IN_ONE_SUM,
                                               segment_counts,
                                               steps_before_pages)
from tests.rope_configs import LLAMA3, PLAIN

PAGE_SIZE = 4


def segments_by_loop(shift, live):
  """(first, end, shift) of each run of live pages with one shift; a run's
  range reaches the next run's first page (the last one: past the last live
  page), as `prefill_segments` documents."""
  starts = [p for p in range(len(shift)) if live[p] and not (
      p > 0 and live[p - 1] and shift[p - 1] == shift[p])]
  if not starts:
    return []
  last_live = max(p for p in range(len(shift)) if live[p])
  ends = starts[1:] + [last_live + 1]
  return [(s, e, int(shift[s])) for s, e in zip(starts, ends)]


def records_by_loop(table, pos, shift, length, live, *, num_pages, ppb):
  """One batch row: (records [steps, fields], step_first, shifts)."""
  num_logical = len(table)
  layout = RecordLayout(ppb)
  records, step_first = [], []
  segments = segments_by_loop(shift, live)
  for seg, (first, end, _) in enumerate(segments):
    for block in range(first // ppb, -(-end // ppb)):
      rec = np.zeros(layout.width, np.int64)
      lims = []
      for i in range(ppb):
        page = block * ppb + i
        clipped = min(page, num_logical - 1)
        inside = first <= page < end and page < num_logical
        lim = int(length[clipped]) if inside and live[clipped] else 0
        rec[layout.phys + i] = min(max(int(table[clipped]), 0), num_pages - 1)
        rec[layout.pos + i] = pos[clipped]
        rec[layout.lim + i] = lim
        lims.append((lim, int(pos[clipped])))
      rec[layout.seg] = seg
      rec[layout.new_seg] = int(block == first // ppb)
      rec[layout.fixup] = int(any(lim < PAGE_SIZE for lim, _ in lims))
      rec[layout.max_pos] = max((p + lim - 1 for lim, p in lims if lim > 0),
                                default=INT32_MIN)
      records.append(rec)
      step_first.append(max(block * ppb, first))
  return records, step_first, [s for _, _, s in segments]


def assert_same_plans(got, expected):
  """Two plans (NamedTuples of arrays), field by field, bit for bit."""
  for name in expected._fields:
    want, have = (np.asarray(getattr(expected, name)),
                  np.asarray(getattr(got, name)))
    assert want.shape == have.shape, name
    np.testing.assert_array_equal(have, want, err_msg=name)


def random_page_fields(rng, batch, num_logical, page_size):
  """(page_table, page_pos, page_shift, page_len) of `page_size`-token
  pages (a multiple of PAGE_SIZE): `random_metadata`'s layouts, dead pages
  empty, live ones of 1 to page_size tokens, the shifts scaled by 1, 977
  or 65537."""
  table, pos, shift, _, live = random_metadata(rng, batch, num_logical)
  pos = pos * (page_size // PAGE_SIZE)
  length = np.where(live, rng.integers(1, page_size + 1,
                                       (batch, num_logical)), 0)
  shift = shift * int(rng.choice([1, 977, 65537]))
  return table, pos, shift, length


def random_metadata(rng, batch, num_logical):
  """Documents of 1, 3 or 8 pages (one shift each, sometimes a shift that
  changes inside a document), some pages dead, some partial."""
  doc_pages = int(rng.choice([1, 3, 8]))
  shift = ((np.arange(num_logical) // doc_pages)[None] * 16
           + rng.integers(0, 2, (batch, num_logical)) * 1000
           * (rng.random() < 0.3))
  live = rng.random((batch, num_logical)) < rng.choice([0.0, 0.4, 0.9, 1.0])
  length = rng.integers(1, PAGE_SIZE + 1, (batch, num_logical))
  pos = np.arange(num_logical)[None].repeat(batch, 0) * PAGE_SIZE
  table = rng.permutation(batch * num_logical).reshape(batch, num_logical)
  as_i32 = lambda a: np.ascontiguousarray(a).astype(np.int32)
  return as_i32(table), as_i32(pos), as_i32(shift), as_i32(length), live


# (258, 2): 129 blocks, one past BLOCKS_IN_ONE_SUM: the prefix sums over
# blocks in two levels.
@pytest.mark.parametrize("num_logical,ppb",
                         [(5, 1), (33, 2), (70, 8), (258, 2)])
def test_step_records_match_a_loop(num_logical, ppb):
  batch = 3
  num_pages = batch * num_logical
  plan = jax.jit(functools.partial(
      step_records, num_pages=num_pages, page_size=PAGE_SIZE,
      pages_per_block=ppb))
  if num_logical == 258:
    assert -(-num_logical // ppb) == BLOCKS_IN_ONE_SUM + 1
  rng = np.random.default_rng(num_logical)
  for _ in range(12):
    table, pos, shift, length, live = random_metadata(rng, batch,
                                                      num_logical)
    records, num_steps, step_first, shifts = plan(table, pos, shift, length,
                                                  live)
    records, step_first = np.asarray(records), np.asarray(step_first)
    assert records.shape[1] == max_steps(num_logical, ppb)
    for b in range(batch):
      want, want_first, want_shifts = records_by_loop(
          table[b], pos[b], shift[b], length[b], live[b],
          num_pages=num_pages, ppb=ppb)
      steps = len(want)
      assert int(num_steps[b]) == steps
      if steps:
        np.testing.assert_array_equal(records[b, :steps], np.stack(want))
      assert not records[b, steps:].any(), "records past the row's steps"
      assert step_first[b, :steps].tolist() == want_first
      assert (step_first[b, steps:] == INT32_MAX).all()
      assert np.asarray(shifts)[b, :len(want_shifts)].tolist() == want_shifts


@pytest.mark.parametrize("length", [1, 31, 32, 33, 100, 576])
def test_prefix_sum_matches_cumsum_across_blocks(length):
  x = np.random.default_rng(length).integers(-40, 50, (3, length))
  got = jax.jit(prefix_sum)(jnp.asarray(x, jnp.int32))
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.cumsum(x, axis=-1))


@pytest.mark.parametrize("num_logical,ppb", [(5, 1), (33, 2), (70, 8),
                                             (258, 2)])
def test_steps_before_every_page_end_count_the_step_records(num_logical,
                                                            ppb):
  """steps_before_pages (closed form from segment_counts) against counting
  the records' first pages, at every page end 0..M; segment_counts'
  extents and token blocks' ends against NumPy."""
  batch, num_tiles = 3, 4
  rng = np.random.default_rng(num_logical + 7)
  ends = jnp.arange(num_logical + 1, dtype=jnp.int32)

  @jax.jit
  def closed_form(table, pos, shift, length, live, tile_newest):
    counts = segment_counts(pos, shift, live, pages_per_block=ppb,
                            tile_newest=tile_newest)
    every_end = steps_before_pages(
        counts, jnp.broadcast_to(ends, (batch, ends.size)), ppb)
    _, num_steps, step_first, _ = step_records(
        table, pos, shift, length, live, num_pages=batch * num_logical,
        page_size=PAGE_SIZE, pages_per_block=ppb)
    return counts, every_end, num_steps, step_first

  for _ in range(8):
    table, pos, shift, length, live = random_metadata(rng, batch,
                                                      num_logical)
    tile_newest = rng.integers(-3, num_logical * PAGE_SIZE + 3,
                               (batch, num_tiles)).astype(np.int32)
    tile_newest[0, 0] = INT32_MIN  # a token block of padding rows only
    counts, every_end, num_steps, step_first = closed_form(
        table, pos, shift, length, live, tile_newest)
    step_first = np.asarray(step_first)
    for b in range(batch):
      want = [(step_first[b] < e).sum() for e in range(num_logical + 1)]
      assert np.asarray(every_end)[b].tolist() == want
      assert want[-1] == int(num_steps[b])
      live_pages = np.flatnonzero(live[b])
      padded = -(-num_logical // ppb) * ppb
      assert int(counts.first_live[b]) == (live_pages[0] if live_pages.size
                                           else padded)
      assert int(counts.last_live[b]) == (live_pages[-1] if live_pages.size
                                          else -1)
      for t in range(num_tiles):
        seen = np.flatnonzero(live[b] & (pos[b] <= tile_newest[b, t]))
        assert int(counts.tile_ends[b, t]) == (seen[-1] + 1 if seen.size
                                               else 0)


def test_step_records():
  # Pages (ppb = 2): [0, 3) shift 5, page 3 dead, [4, 7) shift 0 with page 6
  # half full; page 7 dead.
  page_shift = jnp.array([[5, 5, 5, 5, 0, 0, 0, 0]], jnp.int32)
  live = jnp.array([[1, 1, 1, 0, 1, 1, 1, 0]], bool)
  page_len = jnp.array([[4, 4, 4, 4, 4, 4, 2, 4]], jnp.int32)
  page_pos = jnp.arange(8, dtype=jnp.int32)[None] * 4
  page_table = jnp.array([[7, 6, 5, 4, 3, 2, 1, 0]], jnp.int32)
  records, num_steps, step_first, shift = jax.jit(functools_partial())(
      page_table, page_pos, page_shift, page_len, live)
  layout = RecordLayout(2)
  records = np.asarray(records[0])
  # Segment 0 = pages [0, 4) (dead page 3 ends it): blocks 0, 1.
  # Segment 1 = pages [4, 7): blocks 2, 3.
  assert int(num_steps[0]) == 4
  assert np.asarray(step_first[0, :5]).tolist() == [0, 2, 4, 6, 2**31 - 1]
  assert np.asarray(shift[0, :2]).tolist() == [5, 0]
  lim = records[:4, layout.lim:layout.lim + 2].tolist()
  assert lim == [[4, 4], [4, 0], [4, 4], [2, 0]]
  assert records[:4, layout.phys:layout.phys + 2].tolist() == [
      [7, 6], [5, 4], [3, 2], [1, 0]]
  assert records[:4, layout.seg].tolist() == [0, 0, 1, 1]
  assert records[:4, layout.new_seg].tolist() == [1, 0, 1, 0]
  assert records[:4, layout.fixup].tolist() == [0, 1, 0, 1]
  assert records[:4, layout.max_pos].tolist() == [7, 11, 23, 25]
  assert layout.width % 32 == 0


def functools_partial():
  def fn(*args):
    return step_records(*args, num_pages=8, page_size=4, pages_per_block=2)
  return fn


def test_plan_units_and_steps():
  """Plan of a 100-token chunk after 160 tokens of context, group 4, two
  warpgroups: 2 token blocks x 4 heads = 8 units = 4 CTAs, and the CTAs of
  token block 0 skip the pages only block 1 can see."""
  from pallas_kernels.gpu_prefill_mgpu import plan_prefill
  pages, page_size = 17, 16  # 10 context pages + 7 for the chunk
  page_pos = jnp.arange(pages, dtype=jnp.int32)[None] * page_size
  page_len = jnp.full((1, pages), page_size, jnp.int32).at[0, 16].set(4)
  zeros = jnp.zeros((1, pages), jnp.int32)
  q_pos = (160 + jnp.arange(100, dtype=jnp.int32))[None]
  plan = plan_prefill(jnp.arange(pages, dtype=jnp.int32)[None], page_pos,
                      zeros, page_len, q_pos, rope=PLAIN, group=4,
                      head_dim=64, num_pages=pages, page_size=page_size,
                      block_sizes=MgpuBlockSizes(block_kv=64))
  assert plan.row_pos.shape == (1, 128)
  assert np.asarray(plan.row_pos[0, :100]).tolist() == list(range(160, 260))
  assert np.all(np.asarray(plan.row_pos[0, 100:]) == -(2**31))
  # Block 1 holds padding rows: its oldest row is the padding sentinel, so
  # every one of its steps goes through the mask.
  assert np.asarray(plan.min_row).tolist() == [[160, -(2**31)]]
  # One segment, 4 pages a step.  Block 0 (160..223) sees pages 0..13:
  # steps starting at pages 0, 4, 8, 12.  Block 1 sees page 16 too.
  assert np.asarray(plan.n_steps).tolist() == [[4, 4, 5, 5]]


def test_plan_records_carry_cos_sin():
  """cos_sin_in_records: each record is the copied form's, then its
  segment's cos and sin (f32 bits, those the copied form's plan holds per
  segment); a kernel given a plan of the other width refuses it; shared
  memory grows by the wider record ring."""
  from pallas_kernels.gpu_block_sizes import smem_bytes
  from pallas_kernels.gpu_prefill_mgpu import (mgpu_prefill_kernel,
                                               plan_prefill)
  pages, page_size, head_dim = 12, 16, 64
  page_pos = jnp.arange(pages, dtype=jnp.int32)[None] * page_size
  # Three documents of 4 pages at their own shifts.
  shift = jnp.asarray([[700] * 4 + [90000] * 4 + [0] * 4], jnp.int32)
  page_len = jnp.full((1, pages), page_size, jnp.int32)
  q_pos = (pages * page_size + jnp.arange(8, dtype=jnp.int32))[None]
  make = lambda sizes: plan_prefill(
      jnp.arange(pages, dtype=jnp.int32)[None], page_pos, shift, page_len,
      q_pos, rope=LLAMA3, group=1, head_dim=head_dim, num_pages=pages,
      page_size=page_size, block_sizes=sizes)
  plain = make(MgpuBlockSizes(block_kv=64, cos_sin_in_records=False))
  sizes = MgpuBlockSizes(block_kv=64, cos_sin_in_records=True)
  carried = make(sizes)
  layout = RecordLayout(4, cos_sin_dim=head_dim)
  records = np.asarray(carried.records)
  assert records.shape[-1] == layout.width == 32 + 64
  np.testing.assert_array_equal(records[..., :layout.cos_sin],
                                np.asarray(plain.records))
  cos_sin = records[..., layout.cos_sin:layout.cos_sin + head_dim].view(
      np.float32).reshape(*records.shape[:2], 2, head_dim // 2)
  steps = int(np.max(np.asarray(carried.n_steps)))
  assert steps == 3
  segs = records[0, :steps, layout.seg]
  assert segs.tolist() == [0, 1, 2]
  np.testing.assert_array_equal(
      cos_sin[0, :steps], np.asarray(plain.cos_sin)[0, segs])
  assert carried.cos_sin.shape == (1, pages, 2, 0)  # none beside them
  assert not np.allclose(cos_sin[0, 0], cos_sin[0, 1])
  # A plan made for other block sizes: refused before any work.
  q = jnp.zeros((1, 64, 2, head_dim), jnp.bfloat16)
  kv = jnp.zeros((2, pages, page_size, head_dim), jnp.bfloat16)
  with pytest.raises(ValueError, match="make the plan with the kernel's"):
    mgpu_prefill_kernel(q, kv, kv, plain, out_dtype=jnp.bfloat16,
                        block_sizes=sizes, interpret=True)
  wider = smem_bytes(MgpuBlockSizes(cos_sin_in_records=True), 128)
  narrower = smem_bytes(MgpuBlockSizes(cos_sin_in_records=False), 128)
  assert wider - narrower == 2 * 2 * 128 * 4
