"""The sink trainer's held-out KL (lazyattn_jax/training/sink.py): its
samples are never trained on, and the three KLs (no preamble, initial sink,
trained sink) score the same samples.

Before, the evaluation batches came from the training source under another
order seed (29 of the shipped sink's 64 evaluation samples were also
trained on), and each layout replaced over-long samples on its own, so the
KL without a preamble was measured on other samples (3 of 64 slots).  The
test records the teacher's token rows of every training and evaluation
batch, whatever builds them, so it judges the samples themselves.
"""

import numpy as np
import pytest
from flax import nnx

from lazyattn_jax.training import held_out
from lazyattn_jax.training import sink as sink_mod
from lazyattn_jax.training.batch import BatchBuilder, Layout
from lazyattn_jax.training.data import SyntheticFacts
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.model_io import from_model
from lazyattn_jax.training.optim import OptimizerConfig
from lazyattn_jax.training.sink import SinkConfig, train_sink
from models.llama import Llama
from tests.training_helpers import VOCAB, tiny_config, tiny_tokenizer

P = 8


@pytest.fixture(scope="module")
def trainable():
  return from_model(Llama(tiny_config(), rngs=nnx.Rngs(0)), tiny_tokenizer())


def _rows(batch) -> list[tuple[int, ...]]:
  """The teacher's token sequence of each sample (padding dropped): the
  plain prompt and answer, the same whatever layout the student has."""
  tokens = np.asarray(batch["teacher"]["tokens"])
  mask = np.asarray(batch["teacher"]["mask"])
  lengths = np.diagonal(mask, axis1=1, axis2=2).sum(axis=1)
  return [tuple(int(t) for t in row[:n]) for row, n in zip(tokens, lengths)]


def _max_len_between(source, tokenizer):
  """A max_len some samples fit only without the sink: the median of the
  longest form under Layout(P)."""
  probe = BatchBuilder(source, tokenizer, VOCAB, Layout(P), batch_size=1,
                       max_len=10**6)
  plain = BatchBuilder(source, tokenizer, VOCAB, Layout(0), batch_size=1,
                       max_len=10**6)
  sizes = []
  for i in range(len(source)):
    sample = probe._tokens(i)
    k = len(sample.documents)
    sizes.append(sample.prompt_len + len(sample.answer) + P * max(k, 1))
  max_len = int(np.median(sizes))
  probe.max_len = plain.max_len = max_len
  only_plain = [i for i in range(len(source))
                if plain._fits(plain._tokens(i))
                and not probe._fits(probe._tokens(i))]
  assert len(only_plain) >= len(source) // 4, (max_len, only_plain)
  return max_len


def test_eval_samples_are_held_out_and_shared_by_every_kl(trainable,
                                                          monkeypatch):
  source = SyntheticFacts(40, 3, seed=1)
  max_len = _max_len_between(source, trainable.tokenizer)
  evaluated, trained = [], []
  eval_step, train_step = sink_mod._eval_step, sink_mod._train_step

  def recording_eval_step(functions, stored_preamble=None):
    evaluated.append([])  # one group per KL (mean_kl asks once per call)
    kl = eval_step(functions, stored_preamble)

    def step(params, batch, sink):
      evaluated[-1].extend(_rows(batch))
      return kl(params, batch, sink)
    return step

  def recording_train_step(functions, optimizer, remat, stored_preamble=None):
    tx, step = train_step(functions, optimizer, remat, stored_preamble)

    def recorded(sink, opt_state, params, batch):
      trained.extend(_rows(batch))
      return step(sink, opt_state, params, batch)
    return tx, recorded

  monkeypatch.setattr(sink_mod, "_eval_step", recording_eval_step)
  monkeypatch.setattr(sink_mod, "_train_step", recording_train_step)
  config = SinkConfig(preamble_len=P, steps=12, batch_size=4, eval_batches=2,
                      max_len=max_len,
                      optimizer=OptimizerConfig(learning_rate=3e-2,
                                                warmup_steps=2))
  result = train_sink(trainable, source, config, progress=False)
  assert len(trained) == 12 * 4
  assert len(evaluated) == 3, "no_preamble, initial_sink, trained_sink"
  no_preamble, initial, final = evaluated
  assert len(no_preamble) == 2 * 4
  # The same samples, in the same batches, for every KL.
  assert no_preamble == initial == final
  assert len(set(no_preamble)) == len(no_preamble)
  # None of them was trained on.
  assert not set(no_preamble) & set(trained)
  # The result says which they were: the source's last usable samples,
  # with training reading only the samples before them.
  assert len(result.eval_indices) == 8
  assert min(result.eval_indices) == result.train_size
  assert result.eval_indices == sorted(result.eval_indices, reverse=True)


def test_evaluation_split_walks_back_skipping_over_long_samples(trainable):
  source = SyntheticFacts(40, 3, seed=1)
  tokenizer = trainable.tokenizer
  max_len = _max_len_between(source, tokenizer)
  check = BatchBuilder(source, tokenizer, VOCAB, Layout(P), batch_size=1,
                       max_len=max_len)
  fits = [check._fits(check._tokens(i)) for i in range(len(source))]
  train_size, picked = held_out.evaluation_split(
      source, tokenizer, VOCAB, Layout(P), 6, max_len)
  indices = [i for i, _ in picked]
  expected = [i for i in reversed(range(len(source))) if fits[i]][:6]
  assert indices == expected and train_size == expected[-1]
  # Fixed: the same again, and no seed involved.
  again = held_out.evaluation_split(source, tokenizer, VOCAB, Layout(P), 6,
                                    max_len)
  assert [i for i, _ in again[1]] == indices and again[0] == train_size
  assert held_out.evaluation_split(source, tokenizer, VOCAB, Layout(P), 0,
                                   max_len) == (len(source), [])
  with pytest.raises(TrainingInputError, match="held-out evaluation"):
    held_out.evaluation_split(source, tokenizer, VOCAB, Layout(P),
                              sum(fits) + 1, max_len)
  part = held_out.SourceSlice(source, 0, train_size)
  assert len(part) == train_size and part[3] == source[3]
  with pytest.raises(IndexError):
    part[train_size]
