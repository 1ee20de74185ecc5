"""The contract itself: reference and XLA path against a float64 truth, RoPE
range reduction, and typed errors on bad input (issue 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import (MAX_ROPE_POSITION, RopeConfig, lazy_attention,
                            lazy_attention_reference)
from pallas_kernels.lazy_attention import (plan_lazy_attention,
                                           resolve_impl)
from pallas_kernels.rope import cos_sin_from_chunks
from pallas_kernels.testing import (make_case, numpy_truth, relative_error,
                                    zero_args)
from tests.rope_configs import LLAMA3, PLAIN


# (heads, kv heads, head dim, page size, dtype, T, base position, rope)
CASES = [
    (9, 3, 64, 8, "float32", 7, 0, PLAIN),
    (9, 3, 64, 16, "bfloat16", 1, 1 << 20, LLAMA3),
    (8, 8, 128, 8, "float32", 64, 60_000, PLAIN),
    (8, 8, 64, 16, "bfloat16", 7, 0, LLAMA3),
    (32, 8, 128, 16, "float32", 1, 1 << 20, LLAMA3),
    (32, 8, 64, 8, "bfloat16", 64, 1 << 20, PLAIN),
]


def _inputs(case, dtype):
  args = [jnp.asarray(a) for a in case.args()]
  if dtype == "bfloat16":
    args[:3] = [a.astype(jnp.bfloat16) for a in args[:3]]
    # The truth sees exactly the rounded inputs the implementation sees.
    case.q, case.k_pages, case.v_pages = (
        np.asarray(a.astype(jnp.float32)) for a in args[:3])
  return args


@pytest.mark.parametrize("heads,kv_heads,head_dim,page,dtype,q_len,base,rope",
                         CASES)
def test_reference_and_xla_match_float64_truth(heads, kv_heads, head_dim, page,
                                               dtype, q_len, base, rope):
  rng = np.random.default_rng(hash((heads, head_dim, page, q_len, base)) % 2**32)
  case = make_case(rng, batch=2, q_len=q_len, num_heads=heads,
                   num_kv_heads=kv_heads, head_dim=head_dim, page_size=page,
                   base_position=base)
  args = _inputs(case, dtype)
  truth = numpy_truth(case, rope)
  tol = 1e-5 if dtype == "float32" else 2e-2
  for impl in ("reference", "xla"):
    if impl == "reference":
      out = lazy_attention_reference(*args, rope=rope)
    else:
      out = lazy_attention(*args, rope=rope, impl="xla")
    out = np.asarray(out.astype(jnp.float32))
    assert not np.isnan(out).any(), impl
    assert relative_error(out, truth) < tol, (impl, relative_error(out, truth))
    padding = case.q_pos < 0
    assert np.all(out[padding] == 0), impl


def test_sm_scale_is_an_array_argument():
  rng = np.random.default_rng(3)
  case = make_case(rng, q_len=3, num_heads=4, num_kv_heads=2, head_dim=16,
                   page_size=4)
  args = [jnp.asarray(a) for a in case.args()]
  for scale in (0.1, 0.3):
    out = lazy_attention(*args, rope=PLAIN, sm_scale=scale, impl="xla")
    truth = numpy_truth(case, PLAIN, sm_scale=scale)
    assert relative_error(out, truth) < 1e-5


@pytest.mark.parametrize("rope", [PLAIN, LLAMA3, RopeConfig(theta=100000.0)])
def test_rope_range_reduction_is_exact_to_float32(rope):
  head_dim = 128
  positions = np.concatenate([
      np.arange(-3000, 3000),
      np.random.default_rng(0).integers(-(MAX_ROPE_POSITION - 1),
                                        MAX_ROPE_POSITION, 20000)]).astype(np.int32)
  cos, sin = cos_sin_from_chunks(jnp.asarray(positions)[:, None],
                                 jnp.asarray(rope.turn_chunks(head_dim)))
  freq = rope.inv_frequencies(head_dim)
  angle = positions[:, None].astype(np.float64) * np.concatenate([freq, freq])
  assert np.abs(np.asarray(cos) - np.cos(angle)).max() < 3e-6
  assert np.abs(np.asarray(sin) - np.sin(angle)).max() < 3e-6
  # A plain float32 product is far off at these positions (why it exists).
  naive = np.cos((positions[:, None].astype(np.float32) *
                  np.concatenate([freq, freq]).astype(np.float32)))
  assert np.abs(naive - np.cos(angle)).max() > 1e-2


def _good_args():
  rng = np.random.default_rng(5)
  case = make_case(rng, q_len=3, num_heads=4, num_kv_heads=2, head_dim=16,
                   page_size=4)
  return [jnp.asarray(a) for a in case.args()]


NAMES = ["q", "k_pages", "v_pages", "page_table", "page_pos", "page_shift",
         "page_len", "q_pos"]


@pytest.mark.parametrize("name,change,match", [
    ("q", lambda a: a[..., :-2], "k_pages head dim"),
    ("q", lambda a: a[0], "q must be"),
    ("q", lambda a: a.astype(jnp.int32), "q must be float32"),
    ("k_pages", lambda a: a.astype(jnp.bfloat16), "k_pages dtype"),
    ("v_pages", lambda a: a[:, :-1], "v_pages shape"),
    ("q", lambda a: jnp.concatenate([a, a[:, :, :1]], 2),
     "multiple of k_pages heads"),
    ("page_table", lambda a: a.astype(jnp.float32), "page_table must be int32"),
    ("page_pos", lambda a: a[:, :-1], "page_pos shape"),
    ("page_shift", lambda a: a[:1], "page_shift shape"),
    ("page_len", lambda a: a.astype(jnp.int16), "page_len must be int32"),
    ("q_pos", lambda a: a[:, :-1], "q_pos shape"),
    ("q_pos", lambda a: a.astype(jnp.float32), "q_pos must be int32"),
])
def test_bad_shapes_and_dtypes_raise_value_error_naming_the_argument(
    name, change, match):
  args = _good_args()
  i = NAMES.index(name)
  args[i] = change(args[i])
  with pytest.raises(ValueError, match=match):
    lazy_attention(*args, rope=PLAIN, impl="xla")
  # The same check fires at trace time, inside jit.
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda *a: lazy_attention(*a, rope=PLAIN, impl="xla"))(*args)


@pytest.mark.parametrize("name,value,match", [
    ("page_table", 10**6, "page_table entries"),
    ("page_len", 99, "page_len entries"),
    ("q_pos", -5, "q_pos entries"),
    ("page_shift", MAX_ROPE_POSITION, "page_shift magnitude"),
])
def test_bad_values_raise_outside_jit(name, value, match):
  args = _good_args()
  i = NAMES.index(name)
  args[i] = args[i].at[0, 0].set(value)
  with pytest.raises(ValueError, match=match):
    lazy_attention(*args, rope=PLAIN, impl="xla")


@pytest.mark.parametrize("batch,q_len", [(2, 0), (0, 1), (0, 4)])
@pytest.mark.parametrize("impl,interpret", [
    ("xla", False), ("gpu", True), ("gpu", False)],
    ids=["xla", "gpu-triton", "gpu-mosaic"])
def test_no_batch_or_query_rows_give_an_empty_result(impl, interpret, batch,
                                                     q_len):
  # The XLA path's result; the GPU kernels and the Mosaic GPU plan raised
  # ZeroDivisionError or jax errors (TPU: tests/test_tpu_kernels.py).  No
  # kernel runs: on CPU the Mosaic GPU one (interpret=False) could not.
  args = zero_args(batch=batch, q_len=q_len, num_heads=4, num_kv_heads=2,
                   head_dim=64, num_pages=4, page_size=8, num_logical_pages=3,
                   dtype=jnp.bfloat16)
  plan = plan_lazy_attention(args[0], args[1], *args[3:], rope=PLAIN,
                             impl=impl, interpret=interpret)
  assert plan is None
  attend = lambda *a: lazy_attention(*a, rope=PLAIN, impl=impl,
                                     interpret=interpret, plan=plan)
  for out in (attend(*args), jax.jit(attend)(*args)):
    assert out.shape == (batch, q_len, 4, 64) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize("batch,q_len", [(2, 0), (0, 1), (0, 4)])
def test_reference_gives_the_same_empty_result(batch, q_len):
  # The oracle raised ZeroDivisionError on these shapes.
  args = zero_args(batch=batch, q_len=q_len, num_heads=4, num_kv_heads=2,
                   head_dim=64, num_pages=4, page_size=8, num_logical_pages=3,
                   dtype=jnp.bfloat16)
  out = lazy_attention_reference(*args, rope=PLAIN)
  assert out.shape == (batch, q_len, 4, 64) and out.dtype == jnp.bfloat16


def test_no_logical_pages_raise_value_error_naming_page_table():
  # Was numpy's "zero-size array to reduction operation max which has no
  # identity", from the softmax.
  args = _good_args()
  args[3:7] = [a[:, :0] for a in args[3:7]]
  match = r"^page_table must be \[B=2, M\] with M >= 1 logical pages"
  with pytest.raises(ValueError, match=match):
    lazy_attention(*args, rope=PLAIN, impl="xla")
  with pytest.raises(ValueError, match=match):
    jax.jit(lambda *a: lazy_attention(*a, rope=PLAIN, impl="xla"))(*args)
  with pytest.raises(ValueError, match=match):
    lazy_attention_reference(*args, rope=PLAIN)


def test_impl_and_rope_arguments_are_checked():
  args = _good_args()
  with pytest.raises(ValueError, match="impl must be one of"):
    lazy_attention(*args, rope=PLAIN, impl="cuda")
  with pytest.raises(ValueError, match="rope must be a RopeConfig"):
    lazy_attention(*args, rope=10000.0, impl="xla")
  with pytest.raises(ValueError, match="theta"):
    RopeConfig(theta=0.5)
  assert resolve_impl("auto") == {"gpu": "gpu", "tpu": "tpu"}.get(
      jax.default_backend(), "xla")
