"""`lazyattn` command line: a built-in demo and RAG over your own files.

  lazyattn demo [--model NAME_OR_PATH] [--max-new-tokens N]
                [--dtype D] [--kv-dtype D]
  lazyattn rag --doc FILE [FILE ...] --query TEXT [--max-new-tokens N]
               [--model NAME_OR_PATH] [--dtype D] [--kv-dtype D]
               [--tensor-parallel N]
               [--preamble chat | --sink FILE] [--recompute]
               [--recompute-tokens K]
  lazyattn serve [--model NAME_OR_PATH] [--host H] [--port P] [--mode M]
                 [--num-pages N] [--max-batch B] ...
  lazyattn finetune --out DIR [--model NAME_OR_PATH] [--steps N] ...

Bad input exits with status 2 and a one-line message (no traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources

from lazyattn_jax.cache_config import COMPUTE_DTYPES, FLOAT8_POOL
from lazyattn_jax.errors import RequestFailedError

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report it
# Attention implementations (pallas_kernels.lazy_attention's impl argument).
IMPLS = ("auto", "xla", "gpu", "tpu")
# The impls that need JAX's backend of the same name; "auto" and "xla" run
# on any backend.
BACKEND_IMPLS = ("gpu", "tpu")


class UsageError(Exception):
  """A problem with the user's input: reported in one line, exit status 2."""


def _first_line(error: Exception) -> str:
  return (str(error).splitlines() or [type(error).__name__])[0]


def _load_engine(model: str, args, **settings):
  from lazyattn_jax.default_model import ModelUnavailableError, UnknownModelError
  from lazyattn_jax.engine import LazyEngine
  from lazyattn_jax.errors import InvalidOptionError
  from models.errors import ModelFormatError
  from lazyattn_jax.errors import TensorParallelError
  try:
    return LazyEngine.from_pretrained(model, num_pages=args.cache_pages,
                                      dtype=args.dtype,
                                      kv_dtype=args.kv_dtype,
                                      impl=args.impl, progress=True,
                                      tensor_parallel=args.tensor_parallel,
                                      **settings)
  except (UnknownModelError, ModelUnavailableError,
          TensorParallelError) as e:
    raise UsageError(_first_line(e)) from None
  except FileNotFoundError as e:
    raise UsageError(f"model not found: {_first_line(e)}") from None
  except ModelFormatError as e:  # corrupted, truncated or unsupported files
    raise UsageError(f"cannot load the model: {_first_line(e)}") from None
  except OSError as e:  # unreadable files (permissions, I/O errors)
    raise UsageError(f"cannot read the model: {e}") from None
  except InvalidOptionError as e:  # answer-quality options
    raise UsageError(_first_line(e)) from None


def _read_document(path: str) -> str:
  if not os.path.exists(path):
    raise UsageError(f"document not found: {path}")
  if os.path.isdir(path):
    raise UsageError(f"document is a directory, not a file: {path}")
  try:
    with open(path, "rb") as f:
      data = f.read()
    text = data.decode("utf-8")
  except UnicodeDecodeError as e:
    raise UsageError(f"document is not UTF-8 text: {path} (byte {e.start})") from None
  except OSError as e:
    raise UsageError(f"cannot read document {path}: {e.strerror}") from None
  if not text.strip():
    raise UsageError(f"document is empty: {path}")
  return text


def _generate(engine, query, documents, max_new_tokens):
  from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
  try:
    return engine.generate(query, documents, max_new_tokens=max_new_tokens)
  except (CacheCapacityError, InvalidRequestError) as e:
    raise UsageError(_first_line(e)) from None


def _hits_line(names, hits) -> str:
  return ", ".join(f"{n} [{'cached' if h else 'encoded'}]"
                   for n, h in zip(names, hits))


def run_rag(args) -> int:
  """`lazyattn rag`: answers --query over the --doc files; exit status."""
  if not args.query or not args.query.strip():
    raise UsageError("the query is empty")
  texts = [_read_document(p) for p in args.doc]
  engine = _text_engine("rag", args)
  from lazyattn_jax.errors import CacheCapacityError, InvalidRequestError
  try:
    # Per document: was it cached before this run?  generate's own doc_hits
    # would say True for every one, as they were encoded just now.
    hits = engine.encode_documents(texts, progress=True)
  except (CacheCapacityError, InvalidRequestError) as e:
    raise UsageError(_first_line(e)) from None
  result = _generate(engine, args.query, texts, args.max_new_tokens)
  print(result.text.strip())
  print(f"\n[time to first token {result.ttft_s * 1000:.0f} ms; documents: "
        f"{_hits_line([os.path.basename(p) for p in args.doc], hits)}]")
  return 0


def _text_engine(command: str, args):
  """The engine of `command`, which reads and writes text."""
  engine = _load_engine(args.model, args, **_quality(args))
  if engine.tokenizer is None:
    raise UsageError(f"lazyattn {command} needs a model with a tokenizer: "
                     f"{args.model} has none (no tokenizer.json)")
  return engine


def _quality(args) -> dict:
  from lazyattn_jax.cli_options import quality_settings
  try:
    return quality_settings(args)
  except ValueError as e:
    raise UsageError(_first_line(e)) from None


def load_demo_corpus() -> dict:
  """The demo's packaged corpus: {"documents": [{"title", "text"}],
  "questions": [...]}."""
  text = resources.files("lazyattn_jax").joinpath("data/demo_corpus.json").read_text("utf-8")
  return json.loads(text)


def run_demo(args) -> int:
  """`lazyattn demo`: the packaged questions over the demo corpus."""
  corpus = load_demo_corpus()
  by_title = {d["title"]: d["text"] for d in corpus["documents"]}
  engine = _text_engine("demo", args)
  print(f"Demo corpus: {len(by_title)} documents; {len(corpus['questions'])} "
        f"questions reusing them in different orders.\n")
  # Compile on a first pass, then start again from an empty cache, so that the
  # times below compare encoding documents against reusing them, not compiling.
  print("Compiling (first pass only)...", flush=True)
  for q in corpus["questions"]:
    _generate(engine, q["query"], [by_title[t] for t in q["documents"]],
              args.max_new_tokens)
  engine.reset_cache()
  ttfts = []
  for i, q in enumerate(corpus["questions"], 1):
    docs = [by_title[t] for t in q["documents"]]
    result = _generate(engine, q["query"], docs, args.max_new_tokens)
    ttfts.append(result.ttft_s)
    print(f"Q{i}: {q['query']}")
    print(f"A{i}: {result.text.strip()}")
    print(f"    time to first token {result.ttft_s * 1000:.0f} ms; documents: "
          f"{_hits_line(q['documents'], result.doc_hits)}\n")
  cold, reused = ttfts[0], min(ttfts[1:]) if len(ttfts) > 1 else ttfts[0]
  print(f"First request (documents encoded): {cold * 1000:.0f} ms to first "
        f"token; reused request (documents read from the cache at new "
        f"positions, zero copy): {reused * 1000:.0f} ms "
        f"({cold / max(reused, 1e-9):.1f}x faster).")
  return 0


# Settings of `lazyattn serve` taken from their dataclasses.
SERVER_OPTIONS = ("max_queue", "default_max_tokens", "drain_timeout_s",
                  "max_registered_documents", "retry_after_s")
ENGINE_OPTIONS = ("max_batch", "decode_steps", "max_prefill_tokens",
                  "first_token_group_tokens", "decode_during_prefill",
                  "decode_loops_to_first_finish", "prefill_chunk_tokens")


def run_serve(args) -> int:
  """`lazyattn serve`: the OpenAI-compatible HTTP server until stopped."""
  from lazyattn_jax.cli_options import chosen
  from lazyattn_jax.config import INTERACTIVE_SETTINGS
  from lazyattn_jax.server import ServerConfig
  from lazyattn_jax.server.log_output import show_server_logs
  try:
    from lazyattn_jax.server import create_app
    from lazyattn_jax.server.draining import DrainingServer
  except ImportError as e:
    raise UsageError(f"lazyattn serve needs the serve extra ({e.name} is "
                     f"missing): pip install 'lazyattn-jax[serve]'") from None
  try:
    server_config = ServerConfig(
        model_name=args.served_model_name or args.model,
        **chosen(args, SERVER_OPTIONS))
    if args.no_default_quality:
      quality = dict(quality=None)
    else:
      quality = {}
    start = {} if args.plain_rounds else INTERACTIVE_SETTINGS
    scheduler = {**start, **chosen(args, ENGINE_OPTIONS)}
    engine = _load_engine(args.model, args, mode=args.mode,
                          page_size=args.page_size,
                          **quality, **scheduler)
  except ValueError as e:  # a setting the server or the engine refuses
    raise UsageError(_first_line(e)) from None
  app = create_app(engine, server_config, close_engine=True)
  show_server_logs(args.log_level)

  def banner(port: int):  # once listening: the port the OS picked for 0
    print(f"Serving {server_config.model_name!r} ({args.mode} mode) on "
          f"http://{args.host}:{port}/v1", flush=True)
  DrainingServer(app, on_listening=banner, host=args.host, port=args.port,
                 log_level=args.log_level).run()
  return 0



def _add_serve_parser(sub, common):
  from lazyattn_jax.cli_options import add_config_options
  from lazyattn_jax.config import INTERACTIVE_SETTINGS, SchedulerConfig
  from lazyattn_jax.server.config import ServerConfig
  serve = sub.add_parser(
      "serve", parents=[common],
      help="an OpenAI-compatible HTTP server with a documents field")
  serve.add_argument("--served-model-name",
                     help="the name clients give as `model` (default: "
                          "--model)")
  serve.add_argument("--host", default="127.0.0.1")
  serve.add_argument("--port", type=int, default=8000)
  serve.add_argument("--mode", default="lazy",
                     help="KV reuse mode: lazy, block, prefix or full")
  serve.add_argument("--page-size", type=int, default=16)
  serve.add_argument("--log-level", default="info",
                     choices=["critical", "error", "warning", "info", "debug"])
  serve.add_argument("--no-default-quality", action="store_true",
                     help="turn off the answer-quality options on by default "
                          "in lazy and block modes (first-page recompute, "
                          "and the shipped learned sink for the default "
                          "model)")
  engine = serve.add_argument_group(
      "scheduling", "the engine's SchedulerConfig; unset ones take "
      "SchedulerConfig.interactive()'s settings (decode during prefill, "
      "for time to first token), then from_pretrained's max_batch 8, then "
      "SchedulerConfig's defaults")
  engine.add_argument("--plain-rounds", action="store_true",
                      help="unset ones take from_pretrained's max_batch 8 "
                           "and SchedulerConfig's defaults, as the Python API "
                           "does (plain rounds, for the most tokens/s)")
  add_config_options(engine, SchedulerConfig, ENGINE_OPTIONS,
                     use_defaults=False,
                     shown_defaults=dict(INTERACTIVE_SETTINGS, max_batch=8))
  add_config_options(serve, ServerConfig, SERVER_OPTIONS)


def run_finetune(args) -> int:
  """`lazyattn finetune`: block fine-tuning (lazyattn_jax.finetune)."""
  from lazyattn_jax.training.cli_errors import USER_ERRORS
  from lazyattn_jax.training.finetune_cli import run
  try:
    return run(args)
  except USER_ERRORS as e:
    raise UsageError(_first_line(e)) from None


def build_parser() -> argparse.ArgumentParser:
  """The `lazyattn` argument parser, one subcommand per run_* function."""
  parser = argparse.ArgumentParser(
      prog="lazyattn",
      description="Retrieval-augmented generation with zero-copy, "
                  "position-agnostic document KV reuse.")
  sub = parser.add_subparsers(dest="command", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("--model", default="smollm2-135m-instruct",
                      help="model name or path (.gguf file or HF directory)")
  common.add_argument("--cache-pages", "--num-pages", dest="cache_pages",
                      type=int, default=1024,
                      help="KV cache size in pages (of 16 tokens, or "
                           "serve's --page-size)")
  # Dtypes are checked in _check_arguments, not by argparse's choices, so
  # that a bad one is a one-line error like the others.
  common.add_argument("--dtype", default="float32",
                      help="compute dtype, and the KV cache's unless "
                           "--kv-dtype says otherwise: "
                           f"{', '.join(COMPUTE_DTYPES)} (default: float32)")
  common.add_argument("--kv-dtype", default=None,
                      help="KV cache dtype: the compute dtype (the default) "
                           f"or {FLOAT8_POOL}, which stores float8 "
                           "pages with per-page scales, about half the "
                           "bytes of bfloat16")
  common.add_argument("--impl", default="auto",
                      help=f"attention implementation: {', '.join(IMPLS)}")
  common.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                      help="split the model over N devices (weights "
                           "Megatron-style, the KV pool over KV heads)")
  answering = argparse.ArgumentParser(add_help=False)
  answering.add_argument("--max-new-tokens", type=int, default=48)
  from lazyattn_jax.cli_options import add_quality_options
  add_quality_options(answering)
  sub.add_parser("demo", parents=[common, answering],
                 help="answer questions over a built-in corpus, reusing documents")
  rag = sub.add_parser("rag", parents=[common, answering],
                       help="answer a query over your documents")
  rag.add_argument("--doc", nargs="+", required=True, metavar="FILE",
                   help="UTF-8 text files, one document each")
  rag.add_argument("--query", required=True)
  _add_serve_parser(sub, common)
  from lazyattn_jax.training.finetune_cli import HELP, add_arguments
  add_arguments(sub.add_parser("finetune", help=HELP))
  return parser


def _check_arguments(args):
  """Value checks argparse does not make, as one-line usage errors (argparse's
  own errors print the usage too)."""
  if getattr(args, "max_new_tokens", 1) < 1:
    raise UsageError("--max-new-tokens must be >= 1")
  if not 0 <= getattr(args, "port", 0) <= 65535:
    raise UsageError(f"--port must lie in [0, 65535], got {args.port}")
  if args.cache_pages < 1:
    raise UsageError(f"--cache-pages must be >= 1, got {args.cache_pages}")
  if args.tensor_parallel < 1:
    raise UsageError(f"--tensor-parallel must be >= 1, got "
                     f"{args.tensor_parallel}")
  if getattr(args, "page_size", 1) < 1:
    raise UsageError(f"--page-size must be >= 1, got {args.page_size}")
  if args.impl not in IMPLS:
    raise UsageError(f"--impl must be one of {', '.join(IMPLS)}, got "
                     f"{args.impl!r}")
  _check_dtypes(args)
  check_impl_backend(args.impl)


def _check_dtypes(args):
  """--dtype and --kv-dtype, before the model loads: a pool dtype other
  than the compute dtype or float8 builds an engine that cannot generate."""
  from lazyattn_jax.cache_config import check_compute_dtype, check_pool_dtype
  from lazyattn_jax.errors import InvalidOptionError
  try:
    dtype = check_compute_dtype(args.dtype, name="--dtype")
    if args.kv_dtype is not None:
      check_pool_dtype(args.kv_dtype, dtype, pool_name="--kv-dtype",
                       compute_name="--dtype")
  except InvalidOptionError as e:
    raise UsageError(_first_line(e)) from None


def check_impl_backend(impl: str):
  """--impl gpu or tpu on another backend fails in every step's compile
  (Pallas runs only interpreted there), so it is refused up front.  The
  Python API keeps accepting it: its steps may be lowered for another
  platform than the one they were built on."""
  if impl not in BACKEND_IMPLS:
    return
  import jax
  backend = jax.default_backend()
  if backend != impl:
    working = ["auto", "xla"] + ([backend] if backend in BACKEND_IMPLS
                                 else [])
    raise UsageError(f"--impl {impl} needs JAX's {impl} backend, but JAX "
                     f"runs on {backend} here; use --impl "
                     f"{' or '.join(working)}")


def main(argv=None) -> int:
  """Entry point of `lazyattn`: runs a subcommand; usage errors exit 2."""
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    if args.command == "finetune":  # its own options and checks
      return run_finetune(args)
    _check_arguments(args)
    if args.command == "demo":
      return run_demo(args)
    if args.command == "serve":
      return run_serve(args)
    return run_rag(args)
  except UsageError as e:
    print(f"lazyattn: error: {e}", file=sys.stderr)
    return EXIT_USAGE
  except RequestFailedError as e:  # the engine failed, not the input
    print(f"lazyattn: error: generation failed: {str(e).splitlines()[0]}",
          file=sys.stderr)
    return 1
  except KeyboardInterrupt:  # Ctrl-C: one line, not a traceback
    resume = (f"; the same command resumes from the last checkpoint under "
              f"{args.out}, if one was written"
              if args.command == "finetune" else "")
    print(f"lazyattn: interrupted{resume}", file=sys.stderr)
    return EXIT_INTERRUPTED


if __name__ == "__main__":
  sys.exit(main())
