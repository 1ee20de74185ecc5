"""Faults of the training commands and their Python API: negative seeds,
an output path that cannot be written, resuming with another model,
non-finite values in the JSON log, and a time limit of zero.

The command-line cases that must fail before any work name a model that
does not exist: the expected error (not "model not found") shows the check
came first.  Names added with the fixes (errors.OutputPathError,
report.output_errors) are looked up inside the tests, so each test fails
on its own without its fix."""

import json
import math

import numpy as np
import pytest
from flax import nnx

from lazyattn_jax import cli
from lazyattn_jax.training import errors, order, report
from lazyattn_jax.training.data import SyntheticFacts
from lazyattn_jax.training.errors import TrainingInputError
from lazyattn_jax.training.export import export_model
from lazyattn_jax.training.finetune import FinetuneConfig, finetune
from lazyattn_jax.training.model_io import from_model
from lazyattn_jax.training.optim import OptimizerConfig
from lazyattn_jax.training.sink import SinkConfig, main as sink_main
from lazyattn_jax.training.sink import train_sink
from models.llama import Llama
from tests.test_training_cli import model_dir  # noqa: F401 - the fixture
from tests.training_helpers import tiny_config, tiny_tokenizer

CONFIG = FinetuneConfig(steps=2, batch_size=2, checkpoint_every=1,
                        optimizer=OptimizerConfig(learning_rate=1e-3,
                                                  warmup_steps=1))


def _trainable(**overrides):
  return from_model(Llama(tiny_config(**overrides), rngs=nnx.Rngs(0)),
                    tiny_tokenizer())


def _finetune_error(capsys, *args) -> str:
  """The one error line of `lazyattn finetune ARGS` (exit status 2)."""
  status = cli.main(["finetune", "--no-progress", *args])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, (status, err)
  assert err[0].startswith("lazyattn: error:"), err
  return err[0]


def _sink_error(capsys, *args) -> str:
  """The one error line of `python -m lazyattn_jax.training.sink ARGS`."""
  status = sink_main(["--no-progress", *args])
  err = capsys.readouterr().err.strip().splitlines()
  assert status == 2 and len(err) == 1, (status, err)
  assert err[0].startswith("sink: error:"), err
  return err[0]


def _strict_json(path):
  """json.load that refuses NaN and Infinity, as jq or JavaScript do."""
  def refuse(constant):
    raise ValueError(f"not JSON: {constant}")
  with open(path, encoding="utf-8") as f:
    return json.load(f, parse_constant=refuse)


# Bug 1: negative seeds.

def test_a_negative_seed_gives_its_own_fixed_order():
  first = order.sample_indices(-1, 3, 4, 10)
  assert first == order.sample_indices(-1, 3, 4, 10)
  assert first != order.sample_indices(1, 3, 4, 10)
  assert order.replacement_index(-7, 2, 1, 1, 50) == order.replacement_index(
      -7, 2, 1, 1, 50)
  np.testing.assert_array_equal(
      order.full_attention_slots(-2**63, 5, 8, 0.5),
      order.full_attention_slots(-2**63, 5, 8, 0.5))
  # Seeds >= 0 keep the order they always had (resumed runs stay valid).
  assert order.sample_indices(5, 0, 10, 10) == list(
      np.random.default_rng([5, 0, 0]).permutation(10))
  data = SyntheticFacts(10, 2, seed=-3)
  assert data[4] == SyntheticFacts(10, 2, seed=-3)[4]


def test_a_seed_outside_64_bits_is_refused(tmp_path, capsys):
  for bad in (2**63, -2**63 - 1, True, 1.5):
    with pytest.raises(TrainingInputError, match="seed"):
      FinetuneConfig(seed=bad)
    with pytest.raises(TrainingInputError, match="seed"):
      SinkConfig(seed=bad)
  assert FinetuneConfig(seed=-2**63).seed == -2**63
  line = _finetune_error(capsys, "--out", str(tmp_path / "o"), "--model",
                         str(tmp_path / "nope"), "--seed", str(2**63))
  assert "seed must lie in" in line


def test_the_sink_command_trains_with_a_negative_seed(tmp_path, model_dir):
  """Also bug 4: without eval batches the eval KLs are null in the log."""
  out = tmp_path / "sink"
  assert sink_main(["--model", model_dir, "--out", str(out), "--steps", "1",
                    "--batch-size", "2", "--preamble-len", "2",
                    "--docs-per-question", "2", "--eval-batches", "0",
                    "--seed", "-1", "--no-progress"]) == 0
  log = _strict_json(out / "sink_log.json")
  assert log["settings"]["seed"] == -1 and len(log["history"]) == 1
  assert log["eval_kl"] == dict(no_preamble=None, initial_sink=None,
                                trained_sink=None)


def test_finetune_trains_with_a_negative_seed(tmp_path, model_dir, capsys):
  assert cli.main(["finetune", "--model", model_dir, "--out",
                   str(tmp_path / "ft"), "--steps", "1", "--batch-size", "2",
                   "--docs-per-question", "2", "--seed", "-5",
                   "--no-progress"]) == 0
  assert "1/1 steps" in capsys.readouterr().out


# Bug 2: an output path that cannot be written.

def test_an_out_that_is_a_file_is_refused_before_loading(tmp_path, capsys):
  taken = tmp_path / "taken.txt"
  taken.write_text("x")
  nope = str(tmp_path / "nope")
  line = _finetune_error(capsys, "--model", nope, "--out", str(taken))
  assert f"output directory {taken} exists and is not a directory" in line
  line = _sink_error(capsys, "--model", nope, "--out", str(taken))
  assert f"output directory {taken} exists and is not a directory" in line
  line = _sink_error(capsys, "--model", nope, "--out",
                     str(taken / "below"))
  assert "cannot create the output directory" in line
  # An output file of the run that is a directory.
  (tmp_path / "out" / "sink_log.json").mkdir(parents=True)
  line = _sink_error(capsys, "--model", nope, "--out", str(tmp_path / "out"))
  assert "sink_log.json is a directory" in line
  (tmp_path / "ft").mkdir()
  (tmp_path / "ft" / "checkpoints").write_text("x")
  line = _finetune_error(capsys, "--model", nope, "--out",
                         str(tmp_path / "ft"))
  assert "checkpoints is not a directory" in line


def test_finetune_refuses_an_out_that_is_a_file(tmp_path):
  taken = tmp_path / "taken"
  taken.write_text("x")
  with pytest.raises(errors.OutputPathError, match="is not a directory"):
    finetune(_trainable(), SyntheticFacts(8, 2), CONFIG, taken,
             progress=False)


def test_write_failures_under_the_output_are_one_line_errors(tmp_path):
  with pytest.raises(errors.OutputPathError, match="No space left"):
    with report.output_errors(tmp_path):
      raise OSError(28, "No space left on device", str(tmp_path / "a.json"))
  with pytest.raises(PermissionError):  # not about the output: unchanged
    with report.output_errors(tmp_path / "out"):
      raise PermissionError(13, "Permission denied", str(tmp_path / "b"))


# Bug 3: resuming with another model.

def test_resuming_with_a_model_of_another_size_is_refused(tmp_path):
  # stop_at=0 checkpoints the initial state without compiling a step.
  out, base = tmp_path / "out", _trainable()
  finetune(base, SyntheticFacts(8, 2), CONFIG, out, stop_at=0,
           progress=False, export=False)
  # Same architecture and id ("in-memory", no file hash), wider MLP: the
  # record must tell them apart before orbax restores any array.
  with pytest.raises(TrainingInputError,
                     match="holds a run with another recipe or model"):
    finetune(_trainable(intermediate_size=96), SyntheticFacts(8, 2), CONFIG,
             out, progress=False, export=False)
  with pytest.raises(TrainingInputError, match=r"\(model differ\)"):
    finetune(_trainable(qk_norm=True), SyntheticFacts(8, 2), CONFIG, out,
             progress=False, export=False)
  # The same model still resumes.
  assert finetune(base, SyntheticFacts(8, 2), CONFIG, out, stop_at=0,
                  progress=False, export=False).step == 0


def test_resuming_the_command_with_another_model_is_one_line(
    tmp_path, model_dir, capsys):
  other = export_model(tmp_path / "other", tiny_config(num_layers=1),
                       nnx.to_pure_dict(nnx.state(Llama(
                           tiny_config(num_layers=1), rngs=nnx.Rngs(0)))),
                       tiny_tokenizer())
  args = ["--out", str(tmp_path / "out"), "--steps", "2", "--batch-size",
          "2", "--docs-per-question", "2", "--stop-at-step", "1"]
  assert cli.main(["finetune", "--model", model_dir, "--no-progress",
                   *args]) == 0
  capsys.readouterr()
  line = _finetune_error(capsys, "--model", other, *args)
  assert "holds a run with another recipe or model" in line


def test_a_record_from_before_the_model_structure_still_resumes():
  from lazyattn_jax.training.finetune import _recipe_differences
  recipe = dict(config=dict(steps=2), model_sha256="a", model=dict(x=[1]))
  old = dict(config=dict(steps=2), model_sha256="a")
  assert _recipe_differences(old, recipe) == []
  assert _recipe_differences(dict(old, model_sha256="b"), recipe) == [
      "model_sha256"]
  assert _recipe_differences(dict(recipe, model=dict(x=[2])), recipe) == [
      "model"]
  assert _recipe_differences(None, recipe) == sorted(recipe)


# Bug 4: non-finite values in the JSON log.

def test_the_log_is_strict_json_with_null_for_non_finite_values(tmp_path):
  history = report.History()
  history.add(0, dict(loss=float("nan"), kl=1.5))
  history.add(1, dict(loss=np.float32("inf"), kl=-math.inf))
  path = tmp_path / "log.json"
  report.write_log(str(path), dict(max_minutes=math.inf, seed=-1), history,
                   eval_kl=dict(a=np.float64("nan"), b=0.25),
                   sizes=(1, float("nan")))
  log = _strict_json(path)
  assert log["history"] == [dict(step=0, loss=None, kl=1.5),
                            dict(step=1, loss=None, kl=None)]
  assert log["settings"] == dict(max_minutes=None, seed=-1)
  assert log["eval_kl"] == dict(a=None, b=0.25)
  assert log["sizes"] == [1, None]


# Bug 5: a time limit of zero or less.

@pytest.mark.parametrize("minutes", ["0", "-1", "nan"])
def test_the_sink_command_refuses_no_time(tmp_path, capsys, minutes):
  line = _sink_error(capsys, "--model", str(tmp_path / "nope"), "--out",
                     str(tmp_path / "out"), "--max-minutes", minutes)
  assert line == "sink: error: --max-minutes must be > 0"
  assert not (tmp_path / "out").exists()


def test_the_trainers_refuse_no_time(tmp_path):
  with pytest.raises(TrainingInputError, match="max_minutes must be > 0"):
    train_sink(_trainable(), SyntheticFacts(8, 2),
               SinkConfig(preamble_len=2, steps=1, batch_size=2),
               max_minutes=0, progress=False)
  with pytest.raises(TrainingInputError, match="max_minutes must be > 0"):
    finetune(_trainable(), SyntheticFacts(8, 2), CONFIG, tmp_path / "ft",
             max_minutes=-1.0, progress=False)
  assert not (tmp_path / "ft").exists()


def test_a_config_field_added_later_keeps_existing_signatures():
  # A field added to LlamaConfig with a default that keeps the old
  # behaviour must not make runs recorded before it refuse to resume.
  import dataclasses
  from lazyattn_jax.training.model_io import model_signature
  from models.config import LlamaConfig

  @dataclasses.dataclass(frozen=True)
  class Extended(LlamaConfig):
    new_option: bool = False

  base = _trainable()
  extended = dataclasses.replace(base, config=Extended(
      **{f.name: getattr(base.config, f.name)
         for f in dataclasses.fields(base.config)}))
  signature = model_signature(base)
  assert {k: v for k, v in model_signature(extended).items()
          if k != "architecture"} == {k: v for k, v in signature.items()
                                      if k != "architecture"}
  # A field set away from its default is still part of the signature.
  assert signature != model_signature(dataclasses.replace(
      base, config=dataclasses.replace(base.config, qk_norm=True)))


# hunt17 bug 1: non-finite learning rate, weight decay and loss weights.

@pytest.mark.parametrize("option,value", [
    ("--weight-decay", "nan"), ("--weight-decay", "inf"), ("--lr", "inf"),
    ("--kl-weight", "nan"), ("--ce-weight", "inf")])
def test_non_finite_float_options_are_refused(tmp_path, capsys, option,
                                              value):
  line = _finetune_error(capsys, "--model", str(tmp_path / "nope"), "--out",
                         str(tmp_path / "out"), option, value)
  assert line == f"lazyattn: error: {option} must be finite, got {value}"
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("field,value", [
    ("learning_rate", math.inf), ("weight_decay", math.nan),
    ("weight_decay", math.inf)])
def test_the_optimizer_refuses_non_finite_values(field, value):
  with pytest.raises(TrainingInputError,
                     match=f"{field} must be finite and "):
    OptimizerConfig(**{field: value})


@pytest.mark.parametrize("field,value", [
    ("kl_weight", math.nan), ("ce_weight", math.nan),
    ("kl_weight", math.inf), ("ce_weight", math.inf)])
def test_the_recipe_refuses_non_finite_loss_weights(field, value):
  with pytest.raises(TrainingInputError,
                     match=f"{field} must be finite and >= 0"):
    FinetuneConfig(**{field: value})


# hunt17 bug 2: --stop-at-step below 0, and a stop before any step.

def test_a_negative_stop_step_is_refused(tmp_path, capsys):
  line = _finetune_error(capsys, "--model", str(tmp_path / "nope"), "--out",
                         str(tmp_path / "out"), "--stop-at-step", "-5")
  assert line == "lazyattn: error: --stop-at-step must be >= 0, got -5"
  assert not (tmp_path / "out").exists()
  with pytest.raises(TrainingInputError, match="stop_at must be >= 0"):
    finetune(_trainable(), SyntheticFacts(8, 2), CONFIG, tmp_path / "ft",
             stop_at=-1, progress=False)
  assert not (tmp_path / "ft").exists()


def test_a_stop_before_the_first_step_says_no_model_was_exported(
    tmp_path, model_dir, capsys):
  status = cli.main(["finetune", "--model", model_dir, "--out",
                     str(tmp_path / "out"), "--steps", "2", "--batch-size",
                     "2", "--docs-per-question", "2", "--no-progress",
                     "--stop-at-step", "0"])
  out = capsys.readouterr().out
  assert status == 0
  assert "the model so far (step 0): none exported" in out, out
  assert "None" not in out
  assert not (tmp_path / "out" / "model").exists()


# hunt17 bug 4: resuming with other data.

def test_resuming_with_other_data_is_refused(tmp_path):
  # stop_at=0 checkpoints the initial state without compiling a step.
  out, base = tmp_path / "out", _trainable()
  finetune(base, SyntheticFacts(8, 2), CONFIG, out, stop_at=0,
           progress=False, export=False)
  for other in (SyntheticFacts(8, 5), SyntheticFacts(9, 2),
                SyntheticFacts(8, 2, seed=7)):
    with pytest.raises(TrainingInputError,
                       match=r"another recipe or model \(data differ\)"):
      finetune(base, other, CONFIG, out, progress=False, export=False)
  # An explicit data_id is what is compared, instead of the fingerprint.
  with pytest.raises(TrainingInputError, match=r"\(data differ\)"):
    finetune(base, SyntheticFacts(8, 2), CONFIG, out, progress=False,
             export=False, data_id=("synthetic", 2))
  with pytest.raises(TrainingInputError, match="data_id must be JSON-able"):
    finetune(base, SyntheticFacts(8, 2), CONFIG, out, progress=False,
             export=False, data_id=object())
  # The same data (a new but equal source) still resumes.
  assert finetune(base, SyntheticFacts(8, 2), CONFIG, out, stop_at=0,
                  progress=False, export=False).step == 0


def test_a_record_from_before_the_data_identity_still_resumes():
  from lazyattn_jax.training.finetune import _recipe_differences
  recipe = dict(config=dict(steps=2), model=dict(x=[1]), data=dict(size=8))
  old = dict(config=dict(steps=2), model=dict(x=[1]))
  assert _recipe_differences(old, recipe) == []
  assert _recipe_differences(dict(recipe, data=dict(size=9)), recipe) == [
      "data"]


def test_resuming_the_command_with_other_data_is_one_line(
    tmp_path, model_dir, capsys):
  args = ["--model", model_dir, "--out", str(tmp_path / "out"), "--steps",
          "2", "--batch-size", "2", "--stop-at-step", "0"]
  assert cli.main(["finetune", "--no-progress", *args,
                   "--docs-per-question", "2"]) == 0
  capsys.readouterr()
  line = _finetune_error(capsys, *args, "--docs-per-question", "5")
  assert "holds a run with another recipe or model (data differ)" in line
  log = json.loads((tmp_path / "out" / "log.json").read_text())
  assert log["settings"]["data"] == dict(
      name="synthetic", docs_per_question=2, size=100_000)
  assert cli.main(["finetune", "--no-progress", *args,
                   "--docs-per-question", "2"]) == 0


# Refused only after the data and model had loaded (seconds to a minute).

@pytest.mark.parametrize("option,value,message", [
    ("--max-len", "0", "--max-len must be > 0, got 0"),
    ("--devices", "0", "--devices must lie in [1, {n}], got 0"),
    ("--devices", "99", "--devices must lie in [1, {n}], got 99"),
])
def test_the_sink_command_refuses_before_loading(tmp_path, capsys, option,
                                                 value, message):
  import jax
  line = _sink_error(capsys, "--model", str(tmp_path / "nope"), "--out",
                     str(tmp_path / "out"), option, value)
  n = len(jax.local_devices())
  assert line == f"sink: error: {message.format(n=n)}"


@pytest.mark.parametrize("option,value,message", [
    ("--devices", "0", "--devices must lie in [1, {n}], got 0"),
    ("--preamble-sink", "missing.safetensors",
     "sink file not found: missing.safetensors"),
])
def test_finetune_refuses_before_loading(tmp_path, capsys, option, value,
                                         message):
  import jax
  line = _finetune_error(capsys, "--model", str(tmp_path / "nope"), "--out",
                         str(tmp_path / "out"), option, value)
  n = len(jax.local_devices())
  assert line == f"lazyattn: error: {message.format(n=n)}"


def test_the_configs_refuse_a_max_len_below_one():
  with pytest.raises(TrainingInputError, match="max_len must be >= 1"):
    SinkConfig(max_len=0)
  with pytest.raises(TrainingInputError, match="max_len must be >= 1"):
    FinetuneConfig(max_len=0)


def _out_of_memory(*args, **kwargs):
  import jax
  raise jax.errors.JaxRuntimeError(
      "RESOURCE_EXHAUSTED: Out of memory allocating 45296140920 bytes.")


def test_a_step_out_of_device_memory_names_the_settings_to_change(
    tmp_path, model_dir, capsys, monkeypatch):
  """Before: a JaxRuntimeError traceback from inside the training step."""
  import lazyattn_jax.training.finetune
  from lazyattn_jax.training import sink_cli
  monkeypatch.setattr(lazyattn_jax.training.finetune, "finetune",
                      _out_of_memory)
  line = _finetune_error(capsys, "--model", model_dir, "--out",
                         str(tmp_path / "ft"), "--steps", "1",
                         "--batch-size", "2", "--docs-per-question", "2")
  assert ("the training step does not fit in device memory; try --remat, a "
          "--batch-size under 2, a --max-len under 2048 (RESOURCE_EXHAUSTED"
          in line), line
  monkeypatch.setattr(sink_cli, "train_sink", _out_of_memory)
  line = _sink_error(capsys, "--model", model_dir, "--out",
                     str(tmp_path / "sink"), "--steps", "1", "--remat",
                     "--batch-size", "4", "--docs-per-question", "2")
  assert "device memory; try a --batch-size under 4, a --max-len" in line


def test_other_runtime_errors_are_not_called_memory(tmp_path, model_dir,
                                                    monkeypatch):
  import jax
  from lazyattn_jax.training import sink_cli

  def fails(*args, **kwargs):
    raise jax.errors.JaxRuntimeError("INTERNAL: something else")
  monkeypatch.setattr(sink_cli, "train_sink", fails)
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    sink_main(["--no-progress", "--model", model_dir, "--out",
               str(tmp_path / "sink"), "--steps", "1",
               "--docs-per-question", "2"])
