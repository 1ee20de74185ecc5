"""The answer metrics against hand-worked cases (SQuAD/HotpotQA rules)."""

import pytest

from lazyattn_jax.quality import metrics as m


@pytest.mark.parametrize("text, expected", [
    ("The  Quick, brown fox!", "quick brown fox"),
    ("an apple a day", "apple day"),
    ("Theater and Anathema", "theater and anathema"),  # articles: whole words
    ("A.B.C.", "abc"),
    ("Ed Wood's", "ed woods"),
    # Punctuation goes before articles: "the-end" is one word by then, and
    # "a.m." is "am" (articles first would give "end" and "m").
    ("the-end", "theend"),
    ("a.m.", "am"),
    ("  \t\nTHE\n", ""),
    ("café – 1,000", "café – 1000"),  # only ASCII punctuation is dropped
])
def test_normalize(text, expected):
  assert m.normalize_answer(text) == expected


def test_exact_match():
  assert m.exact_match("the Eiffel Tower.", "Eiffel Tower") == 1.0
  assert m.exact_match("EIFFEL  tower", "the eiffel tower") == 1.0
  assert m.exact_match("Eiffel", "Eiffel Tower") == 0.0
  assert m.exact_match("1,000", "1000") == 1.0
  assert m.exact_match("1 000", "1000") == 0.0


def test_f1_token_overlap():
  assert m.f1_score("Barack Obama", "Barack Obama") == 1.0
  # precision 2/3, recall 1: 2pr/(p+r) = 0.8
  assert m.f1_score("Barack Obama president", "Barack Obama") == pytest.approx(0.8)
  # shared tokens count with multiplicity: "cat cat" vs "cat" -> p 1/2, r 1
  assert m.f1_score("the cat, the cat", "cat") == pytest.approx(2 / 3)
  assert m.f1_score("cat", "cat cat") == pytest.approx(2 / 3)
  assert m.f1_score("dog", "cat") == 0.0
  assert m.f1_score("", "cat") == 0.0
  assert m.f1_score("The", "cat") == 0.0  # normalizes to nothing


def test_f1_yes_no_rule():
  assert m.f1_score("Yes.", "yes") == 1.0
  # Plain token F1 would give 2/3 and 1/2; HotpotQA gives no partial credit
  # when either side is yes / no / noanswer and they differ.
  assert m.f1_score("no", "no way") == 0.0
  assert m.f1_score("yes it is", "yes") == 0.0
  assert m.f1_score("noanswer", "no answer") == 0.0
  assert m.f1_score("no", "yes") == 0.0


def test_answer_contained():
  assert m.answer_contained("It was The Beatles.", "the Beatles") == 1.0
  assert m.answer_contained("not now", "no") == 0.0  # whole tokens only
  assert m.answer_contained("York New", "New York") == 0.0  # contiguous
  assert m.answer_contained("in New York City", "new york") == 1.0
  assert m.answer_contained("anything", "The") == 0.0  # empty gold
  assert m.answer_contained("", "cat") == 0.0


def test_answer_text_is_the_first_nonempty_line():
  assert m.answer_text("\n  Paris \nbecause it is the capital") == "Paris"
  assert m.answer_text("") == ""
  s = m.score("\nThe Eiffel Tower\nIt is in Paris.", "Eiffel Tower")
  assert (s.em, s.f1, s.contained) == (1.0, 1.0, 1.0)
  s = m.score("I think the Eiffel Tower", "Eiffel Tower")
  assert s.em == 0.0 and s.contained == 1.0
  assert s.f1 == pytest.approx(2 * (2 / 4) / (2 / 4 + 1))


def test_summaries():
  scores = [m.Score(1, 1, 1), m.Score(0, 0.5, 1), m.Score(0, 0, 0)]
  total = m.summarize(scores)
  assert total["n"] == 3
  assert total["em"] == pytest.approx(1 / 3)
  assert total["f1"] == pytest.approx(0.5)
  assert total["contained"] == pytest.approx(2 / 3)
  by = m.summarize_by(scores, [10, 2, 10])
  assert list(by) == ["2", "10"]  # numeric order, string keys for JSON
  assert by["10"]["n"] == 2 and by["10"]["f1"] == pytest.approx(0.5)
  assert m.summarize([]) == dict(n=0, em=0.0, f1=0.0, contained=0.0)


def test_mentions_answer_is_case_insensitive_anywhere_in_the_text():
  from lazyattn_jax.quality.metrics import mentions_answer
  assert mentions_answer("First line.\nIt is PARIS, of course.", "Paris")
  assert not mentions_answer("London", "Paris")
