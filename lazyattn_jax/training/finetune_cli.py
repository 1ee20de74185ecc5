"""`lazyattn finetune` (and `python -m lazyattn_jax.finetune`): options and
the run.  `lazyattn_jax.cli` adds the subcommand with `add_arguments` and
calls `run`; errors in `cli_errors.USER_ERRORS` are the user's (one line,
exit status 2)."""

from __future__ import annotations

import argparse
import math
import os
import time

import numpy as np

HELP = ("block fine-tuning for lazy attention (KL to full attention + "
        "cross-entropy); writes checkpoints, a loss curve and a model "
        "directory")


def add_arguments(p: argparse.ArgumentParser):
  """The finetune options (defaults: FinetuneConfig's)."""
  from lazyattn_jax.training.cli_options import add_shared_options
  add_shared_options(p, steps=1000, batch_size=16, lr=2e-5, warmup_steps=50,
                     batch_help="samples per step, a multiple of the devices")
  p.add_argument("--out", required=True,
                 help="output directory (checkpoints/, model/, loss.png, "
                      "log.json); a run there is resumed")
  p.add_argument("--weight-decay", type=float, default=0.01)
  p.add_argument("--full-share", type=float, default=0.25,
                 help="share of samples with plain causal full attention")
  p.add_argument("--kl-weight", type=float, default=1.0,
                 help="weight of KL(full-attention teacher || student)")
  p.add_argument("--ce-weight", type=float, default=0.5,
                 help="weight of the answers' cross-entropy")
  preamble = p.add_mutually_exclusive_group()
  preamble.add_argument("--preamble", choices=["chat"], default=None,
                        help="chat: every document is encoded after the "
                             "chat template's prefix, as "
                             "QualityOptions(preamble='chat') serves it")
  preamble.add_argument("--preamble-sink", default=None, metavar="FILE",
                        help="a learned sink file (frozen) as the preamble; "
                             "exported with the model")
  # Replaced by --preamble chat; kept hidden to refuse it in one line
  # (_check) rather than with argparse's unknown-option usage.
  p.add_argument("--preamble-text", default=None, help=argparse.SUPPRESS)
  p.add_argument("--recompute-tokens", type=int, default=0,
                 help="first tokens of each later document recomputed per "
                      "request (the engine's first-page recompute), a "
                      "multiple of the page size 16 (0: none)")
  p.add_argument("--checkpoint-every", type=int, default=200)
  p.add_argument("--keep-checkpoints", type=int, default=2)
  p.add_argument("--export-dtype", default="float32",
                 help="float32, bfloat16 or float16 tensors in the export")
  p.add_argument("--stop-at-step", type=int, default=None,
                 help="stop with a checkpoint once this many steps are done")


def _check(args):
  """Value checks argparse does not make, naming the option."""
  from lazyattn_jax.training.errors import TrainingInputError
  from lazyattn_jax.training.model_io import check_dtype
  from lazyattn_jax.training.served_layout import check_recompute_tokens
  positive = ("steps", "batch_size", "checkpoint_every", "keep_checkpoints",
              "max_len", "docs_per_question", "lr", "clip_norm")
  for name in positive:
    # --docs-per-question is None for the hotpotqa source (its own count).
    if name == "docs_per_question" and args.docs_per_question is None:
      continue
    if not getattr(args, name) > 0:
      raise TrainingInputError(f"--{name.replace('_', '-')} must be > 0, "
                               f"got {getattr(args, name)}")
  # `nan < 0` is False and inf passes `> 0`: either exports an all-NaN
  # model, so the float settings must be finite as well.
  for name in ("lr", "weight_decay", "kl_weight", "ce_weight"):
    if not math.isfinite(getattr(args, name)):
      raise TrainingInputError(f"--{name.replace('_', '-')} must be finite, "
                               f"got {getattr(args, name)}")
  for name in ("warmup_steps", "weight_decay", "kl_weight", "ce_weight",
               "recompute_tokens"):
    if getattr(args, name) < 0:
      raise TrainingInputError(f"--{name.replace('_', '-')} must be >= 0, "
                               f"got {getattr(args, name)}")
  if args.stop_at_step is not None and args.stop_at_step < 0:
    raise TrainingInputError(f"--stop-at-step must be >= 0, got "
                             f"{args.stop_at_step}")
  if not 0.0 <= args.full_share <= 1.0:
    raise TrainingInputError(f"--full-share must lie in [0, 1], got "
                             f"{args.full_share}")
  if args.max_minutes is not None and not args.max_minutes > 0:
    raise TrainingInputError("--max-minutes must be > 0")
  if args.preamble_text is not None:
    raise TrainingInputError(
        "--preamble-text was replaced by --preamble chat: the engine serves "
        "no token preamble but the chat template's prefix "
        "(QualityOptions(preamble='chat')), so a model trained after other "
        "text would be served in a layout it was not trained for")
  check_recompute_tokens(args.recompute_tokens, "--recompute-tokens")
  check_dtype(args.dtype)
  from lazyattn_jax.training.parallel import check_device_count
  check_device_count(args.devices, "--devices")
  if args.preamble_sink:  # readable and well formed; its width once loaded
    from lazyattn_jax.training.sink_file import load_sink
    load_sink(args.preamble_sink)


def config_from_args(args, layout=None):
  """The FinetuneConfig the options describe."""
  from lazyattn_jax.training.batch import Layout
  from lazyattn_jax.training.finetune import FinetuneConfig
  from lazyattn_jax.training.optim import OptimizerConfig
  return FinetuneConfig(
      steps=args.steps, batch_size=args.batch_size, seed=args.seed,
      full_share=args.full_share, kl_weight=args.kl_weight,
      ce_weight=args.ce_weight,
      layout=layout or Layout(recompute_tokens=args.recompute_tokens),
      remat=args.remat, max_len=args.max_len,
      checkpoint_every=args.checkpoint_every,
      keep_checkpoints=args.keep_checkpoints, export_dtype=args.export_dtype,
      optimizer=OptimizerConfig(learning_rate=args.lr,
                                warmup_steps=args.warmup_steps,
                                weight_decay=args.weight_decay,
                                clip_norm=args.clip_norm))


def _layout(args, tokenizer, hidden_size):
  """(Layout, sink or None) from the preamble options."""
  from lazyattn_jax.training.batch import Layout
  from lazyattn_jax.training.served_layout import chat_layout
  from lazyattn_jax.training.sink_file import load_sink
  k = args.recompute_tokens
  if args.preamble_sink:
    sink, _ = load_sink(args.preamble_sink, hidden_size=hidden_size)
    return Layout(len(sink), None, k), sink
  if args.preamble == "chat":
    return chat_layout(tokenizer, k), None
  return Layout(0, None, k), None


def run(args) -> int:
  """Runs `lazyattn finetune` with parsed `args`; returns the exit status."""
  from lazyattn_jax.training.data import load_source
  from lazyattn_jax.training.finetune import (OUTPUT_DIRS, OUTPUT_FILES,
                                              finetune)
  from lazyattn_jax.cli import EXIT_INTERRUPTED
  from lazyattn_jax.training.cli_errors import out_of_memory_hint
  from lazyattn_jax.training.interrupt import stop_on_interrupt
  from lazyattn_jax.training.model_io import load_trainable
  from lazyattn_jax.training.report import output_errors, prepare_output_dir
  from lazyattn_jax.training.data import resolve_docs_per_question
  # The count the source uses (synthetic's default 4 when not given), so
  # the recipe records it; a value for hotpotqa is refused here.
  args.docs_per_question = resolve_docs_per_question(
      args.data, args.docs_per_question)
  _check(args)
  config_from_args(args)  # refuse bad settings before loading anything
  try:
    import orbax.checkpoint  # noqa: F401
  except ImportError as e:
    from lazyattn_jax.training.errors import TrainingInputError
    raise TrainingInputError(
        f"lazyattn finetune needs the train extra ({e.name} is missing): "
        "pip install 'lazyattn-jax[train]'") from None
  # Before loading anything: a bad --out costs nothing (finetune checks
  # it again for callers of the Python API).
  prepare_output_dir(args.out, files=OUTPUT_FILES, dirs=OUTPUT_DIRS)
  source = load_source(args.data, seed=args.seed + 1,
                       docs_per_question=args.docs_per_question)
  model = load_trainable(args.model, args.dtype, progress=not args.no_progress)
  layout, sink = _layout(args, model.tokenizer, model.config.hidden_size)
  started = time.time()
  with output_errors(args.out), out_of_memory_hint(args), \
      stop_on_interrupt("finetune") as interrupted:
    result = finetune(model, source, config_from_args(args, layout), args.out,
                      sink=sink, devices=args.devices,
                      stop_at=args.stop_at_step, data_id=dict(
                          name=args.data,
                          docs_per_question=args.docs_per_question,
                          size=len(source)),
                      max_minutes=args.max_minutes, should_stop=interrupted,
                      progress=not args.no_progress)
  rows = result.history.rows
  last = rows[-1] if rows else {}
  step_s = float(np.median([r["step_s"] for r in rows[1:]])) if len(
      rows) > 1 else float("nan")
  print(f"{result.step}/{args.steps} steps in {time.time() - started:.0f} s "
        f"(this run); last loss {last.get('loss', float('nan')):.4f} "
        f"(kl {last.get('kl', float('nan')):.4f}, ce "
        f"{last.get('ce', float('nan')):.4f}); samples: "
        f"{result.lazy_samples} lazy, {result.full_samples} full; median "
        f"step {step_s:.3f} s")
  if result.finished:
    print(f"model: {result.export_dir}\nloss curve: "
          f"{os.path.join(args.out, 'loss.png')}")
  else:
    # No export when no step was done (e.g. --stop-at-step 0): say so
    # rather than print the path None.
    exported = (result.export_dir if result.export_dir is not None else
                "none exported")
    print(f"stopped early; the model so far (step {result.step}): "
          f"{exported}\nrun the same command again to resume from "
          f"{os.path.join(args.out, 'checkpoints')}")
  return EXIT_INTERRUPTED if interrupted() else 0
