"""A sink trained for float8 pages (lazyattn_jax/training/float8_preamble.py):
the preamble's K/V rows come back as the library's float8 page write stores
them, other rows untouched, the gradient straight through; SinkConfig's
float8_pages reaches the training and scoring forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from lazyattn_jax.training.data import SyntheticFacts
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.float8_preamble import Float8Preamble
from lazyattn_jax.training.model_io import from_model
from lazyattn_jax.training.sink import SinkConfig, train_sink
from lazyattn_jax.training.sink_cli import build_parser
from models.config import RopeConfig
from models.llama import Llama
from models.quantized_pool import write_quantized_rows
from pallas_kernels.kv_quant import FP8_DTYPE
from pallas_kernels.rope import apply_rope
from tests.test_training_cli import model_dir  # noqa: F401 - the fixture
from tests.training_helpers import tiny_config, tiny_tokenizer

HEADS, HEAD_DIM, PAGE = 2, 16, 8


def _rows(preamble_len: int, before: int, after: int, seed: int = 0):
  """k, v [1, T, K, H] with a preamble at rows before..before+P-1 (a few
  rows large, as a sink's first token often is) and its preamble_index."""
  rng = np.random.default_rng(seed)
  total = before + preamble_len + after
  k = rng.normal(size=(1, total, HEADS, HEAD_DIM)).astype(np.float32)
  v = rng.normal(size=(1, total, HEADS, HEAD_DIM)).astype(np.float32)
  k[0, before] *= 30.0
  v[0, before + 1] *= 1e-3
  index = np.full((1, total), -1, np.int32)
  index[0, before:before + preamble_len] = np.arange(preamble_len)
  return jnp.asarray(k), jnp.asarray(v), jnp.asarray(index)


def _pool_readback(values, page_size):
  """[P, K, H] float32 rows written at rows 0..P-1 of a float8 pool by the
  library's page write, read back as the kernels read them."""
  rows = values.shape[0]
  num_pages = -(-rows // page_size)
  pages = jnp.zeros((HEADS, num_pages * page_size, HEAD_DIM), FP8_DTYPE)
  scales = jnp.zeros((HEADS, num_pages), jnp.float32)
  pages, scales = write_quantized_rows(
      pages, scales, jnp.arange(rows, dtype=jnp.int32),
      jnp.swapaxes(values, 0, 1), page_size)
  read = pages.astype(jnp.float32) * jnp.repeat(scales, page_size,
                                                axis=1)[..., None]
  return np.asarray(jnp.swapaxes(read[:, :rows], 0, 1))


@pytest.mark.parametrize("preamble_len", [5, PAGE, 2 * PAGE + 3])
def test_preamble_rows_read_as_the_float8_pool_stores_them(preamble_len):
  rope = RopeConfig()
  k, v, index = _rows(preamble_len, before=3, after=4)
  k_read, v_read = Float8Preamble(PAGE, preamble_len)(k, v, index, rope)
  rows = slice(3, 3 + preamble_len)
  # Keys are stored rotated at their stored angle (the preamble index).
  stored_k = apply_rope(k[0, rows], index[0, rows], rope)
  np.testing.assert_allclose(
      np.asarray(apply_rope(k_read[0, rows], index[0, rows], rope)),
      _pool_readback(stored_k, PAGE), rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(v_read[0, rows]),
                                _pool_readback(v[0, rows], PAGE))
  # The rounding is real, and the other rows are untouched.
  assert not np.allclose(np.asarray(v_read[0, rows]), np.asarray(v[0, rows]),
                         rtol=1e-3)
  for read, raw in ((k_read, k), (v_read, v)):
    np.testing.assert_array_equal(np.asarray(read[0, :3]), np.asarray(raw[0, :3]))
    np.testing.assert_array_equal(np.asarray(read[0, rows.stop:]),
                                  np.asarray(raw[0, rows.stop:]))


@pytest.mark.parametrize("page_size", [1, 4, 8, 32])
def test_the_rounding_barely_depends_on_the_page_size(page_size):
  """Scales are powers of two and e4m3 rounds alike at any power-of-two
  scale but in its subnormal range: the preamble's rows read back the same
  whichever pages split them, but for values under the page's subnormal
  bound (why one float8 sink serves pools of every page size)."""
  rope = RopeConfig(theta=10000.0)
  rng = np.random.default_rng(3)
  # Rows of very different sizes, so smaller pages take other scales.
  sizes = np.logspace(-1.5, 1.5, 16)[None, :, None, None]
  k = rng.standard_normal((1, 16, 2, 8)) * sizes
  v = rng.standard_normal((1, 16, 2, 8)) * sizes[:, ::-1]
  k, v = jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32)
  index = jnp.arange(16)[None, :]
  k16, v16 = Float8Preamble(16, 16)(k, v, index, rope)
  kp, vp = Float8Preamble(page_size, 16)(k, v, index, rope)
  # Page 16's scale (one per KV head) maps the head's largest value to at
  # most 448 and is within 2x of that; e4m3's smallest normal is 2**-6 of
  # the scale.  Keys are rounded as stored: rotated at the preamble index.
  stored = lambda x: np.asarray(apply_rope(x[0], index[0], rope))
  for ours, theirs, x in ((vp[0], v16[0], v[0]),
                          (stored(kp), stored(k16), stored(k))):
    ours, theirs, x = np.asarray(ours), np.asarray(theirs), np.abs(x)
    tiny = x < x.max(axis=(0, 2), keepdims=True) * 2 / 448 * 2.0**-6
    np.testing.assert_allclose(ours[~tiny], theirs[~tiny], rtol=1e-5,
                               atol=1e-6)
    assert tiny.mean() < 0.1


def test_rows_keep_their_values_dtype():
  k, v, index = _rows(PAGE, before=2, after=2)
  k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
  _, v_read = Float8Preamble(PAGE, PAGE)(k, v, index, RopeConfig())
  assert v_read.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(v_read[0, :2], np.float32),
                                np.asarray(v[0, :2], np.float32))


def test_the_gradient_passes_the_rounding_unchanged():
  k, v, index = _rows(PAGE, before=2, after=2)
  weights = jax.random.normal(jax.random.key(0), k.shape)
  round_trip = Float8Preamble(PAGE, PAGE)

  def loss(k, v):
    k_read, v_read = round_trip(k, v, index, RopeConfig())
    return jnp.sum(k_read * weights) + jnp.sum(v_read * weights)

  grad_k, grad_v = jax.grad(loss, argnums=(0, 1))(k, v)
  np.testing.assert_allclose(np.asarray(grad_k), np.asarray(weights),
                             rtol=1e-6)
  np.testing.assert_allclose(np.asarray(grad_v), np.asarray(weights),
                             rtol=1e-6)


@pytest.fixture(scope="module")
def trainable():
  # bfloat16: the rounding must leave other rows in the compute dtype (a
  # float32 V made every attention's PV product float32).
  return from_model(Llama(tiny_config(), rngs=nnx.Rngs(0)), tiny_tokenizer(),
                    dtype="bfloat16")


def test_float8_pages_score_and_train_on_the_rounded_preamble(trainable):
  source = SyntheticFacts(32, 3, seed=1)
  scores = {}
  for float8 in (False, True):
    config = SinkConfig(preamble_len=4, steps=2, batch_size=2, eval_batches=1,
                        float8_pages=float8, page_size=4)
    result = train_sink(trainable, source, config, progress=False)
    scores[float8] = result.eval_kl
    assert len(result.history.rows) == 2
    assert np.isfinite(result.sink).all()
  # Without a preamble nothing is rounded (the same KL to the bit); with
  # one the KL moves.
  assert scores[True]["no_preamble"] == scores[False]["no_preamble"]
  assert scores[True]["initial_sink"] != scores[False]["initial_sink"]


def test_float8_pages_settings():
  with pytest.raises(TrainingInputError, match="page_size must be >= 1"):
    SinkConfig(float8_pages=True, page_size=0)
  assert SinkConfig().stored_preamble() is None
  assert SinkConfig(float8_pages=True, preamble_len=16).stored_preamble() == (
      Float8Preamble(page_size=16, preamble_len=16))
  args = build_parser().parse_args(["--out", "x", "--float8-pages"])
  assert args.float8_pages and args.page_size == 16
  assert build_parser().parse_args(["--out", "x", "--page-size", "8"]
                                   ).page_size == 8


def test_heldout_kls_score_every_sink_on_the_same_last_samples(trainable):
  from benchmarks.sink_heldout_kl import heldout_kls
  from lazyattn_jax.training.sink import init_sink
  source = SyntheticFacts(24, 3, seed=2)
  start = init_sink(trainable, 4)
  other = start + np.float32(0.5)
  out = heldout_kls(trainable, source, {"a": start, "b": other}, batches=1,
                    batch_size=2, page_size=4)
  assert out["samples"] == [23, 22]
  assert np.isfinite(out["no_preamble"])
  for name in "ab":
    assert set(out[name]) == {"16-bit", "float8"}
    assert out[name]["16-bit"] != out[name]["float8"]
  assert out["a"]["16-bit"] != out["b"]["16-bit"]
  with pytest.raises(ValueError, match="different lengths"):
    heldout_kls(trainable, source, {"a": start, "c": start[:2]}, batches=1,
                batch_size=2, page_size=4)


def test_the_sink_command_records_its_float8_pages(tmp_path, model_dir):
  from lazyattn_jax.training.sink import main
  from lazyattn_jax.training.sink_file import load_sink
  out = tmp_path / "sink"
  assert main(["--model", model_dir, "--out", str(out), "--steps", "1",
               "--batch-size", "2", "--preamble-len", "2",
               "--docs-per-question", "2", "--eval-batches", "0",
               "--float8-pages", "--page-size", "8", "--no-progress"]) == 0
  _, metadata = load_sink(out / "sink.safetensors")
  assert (metadata["float8_pages"], metadata["page_size"]) == ("true", "8")
