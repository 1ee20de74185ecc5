"""TPU (Pallas / Mosaic) lazy attention kernels, checked on CPU.

No TPU is needed:
  - parity runs the kernels under `pltpu.InterpretParams()`, which keeps TPU
    semantics (SMEM scalar prefetch, DMAs and semaphores, uninitialised VMEM
    filled with NaN, out-of-bounds reads raise), against the jnp reference
    and a float64 NumPy truth;
  - lowering exports the real Mosaic kernels with
    `jax.export(..., platforms=["tpu"])`.

TPU interpret mode is slow (every memory access is a host callback, every
new shape a fresh XLA compile), so the parity cases are a short list that
covers every value of every axis once or more, not the cross product:
Hq/Hkv 9/3, 8/8, 32/8; H 64, 128; page sizes 8, 16; float32, bfloat16; T 1,
7, 64; base positions 0 and 2^20; plain and Llama-3 RoPE.  Every case has
NaN-filled unused pages and padding slots, ragged documents, an empty page
between documents, a physical page shared by two rows at different shifts,
shuffled physical pages, and padding query rows.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels import RopeConfig, lazy_attention, lazy_attention_reference
from pallas_kernels import tpu_page_metadata
from pallas_kernels.tpu_block_sizes import (TpuDecodeBlockSizes,
                                            TpuPrefillBlockSizes)
from pallas_kernels.tpu_decode import lazy_decode_tpu
from pallas_kernels.tpu_prefill import lazy_prefill_tpu
from pallas_kernels.testing import (contract_specs, make_case, numpy_truth,
                                    relative_error, zero_args)
from tests.rope_configs import LLAMA3, PLAIN

TOLERANCE = {np.float32: 1e-5, jnp.bfloat16: 2e-2}


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  q_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  page_size: int
  dtype: type
  base_position: int
  rope: RopeConfig
  # None: through the public lazy_attention (default block sizes); otherwise
  # the kernel entry point with these (small) blocks, so that rows span many
  # KV blocks and blocks span document boundaries.
  block_sizes: TpuDecodeBlockSizes | TpuPrefillBlockSizes | None
  batch: int = 2
  max_doc_len: int = 40
  # Decode has no padding rows from make_case (T == 1): blank these rows.
  padding_rows: tuple[int, ...] = ()
  # Run the interpreter's happens-before race detector (DMAs into the double
  # buffer against the kernel's reads of it).
  detect_races: bool = False


CASES = [
    Case("decode-f32-9/3-h64-p16", 1, 9, 3, 64, 16, np.float32, 0, PLAIN,
         TpuDecodeBlockSizes(kv_tokens_per_block=32, num_splits=1,
                             max_metadata_bytes=1),  # one row per call
         batch=3, padding_rows=(1,)),
    Case("decode-bf16-32/8-h128-p8-2^20-llama3", 1, 32, 8, 128, 8,
         jnp.bfloat16, 1 << 20, LLAMA3,
         TpuDecodeBlockSizes(kv_tokens_per_block=16, num_splits=2),
         max_doc_len=24, batch=3, padding_rows=(2,), detect_races=True),
    Case("decode-f32-8/8-h128-p8-2^20-llama3-public", 1, 8, 8, 128, 8,
         np.float32, 1 << 20, LLAMA3, None, batch=3, max_doc_len=24,
         padding_rows=(0,)),
    Case("prefill-f32-T7-32/8-h64-p8-2^20-llama3", 7, 32, 8, 64, 8,
         np.float32, 1 << 20, LLAMA3,
         TpuPrefillBlockSizes(kv_tokens_per_block=16, max_metadata_bytes=1),
         max_doc_len=24),  # one row per kernel call
    Case("prefill-bf16-T64-9/3-h128-p16", 64, 9, 3, 128, 16, jnp.bfloat16, 0,
         PLAIN, TpuPrefillBlockSizes(q_tokens_per_block=32,
                                     kv_tokens_per_block=32),
         detect_races=True),
    Case("prefill-f32-T64-8/8-h64-p16-2^20-public", 64, 8, 8, 64, 16,
         np.float32, 1 << 20, PLAIN, None),
]


def _run(case: Case, seed: int):
  lazy = make_case(np.random.default_rng(seed), batch=case.batch,
                   q_len=case.q_len, num_heads=case.num_heads,
                   num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                   page_size=case.page_size, dtype=case.dtype,
                   max_doc_len=case.max_doc_len,
                   base_position=case.base_position)
  for row in case.padding_rows:
    lazy.q_pos[row] = -1
  args = [jnp.asarray(a) for a in lazy.args()]
  if case.block_sizes is None:
    out = lazy_attention(*args, rope=case.rope, impl="tpu", interpret=True)
  else:
    kernel = lazy_decode_tpu if case.q_len == 1 else lazy_prefill_tpu
    sm_scale = jnp.float32(case.head_dim ** -0.5)
    interpret = pltpu.InterpretParams(detect_races=case.detect_races)
    out = jax.jit(lambda *a: kernel(
        *a, rope=case.rope, sm_scale=sm_scale, interpret=interpret,
        block_sizes=case.block_sizes))(*args)
  return lazy, args, out


def _races_found():
  """The TPU interpreter's race flag (private API; None where it moved)."""
  try:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call
  except ImportError:
    return None
  races = getattr(interpret_pallas_call, "races", None)
  return getattr(races, "races_found", None)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_tpu_kernel_parity_interpret(case):
  lazy, args, out = _run(case, seed=CASES.index(case) + 1)
  assert out.shape == lazy.q.shape and out.dtype == lazy.q.dtype
  out = np.asarray(jnp.asarray(out, jnp.float32))
  assert not np.isnan(out).any()

  padding = lazy.q_pos < 0
  assert padding.any(), "every case must include padding query rows"
  assert np.all(out[padding] == 0.0)

  tol = TOLERANCE[case.dtype]
  truth = numpy_truth(lazy, case.rope)
  assert relative_error(out, truth) <= tol
  reference = lazy_attention_reference(*args, rope=case.rope)
  assert relative_error(out, np.asarray(reference, np.float64)) <= tol

  if case.detect_races:
    # None only where a jax release moved the flag: the parity above stands.
    assert _races_found() in (False, None)


def _page_metadata(*page_arrays, num_physical_pages, pages_per_block):
  build = jax.jit(functools.partial(tpu_page_metadata.build_page_metadata,
                                    num_physical_pages=num_physical_pages,
                                    pages_per_block=pages_per_block))
  return build(*(jnp.asarray(a, jnp.int32) for a in page_arrays))


def test_blocks_spanning_documents_are_exercised():
  """The small-block cases must hit blocks with more than one shift."""
  for case in CASES:
    if case.block_sizes is None:
      continue
    lazy = make_case(np.random.default_rng(CASES.index(case) + 1),
                     batch=case.batch, q_len=case.q_len,
                     num_heads=case.num_heads,
                     num_kv_heads=case.num_kv_heads, head_dim=case.head_dim,
                     page_size=case.page_size, max_doc_len=case.max_doc_len,
                     base_position=case.base_position)
    ppb = case.block_sizes.kv_tokens_per_block // case.page_size
    meta = _page_metadata(lazy.page_table, lazy.page_pos, lazy.page_shift,
                          lazy.page_len,
                          num_physical_pages=lazy.k_pages.shape[1],
                          pages_per_block=ppb)
    assert int(jnp.max(meta.block_num_shifts)) > 1, case.name


def test_page_metadata_lists_distinct_shifts_per_block():
  rng = np.random.default_rng(7)
  batch, num_logical, ppb, num_physical = 3, 11, 4, 9
  page_table = rng.integers(0, num_physical, (batch, num_logical))
  page_pos = rng.integers(0, 1000, (batch, num_logical))
  page_shift = rng.integers(0, 3, (batch, num_logical)) * 100
  page_len = rng.integers(0, 3, (batch, num_logical))  # some pages empty
  meta = _page_metadata(page_table, page_pos, page_shift, page_len,
                        num_physical_pages=num_physical, pages_per_block=ppb)
  num_blocks = -(-num_logical // ppb)
  pages_per_row = num_blocks * ppb
  info = np.asarray(meta.page_info).reshape(batch, pages_per_row)
  lists = np.asarray(meta.block_shifts).reshape(batch, num_blocks, ppb)
  counts = np.asarray(meta.block_num_shifts).reshape(batch, num_blocks)
  for b in range(batch):
    for blk in range(num_blocks):
      expected = []  # distinct shifts of used pages, in order of first use
      for m in range(blk * ppb, min((blk + 1) * ppb, num_logical)):
        if page_len[b, m] and page_shift[b, m] not in expected:
          expected.append(int(page_shift[b, m]))
      assert counts[b, blk] == max(1, len(expected))
      assert list(lists[b, blk, :len(expected)]) == expected
      for m in range(blk * ppb, (blk + 1) * ppb):
        length = info[b, m] & 0xFFFF
        index = info[b, m] >> 16
        if m < num_logical:
          assert length == page_len[b, m]
          if length:
            assert lists[b, blk, index] == page_shift[b, m]
        else:
          assert length == 0  # padding pages are never read


LOWERING_CONFIGS = [
    # (dtype, N, K, H, P)
    (jnp.float32, 9, 3, 64, 16),
    (jnp.bfloat16, 32, 8, 128, 8),  # bf16 page smaller than its 16-row tile
    (jnp.bfloat16, 8, 8, 64, 16),
]


@pytest.mark.parametrize("q_len", [1, 64], ids=["decode", "prefill"])
@pytest.mark.parametrize(
    "config", LOWERING_CONFIGS,
    ids=[f"{jnp.dtype(c[0]).name}-{c[1]}/{c[2]}-h{c[3]}-p{c[4]}"
         for c in LOWERING_CONFIGS])
def test_tpu_kernels_export_for_tpu(q_len, config):
  dtype, num_heads, num_kv_heads, head_dim, page_size = config
  batch = 4
  args = contract_specs(batch=batch, q_len=q_len, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, head_dim=head_dim,
                        num_pages=64, page_size=page_size,
                        num_logical_pages=40, dtype=dtype)
  kernel = lazy_decode_tpu if q_len == 1 else lazy_prefill_tpu

  def attend(q, k_pages, v_pages, page_table, page_pos, page_shift, page_len,
             q_pos, sm_scale):
    return kernel(q, k_pages, v_pages, page_table, page_pos, page_shift,
                  page_len, q_pos, rope=LLAMA3, sm_scale=sm_scale,
                  interpret=False)

  exported = jax.export.export(jax.jit(attend), platforms=["tpu"])(
      *args, jax.ShapeDtypeStruct((), jnp.float32))
  assert exported.platforms == ("tpu",)
  (out_aval,) = exported.out_avals
  assert out_aval.shape == (batch, q_len, num_heads, head_dim)
  assert out_aval.dtype == dtype
  assert "tpu_custom_call" in exported.mlir_module()


def test_block_sizes_reject_bad_values():
  with pytest.raises(ValueError, match="kv_tokens_per_block"):
    TpuDecodeBlockSizes(kv_tokens_per_block=0)
  with pytest.raises(ValueError, match="num_splits"):
    TpuDecodeBlockSizes(num_splits=0)
  with pytest.raises(ValueError, match="q_tokens_per_block"):
    TpuPrefillBlockSizes(q_tokens_per_block=-8)


def test_page_size_must_fill_sublane_tiles():
  args = zero_args(batch=1, q_len=1, num_heads=2, num_kv_heads=1,
                   head_dim=64, num_pages=4, page_size=4,
                   num_logical_pages=2)
  with pytest.raises(ValueError, match="page size"):
    lazy_decode_tpu(*args, rope=PLAIN, sm_scale=jnp.float32(0.125),
                    interpret=True)


def _sized_args(batch, q_len, num_logical_pages, dtype=jnp.float32):
  return zero_args(batch=batch, q_len=q_len, num_heads=4, num_kv_heads=2,
                   head_dim=64, num_pages=4, page_size=8,
                   num_logical_pages=num_logical_pages, dtype=dtype)


@pytest.mark.parametrize("batch,q_len", [(2, 0), (0, 1), (0, 4), (0, 0)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16],
                         ids=["f32", "bf16"])
def test_no_batch_or_query_rows_give_the_empty_result_of_the_xla_path(
    batch, q_len, dtype):
  # T == 0 crashed in the prefill's tiling (round_up(q_len, 0)) and B == 0
  # in the page metadata (reshape(0, -1)), both with ZeroDivisionError.
  args = _sized_args(batch, q_len, 3, dtype)
  want = lazy_attention(*args, rope=PLAIN, impl="xla")
  attend = functools.partial(lazy_attention, rope=PLAIN, impl="tpu",
                             interpret=pltpu.InterpretParams())
  for out in (attend(*args), jax.jit(attend)(*args)):
    assert out.shape == want.shape == (batch, q_len, 4, 64)
    assert out.dtype == want.dtype == dtype


@pytest.mark.parametrize("q_len", [1, 4], ids=["decode", "prefill"])
def test_no_logical_pages_raise_value_error_naming_page_table(q_len):
  # The TPU path raised numpy's "zero-size array to reduction operation
  # max", as the XLA path did; both now name the argument.
  args = _sized_args(2, q_len, 0)
  for impl in ("tpu", "xla"):
    with pytest.raises(ValueError,
                       match=r"^page_table must be \[B=2, M\] with M >= 1 "
                             r"logical pages, got shape \(2, 0\)$"):
      lazy_attention(*args, rope=PLAIN, impl=impl,
                     interpret=pltpu.InterpretParams() if impl == "tpu"
                     else False)


@pytest.mark.parametrize("q_len", [1, 256], ids=["decode", "prefill"])
def test_each_kernel_call_keeps_its_scalars_within_max_metadata_bytes(
    q_len, monkeypatch):
  # The prefill passes two scalars per query tile ([B, nT] each); the
  # chunking charged a row "a few" instead, so 256 tokens in tiles of 8
  # sent 1,360 bytes of scalars to a call with a budget of 400.
  import pallas_kernels.tpu_decode as tpu_decode
  import pallas_kernels.tpu_prefill as tpu_prefill
  module = tpu_decode if q_len == 1 else tpu_prefill
  budget, batch, calls = 400, 4, []

  def spy(call, meta, program_scalars, operands, **kwargs):
    def recorded(scalars, chunk_operands):
      calls.append((sum(x.size * x.dtype.itemsize for x in scalars),
                    chunk_operands[0].shape[0]))
      return call(scalars, chunk_operands)
    return tpu_page_metadata.call_in_batch_chunks(
        recorded, meta, program_scalars, operands, **kwargs)

  monkeypatch.setattr(module, "call_in_batch_chunks", spy)
  specs = contract_specs(batch=batch, q_len=q_len, num_heads=2,
                         num_kv_heads=1, head_dim=64, num_pages=32,
                         page_size=64, num_logical_pages=5)
  if q_len == 1:
    kernel, block_sizes = lazy_decode_tpu, TpuDecodeBlockSizes(
        kv_tokens_per_block=64, num_splits=1, max_metadata_bytes=budget)
  else:
    kernel, block_sizes = lazy_prefill_tpu, TpuPrefillBlockSizes(
        q_tokens_per_block=8, kv_tokens_per_block=320,
        max_metadata_bytes=budget)
  jax.eval_shape(lambda *a: kernel(*a, rope=PLAIN, sm_scale=0.125,
                                   interpret=True, block_sizes=block_sizes),
                 *specs)
  assert sum(rows for _, rows in calls) == batch
  assert all(scalar_bytes <= budget for scalar_bytes, _ in calls), calls
