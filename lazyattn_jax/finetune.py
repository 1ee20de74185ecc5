"""`python -m lazyattn_jax.finetune ...` is `lazyattn finetune ...`: block
fine-tuning for lazy attention (lazyattn_jax/training/, docs/training.md)."""

import sys

from lazyattn_jax.cli import main

if __name__ == "__main__":
  sys.exit(main(["finetune", *sys.argv[1:]]))
