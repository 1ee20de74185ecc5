"""Training a learned document sink: P vectors every document is encoded
after.

The engine can encode each document after a shared preamble (issue #13):
the document's KV then depends on the preamble, which is encoded once and
shared, so reuse stays zero-copy.  A learned sink is such a preamble made
of P free vectors in the embedding space instead of tokens.  The model
stays frozen; only the sink trains, by distillation: the student is the
model under the engine's layout with the sink before every document (and
once, at positions 0..P-1, before the whole request); the teacher is the
same model over the plain causal prompt.  The loss is KL(teacher ||
student) on the answer tokens.

The sink starts as the embeddings of real tokens, so step 0 is a working
token preamble: "chat" takes the first P tokens of the chat template's
prefix (the system prompt SmolLM2 always sees), continued with
`GENERIC_TEXT` when the prefix is shorter; "text" takes `GENERIC_TEXT`'s.

Evaluation (`held_out.evaluation_split`): eval_batches x batch_size samples taken
from the end of the source, walking back from its last sample and skipping
any too long for the sink's layout (the longer of the two scored), are
held out: training reads only the samples before the first one walked.
The three KLs (no preamble, initial sink, trained sink) score exactly these
samples, in the same batches.

  python -m lazyattn_jax.training.sink --help   (sink_cli.py)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazyattn_jax.training import parallel, report
from lazyattn_jax.training.batch import BatchBuilder, Layout
from lazyattn_jax.training.held_out import (SourceSlice, evaluation_batches,
                                            evaluation_split)
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.loading import DEFAULT_PAGE_SIZE
from lazyattn_jax.training.float8_preamble import Float8Preamble
from lazyattn_jax.training.forward import global_norm, kl_and_ce
from lazyattn_jax.training.optim import OptimizerConfig
from lazyattn_jax.training.order import check_seed
from lazyattn_jax.training.sink_file import check_sink

GENERIC_TEXT = ("The following passage is one of several documents retrieved "
                "to answer a question. Read it carefully.")
INITS = ("chat", "text")
OUTPUT_FILES = ("sink.safetensors", "sink_loss.png", "sink_log.json")


@dataclasses.dataclass(frozen=True)
class SinkConfig:
  """Settings of a sink training run.

  Attributes:
    preamble_len: P, the number of sink vectors.
    steps: optimizer steps.
    batch_size: samples per step (a multiple of the devices).
    seed: data order seed, any 64-bit integer.
    init: "chat" (the chat prefix's first P token embeddings) or "text"
      (GENERIC_TEXT's).
    remat: recompute attention in the backward pass (less memory).
    max_len: longest dense sequence; longer samples are replaced (in
      training) or skipped (when picking the evaluation samples).
    eval_batches: batches of held-out samples scored before and after
      training (`evaluation_split`; 0: none, and training reads the whole
      source).
    devices: local devices to use (None: all).
    optimizer: learning rate, warm-up, decay, clipping (Adam).
    float8_pages: train (and score) the sink on its K/V as a float8 pool
      of `page_size`-token pages returns them (`float8_preamble`), for
      engines with `kv_dtype="float8_e4m3fn"`.
    page_size: the served pool's tokens per page (float8_pages only).
  """
  preamble_len: int = 16
  steps: int = 300
  batch_size: int = 8
  seed: int = 0
  init: str = "chat"
  remat: bool = False
  max_len: int = 2048
  eval_batches: int = 4
  devices: int | None = None
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=3e-3,
                                               warmup_steps=20)
  float8_pages: bool = False
  page_size: int = DEFAULT_PAGE_SIZE

  def __post_init__(self):
    object.__setattr__(self, "seed", check_seed(self.seed))
    if not 1 <= self.preamble_len <= 1024:
      raise TrainingInputError(f"preamble_len must lie in [1, 1024], got "
                               f"{self.preamble_len}")
    if self.steps < 1 or self.batch_size < 1 or self.eval_batches < 0:
      raise TrainingInputError("steps and batch_size must be >= 1, "
                               "eval_batches >= 0")
    if self.page_size < 1:
      raise TrainingInputError(f"page_size must be >= 1, got "
                               f"{self.page_size}")
    if self.max_len < 1:
      raise TrainingInputError(f"max_len must be >= 1, got {self.max_len}")
    if self.init not in INITS:
      raise TrainingInputError(f"init must be one of {INITS}, got "
                               f"{self.init!r}")
    # The schedule spans the run: total_steps follows steps.
    if self.optimizer.total_steps != self.steps:
      object.__setattr__(self, "optimizer", dataclasses.replace(
          self.optimizer, total_steps=self.steps))

  def stored_preamble(self):
    """The rounding the served pool applies to the preamble's K/V, or None."""
    if not self.float8_pages:
      return None
    return Float8Preamble(page_size=self.page_size,
                          preamble_len=self.preamble_len)


def init_tokens(tokenizer, preamble_len: int, how: str = "chat") -> list[int]:
  """The P token ids whose embeddings start the sink (see the module doc)."""
  from lazyattn_jax.requests import chat_parts
  if tokenizer is None:
    raise TrainingInputError("initializing a sink needs the model's tokenizer")
  ids = chat_parts(tokenizer, "x")[0] if how == "chat" else []
  generic = tokenizer.encode(GENERIC_TEXT, parse_special=False)
  while len(ids) < preamble_len:
    ids = ids + generic
  return ids[:preamble_len]


def init_sink(trainable, preamble_len: int, how: str = "chat") -> np.ndarray:
  """float32 [P, D]: the embeddings of `init_tokens`."""
  ids = init_tokens(trainable.tokenizer, preamble_len, how)
  table = trainable.params["embed_tokens"]
  return np.asarray(table[np.asarray(ids)], np.float32)


@functools.lru_cache(maxsize=8)
def _train_step(functions, optimizer: OptimizerConfig, remat: bool,
                stored_preamble=None):
  tx = optimizer.build()

  def loss_fn(sink, params, batch):
    teacher = jax.lax.stop_gradient(
        functions.answer_logits(params, batch["teacher"], remat=remat))
    student = functions.answer_logits(params, batch["student"], sink,
                                      remat=remat,
                                      stored_preamble=stored_preamble)
    kl, ce = kl_and_ce(student, teacher, batch["labels"], batch["weights"])
    return kl, dict(kl=kl, ce=ce)

  def step(sink, opt_state, params, batch):
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        sink, params, batch)
    updates, opt_state = tx.update(grad, opt_state, sink)
    return optax.apply_updates(sink, updates), opt_state, dict(
        loss=loss, grad_norm=global_norm(grad), **metrics)

  return tx, jax.jit(step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=8)
def _eval_step(functions, stored_preamble=None):
  def kl(params, batch, sink):
    teacher = functions.answer_logits(params, batch["teacher"])
    student = functions.answer_logits(params, batch["student"], sink,
                                      stored_preamble=stored_preamble)
    return kl_and_ce(student, teacher, batch["labels"], batch["weights"])[0]
  return jax.jit(kl)


def mean_kl(trainable, batches, mesh, sink=None,
            stored_preamble=None) -> float:
  """Mean KL(teacher || student) over `batches` (a list of batch.Batch),
  with the preamble's K/V rounded by `stored_preamble` if given."""
  step = _eval_step(trainable.functions, stored_preamble)
  params = parallel.replicate(trainable.params, mesh)
  sink = None if sink is None else parallel.replicate(jnp.asarray(sink), mesh)
  values = [float(step(params, parallel.shard_batch(b.arrays(), mesh), sink))
            for b in batches]
  return float(np.mean(values)) if values else float("nan")


@dataclasses.dataclass
class SinkResult:
  """What `train_sink` returns: the sink, its metrics, and held-out KL of
  the lazy layout without a preamble, with the initial and the trained
  sink (NaN without eval batches), all three on the same samples.

  Attributes:
    eval_indices: the source indices of the evaluation samples
      (`evaluation_split`), in batch order.
    train_size: training read only source[:train_size].
  """
  sink: np.ndarray
  history: report.History
  eval_kl: dict[str, float]
  eval_indices: list[int] = dataclasses.field(default_factory=list)
  train_size: int = 0


def train_sink(trainable, source, config: SinkConfig, *, sink=None,
               max_minutes: float | None = None, should_stop=None,
               progress: bool = True) -> SinkResult:
  """Trains a sink for `trainable` (a model_io.TrainableModel, frozen) on
  `source` (a data.DataSource).

  Args:
    sink: a starting [P, D] array (default: `init_sink`).
    max_minutes: stop after this much training wall time, > 0 (the
      result then has fewer steps in its history).
    should_stop: a callable checked before each step; once it returns
      True training stops, as when `max_minutes` is up.

  Raises:
    TrainingInputError (SinkFormatError for a bad `sink`): bad settings.
  """
  c, model = config, trainable
  if max_minutes is not None and not max_minutes > 0:
    raise TrainingInputError(f"max_minutes must be > 0, got {max_minutes}")
  if sink is None:
    sink = init_sink(model, c.preamble_len, c.init)
  sink = check_sink(sink, hidden_size=model.config.hidden_size,
                    preamble_len=c.preamble_len)
  mesh = parallel.data_mesh(c.devices)
  parallel.check_batch_size(mesh, c.batch_size)
  optimizer = c.optimizer
  stored = c.stored_preamble()
  tx, step = _train_step(model.functions, optimizer, c.remat, stored)
  sink_layout = Layout(c.preamble_len)
  # Held out of training, and the same samples for every KL: picked once
  # under the sink's layout, the longer one (a sample that fits it fits
  # the layout without a preamble).
  train_size, picked = evaluation_split(
      source, model.tokenizer, model.config.vocab_size, sink_layout,
      c.eval_batches * c.batch_size, c.max_len)
  train = BatchBuilder(
      SourceSlice(source, 0, train_size), model.tokenizer,
      model.config.vocab_size, sink_layout, batch_size=c.batch_size,
      seed=c.seed, max_len=c.max_len)
  held_out = evaluation_batches(picked, sink_layout, c.batch_size)
  plain = evaluation_batches(picked, Layout(0), c.batch_size)
  evaluate = lambda s, batches: mean_kl(model, batches, mesh, s, stored)
  eval_kl = dict(no_preamble=evaluate(None, plain),
                 initial_sink=evaluate(sink, held_out))
  params = parallel.replicate(model.params, mesh)
  current = parallel.replicate(jnp.asarray(sink), mesh)
  opt_state = parallel.replicate(tx.init(current), mesh)
  history = report.History()
  with report.progress_bar(c.steps, 0, "sink", progress) as bar:
    batch, tick = train.batch(0), time.perf_counter()
    started = time.monotonic()
    for i in range(c.steps):
      if (max_minutes is not None and
          time.monotonic() - started > 60 * max_minutes) or (
              should_stop is not None and should_stop()):
        break
      current, opt_state, metrics = step(
          current, opt_state, params,
          parallel.shard_batch(batch.arrays(), mesh))
      # The step runs asynchronously: build the next batch meanwhile.
      batch = train.batch(i + 1) if i + 1 < c.steps else None
      metrics = jax.device_get(metrics)  # waits for the step
      now = time.perf_counter()
      history.add(i, dict(metrics, step_s=now - tick))
      tick = now
      bar.set_postfix(kl=f"{float(metrics['kl']):.4f}")
      bar.update(1)
  trained = np.asarray(jax.device_get(current), np.float32)
  eval_kl["trained_sink"] = evaluate(trained, held_out)
  return SinkResult(trained, history, eval_kl, [n for n, _ in picked],
                    train_size)


def main(argv=None) -> int:
  """`python -m lazyattn_jax.training.sink` (`sink_cli.main`)."""
  from lazyattn_jax.training.sink_cli import main as cli_main
  return cli_main(argv)


if __name__ == "__main__":
  sys.exit(main())
