"""Training batches and loss (lazyattn_jax/training): the student sees the
engine's layout, the teacher plain causal attention, and the loss reads
exactly the answer tokens."""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from lazyattn_jax.training import order
from lazyattn_jax.training.batch import (BatchBuilder, Layout, make_batch,
                                         student_sequence)
from lazyattn_jax.training.data import Sample, SyntheticFacts, as_sample
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.examples import TokenSample, tokenize_sample
from lazyattn_jax.training.forward import kl_and_ce
from lazyattn_jax.training.model_io import from_model
from models.llama import Llama
from tests.engine_helpers import dense_lazy_logits
from tests.training_helpers import tiny_config, tiny_tokenizer


@pytest.fixture(scope="module")
def model():
  return Llama(tiny_config(), rngs=nnx.Rngs(5))


@pytest.fixture(scope="module")
def trainable(model):
  return from_model(model, tiny_tokenizer())


@functools.lru_cache(maxsize=None)
def _losses(functions):
  def losses(params, batch, sink):
    student = functions.answer_logits(params, batch["student"], sink)
    teacher = functions.answer_logits(params, batch["teacher"])
    return kl_and_ce(student, teacher, batch["labels"], batch["weights"])
  return jax.jit(losses)


def kl_of(trainable, batch, sink=None):
  kl, _ = _losses(trainable.functions)(trainable.params, batch.arrays(), sink)
  return float(kl)


def _ids(rng, n):
  return tuple(int(t) for t in rng.integers(4, 250, n))


def test_kl_is_zero_when_the_layouts_agree_and_positive_otherwise(trainable):
  rng = np.random.default_rng(0)
  query, answer = _ids(rng, 3), _ids(rng, 4)
  one_doc = TokenSample((_ids(rng, 9),), query, answer)
  # One document: lazy is causal attention, so student == teacher.
  assert kl_of(trainable, make_batch([one_doc], Layout())) == 0.0
  # Full-attention samples are laid out as the teacher is, whatever the docs.
  three = TokenSample((_ids(rng, 9), _ids(rng, 5), _ids(rng, 7)), query,
                      answer)
  assert kl_of(trainable, make_batch([three], Layout(), full=[True])) == 0.0
  assert kl_of(trainable, make_batch([three], Layout())) > 1e-4
  # A preamble moves even a single document off the teacher's layout.
  assert kl_of(trainable, make_batch([one_doc], Layout(2, (7, 8)))) > 1e-4


def test_answer_rows_predict_exactly_the_answer_tokens(trainable):
  tokenizer = tiny_tokenizer()
  sample = SyntheticFacts(4, 3, seed=3)[1]
  tokens = tokenize_sample(tokenizer, sample, 256)
  assert tokenizer.decode(tokens.answer, skip_special_tokens=False) == (
      sample.answer + "<|im_end|>")
  assert tokens.answer[-1] in tokenizer.stop_token_ids
  # The engine's layout: the chat prefix is a leading document.
  assert len(tokens.documents) == 1 + len(sample.documents)
  for layout in (Layout(), Layout(3, (5, 6, 7)), Layout(0, None, 4)):
    batch = make_batch([tokens, tokens], layout, full=[False, True])
    valid = batch.weights > 0
    assert valid.sum(1).tolist() == [len(tokens.answer)] * 2
    assert batch.labels[0, valid[0]].tolist() == list(tokens.answer)
    lengths = [len(student_sequence(tokens, layout, f)[0])
               for f in (False, True)]
    teacher_lengths = lengths[1:] * 2  # full attention is the teacher's
    for seq, real in ((batch.student, lengths),
                      (batch.teacher, teacher_lengths)):
      for b in range(2):
        rows = seq["rows"][b, valid[b]]
        # Row r predicts the token at r + 1, which is the answer's.
        assert seq["tokens"][b, rows + 1].tolist() == list(tokens.answer)
        # Padding sees nothing and is seen by nothing.
        assert not seq["mask"][b, real[b]:].any()
        assert not seq["mask"][b, :, real[b]:].any()


@pytest.mark.parametrize("layout", [
    dict(), dict(preamble=(5, 6, 7)), dict(recompute_tokens=4)])
def test_student_logits_equal_the_dense_layout(trainable, model, layout):
  rng = np.random.default_rng(1)
  docs = [_ids(rng, n) for n in (6, 9, 5)]
  query, answer = _ids(rng, 3), _ids(rng, 4)
  preamble = layout.get("preamble", ())
  spec = Layout(len(preamble), tuple(preamble) or None,
                layout.get("recompute_tokens", 0))
  batch = make_batch([TokenSample(tuple(docs), query, answer)], spec)
  got = trainable.functions.answer_logits(trainable.params,
                                          batch.arrays()["student"])
  want = dense_lazy_logits(model, docs, list(query) + list(answer), **layout)
  tail = want[-len(query) - len(answer):]  # the query segment's rows
  np.testing.assert_allclose(np.asarray(got[0, :len(answer)]),
                             tail[len(query) - 1:len(query) - 1 + len(answer)],
                             atol=2e-5, rtol=2e-5)


def test_sink_vectors_act_as_the_preamble_tokens_they_embed(trainable):
  rng = np.random.default_rng(2)
  sample = TokenSample((_ids(rng, 6), _ids(rng, 8)), _ids(rng, 3),
                       _ids(rng, 4))
  ids = (11, 12, 13)
  as_tokens = kl_of(trainable, make_batch([sample], Layout(3, ids)))
  vectors = np.asarray(trainable.params["embed_tokens"])[list(ids)]
  as_sink = kl_of(trainable, make_batch([sample], Layout(3)), vectors)
  np.testing.assert_allclose(as_sink, as_tokens, rtol=1e-5)


def test_full_attention_share_is_honoured_and_order_is_pure(trainable):
  source = SyntheticFacts(10, 2, seed=4)
  build = lambda share: BatchBuilder(
      source, tiny_tokenizer(), 256, Layout(), batch_size=4, seed=7,
      full_share=share)
  builder = build(0.25)
  batches = [builder.batch(s) for s in range(12)]
  assert [int(b.full.sum()) for b in batches] == [1] * 12
  for b in batches:  # full samples: the student's layout is the teacher's
    for i in np.flatnonzero(b.full):
      n = b.teacher["tokens"].shape[1]
      np.testing.assert_array_equal(b.student["mask"][i, :n, :n],
                                    b.teacher["mask"][i])
  # Epochs are permutations: 12 steps of 4 read every sample 4 or 5 times.
  counts = np.bincount(sum((b.indices for b in batches), []), minlength=10)
  assert counts.min() >= 4 and counts.max() <= 5
  again = build(0.25).batch(9)
  assert again.indices == batches[9].indices
  assert (again.full == batches[9].full).all()
  shares = [order.full_attention_slots(0, s, 8, 0.3).sum()
            for s in range(400)]
  assert set(shares) == {2, 3} and abs(np.mean(shares) - 2.4) < 0.15


def test_bad_samples_and_settings_are_refused():
  with pytest.raises(TrainingInputError, match="query"):
    Sample(("a doc",), "  ", "x")
  with pytest.raises(TrainingInputError, match="documents"):
    Sample("one string", "q", "a")
  assert as_sample({"documents": ["d"], "query": "q", "answers": ["a", "b"]}
                   ).answer == "a"
  with pytest.raises(TrainingInputError, match="full_share"):
    BatchBuilder(SyntheticFacts(4), tiny_tokenizer(), 256, Layout(),
                 batch_size=2, full_share=1.5)
  builder = BatchBuilder(SyntheticFacts(4), tiny_tokenizer(), 256, Layout(),
                         batch_size=2, max_len=20)
  with pytest.raises(TrainingInputError, match="max_len"):
    builder.batch(0)
  with pytest.raises(TrainingInputError, match="preamble_ids"):
    Layout(2, (1,))


def test_hotpotqa_hook_is_lazy_and_says_when_it_is_missing(monkeypatch):
  """The library's HotpotQA source imports lazyattn_jax.quality when asked
  for; without it, one clear error (the real data is not used in tests)."""
  import sys
  from lazyattn_jax.training.data import load_source
  from lazyattn_jax.training.errors import DataUnavailableError
  monkeypatch.setitem(sys.modules, "lazyattn_jax.quality.datasets", None)
  with pytest.raises(DataUnavailableError, match="load_hotpotqa"):
    load_source("hotpotqa")
  monkeypatch.undo()
  from lazyattn_jax.quality import datasets
  from lazyattn_jax.quality.hotpotqa import make_query
  raw = [{"_id": "q1", "question": "Where is Paris?", "answer": "France",
          "type": "bridge", "level": "easy",
          "supporting_facts": [["Paris", 0]],
          "context": [["Paris", ["Paris is in France."]],
                      ["Oslo", ["Oslo is in Norway."]]]}]
  asked = []
  monkeypatch.setattr(datasets, "load_hotpotqa", lambda split: (
      asked.append(split), datasets.parse_hotpotqa(raw))[1])
  source = load_source("hotpotqa")
  # The train split, prompted exactly as the benchmark prompts it.
  assert asked == ["train"] and len(source) == 1
  assert source[0] == Sample(("Paris: Paris is in France.",
                              "Oslo: Oslo is in Norway."),
                             make_query("Where is Paris?"), "France")
  with pytest.raises(TrainingInputError, match="unknown data source"):
    load_source("wiki")
