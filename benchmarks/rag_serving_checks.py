"""Checks of the RAG serving benchmark's options (rag_serving_cli.py) made
before any work starts: option values (`check_values`, at parse time; its
`kernel_error` part also in decode_step and mixed_step), options a
benchmark built on them never runs (`not_run_error`: tensor_parallel,
page_contiguity), and whether every planned run's pool can hold that
mode's largest request (`pool_error`, once the model's shape is known)."""

from __future__ import annotations

import math

from pallas_kernels.sizes import ceil_div

# Options that must be >= 1, and options that must be >= 0.
POSITIVE = ("num_docs", "docs_per_request", "doc_len", "query_len",
            "output_len", "concurrency", "num_requests", "page_size",
            "max_batch", "decode_steps", "max_prefill_tokens", "sink_len")
NON_NEGATIVE = ("cache_pages", "rate", "group_tokens",
                "prefill_tokens_per_step", "prefill_chunk_tokens", "zipf")


def _flag(name: str) -> str:
  return "--" + name.replace("_", "-")


def _number_list(text: str, flag: str, minimum: float, strict: bool):
  """Comma-separated floats of `text`, each >= `minimum` (> if `strict`);
  (values, None) or (None, error)."""
  values = []
  for item in (t.strip() for t in text.split(",")):
    if not item:
      continue
    try:
      value = float(item)
    except ValueError:
      return None, f"{flag} takes comma-separated numbers, got {item!r}"
    if not math.isfinite(value) or value < minimum or (strict and
                                                       value == minimum):
      bound = f"> {minimum:g}" if strict else f">= {minimum:g}"
      return None, f"{flag} values must be finite and {bound}, got {item!r}"
    values.append(value)
  return values, None


def number_error(args, positive, non_negative) -> str | None:
  """The first option of `positive` under 1 or of `non_negative` under 0
  or not finite, and a --cache-fraction (where no --cache-pages is given)
  that is not finite and > 0, as one line; or None.  Also the request
  shape: --docs-per-request at most --num-docs."""
  for name in positive:
    if getattr(args, name) < 1:
      return f"{_flag(name)} must be >= 1, got {getattr(args, name)}"
  for name in non_negative:  # NaN fails `>= 0`; a rate of NaN hung
    if not (getattr(args, name) >= 0 and math.isfinite(getattr(args, name))):
      return (f"{_flag(name)} must be finite and >= 0, got "
              f"{getattr(args, name)}")
  if not getattr(args, "cache_pages", 0) and not (
      args.cache_fraction > 0 and math.isfinite(args.cache_fraction)):
    return (f"--cache-fraction must be finite and > 0, got "
            f"{args.cache_fraction}")
  if args.docs_per_request > args.num_docs:
    return (f"--docs-per-request {args.docs_per_request} is more than "
            f"--num-docs {args.num_docs} (a request's documents differ)")
  return None


def out_path_error(path: str) -> str | None:
  """Makes the directory of the report path `path` (if any); one line if
  it cannot be made or written, else None.  Checked before any work: a
  bad path must not lose a finished run."""
  import os
  if not path:
    return None
  directory = os.path.dirname(os.path.abspath(path))
  try:
    os.makedirs(directory, exist_ok=True)
  except OSError as e:
    return f"cannot create the output directory {directory}: {e.strerror}"
  if not os.access(directory, os.W_OK):
    return f"cannot write to the output directory {directory}"
  return None


def check_values(args) -> str | None:
  """The first problem with the option values of `args` as one line, or
  None."""
  error = number_error(args, POSITIVE, NON_NEGATIVE)
  if error:
    return error
  error = kernel_error(args.impl, args.kv_dtype, args.kv_dtypes, args.model)
  if error:
    return error
  for flag, text, minimum, strict in (
      ("--sweep-rates", args.sweep_rates, 0.0, False),
      ("--sweep-cache-fractions", args.sweep_cache_fractions, 0.0, True)):
    error = _number_list(text, flag, minimum, strict)[1]
    if error:
      return error
  if not args.mode_list and not args.merge:
    return "--modes names no mode"
  return merge_error(args.merge)


def kernel_error(impl: str, kv_dtype: str, kv_dtypes=(),
                 model: str | None = None) -> str | None:
  """The first problem with --impl, --kv-dtype (empty: the model's compute
  dtype) and --kv-dtypes entries as one line, or None; also checked by
  the benchmarks that take these options without the rest (decode_step,
  mixed_step).  With `model` (a --model of `MODEL_DTYPES`), a pool must be
  in its compute dtype or float8, as the engine requires."""
  from benchmarks.rag_serving_setup import MODEL_DTYPES
  from lazyattn_jax.cache_config import COMPUTE_DTYPES, FLOAT8_POOL
  from pallas_kernels.lazy_attention import IMPLS
  if impl not in IMPLS:
    return f"--impl must be one of {IMPLS}, got {impl!r}"
  pools = COMPUTE_DTYPES + (FLOAT8_POOL,)
  compute = MODEL_DTYPES.get(model)
  for flag, dtype in ([("--kv-dtype", kv_dtype)] if kv_dtype else
                      []) + [("--kv-dtypes", d) for d in kv_dtypes]:
    if dtype not in pools:
      return f"{flag} must be among {pools}, got {dtype!r}"
    if compute is not None and dtype not in (compute, FLOAT8_POOL):
      return (f"{flag} {dtype} does not match --model {model}'s compute "
              f"dtype: give {compute} or {FLOAT8_POOL}")
  return None


def not_run_error(args, defaults, names, program: str) -> str | None:
  """One line naming the options of `names` (attribute names) whose value
  in `args` differs from `defaults` (the same command line's values when
  they are left out), for a benchmark (`program`) that parses rag_serving's
  options but never runs those: they are refused, not ignored.  None when
  every one is left at its default."""
  given = [_flag(n) for n in names if getattr(args, n) != getattr(defaults, n)]
  if not given:
    return None
  return (f"{', '.join(given)}: options of benchmarks.rag_serving that "
          f"{program} does not run; leave them out")


def merge_error(paths) -> str | None:
  """The first --merge file that is not a run's .partial.jsonl rows (one
  JSON row with a kind and a mode a line), as one line, or None."""
  import json
  rows = 0
  for path in paths:
    try:
      with open(path) as f:
        lines = f.read().splitlines()
    except OSError as e:
      return f"--merge cannot read {path}: {e.strerror}"
    for number, line in enumerate(lines, 1):
      try:
        row = json.loads(line)
      except ValueError:
        row = None
      if not (isinstance(row, dict) and
              row.get("kind") in ("base", "rate", "cache") and "mode" in row):
        return (f"--merge {path} line {number} is not a run's row: give the "
                f".partial.jsonl files runs write beside --out, not a report")
      rows += 1
  if paths and not rows:
    return f"--merge: no rows in {' '.join(paths)}"
  return None


def largest_request_pages(args, mode: str, hidden_size: int,
                          quality=None) -> int:
  """Pages the trace's largest request takes in `mode` against the whole
  pool, counted as the engine's own check counts them
  (`RequestValidator._check_capacity`); every request of the trace has
  --docs-per-request distinct documents of --doc-len tokens."""
  from lazyattn_jax.modes import make_mode
  from lazyattn_jax.requests import TokenRequest
  from lazyattn_jax.sampling import SamplingParams
  page = args.page_size
  reuse = make_mode(mode, page, "capacity-check", quality,
                    hidden_size=hidden_size,
                    max_doc_tokens=ceil_div(args.doc_len, page) * page)
  docs = tuple(tuple([i + 1] * args.doc_len)
               for i in range(args.docs_per_request))
  request = TokenRequest((1,) * args.query_len, docs,
                         SamplingParams(max_new_tokens=args.output_len))
  return reuse.cache_needs(request).pages(page)


def pool_error(args, hidden_size: int, pools) -> str | None:
  """One line naming the first planned run whose pool cannot hold its
  mode's largest request, or None.  `pools`: (mode, quality run name or "",
  pages, the option that sets those pages) of every planned run."""
  from benchmarks.rag_serving import quality_options_named
  from types import SimpleNamespace
  needed = {}
  for mode, quality_name, pages, option in pools:
    key = (mode, quality_name)
    if key not in needed:
      quality = (quality_options_named(
          quality_name, SimpleNamespace(hidden_size=hidden_size),
          args.sink_len) if quality_name else None)
      needed[key] = largest_request_pages(args, mode, hidden_size, quality)
    if needed[key] > pages:
      label = f"{mode} + {quality_name}" if quality_name else mode
      return (f"mode {label}: the largest request needs {needed[key]} pages "
              f"but the pool has {pages}; raise {option}")
  return None


def planned_pools(args, config, dtype: str, base_pages: int) -> list:
  """(mode, quality run name, pages, option setting the pages) of every run
  rag_serving.main will make, in its order."""
  from benchmarks.rag_serving_setup import cache_pages_for, same_bytes_pages
  base_option = ("--cache-pages" if args.cache_pages else
                 "--cache-fraction or --cache-pages (or give "
                 "--add-working-pages)")
  pools = []
  for mode in ([] if args.skip_base else args.mode_list):
    # the plain run or the decode-during-prefill one: the base pool
    pools.append((mode, "", base_pages, base_option))
    for kv_dtype in args.kv_dtypes:
      pools.append((mode, "", same_bytes_pages(config, args, dtype, kv_dtype,
                                               base_pages),
                    f"{base_option} (--kv-dtypes {kv_dtype} runs)"))
    for name in (args.quality_runs if mode in ("lazy", "block") else []):
      pools.append((mode, name, base_pages, base_option))
  if args.sweep_rates:
    pools += [(mode, "", base_pages, base_option) for mode in args.mode_list]
  for fraction in _number_list(args.sweep_cache_fractions, "", 0, True)[0]:
    pools += [(mode, "", cache_pages_for(args, fraction),
               f"--sweep-cache-fractions {fraction:g}")
              for mode in args.mode_list]
  return pools
