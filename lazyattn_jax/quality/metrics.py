"""Answer scoring as in the SQuAD and HotpotQA evaluation scripts.

Written from their specification:

- normalization: lowercase; drop every ASCII punctuation character
  (`string.punctuation`); drop the articles "a", "an", "the" as whole words;
  collapse whitespace;
- exact match: the normalized prediction equals the normalized gold answer;
- F1: over the multisets of normalized whitespace tokens (shared tokens
  counted with multiplicity; precision over the prediction's tokens, recall
  over the gold's).  As in HotpotQA, when either side normalizes to "yes",
  "no" or "noanswer" and the two differ, F1 is 0 (no partial credit for
  "no" against "no way");
- answer contained (not in the official scripts, common in RAG papers and
  here because a small chat model rarely answers in exactly the gold's
  words): the gold's normalized tokens appear as a contiguous run in the
  prediction's normalized tokens (so gold "no" is not found in "not now").

`answer_text` chooses what is scored from a generation: its first non-empty
line, since the prompt asks for the answer alone and anything after the
first line is commentary.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import string
from collections.abc import Iterable, Sequence

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL_ANSWERS = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
  """Lowercase, no punctuation, no articles, single spaces (SQuAD's order)."""
  text = text.lower()
  text = "".join(ch for ch in text if ch not in _PUNCTUATION)
  text = _ARTICLES.sub(" ", text)
  return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
  """1.0 when the normalized strings are equal, else 0.0."""
  return float(normalize_answer(prediction) == normalize_answer(gold))


def f1_score(prediction: str, gold: str) -> float:
  """Token F1 of the normalized strings, with HotpotQA's yes/no rule."""
  pred, ref = normalize_answer(prediction), normalize_answer(gold)
  if (pred in _SPECIAL_ANSWERS or ref in _SPECIAL_ANSWERS) and pred != ref:
    return 0.0
  pred_tokens, ref_tokens = pred.split(), ref.split()
  common = collections.Counter(pred_tokens) & collections.Counter(ref_tokens)
  same = sum(common.values())
  if same == 0:
    return 0.0
  precision = same / len(pred_tokens)
  recall = same / len(ref_tokens)
  return 2 * precision * recall / (precision + recall)


def answer_contained(prediction: str, gold: str) -> float:
  """1.0 when the gold's normalized tokens occur, contiguously, among the
  prediction's; 0.0 otherwise (and for a gold that normalizes to nothing)."""
  ref = normalize_answer(gold).split()
  pred = normalize_answer(prediction).split()
  if not ref:
    return 0.0
  return float(any(pred[i:i + len(ref)] == ref
                   for i in range(len(pred) - len(ref) + 1)))


def mentions_answer(generated: str, gold: str) -> bool:
  """The synthetic set's original criterion: the gold answer anywhere in
  the whole generation, case-insensitive."""
  return gold.lower() in generated.lower()


def answer_text(generated: str) -> str:
  """The part of a generation that is scored: its first non-empty line."""
  for line in generated.splitlines():
    if line.strip():
      return line.strip()
  return ""


@dataclasses.dataclass(frozen=True)
class Score:
  """The three metrics of one answer."""
  em: float
  f1: float
  contained: float


def score(generated: str, gold: str) -> Score:
  """Scores a generation (its `answer_text`) against the gold answer."""
  answer = answer_text(generated)
  return Score(exact_match(answer, gold), f1_score(answer, gold),
               answer_contained(answer, gold))


def summarize(scores: Sequence[Score]) -> dict:
  """Means of each metric over `scores`, and their count."""
  n = len(scores)
  return dict(
      n=n,
      em=sum(s.em for s in scores) / n if n else 0.0,
      f1=sum(s.f1 for s in scores) / n if n else 0.0,
      contained=sum(s.contained for s in scores) / n if n else 0.0)


def summarize_by(scores: Sequence[Score], keys: Iterable) -> dict:
  """`summarize` per key (e.g. the gold position), keys in sorted order."""
  groups: dict = {}
  for s, key in zip(scores, keys, strict=True):
    groups.setdefault(key, []).append(s)
  return {str(k): summarize(groups[k]) for k in sorted(groups)}
