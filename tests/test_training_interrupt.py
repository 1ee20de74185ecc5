"""Ctrl-C during training (lazyattn_jax/training/interrupt.py): the first
SIGINT stops the loop between steps with a checkpoint (finetune) or the sink
so far, exit status 130; a second one interrupts at once."""

import os
import signal

import numpy as np
import pytest

from lazyattn_jax import cli
from lazyattn_jax.training import sink as sink_module
from lazyattn_jax.training.batch import BatchBuilder
from lazyattn_jax.training.interrupt import stop_on_interrupt
from lazyattn_jax.training.sink_file import load_sink
from tests.test_training_cli import model_dir  # noqa: F401


def test_first_sigint_asks_to_stop_and_a_second_interrupts(capsys):
  before = signal.getsignal(signal.SIGINT)
  with stop_on_interrupt("train") as stop:
    assert not stop()
    os.kill(os.getpid(), signal.SIGINT)
    assert stop()
    assert "train: stopping after this step" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGINT) is before


@pytest.fixture
def sigint_while_building_batch_1(monkeypatch):
  """Sends SIGINT to this process while step 0 runs (as the loop builds the
  next batch), as a user's Ctrl-C would arrive."""
  original = BatchBuilder.batch

  def batch(self, step):
    if step == 1:
      os.kill(os.getpid(), signal.SIGINT)
    return original(self, step)

  monkeypatch.setattr(BatchBuilder, "batch", batch)


def test_ctrl_c_stops_finetune_with_a_checkpoint_that_resumes(
    tmp_path, model_dir, capsys, monkeypatch, sigint_while_building_batch_1):
  out = tmp_path / "out"
  args = ["finetune", "--model", model_dir, "--out", str(out), "--steps",
          "3", "--batch-size", "2", "--checkpoint-every", "100",
          "--docs-per-question", "2", "--no-progress"]
  assert cli.main(args) == 130
  captured = capsys.readouterr()
  assert "finetune: stopping after this step" in captured.err
  assert "stopped early; the model so far (step 1)" in captured.out
  assert sorted(os.listdir(out / "checkpoints")) == ["1"]
  monkeypatch.undo()
  assert cli.main(args) == 0
  assert "3/3 steps" in capsys.readouterr().out


def test_ctrl_c_stops_the_sink_trainer_and_writes_the_sink_so_far(
    tmp_path, model_dir, capsys, sigint_while_building_batch_1):
  out = tmp_path / "sink"
  status = sink_module.main([
      "--model", model_dir, "--out", str(out), "--steps", "5",
      "--batch-size", "2", "--preamble-len", "4", "--eval-batches", "1",
      "--docs-per-question", "2", "--no-progress"])
  assert status == 130
  assert "interrupted_at_step" in capsys.readouterr().out
  sink, metadata = load_sink(out / "sink.safetensors", hidden_size=64)
  assert sink.shape == (4, 64) and np.isfinite(sink).all()
  assert metadata["steps"] == "1"
