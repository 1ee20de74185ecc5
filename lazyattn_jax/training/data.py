"""Training samples and where they come from.

A sample is what a RAG request is made of plus the answer to learn:
retrieved documents, a query and an answer, all text.  A data source is
anything with `len()` and integer indexing that returns samples
(`DataSource`); `load_source` names the built-in ones:

- "synthetic": `SyntheticFacts`, the fact-lookup task of
  benchmarks/rag_quality.py (short biographies of made-up people; the
  asked person's biography is one of k documents, though the value asked
  for may also be another person's: in about 22% of samples at k = 4).
  The library must not import the benchmarks, so the word lists are
  duplicated here.  Unlike the benchmark's fixed people, every sample
  draws fresh people, so no fact can be memorized: the model has to read
  the documents, and training on it cannot leak the benchmark's answers.
- "hotpotqa": HotpotQA's train part from `lazyattn_jax.quality.datasets`
  (imported when asked for; `DataUnavailableError` if it is not there):
  the questions the split does not hold out, less every one whose prompt
  shares a paragraph with a held-out prompt.  A sample is a question with
  all its paragraphs in the dataset's order (10 for nearly all), as the
  benchmark prompts it; `docs_per_question` does not apply and is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

import numpy as np

from lazyattn_jax.training.errors import (DataUnavailableError,
                                          TrainingInputError)
from lazyattn_jax.training.order import seed_entropy

SOURCES = ("synthetic", "hotpotqa")
DEFAULT_DOCS_PER_QUESTION = 4  # the synthetic source's k when not given


@dataclasses.dataclass(frozen=True)
class Sample:
  """One training example: a query over retrieved documents, and its answer.

  Attributes:
    documents: the retrieved passages, in prompt order (text).
    query: the user's question (text; wrapped in the chat template).
    answer: the assistant's reply to learn (text).
  """
  documents: tuple[str, ...]
  query: str
  answer: str

  def __post_init__(self):
    docs = self.documents
    if isinstance(docs, str) or not all(isinstance(d, str) for d in docs):
      raise TrainingInputError("Sample.documents must be a sequence of str")
    object.__setattr__(self, "documents", tuple(docs))
    for name in ("query", "answer"):
      value = getattr(self, name)
      if not isinstance(value, str) or not value.strip():
        raise TrainingInputError(f"Sample.{name} must be non-empty text, "
                                 f"got {value!r}")
    if any(not d.strip() for d in self.documents):
      raise TrainingInputError("Sample.documents holds an empty document")


@runtime_checkable
class DataSource(Protocol):
  """A finite, indexable set of samples; `source[i]` must always return the
  same sample for the same i (training order is a pure function of the
  seed and the step, and an interrupted run resumes on the same data)."""

  def __len__(self) -> int: ...

  def __getitem__(self, index: int) -> Sample: ...


# --- the synthetic fact lookup (benchmarks/rag_quality.py uses these lists) --
FIRST = ["Talia", "Oren", "Mira", "Jonas", "Priya", "Kenji", "Lena", "Tomas",
         "Amara", "Felix", "Sana", "Ivo", "Noor", "Elias", "Rhea", "Marek",
         "Yara", "Bastian", "Ines", "Caleb"]
LAST = ["Brennick", "Falkner", "Osei", "Lindqvist", "Moreau", "Tanaka",
        "Quill", "Harrow", "Vance", "Okafor", "Delacourt", "Stroud"]
CITIES = ["Lisbon", "Nairobi", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin",
          "Hanoi", "Quebec", "Tbilisi", "Perth", "Bogota", "Krakow", "Accra",
          "Seville", "Manila"]
JOBS = ["carpenter", "pilot", "chemist", "librarian", "baker", "surgeon",
        "architect", "fisherman", "violinist", "geologist", "journalist",
        "gardener"]
PETS = ["parrot", "tortoise", "ferret", "goldfish", "rabbit", "hamster",
        "lizard", "beagle", "canary", "hedgehog"]
QUESTIONS = {
    "city": ("In which city does {name} live?", "{name} lives in {value}."),
    "job": ("What is the job of {name}?", "{name} works as a {value}."),
    "pet": ("What pet does {name} have?", "{name} has a {value} as a pet."),
}


class SyntheticFacts:
  """Fact lookup over short biographies; sample i is a pure function of
  (seed, i).

  Args:
    size: number of samples.
    docs_per_question: k documents per sample; the asked person's
      biography is one of them (another may hold the same value).
    seed: generator seed (any integer: `order.seed_entropy`).
  """

  def __init__(self, size: int = 100_000, docs_per_question: int = 4,
               seed: int = 1):
    if size < 1:
      raise TrainingInputError(f"size must be >= 1, got {size}")
    if not 1 <= docs_per_question <= len(FIRST) * len(LAST):
      raise TrainingInputError(
          f"docs_per_question must lie in [1, {len(FIRST) * len(LAST)}], "
          f"got {docs_per_question}")
    self.size, self.k, self.seed = size, docs_per_question, seed

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> Sample:
    if not 0 <= index < self.size:
      raise IndexError(index)
    rng = np.random.default_rng([seed_entropy(self.seed), index])
    picks = rng.choice(len(FIRST) * len(LAST), size=self.k, replace=False)
    people = []
    for p in picks:
      name = f"{FIRST[p // len(LAST)]} {LAST[p % len(LAST)]}"
      people.append(dict(name=name, city=str(rng.choice(CITIES)),
                         job=str(rng.choice(JOBS)), pet=str(rng.choice(PETS))))
    docs = [f"{p['name']} lives in {p['city']}. {p['name']} works as a "
            f"{p['job']}. {p['name']} has a {p['pet']} as a pet."
            for p in people]
    attribute = str(rng.choice(list(QUESTIONS)))
    question, reply = QUESTIONS[attribute]
    target = people[0]
    order = rng.permutation(self.k)
    return Sample(
        documents=tuple(docs[i] for i in order),
        query=question.format(name=target["name"]),
        answer=reply.format(name=target["name"], value=target[attribute]))


class ListSource:
  """Samples held in a list (also accepts dicts or objects with
  documents / query / answer, as other loaders return them)."""

  def __init__(self, items: Sequence[Any]):
    self.items = [as_sample(item) for item in items]
    if not self.items:
      raise TrainingInputError("the data source holds no samples")

  def __len__(self) -> int:
    return len(self.items)

  def __getitem__(self, index: int) -> Sample:
    return self.items[index]


def as_sample(item) -> Sample:
  """A Sample from a Sample, a mapping or an object with documents, query
  and answer (a list of answers: the first)."""
  if isinstance(item, Sample):
    return item
  get = item.get if isinstance(item, dict) else (
      lambda key: getattr(item, key, None))
  answer = get("answer")
  if answer is None and get("answers"):
    answer = get("answers")[0]
  documents = get("documents")
  if documents is None:
    raise TrainingInputError(f"a sample needs documents, query and answer; "
                             f"got {type(item).__name__}")
  documents = [d if isinstance(d, str) else (d.get("text") if isinstance(
      d, dict) else str(d)) for d in documents]
  return Sample(tuple(documents), get("query"), answer)


def resolve_docs_per_question(name: str,
                              docs_per_question: int | None) -> int | None:
  """The documents per sample the source `name` uses with this setting.

  "synthetic": `docs_per_question`, or DEFAULT_DOCS_PER_QUESTION when None.
  "hotpotqa": None (each question keeps all its paragraphs); a value is
  refused rather than ignored, since the samples would not have it.  Other
  names: the value unchanged (`load_source` refuses the name).

  Raises:
    TrainingInputError: a value for "hotpotqa".
  """
  if name == "synthetic" and docs_per_question is None:
    return DEFAULT_DOCS_PER_QUESTION
  if name == "hotpotqa" and docs_per_question is not None:
    raise TrainingInputError(
        f"the hotpotqa source takes no docs_per_question (got "
        f"{docs_per_question}; --docs-per-question): each sample is a "
        "question with all its paragraphs (10 for nearly all), as the "
        "benchmark prompts it; docs_per_question applies to synthetic only")
  return docs_per_question


def load_source(name: str, *, seed: int = 1,
                docs_per_question: int | None = None,
                size: int = 100_000) -> DataSource:
  """A built-in data source by name ("synthetic" or "hotpotqa").

  Args:
    docs_per_question: the synthetic source's k (None: 4); the hotpotqa
      source refuses any value (`resolve_docs_per_question`).

  Raises:
    TrainingInputError: an unknown name, or docs_per_question for hotpotqa.
    DataUnavailableError: HotpotQA's loader (`lazyattn_jax.quality`) is not
      installed or failed.
  """
  docs_per_question = resolve_docs_per_question(name, docs_per_question)
  if name == "synthetic":
    return SyntheticFacts(size, docs_per_question, seed)
  if name == "hotpotqa":
    try:
      from lazyattn_jax.quality.datasets import load_hotpotqa
      from lazyattn_jax.quality.hotpotqa import build_items
    except ImportError as e:
      raise DataUnavailableError(
          "the hotpotqa source needs lazyattn_jax.quality.datasets."
          f"load_hotpotqa, which is not available here ({e})") from e
    try:
      # The benchmark's own prompt: all paragraphs in the dataset's order;
      # the train part shares no paragraph with a held-out prompt.
      items = build_items(load_hotpotqa(split="train"), "dataset")
    except (OSError, RuntimeError, ValueError) as e:
      raise DataUnavailableError(f"loading HotpotQA's train part failed: "
                                 f"{e}") from e
    return ListSource(list(items))
  raise TrainingInputError(f"unknown data source {name!r}; known: "
                           f"{', '.join(SOURCES)}")
