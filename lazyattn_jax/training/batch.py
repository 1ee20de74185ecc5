"""Batches of padded dense sequences: the student's layout and the teacher's.

The student sees a sample as the engine computes it
(`models.dense_layout.request_segments`: each document alone, after the
preamble if there is one, a chat preamble in place of the chat-prefix
document; the query and the answer after everything), or,
for the full-attention share, as one causal prompt.  The teacher always
sees the plain causal prompt [documents][query][answer] at contiguous
positions, without a preamble: what the model computes when nothing is
reused.  Each sequence is padded to a bucketed length (padding sees
nothing and is seen by nothing); the answer's rows are gathered by index,
so the loss only touches them.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

from lazyattn_jax.buckets import length_bucket
from lazyattn_jax.training import order
from lazyattn_jax.training.examples import TokenSample, tokenize_sample
from lazyattn_jax.training.errors import TrainingInputError
from models.dense_layout import (DOCUMENT, PREAMBLE, QUERY, dense_inputs,
                                 gather_sources, preamble_rows,
                                 request_segments)

MAX_ATTEMPTS = 32  # replacements tried for an unusable sample


@dataclasses.dataclass(frozen=True)
class Layout:
  """The engine layout the student is trained for.

  Attributes:
    preamble_len: P tokens of shared preamble before every document (0:
      none).  With `preamble_ids` None they are learned vectors (a sink),
      written into the embeddings at `preamble_index`.
    preamble_ids: the preamble's token ids, or None for learned vectors.
      The engine's only token preamble is the chat template's prefix
      (`served_layout.chat_layout`; `finetune` refuses others): it takes
      the place of a sample's leading chat-prefix document, as the engine
      drops that document under preamble="chat".
    recompute_tokens: first tokens of each later document recomputed per
      request (the engine's first-page recompute; 0: none).
  """
  preamble_len: int = 0
  preamble_ids: tuple[int, ...] | None = None
  recompute_tokens: int = 0

  def __post_init__(self):
    if self.preamble_len < 0 or self.recompute_tokens < 0:
      raise TrainingInputError("preamble_len and recompute_tokens must be "
                               ">= 0")
    if (self.preamble_ids is not None and
        len(self.preamble_ids) != self.preamble_len):
      raise TrainingInputError(
          f"preamble_ids has {len(self.preamble_ids)} tokens, preamble_len "
          f"is {self.preamble_len}")


def _rows_of_answer(query_start: int, query_len: int, answer_len: int):
  # Row r's logits predict token r + 1: the answer's first token is
  # predicted by the query's last row.
  first = query_start + query_len - 1
  return np.arange(first, first + answer_len, dtype=np.int32)


def student_sequence(sample: TokenSample, layout: Layout, full: bool):
  """(tokens, positions, mask, preamble_index, answer_rows) of one sample,
  unpadded; `full` lays it out as one causal prompt instead."""
  if full:
    return teacher_sequence(sample)
  tail = list(sample.query) + list(sample.answer)
  documents = sample.documents
  if layout.preamble_ids is not None:
    # The chat preamble replaces the chat-prefix document (the engine's
    # request_validator drops it): it must not come twice.
    documents = documents[sample.leading:]
  segments = request_segments(layout.preamble_len,
                              [len(d) for d in documents], len(tail),
                              recompute_tokens=layout.recompute_tokens)
  preamble = list(layout.preamble_ids or [0] * layout.preamble_len)
  tokens = gather_sources(segments, {PREAMBLE: [preamble],
                                     DOCUMENT: documents,
                                     QUERY: [tail]})
  positions, mask, starts = dense_inputs(segments)
  index = np.full(len(tokens), -1, np.int32)
  rows, which = preamble_rows(segments)
  index[rows] = which
  answer_rows = _rows_of_answer(starts[-1], len(sample.query),
                                len(sample.answer))
  return np.asarray(tokens, np.int32), positions, mask, index, answer_rows


def teacher_sequence(sample: TokenSample):
  """The plain causal prompt, no preamble, positions 0, 1, ..."""
  tokens = [t for d in sample.documents for t in d]
  tokens += list(sample.query) + list(sample.answer)
  n = len(tokens)
  return (np.asarray(tokens, np.int32), np.arange(n, dtype=np.int32),
          np.tril(np.ones((n, n), bool)), np.full(n, -1, np.int32),
          _rows_of_answer(sample.prompt_len - len(sample.query),
                          len(sample.query), len(sample.answer)))


def _pad(sequences, length: int, answer_len: int) -> dict[str, np.ndarray]:
  batch = len(sequences)
  out = dict(tokens=np.zeros((batch, length), np.int32),
             positions=np.zeros((batch, length), np.int32),
             mask=np.zeros((batch, length, length), bool),
             preamble_index=np.full((batch, length), -1, np.int32),
             rows=np.zeros((batch, answer_len), np.int32))
  for b, (tokens, positions, mask, index, rows) in enumerate(sequences):
    n = len(tokens)
    out["tokens"][b, :n] = tokens
    out["positions"][b, :n] = positions
    out["mask"][b, :n, :n] = mask
    out["preamble_index"][b, :n] = index
    out["rows"][b, :len(rows)] = rows
  return out


@dataclasses.dataclass
class Batch:
  """One step's arrays (numpy); `student` and `teacher` hold tokens,
  positions, mask, preamble_index and rows, padded to bucketed lengths.

  Attributes:
    student, teacher: the two layouts' arrays.
    labels: int32[B, A] the answer ids (padding 0).
    weights: float32[B, A] 1 on answer tokens, 0 on padding.
    full: bool[B] which samples the student sees with full attention.
    indices: the source index of each sample.
  """
  student: dict[str, np.ndarray]
  teacher: dict[str, np.ndarray]
  labels: np.ndarray
  weights: np.ndarray
  full: np.ndarray
  indices: list[int]

  def arrays(self) -> dict:
    """What the jitted step takes."""
    return dict(student=self.student, teacher=self.teacher,
                labels=self.labels, weights=self.weights)


class BatchBuilder:
  """Makes the batch of any step, as a pure function of (seed, step).

  Args:
    source: a DataSource.
    tokenizer: the model's LlamaTokenizer.
    vocab_size: the model's vocabulary size.
    layout: the student's engine layout.
    batch_size: samples per step.
    seed: data order seed.
    full_share: share of samples laid out with full attention.
    max_len: longest dense sequence; longer samples are replaced.
  """

  def __init__(self, source, tokenizer, vocab_size: int, layout: Layout, *,
               batch_size: int, seed: int = 0, full_share: float = 0.0,
               max_len: int = 2048):
    if batch_size < 1:
      raise TrainingInputError(f"batch_size must be >= 1, got {batch_size}")
    if not 0.0 <= full_share <= 1.0:
      raise TrainingInputError(f"full_share must lie in [0, 1], got "
                               f"{full_share}")
    if len(source) < 1:
      raise TrainingInputError("the data source is empty")
    self.source, self.tokenizer, self.vocab_size = source, tokenizer, vocab_size
    self.layout, self.batch_size, self.seed = layout, batch_size, seed
    self.full_share, self.max_len = full_share, max_len
    self._tokens = functools.lru_cache(maxsize=8192)(self._tokenize)

  def _tokenize(self, index: int) -> TokenSample:
    return tokenize_sample(self.tokenizer, self.source[index], self.vocab_size)

  def _fits(self, sample: TokenSample) -> bool:
    p, k = self.layout.preamble_len, len(sample.documents)
    # The lazy layout's longest form: a preamble copy per document, and
    # each later document's recomputed head twice.
    longest = sample.prompt_len + len(sample.answer) + p * max(k, 1) + (
        self.layout.recompute_tokens * max(k - 1, 0))
    return longest <= self.max_len

  def fitting_sample(self, index: int) -> TokenSample | None:
    """The tokens of source[index], or None when its longest layout is
    past max_len (the test `sample_at` replaces samples by)."""
    sample = self._tokens(index)
    return sample if self._fits(sample) else None

  def sample_at(self, step: int, slot: int,
                index: int) -> tuple[int, TokenSample]:
    """(index, tokens) of the usable sample for this slot."""
    for attempt in range(MAX_ATTEMPTS + 1):
      if attempt:
        index = order.replacement_index(self.seed, step, slot, attempt,
                                        len(self.source))
      sample = self._tokens(index)
      if self._fits(sample):
        return index, sample
    raise TrainingInputError(
        f"no sample of {MAX_ATTEMPTS + 1} tried fits max_len={self.max_len}; "
        "raise --max-len")

  def batch(self, step: int) -> Batch:
    """The batch of `step`."""
    full = order.full_attention_slots(self.seed, step, self.batch_size,
                                      self.full_share)
    picks = [self.sample_at(step, slot, index) for slot, index in enumerate(
        order.sample_indices(self.seed, step, self.batch_size,
                             len(self.source)))]
    return make_batch([s for _, s in picks], self.layout, full,
                      [i for i, _ in picks])


def make_batch(samples: list[TokenSample], layout: Layout, full=None,
               indices=None) -> Batch:
  """The padded Batch of `samples`; `full[b]` lays sample b out with full
  attention (default: none)."""
  full = np.zeros(len(samples), bool) if full is None else np.asarray(full)
  student = [student_sequence(s, layout, bool(f))
             for s, f in zip(samples, full)]
  teacher = [teacher_sequence(s) for s in samples]
  answer_len = length_bucket(max(len(s.answer) for s in samples), 16)
  labels = np.zeros((len(samples), answer_len), np.int32)
  weights = np.zeros((len(samples), answer_len), np.float32)
  for b, s in enumerate(samples):
    labels[b, :len(s.answer)] = s.answer
    weights[b, :len(s.answer)] = 1.0
  bucket = lambda seqs: length_bucket(max(len(q[0]) for q in seqs), 64)
  return Batch(_pad(student, bucket(student), answer_len),
               _pad(teacher, bucket(teacher), answer_len), labels, weights,
               full, list(indices or range(len(samples))))
