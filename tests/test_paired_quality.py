"""benchmarks/paired_quality: item-by-item comparison of two quality runs."""

import json
import math

import numpy as np
import pytest

from benchmarks import paired_quality
from benchmarks.paired_quality import compare, item_scores, sign_test_p


def test_sign_test_matches_the_binomial():
  assert sign_test_p(0, 0) == 1.0
  assert sign_test_p(5, 5) == 1.0
  assert sign_test_p(0, 6) == pytest.approx(2 / 64)  # 2 * 0.5^6
  # 11 against 3: 2 * P(X <= 3), X ~ Binomial(14, 1/2).
  assert sign_test_p(11, 3) == pytest.approx(2 * (1 + 14 + 91 + 364) / 2**14)
  assert sign_test_p(3, 11) == sign_test_p(11, 3)


def _two_sided_binomial_p(k: int, n: int) -> float:
  """The reference: scipy's exact binomial test where installed, else the
  same sum in fractions, term by term from math.comb."""
  try:
    from scipy.stats import binomtest
  except ImportError:
    from fractions import Fraction
    low = min(k, n - k)
    tail = sum(Fraction(math.comb(n, i), 2 ** n) for i in range(low + 1))
    return float(min(Fraction(1), 2 * tail))
  return float(binomtest(k, n, 0.5, alternative="two-sided").pvalue)


@pytest.mark.parametrize("wins_a, wins_b", [
    (520, 520), (600, 500), (500, 523), (523, 500), (5000, 5200),
    (0, 1024), (1, 1100), (7700, 7930), (100, 60)])
def test_sign_test_has_no_limit_on_the_items(wins_a, wins_b):
  """Past 1023 discordant items 2.0 ** n overflowed (OverflowError)."""
  p = sign_test_p(wins_a, wins_b)
  expected = _two_sided_binomial_p(wins_a, wins_a + wins_b)
  assert p == pytest.approx(expected, rel=1e-9, abs=1e-300)
  assert sign_test_p(wins_b, wins_a) == p


def test_sign_test_known_values_for_many_items():
  assert sign_test_p(520, 520) == 1.0
  assert sign_test_p(600, 500) == pytest.approx(0.0028195449914, rel=1e-9)
  # compare() on 2,000 binary items, 1,100 of them discordant.
  a = np.r_[np.ones(600), np.zeros(500), np.zeros(900)]
  b = np.r_[np.zeros(600), np.ones(500), np.zeros(900)]
  row = compare(a, b, resamples=100)
  assert (row["only_a"], row["only_b"]) == (600, 500)
  assert row["sign_test_p"] == sign_test_p(600, 500)


def test_compare_counts_discordant_items_and_brackets_the_difference():
  a = np.array([1, 1, 1, 0, 0, 1, 0, 1] * 10, float)
  b = np.array([1, 0, 1, 0, 1, 0, 0, 1] * 10, float)
  row = compare(a, b)
  assert (row["only_a"], row["only_b"]) == (20, 10)
  assert row["diff"] == pytest.approx(-10 / 80)
  low, high = row["diff_ci95"]
  assert low < row["diff"] < high
  assert row["sign_test_p"] == pytest.approx(sign_test_p(20, 10))
  # A real score (F1) gets the interval but no sign test.
  f1 = compare(a * 0.5, b * 0.7)
  assert "sign_test_p" not in f1 and f1["diff"] == pytest.approx(
      b.mean() * 0.7 - a.mean() * 0.5)


def test_compare_refuses_unpaired_scores():
  with pytest.raises(ValueError, match="equal, non-empty"):
    compare(np.ones(3), np.ones(4))


def _report(tmp_path):
  predictions = lambda texts: [dict(id=i, position=0, answer="Paris",
                                    text=t) for i, t in enumerate(texts)]
  report = dict(runs=[
      dict(label="base", predictions=predictions(
          ["Paris.", "It is Paris", "London", "paris"])),
      dict(label="fp8", predictions=predictions(
          ["Paris", "London", "London", "Paris"])),
      dict(label="no predictions")])
  path = tmp_path / "q.json"
  path.write_text(json.dumps(report))
  return path, report


def test_item_scores_from_saved_predictions(tmp_path):
  _, report = _report(tmp_path)
  base = report["runs"][0]
  assert item_scores(base, "accuracy").tolist() == [1, 1, 0, 1]
  assert item_scores(base, "em").tolist() == [1, 0, 0, 1]
  with pytest.raises(ValueError, match="--save-predictions"):
    item_scores(report["runs"][2], "contained")


def test_cli_writes_each_comparison(tmp_path, capsys):
  path, _ = _report(tmp_path)
  out = tmp_path / "cmp.json"
  rows = paired_quality.main([str(path), "--compare", "base", "fp8",
                              "--metric", "accuracy", "--out", str(out)])
  assert rows[0]["only_a"] == 1 and rows[0]["only_b"] == 0
  assert json.loads(out.read_text())["comparisons"][0]["b"] == "fp8"
  assert "sign test p 1.000" in capsys.readouterr().out
  with pytest.raises(SystemExit):
    paired_quality.main([str(path), "--compare", "base", "nope"])
  assert "no run labelled 'nope'" in capsys.readouterr().err


def _pairing_refused(tmp_path, capsys, runs, message):
  path = tmp_path / "r.json"
  path.write_text(json.dumps(dict(runs=runs)))
  with pytest.raises(SystemExit) as exit_info:
    paired_quality.main([str(path), "--compare", "a", "b"])
  assert exit_info.value.code == 2
  err = capsys.readouterr().err
  assert message in err.strip().splitlines()[-1] and "Traceback" not in err


def _item(qid, text="Paris", position=0, answer="Paris", **more):
  return dict(id=qid, position=position, answer=answer, text=text, **more)


def _bare(answer, text="x"):
  """A prediction without id and position (a report from another tool)."""
  return dict(answer=answer, text=text)


@pytest.mark.parametrize("runs, message", [
    ([dict(label="a", mode="lazy"), dict(label="b", mode="full")],
     "run 'a' has no predictions (run rag_quality with --save-predictions)"),
    ([dict(label="a", predictions=[]), dict(label="b", predictions=[])],
     "run 'a' has no items in its predictions"),
    ([dict(label="a", predictions=[_item("1"), _item("2")]),
      dict(label="b", predictions=[_item("1")])],
     "runs 'a' and 'b' answered 2 and 1 items"),
    ([dict(label="a", predictions=[_item("1"), _item("2")]),
      dict(label="b", predictions=[_item("1"), _item("8")])],
     "item 1 differs: run 'a' has question '2' (position 0), run 'b' has "
     "'8'"),
    ([dict(label="a", predictions=[_item("1", position=0)]),
      dict(label="b", predictions=[_item("1", position=3)])],
     "item 0 differs"),
    # The gold answer is compared too: the same ids with other answers are
    # other items (another data set, another split).
    ([dict(label="a", predictions=[_item("1"), _item("2", answer="Rome")]),
      dict(label="b", predictions=[_item("1"), _item("2", answer="Oslo")])],
     "item 1 differs: run 'a' has gold answer 'Rome' (question '2'), run "
     "'b' has 'Oslo'"),
    # Without ids and positions the order was never checked.
    ([dict(label="a", predictions=[_bare("Paris"), _bare("Rome")]),
      dict(label="b", predictions=[_bare("Rome"), _bare("Paris")])],
     "item 0 differs: run 'a' has gold answer 'Paris', run 'b' has 'Rome'"),
    ([dict(label="a", predictions=[_item("1", answers=["Paris", "paris"])]),
      dict(label="b", predictions=[_item("1", answers=["Paris"])])],
     "item 0 differs: run 'a' has gold answers ['Paris', 'paris']"),
    ([dict(label="a", predictions=[_item("1", question="Where?")]),
      dict(label="b", predictions=[_item("1", question="When?")])],
     "item 0 differs: run 'a' has question text 'Where?'"),
    ([dict(label="a", predictions=[_item("1", question="Where?")]),
      dict(label="b", predictions=[_item("1")])],
     "run 'b' has none"),
    ([dict(label="a", predictions=[_item("1")]),
      dict(label="b", predictions=[dict(id="1", position=0, text="x")])],
     "item 0 of run 'b' has no answer: not a saved prediction"),
])
def test_unpaired_runs_are_one_line_errors(tmp_path, capsys, runs, message):
  _pairing_refused(tmp_path, capsys, runs, message)


def test_paired_runs_still_compare(tmp_path):
  path = tmp_path / "r.json"
  path.write_text(json.dumps(dict(runs=[
      dict(label="a", predictions=[_item("1"), _item("2", "x")]),
      dict(label="b", predictions=[_item("1", "x"), _item("2")])])))
  rows = paired_quality.main([str(path), "--compare", "a", "b", "--metric",
                              "accuracy"])
  assert rows[0]["items"] == 2 and rows[0]["diff"] == 0.0


def test_paired_runs_without_ids_compare_by_their_answers(tmp_path):
  path = tmp_path / "r.json"
  path.write_text(json.dumps(dict(runs=[
      dict(label="a", predictions=[_bare("Paris", "Paris"), _bare("Rome")]),
      dict(label="b", predictions=[_bare("Paris"), _bare("Rome", "Rome")])])))
  rows = paired_quality.main([str(path), "--compare", "a", "b", "--metric",
                              "accuracy"])
  assert (rows[0]["only_a"], rows[0]["only_b"]) == (1, 1)


def test_items_of_one_question_are_resampled_together():
  # Nine items per question (the gold-sweep layout) were resampled one by
  # one, as if independent, which narrows the interval.
  rng = np.random.default_rng(3)
  per_question = rng.integers(0, 2, 40).astype(float)
  a = np.repeat(per_question, 9)  # a question's items agree
  b = np.repeat(np.roll(per_question, 1), 9)
  questions = np.repeat(np.arange(40), 9)
  items = compare(a, b)
  clustered = compare(a, b, questions=questions)
  assert (items["resampled"], clustered["resampled"]) == ("items",
                                                          "questions")
  assert clustered["questions"] == 40
  assert clustered["diff"] == items["diff"]
  # Resampling 40 questions is resampling 40 items: the same interval.
  alone = compare(per_question, np.roll(per_question, 1))
  assert clustered["diff_ci95"] == pytest.approx(alone["diff_ci95"])
  width = lambda row: row["diff_ci95"][1] - row["diff_ci95"][0]
  assert width(clustered) > 2 * width(items)
  # One item per question: the draws of the item bootstrap, unchanged.
  assert compare(a, b, questions=np.arange(a.size)) == items


def _write(tmp_path, name, runs):
  path = tmp_path / name
  path.write_text(json.dumps(dict(runs=runs)))
  return str(path)


def test_reports_pool_item_by_item(tmp_path):
  # Two sets of questions, each run in its own report: pooled, the counts
  # and the difference are those of all the items together.
  first = _write(tmp_path, "eval.json", [
      dict(label="a", predictions=[_item("1"), _item("2", "x")]),
      dict(label="b", predictions=[_item("1"), _item("2")]),
      dict(label="only here", predictions=[_item("1"), _item("2")])])
  second = _write(tmp_path, "excluded.json", [
      dict(label="b", predictions=[_item("3"), _item("4"), _item("5", "x")]),
      dict(label="a", predictions=[_item("3", "x"), _item("4", "x"),
                                   _item("5", "x")])])
  out = tmp_path / "cmp.json"
  (row,) = paired_quality.main([first, second, "--compare", "a", "b",
                                "--metric", "accuracy", "--out", str(out)])
  assert row["items"] == 5
  assert (row["only_a"], row["only_b"]) == (0, 3)
  assert row["mean_a"] == pytest.approx(1 / 5)
  assert row["diff"] == pytest.approx(3 / 5)
  assert json.loads(out.read_text())["report"] == [first, second]
  runs = paired_quality.pooled_runs(
      [(first, json.loads(open(first).read())),
       (second, json.loads(open(second).read()))])
  assert list(runs) == ["a", "b"]  # a label missing from one is dropped


def test_pooling_refuses_an_item_twice_and_a_missing_label(tmp_path, capsys):
  run = lambda label: dict(label=label, predictions=[_item("1"), _item("2")])
  first = _write(tmp_path, "one.json", [run("a"), run("b")])
  again = _write(tmp_path, "again.json", [run("a"), run("b")])
  with pytest.raises(SystemExit) as info:
    paired_quality.main([first, again, "--compare", "a", "b"])
  assert info.value.code == 2
  assert ("question '1' (position 0) of run 'a' is in both "
          f"{first} and {again}: pooling would count it twice"
          in capsys.readouterr().err)
  other = _write(tmp_path, "other.json", [
      dict(label="a", predictions=[_item("3")])])
  with pytest.raises(SystemExit):
    paired_quality.main([first, other, "--compare", "a", "b"])
  assert (f"no run labelled 'b' in {other}; runs: ['a']"
          in capsys.readouterr().err)
  # One report given twice counted every item twice.
  with pytest.raises(SystemExit):
    paired_quality.main([first, first, "--compare", "a", "b"])
  assert (f"question '1' (position 0) of run 'a' is in {first}, given twice"
          in capsys.readouterr().err)


def _hotpot(tmp_path, name, runs, **fields):
  report = dict(dataset="hotpotqa", layout="dataset", model="m", runs=runs)
  report.update(fields)
  path = tmp_path / name
  path.write_text(json.dumps(report))
  return str(path)


@pytest.mark.parametrize("fields, message", [
    (dict(layout="gold-sweep"), "the reports differ in layout ("),
    (dict(dataset="synthetic"), "the reports differ in dataset ("),
])
def test_pooling_refuses_items_of_another_kind(tmp_path, capsys, fields,
                                               message):
  run = lambda label, qid: dict(label=label, predictions=[_item(qid)])
  first = _hotpot(tmp_path, "one.json", [run("a", "1"), run("b", "1")])
  second = _hotpot(tmp_path, "two.json", [run("a", "2"), run("b", "2")],
                   **fields)
  with pytest.raises(SystemExit):
    paired_quality.main([first, second, "--compare", "a", "b"])
  assert message in capsys.readouterr().err


def test_synthetic_reports_do_not_pool(tmp_path, capsys):
  # Their ids are "0".."N-1" in every report: one id, two questions.
  run = lambda label, qid: dict(label=label, predictions=[_item(qid)])
  paths = [_hotpot(tmp_path, f"s{n}.json", [run("a", str(n)),
                                            run("b", str(n))],
                   dataset="synthetic") for n in range(2)]
  with pytest.raises(SystemExit):
    paired_quality.main(paths + ["--compare", "a", "b"])
  assert "synthetic reports do not pool" in capsys.readouterr().err


def test_pooling_names_the_report_without_predictions(tmp_path, capsys):
  first = _hotpot(tmp_path, "one.json", [
      dict(label="a", predictions=[_item("1")]),
      dict(label="b", predictions=[_item("1")])])
  second = _hotpot(tmp_path, "two.json", [
      dict(label="a", mode="lazy"), dict(label="b", predictions=[_item("2")])])
  with pytest.raises(SystemExit):
    paired_quality.main([first, second, "--compare", "a", "b"])
  assert f"run 'a' has no predictions in {second}" in capsys.readouterr().err


def test_pooling_warns_of_settings_that_differ(tmp_path, capsys):
  run = lambda label, qid, options: dict(
      label=label, mode="lazy", options=options, contained=0.5,
      predictions=[_item(qid)])
  first = _hotpot(tmp_path, "one.json", [run("a", "1", {"sink": "x"}),
                                         run("b", "1", {})])
  second = _hotpot(tmp_path, "two.json", [run("a", "2", {"sink": "y"}),
                                          run("b", "2", {})], model="other")
  paired_quality.main([first, second, "--compare", "a", "b"])
  err = capsys.readouterr().err
  assert "warning: pooling reports of different models" in err
  assert (f"warning: run 'a' pooled with different options: {first}: "
          f"{{'sink': 'x'}}; {second}: {{'sink': 'y'}}") in err
  assert "run 'b' pooled" not in err
  runs = paired_quality.pooled_runs([
      (first, json.loads(open(first).read())),
      (second, json.loads(open(second).read()))])
  # A pooled run keeps no one report's scores beside the pooled items.
  assert set(runs["a"]) == {"label", "predictions"}


@pytest.mark.parametrize("content, message", [
    (None, "No such file or directory"),
    ("not json", "is not a JSON report"),
    (json.dumps({"comparisons": []}), "is not a rag_quality report"),
    (json.dumps({"runs": [{"mode": "lazy"}]}), "is not a rag_quality report"),
])
def test_unreadable_reports_are_usage_errors(tmp_path, capsys, content,
                                             message):
  path = tmp_path / "r.json"
  if content is not None:
    path.write_text(content)
  with pytest.raises(SystemExit) as info:
    paired_quality.main([str(path), "--compare", "a", "b"])
  assert info.value.code == 2
  err = capsys.readouterr().err
  assert message in err and "Traceback" not in err
