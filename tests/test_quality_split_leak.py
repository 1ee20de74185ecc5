"""HotpotQA's train part shares no paragraph with the held-out part
(lazyattn_jax/quality/datasets.py), and the held-out part is what every
published figure was measured on.

Questions share Wikipedia paragraphs, so a split by question id alone put
held-out evidence in training prompts (459 of the held-out questions' 3,126
gold paragraphs, 334 of them as a training question's own gold one).  The
rule is checked on a small HotpotQA-format file written here; the pins run
on the real dev set (fetched into the user cache on first use; skipped when
it cannot be had).
"""

import hashlib
import json

import pytest

from lazyattn_jax.quality import datasets as ds

# The held-out part as every figure in benchmarks/RESULTS.md measured it:
# its size and the sha256 of its ids, in order, one a line (computed before
# the train part's exclusion was added; it must never change).
EVAL_SIZE = 1563
EVAL_IDS_SHA256 = (
    "d8715b32ef8022e9cc5125496e944cae2c6198bae99fddfd1b955b63c8323435")
# The train part: the 5,842 questions the ids name "train", less the 1,489
# whose prompt shares a paragraph (title or body) with a held-out prompt.
TRAIN_SIZE = 4353
TRAIN_IDS_SHA256 = (
    "82f301e71b55df6253e35623e5c6547ecb2341cd3e86337d82648aeb27bbf2af")
# The 1,489 left out of train: a second set never trained on.
EXCLUDED_SIZE = 1489
EXCLUDED_IDS_SHA256 = (
    "db5b2fd940449b428e738b40b86d1ed7f82afce4bff924ceb24354a681a2e174")


def _ids_sha256(examples) -> str:
  return hashlib.sha256("\n".join(e.id for e in examples).encode()).hexdigest()


def _keys(examples) -> set:
  """Every paragraph's identities in these prompts: its title and its
  sentences (as `ds.paragraph_keys` has them; spelled out here so the test
  does not lean on the code it checks)."""
  body = lambda p: " ".join(x.strip() for x in p.sentences if x.strip())
  return {key for e in examples for p in e.paragraphs
          for key in (("title", p.title), ("body", body(p)))}


def _question(qid, paragraphs, gold=(0, 1)):
  context = [[title, [text]] for title, text in paragraphs]
  return dict(_id=qid, question=f"Question {qid}?", answer="a", type="bridge",
              level="hard", context=context,
              supporting_facts=[[paragraphs[i][0], 0] for i in gold])


def _ids_in(part: str, count: int) -> list[str]:
  return [i for i in (f"q{n}" for n in range(200))
          if ds.split_of(i) == part][:count]


def test_train_leaves_out_questions_sharing_a_held_out_paragraph(tmp_path):
  (held,) = _ids_in("eval", 1)
  gold_share, distractor_share, title_share, text_share, clean, clean2 = (
      _ids_in("train", 6))
  raw = [
      _question(held, [("Gold A", "A is a city."), ("Gold B", "B is a river."),
                       ("Other", "Other is a hill."),
                       ("Edited", "Edited was born in 1900.")]),
      # The held-out question's gold paragraph, as a distractor here.
      _question(gold_share, [("Own 1", "x."), ("Own 2", "y."),
                             ("Gold A", "A is a city.")]),
      # Its distractor, as this question's gold paragraph.
      _question(distractor_share, [("Other", "Other is a hill."),
                                   ("Own 3", "z.")]),
      # The same title with a slightly edited text (as 54 titles in the
      # real set have): still the same paragraph.
      _question(title_share, [("Own 4", "u."),
                              ("Edited", "Edited was born in 1901.")]),
      # The same sentences under another title.
      _question(text_share, [("Own 5", "v."),
                             ("Gold B (river)", "B is a river.")]),
      _question(clean, [("Own 6", "w."), ("Own 7", "t.")]),
      _question(clean2, [("Own 8", "s."), ("Own 9", "r.")]),
  ]
  path = tmp_path / "shared.json"
  path.write_text(json.dumps(raw))
  train = ds.load_hotpotqa("train", path=path)
  held_out = ds.load_hotpotqa("eval", path=path)
  assert [e.id for e in held_out] == [held]
  assert [e.id for e in train] == sorted([clean, clean2], key=ds.split_key)
  assert not _keys(train) & _keys(held_out)
  excluded = ds.load_hotpotqa("excluded", path=path)
  assert [e.id for e in excluded] == sorted(
      [gold_share, distractor_share, title_share, text_share],
      key=ds.split_key)
  assert len(ds.load_hotpotqa("all", path=path)) == len(raw)
  # The quality benchmark asks either part.
  from benchmarks.rag_quality import build_parser, hotpotqa_items
  for split, want in (("eval", held_out), ("excluded", excluded)):
    args = build_parser().parse_args(
        ["--dataset", "hotpotqa", "--hotpotqa-json", str(path), "--split",
         split, "--no-progress"])
    items, info = hotpotqa_items(args)
    assert [i.example_id for i in items] == [e.id for e in want]
    assert info["split"] == split and info["split_questions"] == len(want)
  # The same answer whatever the file's order.
  path.write_text(json.dumps(raw[::-1]))
  assert [e.id for e in ds.load_hotpotqa("train", path=path)] == [
      e.id for e in train]


@pytest.fixture(scope="module")
def real_parts():
  try:
    path = ds.hotpotqa_path(progress=False)
  except ds.DatasetUnavailableError as e:
    pytest.skip(f"the HotpotQA dev set is not available here: {e}")
  return (ds.load_hotpotqa("eval", path=path),
          ds.load_hotpotqa("train", path=path),
          ds.load_hotpotqa("all", path=path),
          ds.load_hotpotqa("excluded", path=path))


def test_the_held_out_part_is_unchanged(real_parts):
  held_out, _, every, _ = real_parts
  assert len(held_out) == EVAL_SIZE
  assert _ids_sha256(held_out) == EVAL_IDS_SHA256
  assert len(every) == 7405


def test_no_train_paragraph_is_in_a_held_out_prompt(real_parts):
  held_out, train, every, _ = real_parts
  assert not _keys(train) & _keys(held_out)
  # The texts the model reads, too.
  texts = lambda xs: {p.text for e in xs for p in e.paragraphs}
  assert not texts(train) & texts(held_out)
  # Only questions the ids name "train", in split-digest order.
  assert all(ds.split_of(e.id) == "train" for e in train)
  assert [e.id for e in train] == sorted((e.id for e in train),
                                         key=ds.split_key)
  named_train = [e for e in every if ds.split_of(e.id) == "train"]
  assert len(named_train) == 5842


def test_the_train_part_is_pinned(real_parts):
  _, train, _, _ = real_parts
  assert len(train) == TRAIN_SIZE
  assert _ids_sha256(train) == TRAIN_IDS_SHA256


def test_the_excluded_part_is_the_rest_of_train_and_pinned(real_parts):
  held_out, train, every, excluded = real_parts
  assert len(excluded) == EXCLUDED_SIZE
  assert _ids_sha256(excluded) == EXCLUDED_IDS_SHA256
  # Each shares a paragraph with a held-out prompt; none is trained on.
  held_keys = _keys(held_out)
  assert all(_keys([e]) & held_keys for e in excluded)
  ids = lambda xs: {e.id for e in xs}
  assert not ids(excluded) & (ids(train) | ids(held_out))
  assert ids(excluded) | ids(train) == {
      e.id for e in every if ds.split_of(e.id) == "train"}
