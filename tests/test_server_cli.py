"""`lazyattn serve`: argument errors exit 2 in one line, and the command
serves a model directory (weights, tokenizer.json, chat template) over HTTP
until it is told to stop."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from lazyattn_jax.cli import main
from tests.server_helpers import CORPUS, QUESTIONS  # noqa: F401

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("argv, message", [
    (["--port", "70000"], "--port must lie in"),
    (["--mode", "nope"], "mode must be one of"),
    (["--max-queue", "0"], "max_queue must be an integer >= 1"),
    (["--num-pages", "0"], "must be >= 1"),
    (["--prefill-chunk-tokens", "0"],
     "prefill_chunk_tokens must be an int >= 1 or None, got 0"),
    (["--decode-during-prefill", "--max-prefill-tokens", "0"],
     "max_prefill_tokens must be an int >= 1, got 0"),
])
def test_bad_arguments_exit_2_with_one_line(argv, message, capsys):
  assert main(["serve", "--model", "no-such-model", *argv]) == 2
  err = capsys.readouterr().err.strip()
  assert err.startswith("lazyattn: error:") and message in err
  assert len(err.splitlines()) == 1


@pytest.mark.parametrize("argv, settings", [
    ([], {}),
    (["--max-prefill-tokens", "2048", "--first-token-group-tokens", "2048",
      "--max-batch", "4"],
     dict(max_prefill_tokens=2048, first_token_group_tokens=2048,
          max_batch=4)),
    (["--no-decode-during-prefill", "--prefill-chunk-tokens", "256",
      "--no-decode-loops-to-first-finish"],
     dict(decode_during_prefill=False, prefill_chunk_tokens=256,
          decode_loops_to_first_finish=False)),
])
def test_serve_passes_scheduler_settings_to_the_engine(argv, settings,
                                                        monkeypatch):
  """The interactive settings reach the engine, with the ones given in
  their place; SchedulerConfig's own defaults apply to the rest."""
  from lazyattn_jax.config import INTERACTIVE_SETTINGS
  import lazyattn_jax.cli as cli
  seen = {}

  def load(model, args, **kwargs):
    seen.update(kwargs)
    raise cli.UsageError("stop here")

  monkeypatch.setattr(cli, "_load_engine", load)
  assert main(["serve", "--model", "m", *argv]) == 2
  engine_settings = {k: v for k, v in seen.items()
                     if k in cli.ENGINE_OPTIONS}
  assert engine_settings == {**INTERACTIVE_SETTINGS, **settings}


def test_plain_rounds_serve_as_the_python_api_does(monkeypatch):
  """--plain-rounds: SchedulerConfig's defaults, with the ones given."""
  from lazyattn_jax.config import SchedulerConfig
  import lazyattn_jax.cli as cli
  seen = {}

  def load(model, args, **kwargs):
    seen.update(SchedulerConfig(**{k: v for k, v in kwargs.items()
                                   if k in cli.ENGINE_OPTIONS}).__dict__)
    raise cli.UsageError("stop here")

  monkeypatch.setattr(cli, "_load_engine", load)
  assert main(["serve", "--model", "m", "--plain-rounds"]) == 2
  assert seen == SchedulerConfig().__dict__
  assert main(["serve", "--model", "m", "--plain-rounds", "--max-batch",
               "3"]) == 2
  assert seen == SchedulerConfig(max_batch=3).__dict__


@pytest.fixture(scope="module")
def model_dir(text_model, tmp_path_factory):
  """A HF-style directory of the tiny text model."""
  from models.llama import split_model
  from flax import nnx
  from tests.hf_fixtures import write_hf_checkpoint
  config, model, tokenizer = text_model
  directory = tmp_path_factory.mktemp("tiny-text")
  write_hf_checkpoint(directory, config,
                      nnx.to_pure_dict(split_model(model)[1]))
  (directory / "tokenizer.json").write_text(tokenizer.backend.to_str())
  eos = tokenizer.backend.id_to_token(tokenizer.eos_token_id)
  (directory / "tokenizer_config.json").write_text(json.dumps(
      {"chat_template": tokenizer.chat_template, "eos_token": eos}))
  return directory


def test_pool_settings_that_cannot_work_exit_2_with_one_line(
    model_dir, capsys, monkeypatch):
  """Pages longer than the model's context, and a pool the memory cannot
  hold (as XLA reports it), after the model loaded: one line, no server."""
  import lazyattn_jax.engine as engine_module
  import jax
  assert main(["serve", "--model", str(model_dir), "--impl", "xla",
               "--page-size", "100000"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and "page_size 100000 is longer than the " \
      "model's" in err.strip().splitlines()[-1], err

  def out_of_memory(config):
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")

  monkeypatch.setattr(engine_module, "PagedKVCache", out_of_memory)
  assert main(["serve", "--model", str(model_dir), "--impl", "xla",
               "--num-pages", "64"]) == 2
  err = capsys.readouterr().err
  assert "Traceback" not in err and "the cache does not fit in memory: 64 " \
      "pages" in err.strip().splitlines()[-1], err


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def test_serve_answers_over_http_and_stops_on_sigterm(model_dir):
  openai = pytest.importorskip("openai")
  port = _free_port()
  process = subprocess.Popen(
      [sys.executable, "-m", "lazyattn_jax.cli", "serve", "--model",
       str(model_dir), "--served-model-name", "tiny", "--port", str(port),
       "--impl", "xla", "--num-pages", "64", "--max-batch", "2",
       "--log-level", "warning", "--drain-timeout-s", "5"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  try:
    deadline = time.monotonic() + 180
    while True:
      assert process.poll() is None, process.stdout.read()
      try:
        if httpx.get(url + "/health", timeout=2).status_code == 200:
          break
      except httpx.TransportError:
        pass
      assert time.monotonic() < deadline, "the server did not come up"
      time.sleep(0.5)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused",
                           max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    registered = client.post("/documents", cast_to=object,
                             body={"documents": [CORPUS[1]]})
    bridge = {"id": registered["data"][0]["id"]}
    answers = [client.chat.completions.create(
        model="tiny", max_tokens=4, temperature=0,
        messages=[{"role": "user", "content": QUESTIONS[0]}],
        extra_body={"documents": [bridge, CORPUS[0]]}) for _ in range(2)]
    assert answers[0].choices[0].message.content == (
        answers[1].choices[0].message.content)
    assert [a.usage.cached_documents for a in answers] == [1, 2]
  finally:
    process.send_signal(signal.SIGTERM)
    try:
      output = process.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
      process.kill()
      raise
  # uvicorn shuts down gracefully, then re-raises the signal it caught.
  assert process.returncode in (0, -signal.SIGTERM), output
  assert "Traceback" not in output
  assert "Serving 'tiny' (lazy mode)" in output


def test_serve_on_port_0_names_the_port_it_listens_on(model_dir):
  """The banner comes once the server listens, with the port the OS picked
  (it printed port 0); the library's own errors are logged at the
  server's level."""
  import re
  process = subprocess.Popen(
      [sys.executable, "-m", "lazyattn_jax.cli", "serve", "--model",
       str(model_dir), "--port", "0", "--impl", "xla", "--num-pages", "64",
       "--log-level", "warning"],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  try:
    deadline = time.monotonic() + 180
    for line in process.stdout:
      if line.startswith("Serving"):
        break
      assert time.monotonic() < deadline, "no banner"
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)/v1", line).group(1))
    assert port != 0
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    assert httpx.head(url + "/health", timeout=10).status_code == 200
  finally:
    process.send_signal(signal.SIGTERM)
    try:
      process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
      process.kill()
      raise


def test_serve_shows_the_library_log_at_its_level(capsys):
  import logging
  from lazyattn_jax.server.log_output import show_server_logs
  logger = logging.getLogger("lazyattn_jax")
  before = list(logger.handlers), logger.level
  try:
    show_server_logs("warning")
    show_server_logs("warning")  # once, however often it is called
    logging.getLogger("lazyattn_jax.server").info("not shown")
    logging.getLogger("lazyattn_jax.server").error("engine.step() failed")
  finally:
    logger.handlers[:] = before[0]
    logger.setLevel(before[1])
  err = capsys.readouterr().err
  assert err == "ERROR:     lazyattn_jax.server: engine.step() failed\n"
