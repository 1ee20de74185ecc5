"""The Mosaic GPU decode's block plan made in one Pallas Mosaic GPU launch.

`plan_decode` makes the block plan (`gpu_decode_block_plan.block_records`:
one step per KV block, the RoPE computed in the decode kernel) in about ten
XLA launches.  The work is the page metadata reshaped, so in the whole call
those launches, not their work, stand between the decode kernel and what
runs before it (docs/kernels.md, 'GPU decode, Mosaic GPU').  This kernel
writes the same arrays, bit for bit, in one launch: a CTA a batch row,
which reads the row's page metadata in 128-page pieces (one page a lane),
writes each piece's block records as four strided [128 / ppb, ppb] stores
(a block's eight page ids, then its positions, valid slots and shifts), and
reduces the row's last live page to its step count.

With `MgpuDecodeBlockSizes.dependent_launch` it lets the decode kernel
launch at its start (griddepcontrol.launch_dependents) and waits for the
grid before it before any read.

Limits (`decode_plan_kernel_unsupported` names the first that fails; the
XLA plan serves those shapes): block plans with the RoPE in the kernel
(not the page-fields form), 128 a multiple of the pages per block and no
padding words in a record, and at least 128 logical pages, a whole number
of blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import gpu_common as common
from pallas_kernels.gpu_decode_block_sizes import MgpuDecodeBlockSizes
from pallas_kernels.gpu_decode_block_plan import BlockRecordLayout
from pallas_kernels.gpu_mgpu_lanes import (LANES, lane_kernel, lanes_cast,
                                           start_plan_grid)


def decode_plan_kernel_unsupported(*, num_logical_pages: int, page_size: int,
                                   block_sizes: MgpuDecodeBlockSizes):
  """Why `plan_decode_kernel` cannot make this plan, or None."""
  if (not (block_sizes.steps_by_block and block_sizes.rope_in_kernel)
      or block_sizes.fields_in_kernel):
    return ("the decode plan kernel makes block plans with the RoPE in the "
            "kernel (steps_by_block and rope_in_kernel, not "
            "fields_in_kernel)")
  ppb = block_sizes.block_kv // page_size
  if LANES % ppb or BlockRecordLayout(ppb).width != 4 * ppb:
    return (f"the decode plan kernel needs a divisor of {LANES} pages per "
            f"block, at least 8, got {ppb}")
  if num_logical_pages < LANES or num_logical_pages % ppb:
    return (f"the decode plan kernel needs at least {LANES} logical pages, "
            f"a multiple of the {ppb} pages per block, got "
            f"{num_logical_pages}")
  return None


def _plan_kernel(
    # Inputs.
    table_ref, pos_ref, shift_ref, len_ref,  # int32 [B, M] page metadata
    q_pos_ref,  # int32 [B, 1]
    # Outputs.
    n_steps_ref,  # int32 [B]: blocks up to the row's last live page
    rec_ref,  # int32 [B, M / ppb, 4 ppb]: BlockRecordLayout records
    kernel_q_pos_ref,  # int32 [B]: q_pos, PADDING_ROW for padding rows
    *, num_pages, ppb, dependent_launch, interpret):
  start_plan_grid(dependent_launch=dependent_launch, interpret=interpret)
  batch = lax.axis_index("b")
  num_logical = table_ref.shape[1]
  layout = BlockRecordLayout(ppb)
  as_lanes = lanes_cast(interpret)
  lane = as_lanes(lax.broadcasted_iota(jnp.int32, (LANES,), 0))
  # 128-page pieces; the last starts at M - 128 and rewrites, with the same
  # values, the records of the pages the piece before it wrote.
  starts = sorted({min(c, num_logical - LANES)
                   for c in range(0, num_logical, LANES)})
  # Every load before any store: the compiler does not move a load above a
  # store to an output it cannot tell apart (docs/kernels.md).
  q_pos = q_pos_ref[batch, 0]
  pieces = [{name: as_lanes(ref[batch, pl.ds(start, LANES)])
             for name, ref in (("phys", table_ref), ("pos", pos_ref),
                               ("shift", shift_ref), ("length", len_ref))}
            for start in starts]
  last_live = None
  for start, piece in zip(starts, pieces):
    live = (piece["length"] > 0) & (piece["pos"] <= q_pos) & (q_pos >= 0)
    last = jnp.where(live, start + lane, -1)
    last_live = last if last_live is None else jnp.maximum(last_live, last)
    fields = ((layout.phys, jnp.clip(piece["phys"], 0, num_pages - 1)),
              (layout.pos, piece["pos"]),
              (layout.lim, jnp.where(live, piece["length"], 0)),
              (layout.shift, piece["shift"]))
    blocks = pl.ds(start // ppb, LANES // ppb)
    for offset, value in fields:
      rec_ref[batch, blocks, pl.ds(offset, ppb)] = value.reshape(
          LANES // ppb, ppb)
  last_live = jnp.max(last_live)
  n_steps_ref[batch] = jnp.where(last_live >= 0,
                                 lax.div(last_live, jnp.int32(ppb)) + 1, 0)
  kernel_q_pos_ref[batch] = jnp.where(q_pos >= 0, q_pos, common.PADDING_ROW)


def plan_decode_kernel(page_table, page_pos, page_shift, page_len, q_pos, *,
                       num_pages: int, page_size: int,
                       block_sizes: MgpuDecodeBlockSizes,
                       interpret: bool = False):
  """(n_steps int32 [B], records int32 [B, M / ppb, width], q_pos int32
  [B]): `plan_decode`'s block plan fields, bit for bit, in one Mosaic GPU
  launch.  `q_pos` int32 [B, 1]; `interpret=True` runs the kernel in the
  Mosaic GPU interpreter (CPU, tests).  Raises ValueError, naming the
  limit, for shapes `decode_plan_kernel_unsupported` refuses."""
  batch, num_logical = page_table.shape
  reason = decode_plan_kernel_unsupported(
      num_logical_pages=num_logical, page_size=page_size,
      block_sizes=block_sizes)
  if reason is not None:
    raise ValueError(reason)
  ppb = block_sizes.block_kv // page_size
  out_types = (
      jax.ShapeDtypeStruct((batch,), jnp.int32),
      jax.ShapeDtypeStruct((batch, num_logical // ppb,
                            BlockRecordLayout(ppb).width), jnp.int32),
      jax.ShapeDtypeStruct((batch,), jnp.int32),
  )
  kernel = lane_kernel(
      functools.partial(_plan_kernel, num_pages=num_pages, ppb=ppb,
                        dependent_launch=block_sizes.dependent_launch,
                        interpret=interpret),
      out_type=out_types, grid=(batch,), grid_names=("b",),
      interpret=interpret)
  i32 = lambda a: jnp.asarray(a, jnp.int32)
  return kernel(i32(page_table), i32(page_pos), i32(page_shift),
                i32(page_len), i32(q_pos))
