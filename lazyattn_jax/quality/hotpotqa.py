"""HotpotQA questions as RAG requests: the prompt and the document layouts.

Each context paragraph is one document, "Title: sentence sentence ...".  The
query asks the question and asks for a short answer (`QUERY_TEMPLATE`); the
engine wraps a text query in the model's chat template and puts the
documents inside the user turn, before the query.

Layouts (`LAYOUTS`):

- "dataset": every paragraph, in the dataset's order (10 for all but 60
  questions).  The item's position is the slot of its first supporting
  paragraph; `gold_slots` holds both.
- "gold-sweep": k documents (default 10): the two supporting paragraphs,
  adjacent and in their dataset order, at slots p and p + 1, and the first
  k - 2 distractors, in their dataset order, in the other slots.  One item
  per p = 0 .. k - 2 (the item's position), so every position is measured
  on the same questions; a question with fewer than k - 2 distractors, or
  without exactly two supporting paragraphs (every question of the dev set
  has two), is left out of the sweep (`gold_sweep` returns nothing for
  it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from lazyattn_jax.quality.datasets import HotpotQAExample

LAYOUTS = ("dataset", "gold-sweep")
DEFAULT_SWEEP_DOCS = 10

# The documents come before this inside the user turn; asking for the
# answer alone keeps a chat model from explaining (it is scored on its
# first line, `metrics.answer_text`).
QUERY_TEMPLATE = (
    "Answer the question using the documents above. Reply with only the "
    "answer, in as few words as possible.\nQuestion: {question}")


@dataclasses.dataclass(frozen=True)
class RagItem:
  """One request of the benchmark and what it is scored against.

  Attributes:
    example_id: the question's id.
    query: the text query (the engine adds the chat template).
    documents: the documents' texts, in prompt order.
    answer: the gold answer.
    gold_slots: indices into `documents` of the supporting paragraphs.
    position: the gold position the item is reported under.
    type: the question's type ("bridge", "comparison").
  """
  example_id: str
  query: str
  documents: tuple[str, ...]
  answer: str
  gold_slots: tuple[int, ...]
  position: int
  type: str = ""


def make_query(question: str) -> str:
  """The query text for a question."""
  return QUERY_TEMPLATE.format(question=question.strip())


def dataset_layout(example: HotpotQAExample) -> list[RagItem]:
  """One item: all paragraphs in the dataset's order."""
  gold = example.gold_indices
  return [RagItem(example.id, make_query(example.question),
                  tuple(p.text for p in example.paragraphs), example.answer,
                  gold, gold[0], example.type)]


def gold_sweep(example: HotpotQAExample,
               num_docs: int = DEFAULT_SWEEP_DOCS) -> list[RagItem]:
  """Items with the gold pair at slots (p, p + 1) for p = 0 .. num_docs - 2.

  The other slots hold the first num_docs - 2 distractors in the dataset's
  order.  Returns [] when the question has fewer distractors than that, or
  not exactly two supporting paragraphs (a custom file's question whose
  facts sit in one paragraph, or whose supporting title names two): the
  sweep moves a pair.
  """
  if num_docs < 2:
    raise ValueError(f"a gold sweep needs at least 2 documents, got {num_docs}")
  gold = example.gold_indices
  if len(gold) != 2:
    return []
  texts = [p.text for p in example.paragraphs]
  distractors = [t for i, t in enumerate(texts) if i not in gold]
  if len(distractors) < num_docs - 2:
    return []
  distractors = distractors[:num_docs - 2]
  gold_texts = [texts[i] for i in gold]
  items = []
  for p in range(num_docs - 1):
    documents = distractors[:p] + gold_texts + distractors[p:]
    items.append(RagItem(example.id, make_query(example.question),
                         tuple(documents), example.answer, (p, p + 1), p,
                         example.type))
  return items


def build_items(examples: Iterable[HotpotQAExample], layout: str,
                num_docs: int = DEFAULT_SWEEP_DOCS) -> list[RagItem]:
  """The requests of a layout, question by question (a question's sweep
  items are adjacent, so its documents are still cached when reused)."""
  if layout == "dataset":
    return [item for e in examples for item in dataset_layout(e)]
  if layout == "gold-sweep":
    return [item for e in examples for item in gold_sweep(e, num_docs)]
  raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
