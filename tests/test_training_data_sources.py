"""The built-in training sources' docs_per_question (training/data.py) and
the HotpotQA source's questions.

The hotpotqa source gives every paragraph of a question (10 for nearly
all), as the benchmark prompts it; it used to take docs_per_question and
ignore it, so the shipped sink's log says 4 where it trained on 10.  Now a
value is refused in one line, and the commands' default (no value) keeps
training on what it always did.

Names added with the fix (resolve_docs_per_question,
DEFAULT_DOCS_PER_QUESTION) are looked up inside the tests, so each test
fails on its own without it.
"""

import json

import pytest

from lazyattn_jax import cli
from lazyattn_jax.quality import datasets
from lazyattn_jax.training import data
from lazyattn_jax.training.data import SyntheticFacts, load_source
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.sink import main as sink_main
from tests.test_training_cli import model_dir  # noqa: F401 - the fixture


def _raw(num_questions=3, paragraphs=10):
  return [{"_id": f"q{n}", "question": f"Where is place {n}?",
           "answer": f"land {n}", "type": "bridge", "level": "hard",
           "supporting_facts": [[f"Place {n}-0", 0], [f"Place {n}-1", 0]],
           "context": [[f"Place {n}-{j}", [f"Place {n}-{j} is in land {j}."]]
                       for j in range(paragraphs)]}
          for n in range(num_questions)]


@pytest.fixture
def fake_train_part(monkeypatch):
  """load_hotpotqa returns three 10-paragraph questions (no real data)."""
  def load(split="eval", **_):
    if split != "train":
      raise AssertionError(f"the training source asked for {split!r}")
    return datasets.parse_hotpotqa(_raw())
  monkeypatch.setattr(datasets, "load_hotpotqa", load)


def test_hotpotqa_refuses_docs_per_question_and_keeps_every_paragraph(
    fake_train_part):
  for k in (2, 4, 10):
    with pytest.raises(TrainingInputError, match="takes no docs_per_question"):
      load_source("hotpotqa", docs_per_question=k)
  source = load_source("hotpotqa")
  assert len(source) == 3
  assert all(len(source[i].documents) == 10 for i in range(3))
  assert data.resolve_docs_per_question("hotpotqa", None) is None


def test_synthetic_keeps_its_default_of_four():
  assert load_source("synthetic").k == 4
  assert load_source("synthetic", docs_per_question=2).k == 2
  assert len(load_source("synthetic")[0].documents) == 4
  assert isinstance(load_source("synthetic", size=8), SyntheticFacts)
  assert data.DEFAULT_DOCS_PER_QUESTION == 4
  assert data.resolve_docs_per_question("synthetic", None) == 4


def test_the_commands_refuse_docs_per_question_for_hotpotqa(tmp_path, capsys):
  # Refused before the (missing) model is looked for or --out is made.
  args = ["--data", "hotpotqa", "--docs-per-question", "4", "--model",
          str(tmp_path / "nope"), "--no-progress"]
  assert cli.main(["finetune", "--out", str(tmp_path / "ft"), *args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "takes no docs_per_question" in err[0], err
  assert sink_main(["--out", str(tmp_path / "sink"), *args]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "takes no docs_per_question" in err[0], err
  assert not (tmp_path / "ft").exists() and not (tmp_path / "sink").exists()


def test_the_default_command_trains_on_hotpotqa_as_before(
    tmp_path, model_dir, fake_train_part, capsys):
  """No --docs-per-question: hotpotqa runs, and the recipe records what
  the source does (none for hotpotqa, 4 for synthetic, as before)."""
  for name, expected in (("hotpotqa", None), ("synthetic", 4)):
    out = tmp_path / name
    assert cli.main(["finetune", "--model", model_dir, "--out", str(out),
                     "--data", name, "--steps", "2", "--batch-size", "2",
                     "--stop-at-step", "0", "--no-progress"]) == 0
    log = json.loads((out / "log.json").read_text())
    assert log["settings"]["data"]["docs_per_question"] == expected
    assert log["settings"]["data"]["name"] == name
  capsys.readouterr()


def test_the_real_hotpotqa_source_is_the_leak_free_train_part():
  try:
    datasets.hotpotqa_path(progress=False)
  except datasets.DatasetUnavailableError as e:
    pytest.skip(f"the HotpotQA dev set is not available here: {e}")
  source = load_source("hotpotqa")
  assert len(source) == 4353  # 5,842 before the held-out paragraphs left
  sizes = [len(source[i].documents) for i in range(len(source))]
  assert sizes.count(10) >= 0.99 * len(sizes)
