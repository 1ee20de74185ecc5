"""Answer quality of RAG on real data: datasets, layouts and metrics.

- `datasets`: the HotpotQA dev distractor set (fetched on first use), typed
  records and the fixed train / held-out eval split (`load_hotpotqa`);
- `hotpotqa`: its questions as requests, in the "dataset" and "gold-sweep"
  document layouts;
- `metrics`: exact match, F1 and answer-contained, normalized as in the
  SQuAD / HotpotQA evaluation scripts.

`benchmarks/rag_quality.py --dataset hotpotqa` runs them against the
engine's modes; a training module can import the same train split.
"""

from lazyattn_jax.quality.datasets import (DatasetUnavailableError,
                                           HotpotQAExample, Paragraph,
                                           load_hotpotqa, split_of)
from lazyattn_jax.quality.hotpotqa import LAYOUTS, RagItem, build_items
from lazyattn_jax.quality.metrics import Score, score

__all__ = [
    "DatasetUnavailableError", "HotpotQAExample", "LAYOUTS", "Paragraph",
    "RagItem", "Score", "build_items", "load_hotpotqa", "score", "split_of",
]
