"""Training for the engine's layout (docs/training.md).

- A learned document sink (`sink`): P vectors every document is encoded
  after, trained by distillation with the model frozen
  (`python -m lazyattn_jax.training.sink`); its file format in `sink_file`.
- Block fine-tuning (`finetune`): full-weight training for lazy attention
  with KL to the full-attention teacher plus cross-entropy, data parallel,
  with orbax checkpoints and a safetensors export (`lazyattn finetune`).

Shared pieces: samples and sources (`data`), the training order (`order`),
tokenization as the engine does it (`examples`), padded dense batches of
the student's and the teacher's layouts (`batch`), the layouts the engine
serves (`served_layout`), the forward and losses (`forward`), the
optimizer (`optim`), sharding (`parallel`), held-out evaluation samples
(`held_out`), checkpoints (`checkpoints`),
export (`export`, `tokenizer_export`), model loading (`model_io`) and run
reports (`report`).

Names are imported on first use, so that `lazyattn --help` does not pay
for optax and orbax.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "Sample": "data", "DataSource": "data", "SyntheticFacts": "data",
    "load_source": "data",
    "Layout": "batch", "BatchBuilder": "batch",
    "chat_layout": "served_layout",
    "OptimizerConfig": "optim",
    "SinkConfig": "sink", "train_sink": "sink", "init_sink": "sink",
    "save_sink": "sink_file", "load_sink": "sink_file",
    "FinetuneConfig": "finetune",
    "export_model": "export", "export_tokenizer": "tokenizer_export",
    "load_trainable": "model_io", "from_model": "model_io",
    "TrainingError": "errors", "TrainingInputError": "errors",
    "SinkFormatError": "errors", "DataUnavailableError": "errors",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name):
  if name not in _EXPORTS:
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
  module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
  return getattr(module, name)
