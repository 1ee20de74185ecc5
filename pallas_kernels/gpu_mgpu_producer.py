"""The producer warpgroup of the Mosaic GPU (Hopper) prefill and decode
kernels: each step's KV pages, step record and cos / sin TMA-copied into
a ring of shared-memory slots (`produce_kv_ring`), and the last releases
observed (`drain_kv_ring`).  The compute warpgroups' pieces are
gpu_mgpu_parts.py; design: docs/kernels.md.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Registers per thread (setmaxnreg) of the producer warpgroup.
PRODUCER_REGISTERS = 40


def produce_kv_ring(n_steps, batch, head, page_offset_ref, rec_ref, k_ref,
                    v_ref, cs_ref, rec_smem, k_smem, v_smem, cs_smem, k_bars,
                    v_bars, k_free, v_free, *, layout, pages_per_block: int,
                    page_size: int, stages: int, interpret: bool,
                    first_record=None, ring_step=None, drain: bool = True,
                    set_registers: bool = True, cs_stages: int | None = None,
                    cs_rows: int | None = None, page_ids=None,
                    copy_record=None, copy_contiguous_blocks: bool = False,
                    l2_prefetch: bool = False):
  """The producer warpgroup of the Mosaic GPU prefill and decode kernels.

  Step i copies, into ring slot (ring_step + i) % stages, the K pages of
  step record `first_record + i` (0 when None) with that record and the
  cos/sin of its segment (all on k_bars[slot]), then its V pages (on
  v_bars[slot]), each after the consumer has freed the slot (k_free /
  v_free).  `ring_step` (0 when None) is how many steps earlier calls put
  through the same ring (a persistent CTA streams several work items).
  With `drain`, it then waits for the last releases (`drain_kv_ring`).
  `set_registers=False` leaves the warpgroup's register count to a caller
  that has set it once.  `cs_stages` (stages when None) is the depth of the
  cos/sin ring, deeper where a slot is freed before its cos/sin are used.
  `cs_rows` (None: one) copies that many cos/sin rows from the record's
  `layout.segment` on (a block's pages, `gpu_decode_block_plan`); 0 copies
  none.
  `page_ids(batch, row)` (the step's physical ids, page_offset added) and
  `copy_record(batch, row, dst, barrier)` replace the reads and the copy of
  `rec_ref` where the kernel reads the page metadata itself
  (`gpu_decode_page_fields`).
  `copy_contiguous_blocks`: a step whose pages have consecutive physical
  ids (a document's pages as the cache allocates them, first fit)
  moves its K (and V) block in one TMA copy instead of one per page, plus
  plain arrivals for the barrier's other page counts.
  `l2_prefetch`: before waiting for the step's slot to be freed, prefetch
  its K and V pages into L2 (cp.async.bulk.prefetch.L2, the same pieces
  as the copies), so their HBM reads start a step earlier and the copies
  into the slot read L2; not in the interpreter, where it would change
  nothing.
  Returns ring_step + n_steps.
  """
  if not interpret and set_registers:
    plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")
  page_offset = page_offset_ref[0]
  base = jnp.int32(0) if ring_step is None else ring_step

  def step(i, _):
    ring = base + i
    slot = lax.rem(ring, stages)
    row = i if first_record is None else first_record + i
    # Scalar reads first: their latency overlaps the wait for the slot.
    phys = (page_ids(batch, row) if page_ids is not None else
            [rec_ref[batch, row, layout.phys + j] + page_offset
             for j in range(pages_per_block)])
    seg = layout.segment(rec_ref, batch, row) if cs_rows != 0 else None

    merge = copy_contiguous_blocks and pages_per_block > 1
    if merge:
      contiguous = phys[1] == phys[0] + 1
      for j in range(2, pages_per_block):
        contiguous = jnp.logical_and(contiguous, phys[j] == phys[0] + j)

    def each_piece(pages_ref, move):
      """move(gmem rows, first page, pages) for each piece of the step's
      pages: the whole block where they are consecutive (`merge`), else
      one page at a time."""
      def page_by_page():
        for j in range(pages_per_block):
          move(pages_ref.at[head, pl.ds(phys[j] * page_size, page_size)],
               j, 1)
      if not merge:
        page_by_page()
        return
      whole = pages_ref.at[head, pl.ds(phys[0] * page_size,
                                       pages_per_block * page_size)]
      pl.when(contiguous)(lambda: move(whole, 0, pages_per_block))
      pl.when(jnp.logical_not(contiguous))(page_by_page)

    def copy_pages(pages_ref, ring_smem, barrier):
      def move(src, first, pages):
        dst = (ring_smem.at[slot] if pages == pages_per_block else
               ring_smem.at[slot, pl.ds(first * page_size,
                                        pages * page_size)])
        plgpu.copy_gmem_to_smem(src, dst, barrier)
        # The barrier counts one arrival per page: a block copy makes one
        # (with the block's bytes), plain arrivals the rest, after it.
        for _ in range(pages - 1):
          plgpu.barrier_arrive(barrier)
      each_piece(pages_ref, move)

    if l2_prefetch and not interpret:  # while the slots are still in use
      for pages_ref in (k_ref, v_ref):
        each_piece(pages_ref, lambda src, *_: plgpu.async_prefetch(src))

    @pl.when(ring >= stages)
    def _():
      plgpu.barrier_wait(k_free.at[slot])
    copy_pages(k_ref, k_smem, k_bars.at[slot])
    if copy_record is not None:
      copy_record(batch, row, rec_smem.at[lax.rem(ring, 2 * stages)],
                  k_bars.at[slot])
    else:
      plgpu.copy_gmem_to_smem(rec_ref.at[batch, row],
                              rec_smem.at[lax.rem(ring, 2 * stages)],
                              k_bars.at[slot])
    if cs_rows != 0:  # 0: the kernel computes its cos / sin itself
      cs_src = (cs_ref.at[batch, seg] if cs_rows is None
                else cs_ref.at[batch, pl.ds(seg, cs_rows)])
      plgpu.copy_gmem_to_smem(cs_src,
                              cs_smem.at[lax.rem(ring, cs_stages or stages)],
                              k_bars.at[slot])

    @pl.when(ring >= stages)
    def _():
      plgpu.barrier_wait(v_free.at[slot])
    copy_pages(v_ref, v_smem, v_bars.at[slot])
    return ()

  lax.fori_loop(0, n_steps, step, ())
  end = base + n_steps
  if drain:
    drain_kv_ring(end, k_free, v_free, stages=stages)
  return end


def drain_kv_ring(ring_steps, k_free, v_free, *, stages: int):
  """Observe the last releases of every slot after `ring_steps` steps, so
  each barrier phase is seen by its waiter (the interpreter checks this; on
  the GPU it only makes the producer wait for the consumers, having nothing
  left to do)."""
  def drain(i, _):
    slot = lax.rem(i, stages)
    plgpu.barrier_wait(k_free.at[slot])
    plgpu.barrier_wait(v_free.at[slot])
    return ()

  lax.fori_loop(jnp.maximum(ring_steps - stages, 0), ring_steps, drain, ())
