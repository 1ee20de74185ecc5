"""The Mosaic GPU prefill's plan made in one Pallas Mosaic GPU launch.

`plan_prefill` (gpu_prefill_mgpu_plan.py) makes the same `PrefillPlan` in
about ten XLA fusions; under the whole call those launches, not their
work, are what the call lacks against cuDNN (docs/kernels.md, "What part 4
still needs").  This kernel writes the same arrays, bit for bit, in one
launch of small CTAs, each recomputing the few per-row counts it needs
from the row's page metadata (a few 128-lane loads and reductions) instead
of reading them from an earlier launch.

A step's first page is a segment start, or the first page of a KV block
that lies after the row's first live page and at or before its last one
(a block carried inside a segment that began earlier).  So every count the
plan needs is a count of "step-first" pages: a step's index is the
step-first pages before its first page; a token block's steps are the
step-first pages before the last page it can see.  Grid (CTAs, B), one
role a CTA, the roles with the longest chains first:

- a CTA for each tile: its `n_steps`;
- a CTA for each KV block: the records of the steps whose first page lies
  in it, written to their rows (rows past the row's steps are zeroed in
  slices, one a CTA);
- T_pad / 8 CTAs, each 8 rows of `row_pos` and `query_cos_sin`;
- T_pad / 64 CTAs, each a token block's `min_row`.

A role on the same CTA after another's stores would wait out its loads'
whole latency, and the two chains would add up.

Limits (`plan_kernel_unsupported` names the first that fails; the XLA plan
serves those shapes): head dim 128, records that carry their segment's
cos / sin, at least 129 logical pages and 128 query tokens (the row's
metadata is read in 128-lane pieces).

Design: docs/kernels.md.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_block_sizes import WG_ROWS, MgpuBlockSizes
from pallas_kernels.gpu_mgpu_lanes import (LANES, lane_kernel, lanes_cast,
                                           start_plan_grid)
from pallas_kernels.gpu_prefill_mgpu_plan import (INT32_MAX, INT32_MIN,
                                                  Q15_ONE, PrefillPlan,
                                                  RecordLayout, max_steps,
                                                  padded_query_len)
from pallas_kernels.rope import NUM_TURN_CHUNKS, RopeConfig, cos_sin_from_chunks
from pallas_kernels.sizes import ceil_div

ROWS_PER_QUERY_CTA = 8
HEAD_DIM = 128


def plan_kernel_unsupported(*, num_logical_pages: int, q_len: int,
                            head_dim: int, block_sizes: MgpuBlockSizes):
  """Why `plan_prefill_kernel` cannot make this plan, or None."""
  if head_dim != HEAD_DIM:
    return f"the plan kernel needs head dim {HEAD_DIM}, got {head_dim}"
  if not block_sizes.cos_sin_in_records:
    return "the plan kernel writes records that carry cos / sin"
  if num_logical_pages <= LANES:
    return (f"the plan kernel needs more than {LANES} logical pages, got "
            f"{num_logical_pages}")
  if q_len < LANES:
    return f"the plan kernel needs at least {LANES} query tokens, got {q_len}"
  return None


def lane_turn_chunks(rope: RopeConfig, head_dim: int) -> np.ndarray:
  """int32 [NUM_TURN_CHUNKS, 128]: lane k holds the turn chunks of record
  word k of a step's cos | sin (`RopeConfig.turn_chunks` is already laid
  out as cos | sin halves)."""
  return rope.turn_chunks(head_dim)[:, np.arange(LANES) % head_dim]


def _nearest(x):
  """floor(x + 0.5) from a truncating conversion (Mosaic GPU has no floor):
  the same float as `jnp.floor(x + 0.5)`, the XLA plan's rounding, for
  |x| < 2^30 (`gpu_mgpu_parts.shift_cos_sin`'s jnp.round differs at
  ties, which would move an angle of exactly pi to -pi)."""
  y = x + 0.5
  t = y.astype(jnp.int32)
  return (t - (t.astype(jnp.float32) > y).astype(jnp.int32)).astype(
      jnp.float32)


def _round_half_even(x):
  """int32 jnp.round(x) (ties to even) for |x| < 2^30."""
  t = _nearest(x).astype(jnp.int32)
  tie = (t.astype(jnp.float32) - x == 0.5) & (t % 2 != 0)
  return t - tie.astype(jnp.int32)


class _RowScan(NamedTuple):
  """What a CTA derives from its row's metadata (`scan_row`)."""

  newest: jax.Array  # newest q_pos of the row, INT32_MIN if none
  first_live: jax.Array  # first live page, NB * ppb if none
  last_live: jax.Array  # last live page, -1 if none
  live0: jax.Array  # page 0 live
  pos0: jax.Array  # page 0's position
  pieces: list  # 128-lane pieces of pages 1.. with their liveness


def _plan_kernel(
    # Inputs.
    table_ref, pos_ref, shift_ref, len_ref,  # int32 [B, M] page metadata
    q_pos_ref,  # int32 [B, T]
    chunks_ref,  # int32 [NUM_TURN_CHUNKS, 128] (lane_turn_chunks)
    # Outputs.
    n_steps_ref,  # int32 [B, tiles]
    min_row_ref,  # int32 [B, T_pad / 64]
    rec_ref,  # int32 [B, S_max, width]
    row_pos_ref,  # int32 [B, T_pad]
    qcs_ref,  # int16 [B, T_pad, H]; written only where `query_table`
    *, num_pages, page_size, ppb, group, nwg, query_table, dependent_launch,
    interpret):
  start_plan_grid(dependent_launch=dependent_launch, interpret=interpret)
  batch = jax.lax.axis_index("b")
  cta = jax.lax.axis_index("cta")
  num_logical = table_ref.shape[1]
  q_len = q_pos_ref.shape[1]
  num_blocks = ceil_div(num_logical, ppb)
  s_max, width = rec_ref.shape[1], rec_ref.shape[2]
  t_pad = row_pos_ref.shape[1]
  layout = RecordLayout(ppb, cos_sin_dim=HEAD_DIM)
  as_lanes = lanes_cast(interpret)
  lane = as_lanes(jax.lax.broadcasted_iota(jnp.int32, (LANES,), 0))

  def lanes_of(ref, start, length):  # ref[batch, start:start + 128]
    return as_lanes(ref[batch, pl.ds(start, length)])

  def pieces(length, first=0):
    """(nominal start, start) of 128-lane pieces over first..length - 1; the
    last piece starts at length - 128 and counts only lanes >= nominal."""
    return [(c, min(c, length - LANES)) for c in range(first, length, LANES)]

  def live_of(length, pos, newest, page=None):
    live = (length > 0) & (pos <= newest) & (newest >= 0)
    return live if page is None else live & (page < num_logical)

  def load_row():
    """The row's q_pos and page metadata in 128-lane pieces (pages from 1
    on, each beside its predecessor; page 0 as scalars), all loaded before
    the first reduction so that their latencies overlap."""
    q_pieces = [lanes_of(q_pos_ref, start, LANES)
                for _, start in pieces(q_len)]
    page_pieces = [dict(
        nominal=nominal, page=start + lane,
        length=lanes_of(len_ref, start, LANES),
        pos=lanes_of(pos_ref, start, LANES),
        shift=lanes_of(shift_ref, start, LANES),
        prev_length=lanes_of(len_ref, start - 1, LANES),
        prev_pos=lanes_of(pos_ref, start - 1, LANES),
        prev_shift=lanes_of(shift_ref, start - 1, LANES))
        for nominal, start in pieces(num_logical, first=1)]
    return q_pieces, page_pieces, len_ref[batch, 0], pos_ref[batch, 0]

  def scan_row(row) -> _RowScan:
    q_pieces, page_pieces, length0, pos0 = row
    newest = None
    for q in q_pieces:
      q = jnp.where(q >= 0, q, INT32_MIN)
      newest = q if newest is None else jnp.maximum(newest, q)
    newest = jnp.max(newest)
    live0 = live_of(length0, pos0, newest)
    first, last = None, None
    for piece in page_pieces:
      piece["live"] = live_of(piece["length"], piece["pos"], newest)
      piece["prev_live"] = live_of(piece["prev_length"], piece["prev_pos"],
                                   newest)
      f = jnp.where(piece["live"], piece["page"], num_blocks * ppb)
      l = jnp.where(piece["live"], piece["page"], -1)
      first = f if first is None else jnp.minimum(first, f)
      last = l if last is None else jnp.maximum(last, l)
    first = jnp.where(live0, 0, jnp.min(first))
    last = jnp.maximum(jnp.max(last), jnp.where(live0, 0, -1))
    return _RowScan(newest, first, last, live0, pos0, page_pieces)

  def last_seen_pages(scan, tile_newests):
    """Per token block's newest row: 1 + the last page it sees, or 0."""
    lasts = [None] * len(tile_newests)
    for piece in scan.pieces:
      for w, tile_newest in enumerate(tile_newests):
        l = jnp.where(piece["live"] & (piece["pos"] <= tile_newest),
                      piece["page"], -1)
        lasts[w] = l if lasts[w] is None else jnp.maximum(lasts[w], l)
    return [jnp.maximum(jnp.max(last), jnp.where(
        scan.live0 & (scan.pos0 <= tile_newest), 0, -1)) + 1
            for last, tile_newest in zip(lasts, tile_newests)]

  def counts_before(scan, ends, starts_end=None):
    """Step-first pages among pages < each of `ends`, and segment starts
    among pages < `starts_end` (if given), in one pass over the row."""
    at0 = lambda end: (scan.live0 & (end > 0)).astype(jnp.int32)  # page 0
    steps, starts = [None] * len(ends), None
    for piece in scan.pieces:
      page = piece["page"]
      is_start = piece["live"] & ~(piece["prev_live"]
                                   & (piece["prev_shift"] == piece["shift"]))
      carried = ((page % ppb == 0) & (scan.first_live < page)
                 & (page <= scan.last_live))
      fresh = page >= piece["nominal"]  # not counted by the piece before
      for e, end in enumerate(ends):
        s = jnp.where(fresh & (page < end) & (is_start | carried), 1, 0)
        steps[e] = s if steps[e] is None else steps[e] + s
      if starts_end is not None:
        g = jnp.where(fresh & (page < starts_end) & is_start, 1, 0)
        starts = g if starts is None else starts + g
    steps = [jnp.sum(x) + at0(end) for x, end in zip(steps, ends)]
    if starts_end is None:
      return steps
    return steps, jnp.sum(starts) + at0(starts_end)

  # Loaded once, before any store: the compiler does not move a load above
  # a store to an output it cannot tell apart, so a load after a store waits
  # out its whole latency (docs/kernels.md).
  chunks = [as_lanes(chunks_ref[j, :]) for j in range(NUM_TURN_CHUNKS)]

  def cos_sin_lanes(position):  # f32 [128]: cos | sin of one position
    cos, sin = cos_sin_from_chunks(position + jnp.zeros_like(lane), chunks,
                                   nearest=_nearest)
    return jnp.where(lane % HEAD_DIM < HEAD_DIM // 2, cos, sin)

  # Roles by CTA, the longest chains first: where the CTAs do not all fit on
  # the GPU at once, those start in the first wave.
  tile = cta  # its n_steps
  block = cta - n_steps_ref.shape[1]  # its KV block's records
  query_cta = block - num_blocks  # its 8 query rows
  token_block = query_cta - t_pad // ROWS_PER_QUERY_CTA  # its min_row

  @pl.when((block >= 0) & (query_cta < 0))
  def _block():
    first_page = block * ppb
    # The block's pages, scalar by scalar (pages past M repeat the last),
    # loaded first so that their latency overlaps the row's reductions.
    pages = []
    for i in range(ppb):
      at = jnp.minimum(first_page + i, num_logical - 1)
      pages.append(dict(phys=table_ref[batch, at], pos=pos_ref[batch, at],
                        length=len_ref[batch, at],
                        shift=shift_ref[batch, at]))
    before = jnp.maximum(first_page - 1, 0)
    prev_length, prev_pos = len_ref[batch, before], pos_ref[batch, before]
    prev_shift = shift_ref[batch, before]
    scan = scan_row(load_row())
    (steps_before, num_steps), starts_before = counts_before(
        scan, [first_page, num_blocks * ppb], starts_end=first_page)
    for i, p in enumerate(pages):
      p["phys"] = jnp.clip(p["phys"], 0, num_pages - 1)
      p["live"] = live_of(p["length"], p["pos"], scan.newest,
                          first_page + i)
    prev_live = (live_of(prev_length, prev_pos, scan.newest)
                 & (first_page > 0))
    # A step starts at each segment start, and at the block's first page
    # where the block is carried inside a segment begun before it.
    carried = (scan.first_live < first_page) & (first_page <= scan.last_live)
    owner, rank, seg_count = [], jnp.int32(0), starts_before
    for i, p in enumerate(pages):
      p["start"] = p["live"] & ~(prev_live & (prev_shift == p["shift"]))
      p["first"] = p["start"] | carried if i == 0 else p["start"]
      seg_count = seg_count + p["start"].astype(jnp.int32)
      p["seg"] = seg_count - 1
      p["row"] = steps_before + rank
      rank = rank + p["first"].astype(jnp.int32)
      # The step a page belongs to: the last step started at or before it.
      owner.append(jnp.where(p["first"], i, owner[-1] if owner else -1))
      prev_live, prev_shift = p["live"], p["shift"]

    for i, p in enumerate(pages):
      @pl.when(p["first"])
      def _record():
        row = p["row"]
        mine = [(owner[o] == i) & pages[o]["live"] for o in range(ppb)]
        lim = [jnp.where(mine[o], pages[o]["length"], 0) for o in range(ppb)]
        # step_flags' folds, over the step's pages as scalars.
        fixup = functools.reduce(jnp.logical_or,
                                 [l < page_size for l in lim])
        max_pos = functools.reduce(jnp.maximum, [
            jnp.where(l > 0, q["pos"] + l - 1, INT32_MIN)
            for l, q in zip(lim, pages)])
        shift = functools.reduce(jnp.maximum, [
            jnp.where(m, q["shift"], INT32_MIN)
            for m, q in zip(mine, pages)])
        header = ([q["phys"] for q in pages] + [q["pos"] for q in pages]
                  + lim + [p["seg"], p["start"].astype(jnp.int32),
                           fixup.astype(jnp.int32), max_pos])
        for f, value in enumerate(header):
          rec_ref[batch, row, f] = value
        for f in range(len(header), layout.cos_sin):
          rec_ref[batch, row, f] = jnp.int32(0)
        cos_sin = cos_sin_lanes(jnp.where(shift == INT32_MIN, 0, shift))
        rec_ref[batch, row, pl.ds(layout.cos_sin, LANES)] = (
            jax.lax.bitcast_convert_type(cos_sin, jnp.int32))

    # Rows past the row's steps are zero, as the XLA plan's.
    rows_per_cta = ceil_div(s_max, num_blocks)
    zeros = lane * 0  # in the lanes' layout
    for r in range(rows_per_cta):
      row = block * rows_per_cta + r
      @pl.when((row >= num_steps) & (row < s_max))
      def _zero():
        rec_ref[batch, row, pl.ds(0, LANES)] = zeros
        rec_ref[batch, row, pl.ds(width - LANES, LANES)] = zeros

  def row_pos_at(t):  # the plan's row_pos of query row t (< T_pad)
    q = q_pos_ref[batch, jnp.minimum(t, q_len - 1)]
    return jnp.where((t < q_len) & (q >= 0), q, common.PADDING_ROW)

  @pl.when((query_cta >= 0) & (token_block < 0))
  def _query_rows():
    rows = [query_cta * ROWS_PER_QUERY_CTA + r
            for r in range(ROWS_PER_QUERY_CTA)]
    row_positions = [row_pos_at(t) for t in rows]  # all loads first
    for t, row_pos in zip(rows, row_positions):
      row_pos_ref[batch, t] = row_pos
      if not query_table:  # XLA rotates the query: no table to write
        continue
      cos_sin = cos_sin_lanes(jnp.maximum(row_pos, 0))
      # cos_sin * Q15_ONE, as c * 2^15 - c: the one rounding of the exact
      # product even where the compiler fuses a multiply into the add
      # after it (an FMA would round c * Q15_ONE + 0.5 only once).
      q15 = _round_half_even(cos_sin * jnp.float32(Q15_ONE + 1) - cos_sin)
      q15 = jnp.where(row_pos >= 0, q15, 0)
      qcs_ref[batch, t, :] = q15.astype(jnp.int16)

  def token_block_rows(token):  # (oldest, newest) row_pos of token block
    oldest, newest = jnp.int32(INT32_MAX), jnp.int32(INT32_MIN)
    for r in range(WG_ROWS):
      row_pos = row_pos_at(token * WG_ROWS + r)
      oldest, newest = (jnp.minimum(oldest, row_pos),
                        jnp.maximum(newest, row_pos))
    return oldest, newest

  @pl.when(block < 0)
  def _n_steps():
    row = load_row()
    tile_newests = [token_block_rows((tile * nwg + w) // group)[1]
                    for w in range(nwg)]
    scan = scan_row(row)
    steps = counts_before(scan, last_seen_pages(scan, tile_newests))
    n_steps = steps[0]
    for more in steps[1:]:
      n_steps = jnp.maximum(n_steps, more)
    n_steps_ref[batch, tile] = n_steps

  @pl.when(token_block >= 0)
  def _min_row():
    min_row_ref[batch, token_block] = token_block_rows(token_block)[0]


def plan_prefill_kernel(page_table, page_pos, page_shift, page_len, q_pos, *,
                        rope: RopeConfig, group, head_dim, num_pages,
                        page_size, block_sizes: MgpuBlockSizes | None = None,
                        interpret: bool = False) -> PrefillPlan:
  """`plan_prefill`'s PrefillPlan, bit for bit, in one Mosaic GPU launch.

  Same arguments as `gpu_prefill_mgpu_plan.plan_prefill`; `interpret=True`
  runs the kernel in the Mosaic GPU interpreter (CPU, tests).  Raises
  ValueError, naming the limit, for shapes `plan_kernel_unsupported`
  refuses.
  """
  block_sizes = block_sizes or MgpuBlockSizes()
  batch, num_logical = page_table.shape
  q_len = q_pos.shape[1]
  reason = plan_kernel_unsupported(num_logical_pages=num_logical, q_len=q_len,
                                   head_dim=head_dim, block_sizes=block_sizes)
  if reason is not None:
    raise ValueError(reason)
  nwg = block_sizes.num_compute_wgs
  ppb = block_sizes.block_kv // page_size
  t_pad = padded_query_len(q_len, group, nwg)
  num_blocks = ceil_div(num_logical, ppb)
  num_tiles = t_pad // WG_ROWS * group // nwg
  num_ctas = (num_tiles + num_blocks + t_pad // ROWS_PER_QUERY_CTA
              + t_pad // WG_ROWS)
  layout = RecordLayout(ppb, cos_sin_dim=head_dim)
  rotates = block_sizes.rotates_query_in_kernel
  out_types = (
      jax.ShapeDtypeStruct((batch, num_tiles), jnp.int32),
      jax.ShapeDtypeStruct((batch, t_pad // WG_ROWS), jnp.int32),
      jax.ShapeDtypeStruct((batch, max_steps(num_logical, ppb), layout.width),
                           jnp.int32),
      jax.ShapeDtypeStruct((batch, t_pad), jnp.int32),
      jax.ShapeDtypeStruct((batch, t_pad, head_dim), jnp.int16),
  )
  kernel = lane_kernel(
      lambda *refs: _plan_kernel(*refs, num_pages=num_pages,
                                 page_size=page_size, ppb=ppb, group=group,
                                 nwg=nwg, query_table=rotates,
                                 dependent_launch=block_sizes.dependent_launch,
                                 interpret=interpret),
      # The last axis is CUDA's x, launched first: each role's CTAs for
      # every row before the next role's.
      out_type=out_types, grid=(num_ctas, batch),
      grid_names=("cta", "b"), interpret=interpret)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  n_steps, min_row, records, row_pos, query_cos_sin = kernel(
      i32(page_table), i32(page_pos), i32(page_shift), i32(page_len),
      i32(q_pos), jnp.asarray(lane_turn_chunks(rope, head_dim)))
  if not rotates:
    query_cos_sin = jnp.zeros((batch, t_pad, 0), jnp.int16)
  cos_sin = jnp.zeros((batch, num_logical, 2, 0), jnp.float32)
  return PrefillPlan(n_steps, min_row, records, cos_sin, row_pos,
                     query_cos_sin)
