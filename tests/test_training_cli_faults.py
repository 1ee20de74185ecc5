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
from tests.training_helpers import tiny_config, tiny_tokenizer

CONFIG = FinetuneConfig(steps=2, batch_size=2, checkpoint_every=1,
                        optimizer=OptimizerConfig(learning_rate=1e-3,
                                                  warmup_steps=1))


def _trainable(**overrides):
  return from_model(Llama(tiny_config(**overrides), rngs=nnx.Rngs(0)),
                    tiny_tokenizer())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
  """The tiny model and tokenizer as a safetensors directory."""
  path = tmp_path_factory.mktemp("tiny_model")
  model = Llama(tiny_config(), rngs=nnx.Rngs(0))
  return export_model(path, model.config, nnx.to_pure_dict(nnx.state(model)),
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

