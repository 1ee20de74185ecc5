"""Block fine-tuning: full-weight training of a Llama-family model for the
engine's lazy layout.

The student is the model being trained, under exactly the layout the engine
serves (`batch.Layout`: each document encoded alone, or after a preamble;
the query and answer after everything); a share of the samples
(`full_share`) is laid out with plain causal full attention instead, so
full mode does not degrade.  The teacher is the frozen base model over the
plain causal prompt.  The loss is `kl_weight` * KL(teacher || student) +
`ce_weight` * cross-entropy, both on the answer tokens.

Steps are jitted and data parallel over the local devices (`parallel`).
Checkpoints (orbax) are written every `checkpoint_every` steps under
OUT/checkpoints; a run started again with the same recipe and OUT resumes
from the newest one, on the same batches (the data order is a pure
function of seed and step).  A run exports OUT/model, a safetensors
directory `LazyEngine.from_pretrained` loads, when it finishes and also
when it stops early (the weights so far, so a run under a time limit
still leaves a model; resuming replaces it), and writes OUT/loss.png and
OUT/log.json.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from lazyattn_jax.training import parallel, report
from lazyattn_jax.training.batch import BatchBuilder, Layout
from lazyattn_jax.training.checkpoints import Checkpoints
from lazyattn_jax.training.data import as_sample
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.export import EXPORT_DTYPES, export_model
from lazyattn_jax.training.forward import global_norm, kl_and_ce
from lazyattn_jax.training.model_io import model_signature
from lazyattn_jax.training.optim import OptimizerConfig
from lazyattn_jax.training.order import check_seed
from lazyattn_jax.training.served_layout import check_servable
from lazyattn_jax.training.sink_file import check_sink


# What a run writes under its output directory.
OUTPUT_FILES, OUTPUT_DIRS = ("log.json", "loss.png"), ("checkpoints", "model")


@dataclasses.dataclass(frozen=True)
class FinetuneConfig:
  """The recipe of a fine-tuning run (a resumed run must use the same).

  Attributes:
    steps: optimizer steps.
    batch_size: samples per step (a multiple of the devices).
    seed: data order and layout seed, any 64-bit integer.
    full_share: share of samples laid out with full attention.
    kl_weight: weight of KL(teacher || student) on the answer tokens.
    ce_weight: weight of the answers' cross-entropy.
    layout: the engine layout trained for (preamble, first-page recompute).
    remat: recompute attention in the backward pass (less memory).
    max_len: longest dense sequence; longer samples are replaced.
    checkpoint_every: steps between checkpoints.
    keep_checkpoints: how many checkpoints are kept.
    export_dtype: tensor dtype of the exported model.safetensors.
    optimizer: AdamW learning rate, warm-up, decay, clipping, decay.
  """
  steps: int = 1000
  batch_size: int = 16
  seed: int = 0
  full_share: float = 0.25
  kl_weight: float = 1.0
  ce_weight: float = 0.5
  layout: Layout = Layout()
  remat: bool = False
  max_len: int = 2048
  checkpoint_every: int = 200
  keep_checkpoints: int = 2
  export_dtype: str = "float32"
  optimizer: OptimizerConfig = OptimizerConfig(learning_rate=2e-5,
                                               warmup_steps=50,
                                               weight_decay=0.01)

  def __post_init__(self):
    object.__setattr__(self, "seed", check_seed(self.seed))
    if self.steps < 1 or self.batch_size < 1 or self.checkpoint_every < 1:
      raise TrainingInputError("steps, batch_size and checkpoint_every must "
                               "be >= 1")
    if not 0.0 <= self.full_share <= 1.0:
      raise TrainingInputError(f"full_share must lie in [0, 1], got "
                               f"{self.full_share}")
    if self.max_len < 1:
      raise TrainingInputError(f"max_len must be >= 1, got {self.max_len}")
    # Finite first: nan fails no `< 0` test and inf weights give a NaN loss.
    for name in ("kl_weight", "ce_weight"):
      value = getattr(self, name)
      if not (value >= 0 and math.isfinite(value)):
        raise TrainingInputError(f"{name} must be finite and >= 0, got "
                                 f"{value}")
    if not self.kl_weight + self.ce_weight > 0:
      raise TrainingInputError("kl_weight and ce_weight must be >= 0, and "
                               "one of them > 0")
    if self.export_dtype not in EXPORT_DTYPES:
      raise TrainingInputError(f"export_dtype must be one of "
                               f"{', '.join(EXPORT_DTYPES)}")
    # The schedule spans the run: total_steps follows steps.
    if self.optimizer.total_steps != self.steps:
      object.__setattr__(self, "optimizer", dataclasses.replace(
          self.optimizer, total_steps=self.steps))

  def recipe(self) -> dict:
    """The settings that decide the trained weights (JSON-able)."""
    out = dataclasses.asdict(self)
    for runtime in ("checkpoint_every", "keep_checkpoints", "export_dtype"):
      out.pop(runtime)
    return json.loads(json.dumps(out))


@functools.lru_cache(maxsize=8)
def _train_step(functions, optimizer: OptimizerConfig, kl_weight: float,
                ce_weight: float, remat: bool):
  tx = optimizer.build()

  def loss_fn(params, teacher_params, sink, batch):
    teacher = jax.lax.stop_gradient(
        functions.answer_logits(teacher_params, batch["teacher"]))
    student = functions.answer_logits(params, batch["student"], sink,
                                      remat=remat)
    kl, ce = kl_and_ce(student, teacher, batch["labels"], batch["weights"])
    return kl_weight * kl + ce_weight * ce, dict(kl=kl, ce=ce)

  def step(state, teacher_params, sink, batch):
    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(
        state["params"], teacher_params, sink, batch)
    updates, opt_state = tx.update(grad, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    return dict(params=params, opt_state=opt_state), dict(
        loss=loss, grad_norm=global_norm(grad), **metrics)

  return tx, jax.jit(step, donate_argnums=0)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _initial_state(params, tx, compute: str):
  """(train state, teacher weights), as new buffers: the step donates the
  trained weights, and the caller's must survive it.  The teacher's are
  only ever used in the compute dtype.  One jit: a copy per array would
  compile a program per shape."""
  params = jax.tree.map(lambda x: x.astype(jnp.float32) + 0, params)
  teacher = jax.tree.map(lambda x: x.astype(compute), params)
  return dict(params=params, opt_state=tx.init(params)), teacher


# Samples hashed into a source's fingerprint: enough to tell sources apart
# (another size, seed or documents per question), cheap for any source.
_FINGERPRINT_SAMPLES = 4


def data_fingerprint(source) -> dict:
  """A cheap identity of a data source for the recipe: its length and a
  hash of its first few samples (JSON-able)."""
  n = len(source)
  digest = hashlib.sha256()
  for i in range(min(n, _FINGERPRINT_SAMPLES)):
    sample = as_sample(source[i])
    digest.update(json.dumps([list(sample.documents), sample.query,
                              sample.answer]).encode("utf-8"))
  return dict(size=n, head_sha256=digest.hexdigest())


def _data_identity(source, data_id) -> dict | str | list | None:
  """`data_id` as it reads back from JSON (the checkpoint's record is
  compared with it), or the source's fingerprint when None."""
  if data_id is None:
    return data_fingerprint(source)
  try:
    return json.loads(json.dumps(data_id, allow_nan=False))
  except (TypeError, ValueError) as e:
    raise TrainingInputError(f"data_id must be JSON-able, got "
                             f"{data_id!r}") from e


def _recipe_differences(saved, recipe: dict) -> list[str]:
  """The keys of `recipe` in which a checkpoint's saved recipe differs
  (all of them when it has none)."""
  if not isinstance(saved, dict):
    return sorted(recipe)
  keys = set(recipe) | set(saved)
  if "model" not in saved:
    # Written before records held the model's structure: the weights' hash
    # and id still identify a loaded model, so such a run still resumes.
    keys.discard("model")
  if "data" not in saved:
    # Likewise for records from before the data was part of the recipe.
    keys.discard("data")
  return sorted(k for k in keys if saved.get(k) != recipe.get(k))


@dataclasses.dataclass
class FinetuneResult:
  """What `finetune` returns.

  Attributes:
    params: the trained float32 weights (pure dict, on the device).
    history: every step's metrics (loss, kl, ce, grad_norm, lr,
      full_samples, step_s: wall seconds, the first with compiling), the
      resumed run's earlier steps included.
    step: steps done.
    finished: whether all `steps` are done (else it stopped early and can
      be resumed).
    export_dir: the exported model directory (the weights at `step`,
      finished or not), or None.
    full_samples, lazy_samples: samples of each layout over the history.
  """
  params: dict
  history: report.History
  step: int
  finished: bool
  export_dir: str | None
  full_samples: int
  lazy_samples: int


def finetune(trainable, source, config: FinetuneConfig, out_dir, *,
             sink=None, devices: int | None = None,
             stop_at: int | None = None, max_minutes: float | None = None,
             should_stop=None, progress: bool = True,
             export: bool = True, data_id=None) -> FinetuneResult:
  """Fine-tunes `trainable` (a model_io.TrainableModel) on `source`.

  Args:
    out_dir: checkpoints, log, loss curve and exported model go here; an
      existing checkpoint there is resumed.
    sink: [P, D] learned preamble vectors (frozen) when the layout's
      preamble is learned (`layout.preamble_ids` None, P > 0); exported
      beside the weights, which `from_pretrained` serves after them.
    devices: local devices for data parallelism (default all).
    stop_at: stop (with a checkpoint) once this many steps are done.
    max_minutes: stop (with a checkpoint) after this much wall time
      (> 0).
    should_stop: a callable checked before each step; once it returns
      True the run stops (with a checkpoint), e.g.
      `interrupt.stop_on_interrupt`'s request.
    export: export the model at the end of the run, finished or stopped
      early (its safetensors metadata says which step and whether it
      finished).
    data_id: a JSON-able identity of `source` for the recipe (the command
      line passes the --data name, --docs-per-question and the size);
      None: `data_fingerprint(source)`.  A checkpoint made with other data
      is not resumed.

  Raises:
    TrainingInputError: bad settings, a layout the engine cannot serve
      (`served_layout.check_servable`: a token preamble other than the
      chat prefix, recompute not in whole pages), a sink that does not
      fit, or a checkpoint in out_dir made with another recipe or model
      (checked before any training); OutputPathError (one) when out_dir
      cannot be made or written.
  """
  c, model = config, trainable
  layout = c.layout
  # The export is served in its trained layout (trained_quality): train
  # only layouts the engine has.
  check_servable(layout, model.tokenizer)
  learned = layout.preamble_len > 0 and layout.preamble_ids is None
  if learned != (sink is not None):
    raise TrainingInputError(
        "a learned preamble (preamble_len > 0 without preamble_ids) needs "
        "its sink vectors, and a sink needs such a layout")
  if sink is not None:
    sink = check_sink(sink, hidden_size=model.config.hidden_size,
                      preamble_len=layout.preamble_len)
  host_sink = sink  # exported with the model
  if max_minutes is not None and not max_minutes > 0:
    raise TrainingInputError(f"max_minutes must be > 0, got {max_minutes}")
  if stop_at is not None and not stop_at >= 0:
    raise TrainingInputError(f"stop_at must be >= 0, got {stop_at}")
  mesh = parallel.data_mesh(devices)
  parallel.check_batch_size(mesh, c.batch_size)
  compute = jnp.dtype(model.functions.dtype)
  recipe = dict(config=c.recipe(), model_sha256=model.sha256,
                model_id=model.model_id, model=model_signature(model),
                dtype=compute.name,
                sink_sha256=None if sink is None else hashlib.sha256(
                    np.asarray(sink).tobytes()).hexdigest(),
                data=_data_identity(source, data_id))

  report.prepare_output_dir(out_dir, files=OUTPUT_FILES, dirs=OUTPUT_DIRS)
  checkpoints = Checkpoints(os.path.join(out_dir, "checkpoints"),
                            c.keep_checkpoints)
  history, start = report.History(), 0
  try:
    latest = checkpoints.latest_step()
    if latest is not None:
      # The JSON record first: restoring another model's arrays into this
      # state fails inside orbax (tree or shape mismatch) before the
      # recipes could be compared.
      record = checkpoints.record(latest)
      differ = _recipe_differences(record.get("recipe") if isinstance(
          record, dict) else None, recipe)
      if differ:
        raise TrainingInputError(
            f"{checkpoints.directory} holds a run with another recipe or "
            f"model ({', '.join(differ)} differ); use a new output "
            "directory or the same settings")
    optimizer = c.optimizer
    tx, step_fn = _train_step(model.functions, optimizer, c.kl_weight,
                              c.ce_weight, c.remat)
    schedule = jax.jit(optimizer.schedule())  # one compile, not one per op
    builder = BatchBuilder(source, model.tokenizer, model.config.vocab_size,
                           layout, batch_size=c.batch_size, seed=c.seed,
                           full_share=c.full_share, max_len=c.max_len)
    state, teacher = parallel.replicate(
        _initial_state(model.params, tx, compute.name), mesh)
    sink = None if sink is None else parallel.replicate(sink, mesh)
    if latest is not None:
      state, record = checkpoints.restore(latest, state)
      history, start = report.History(record["history"]), latest
    started, done = time.monotonic(), start
    save = lambda n: checkpoints.save(n, state, dict(
        recipe=recipe, step=n, history=history.until(n).rows))
    with report.progress_bar(c.steps, start, "finetune", progress) as bar:
      batch, tick = None, time.perf_counter()
      for i in range(start, c.steps):
        if (stop_at is not None and i >= stop_at) or (
            max_minutes is not None and
            time.monotonic() - started > 60 * max_minutes) or (
                should_stop is not None and should_stop()):
          break
        batch = batch or builder.batch(i)
        state, metrics = step_fn(
            state, teacher, sink,
            parallel.shard_batch(batch.arrays(), mesh))
        full_samples = int(batch.full.sum())
        # The step runs asynchronously: build the next batch meanwhile.
        batch = builder.batch(i + 1) if i + 1 < c.steps else None
        metrics = jax.device_get(metrics)  # waits for the step
        now = time.perf_counter()
        history.add(i, dict(metrics, lr=schedule(i),
                            full_samples=full_samples, step_s=now - tick))
        tick = now
        done = i + 1
        bar.set_postfix(loss=f"{float(metrics['loss']):.4f}")
        bar.update(1)
        if done % c.checkpoint_every == 0 or done == c.steps:
          save(done)
      if done != checkpoints.latest_step():
        save(done)
  finally:
    checkpoints.close()

  finished = done >= c.steps
  report.plot_losses(history, os.path.join(out_dir, "loss.png"),
                     f"block fine-tuning, {c.steps} steps")
  full = int(sum(r["full_samples"] for r in history.rows))
  export_dir = None
  if export and done > 0:
    export_dir = export_model(
        os.path.join(out_dir, "model"), model.config, state["params"],
        model.tokenizer, dtype=c.export_dtype, sink=host_sink,
        metadata=dict(
            lazyattn_finetune=json.dumps(recipe),
            date=time.strftime("%Y-%m-%d"), step=str(done),
            finished=str(finished).lower()))
  report.write_log(os.path.join(out_dir, "log.json"), recipe, history,
                   step=done, finished=finished, export_dir=export_dir,
                   devices=[str(d) for d in mesh.devices.flat],
                   peak_memory_bytes=parallel.peak_memory_bytes(mesh))
  return FinetuneResult(state["params"], history, done, finished, export_dir,
                        full, len(history.rows) * c.batch_size - full)
