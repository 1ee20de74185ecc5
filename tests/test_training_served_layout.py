"""Fine-tuning trains the layout the engine then serves: `--preamble chat`
is the engine's preamble="chat" (no second chat-prefix document), layouts
the engine cannot serve are refused up front, and `from_pretrained` serves
an export in the layout it was trained for unless told otherwise
(lazyattn_jax/trained_quality.py, training/served_layout.py)."""

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

from lazyattn_jax import cli
from lazyattn_jax.errors import InvalidOptionError
from lazyattn_jax.quality_options import QualityOptions
from lazyattn_jax.requests import chat_prefix
from lazyattn_jax.sampling import SamplingParams
from lazyattn_jax.training.batch import Layout, make_batch
from lazyattn_jax.training.data import SyntheticFacts
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.examples import tokenize_sample
from lazyattn_jax.training.export import export_model
from lazyattn_jax.training.finetune import FinetuneConfig, finetune
from lazyattn_jax.training.model_io import from_model, load_trainable
from lazyattn_jax.training.optim import OptimizerConfig
from models.llama import Llama
from tests.training_helpers import (export_tiny_model, tiny_config,
                                    tiny_tokenizer)

SERVE = dict(num_pages=128, impl="xla", max_batch=1, progress=False)
# One step of the tiny model: short even where an option is taken that
# should have been refused.
TINY_RUN = ["--steps", "1", "--batch-size", "2", "--no-progress",
            "--docs-per-question", "2"]
ONE_STEP = dict(steps=1, batch_size=2, optimizer=OptimizerConfig(
    learning_rate=1e-3, warmup_steps=1))


def _engine(path, **settings):
  from lazyattn_jax import LazyEngine
  return LazyEngine.from_pretrained(str(path), **{**SERVE, **settings})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """The tiny model and tokenizer as a safetensors directory."""
  return export_tiny_model(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory, model_dir):
  """`lazyattn finetune --preamble chat`, one step."""
  out = tmp_path_factory.mktemp("chat_run")
  status = cli.main(["finetune", "--model", model_dir, "--out", str(out),
                     "--preamble", "chat", *TINY_RUN])
  assert status == 0
  return out


def test_preamble_chat_trains_what_preamble_chat_serves(chat_run):
  export = chat_run / "model"
  log = json.loads((chat_run / "log.json").read_text())
  layout = log["settings"]["config"]["layout"]
  tokenizer = tiny_tokenizer()
  assert layout["preamble_ids"] == chat_prefix(tokenizer)
  engine = _engine(export)
  # Served by default in the trained layout: the chat preamble, no
  # recompute (trained with --recompute-tokens 0).
  assert engine.quality == QualityOptions(preamble="chat")
  trainable = load_trainable(str(export), progress=False)
  trained = Layout(layout["preamble_len"], tuple(layout["preamble_ids"]),
                   layout["recompute_tokens"])
  sample = SyntheticFacts(8, 3, seed=1)[2]
  tokens = tokenize_sample(tokenizer, sample, trainable.config.vocab_size)
  served = np.asarray(engine.generate(
      sample.query, list(sample.documents), sampling=SamplingParams(
          max_new_tokens=1, temperature=0.0, stop_token_ids=())
  ).first_logits)
  student = lambda t: np.asarray(trainable.functions.answer_logits(
      trainable.params, make_batch([t], trained).arrays()["student"])[0, 0])
  np.testing.assert_allclose(student(tokens), served, atol=1e-4)
  # With the chat prefix also kept as a leading document (the former
  # --preamble-text layout) the logits differ: the check has teeth.
  twice = dataclasses.replace(tokens, leading=0)
  assert np.abs(student(twice) - served).max() > 1e-3


def test_preamble_text_is_refused_in_one_line(tmp_path, model_dir, capsys):
  status = cli.main(["finetune", "--model", model_dir, "--out",
                     str(tmp_path / "out"), "--preamble-text", "Read this.",
                     *TINY_RUN])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert err[0].startswith("lazyattn: error: --preamble-text was replaced "
                           "by --preamble chat: the engine serves no token "
                           "preamble but the chat template's prefix"), err
  assert not (tmp_path / "out").exists()


def test_the_chat_layout_is_the_engines_preamble():
  from lazyattn_jax.training.finetune_cli import _layout
  args = cli.build_parser().parse_args(
      ["finetune", "--out", "x", "--preamble", "chat",
       "--recompute-tokens", "16"])
  layout, sink = _layout(args, tiny_tokenizer(), 64)
  prefix = tuple(chat_prefix(tiny_tokenizer()))
  assert layout == Layout(len(prefix), prefix, 16) and sink is None


def test_unservable_layouts_are_refused_before_training(tmp_path, model_dir,
                                                       capsys):
  status = cli.main(["finetune", "--model", model_dir, "--out",
                     str(tmp_path / "out"), "--recompute-tokens", "8",
                     *TINY_RUN])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, err
  assert "--recompute-tokens 8 cannot be served" in err[0]
  assert "multiple of 16" in err[0]
  # 16 is the page size from_pretrained serves by default.
  from lazyattn_jax.trained_quality import SERVED_PAGE_SIZE
  assert _engine(model_dir).page_size == SERVED_PAGE_SIZE == 16
  trainable = from_model(Llama(tiny_config(), rngs=nnx.Rngs(0)),
                         tiny_tokenizer())
  source = SyntheticFacts(4, 2, seed=1)
  for layout, want in ((Layout(2, (7, 8)), "chat template's prefix"),
                       (Layout(0, None, 4), "multiple of 16")):
    with pytest.raises(TrainingInputError, match=want):
      finetune(trainable, source, FinetuneConfig(layout=layout, **ONE_STEP),
               tmp_path / "api", progress=False)
  assert not (tmp_path / "api").exists()


def _recipe_export(path, layout):
  """The tiny model exported with a fine-tuning recipe naming `layout`."""
  model = Llama(tiny_config(), rngs=nnx.Rngs(0))
  recipe = dict(config=dict(layout=dict(
      dict(preamble_len=0, preamble_ids=None, recompute_tokens=0), **layout)))
  return export_model(path, model.config, nnx.to_pure_dict(nnx.state(model)),
                      tiny_tokenizer(), metadata=dict(
                          lazyattn_finetune=json.dumps(recipe)))


def test_the_served_default_is_the_trained_recompute(tmp_path):
  none = _recipe_export(tmp_path / "k0", {})
  assert _engine(none).quality == QualityOptions()
  assert _engine(none, mode="block").quality == QualityOptions()
  k32 = _recipe_export(tmp_path / "k32", dict(recompute_tokens=32))
  served = _engine(k32).quality
  assert served.recompute and served.tokens_to_recompute(16) == 32
  assert _engine(k32, page_size=8).quality.tokens_to_recompute(8) == 32
  # Explicit quality wins, as options or fields.
  assert _engine(none, quality=QualityOptions(recompute=True)).quality == \
      QualityOptions(recompute=True)
  assert _engine(none, recompute=True).quality == QualityOptions(
      recompute=True)
  assert not _engine(k32, quality=None).quality.enabled
  assert not _engine(k32, recompute=False).quality.enabled
  assert not _engine(k32, mode="full").quality.enabled
  chat = _engine(k32, preamble="chat").quality
  assert chat.preamble == "chat" and chat.tokens_to_recompute(16) == 32
  # A page size that does not divide the trained k is refused, not
  # served with another k.
  with pytest.raises(InvalidOptionError, match="not a multiple"):
    _engine(k32, page_size=64)


def test_a_sink_trained_export_serves_its_sink(tmp_path):
  trainable = from_model(Llama(tiny_config(), rngs=nnx.Rngs(0)),
                         tiny_tokenizer())
  sink = np.random.default_rng(0).normal(size=(4, 64)).astype(np.float32)
  result = finetune(trainable, SyntheticFacts(4, 2, seed=1), FinetuneConfig(
      layout=Layout(4, None, 16), **ONE_STEP), tmp_path / "out", sink=sink,
                    progress=False)
  served = _engine(result.export_dir).quality
  assert served.preamble == "sink" and served.tokens_to_recompute(16) == 16
  np.testing.assert_array_equal(served.sink, sink)
  from lazyattn_jax.trained_quality import SINK_FILE
  from lazyattn_jax.training.sink_file import save_sink
  file = tmp_path / "out" / "model" / SINK_FILE
  save_sink(file, sink + 1)
  with pytest.raises(InvalidOptionError, match="not the sink"):
    _engine(result.export_dir)
  file.unlink()
  with pytest.raises(InvalidOptionError, match="does not hold.*sink="):
    _engine(result.export_dir)
  with pytest.raises(InvalidOptionError, match="does not hold"):
    _engine(result.export_dir, recompute=True)  # still no preamble named
  assert _engine(result.export_dir, quality=QualityOptions(
      preamble="sink", sink=sink)).quality.preamble == "sink"
  # The preamble named by field, as the message says (and `lazyattn rag
  # --sink FILE` does): the trained recompute stays.
  named = _engine(result.export_dir, sink=sink).quality
  assert named.preamble == "sink" and named.tokens_to_recompute(16) == 16
  np.testing.assert_array_equal(named.sink, sink)
  assert _engine(result.export_dir, preamble=None).quality == QualityOptions(
      recompute=True, recompute_tokens=16)


def test_exports_of_former_text_preambles_are_not_served_as_chat(tmp_path):
  path = _recipe_export(tmp_path / "text", dict(preamble_len=2,
                                                preamble_ids=[7, 8]))
  with pytest.raises(InvalidOptionError, match="not the chat template"):
    _engine(path)
  assert not _engine(path, quality=None).quality.enabled
  assert _engine(path, preamble="chat").quality == QualityOptions(
      preamble="chat")

