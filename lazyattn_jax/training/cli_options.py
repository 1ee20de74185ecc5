"""The command-line options the two trainers share (`lazyattn finetune` and
`python -m lazyattn_jax.training.sink`): the model, the data, the
optimizer's schedule, the compute and the run's limits.  Each trainer adds
its own options and its defaults for steps, batch size and learning rate."""

from __future__ import annotations

import argparse


def add_shared_options(p: argparse.ArgumentParser, *, steps: int,
                       batch_size: int, lr: float, warmup_steps: int,
                       batch_help: str = "samples per step"):
  """--model, --steps, --batch-size, --lr, --warmup-steps, --clip-norm,
  --data, --docs-per-question, --seed, --dtype, --remat, --max-len,
  --devices, --max-minutes, --no-progress."""
  p.add_argument("--model", default="smollm2-135m-instruct",
                 help="model name or path (.gguf file or HF directory)")
  p.add_argument("--steps", type=int, default=steps)
  p.add_argument("--batch-size", type=int, default=batch_size,
                 help=batch_help)
  p.add_argument("--lr", type=float, default=lr, help="peak learning rate")
  p.add_argument("--warmup-steps", type=int, default=warmup_steps)
  p.add_argument("--clip-norm", type=float, default=1.0,
                 help="global gradient-norm clipping")
  p.add_argument("--data", default="synthetic",
                 help="synthetic or hotpotqa (its train part: no paragraph "
                      "shared with the held-out questions)")
  # None: the source's own (synthetic: 4; hotpotqa: every paragraph of a
  # question, and it refuses a value), resolved by
  # data.resolve_docs_per_question.
  p.add_argument("--docs-per-question", type=int, default=None,
                 help="documents per synthetic sample (default 4); the "
                      "hotpotqa source keeps each question's paragraphs "
                      "and refuses this option")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--dtype", default="float32",
                 help="compute dtype: float32 or bfloat16 (trained values "
                      "and optimizer state stay float32)")
  p.add_argument("--remat", action="store_true",
                 help="recompute attention in the backward pass")
  p.add_argument("--max-len", type=int, default=2048,
                 help="longest dense sequence; longer samples are replaced")
  p.add_argument("--devices", type=int, default=None,
                 help="local devices for data parallelism (default all)")
  p.add_argument("--max-minutes", type=float, default=None,
                 help="stop after this much wall time, with the results "
                      "saved")
  p.add_argument("--no-progress", action="store_true")
