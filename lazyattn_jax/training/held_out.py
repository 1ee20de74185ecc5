"""Evaluation samples held out of a training source: picked from its end,
the same samples for every layout scored, and the slice training may read
(the sink trainer's held-out KL, `training.sink`)."""

from __future__ import annotations

from lazyattn_jax.training.batch import BatchBuilder, Layout, make_batch
from lazyattn_jax.training.errors import TrainingInputError


class SourceSlice:
  """`source[start:stop]` as a data source: item i is source[start + i]."""

  def __init__(self, source, start: int, stop: int):
    if not 0 <= start <= stop <= len(source):
      raise TrainingInputError(f"bad slice [{start}, {stop}) of a source "
                               f"of {len(source)} samples")
    self.source, self.start, self.stop = source, start, stop

  def __len__(self) -> int:
    return self.stop - self.start

  def __getitem__(self, index: int):
    if not 0 <= index < len(self):
      raise IndexError(index)
    return self.source[self.start + index]


def evaluation_split(source, tokenizer, vocab_size: int, layout: Layout,
                     count: int, max_len: int) -> tuple[int, list]:
  """The held-out evaluation samples and where training must stop.

  Walks back from the source's last sample and takes the first `count`
  that fit `max_len` under `layout` (the batch builder's test; pass the
  longest layout that will be scored), skipping over-long ones.  Every
  sample walked, skipped ones included, is held out: training may read
  only source[:train_size].  The choice depends on the source, the
  tokenizer, the layout's lengths and max_len, never on a seed, so every
  layout is scored on the same samples.

  Returns:
    (train_size, [(index, TokenSample), ...]) with the samples in walking
    order (last index first); (len(source), []) for count 0.

  Raises:
    TrainingInputError: the source cannot give `count` samples that fit
      and still leave one to train on.
  """
  if count < 1:
    return len(source), []
  checker = BatchBuilder(source, tokenizer, vocab_size, layout, batch_size=1,
                         max_len=max_len)
  picked, index = [], len(source)
  while len(picked) < count and index > 1:
    index -= 1
    sample = checker.fitting_sample(index)
    if sample is not None:
      picked.append((index, sample))
  if len(picked) < count:
    raise TrainingInputError(
        f"the source's {len(source)} samples cannot give {count} held-out "
        f"evaluation samples (eval_batches x batch_size) that fit "
        f"max_len={max_len} and leave samples to train on; lower "
        "--eval-batches or raise --max-len")
  return index, picked


def evaluation_batches(picked, layout: Layout, batch_size: int) -> list:
  """`evaluation_split`'s samples as batches of `batch_size`, in order."""
  return [make_batch([s for _, s in picked[i:i + batch_size]], layout,
                     indices=[n for n, _ in picked[i:i + batch_size]])
          for i in range(0, len(picked), batch_size)]
