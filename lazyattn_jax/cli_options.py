"""Command-line options made from a settings dataclass: one option per
field, named after it, typed by its default, and documented by the class
docstring's "Attributes:" section, so the help never drifts from the docs.
The answer-quality options (QualityOptions) take their help from there too,
with flags shaped for a command line (a file for the learned preamble)."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import re


def attribute_docs(cls) -> dict[str, str]:
  """`name: text` entries of a class docstring's "Attributes:" section."""
  doc = inspect.getdoc(cls) or ""
  section = doc.split("Attributes:", 1)[1] if "Attributes:" in doc else ""
  docs: dict[str, str] = {}
  name = None
  for line in section.splitlines():
    match = re.match(r"^  (\w+): (.*)$", line)
    if match:
      name = match.group(1)
      docs[name] = match.group(2)
    elif name and line.startswith("    "):
      docs[name] += " " + line.strip()
    elif line.strip():
      break
  return docs


def add_config_options(parser, cls, names, *, use_defaults: bool = True,
                       shown_defaults=None):
  """Adds --field-name options for `names` of dataclass `cls`.

  `use_defaults=False` leaves unset options None, so the caller passes only
  what the user set (and the owner's own defaults apply); `shown_defaults`
  (name -> value) names in the help the defaults the caller applies
  itself to unset options.
  """
  docs = attribute_docs(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for name in names:
    default = fields[name].default
    text = docs.get(name, "").replace("%", "%%")
    if shown_defaults and name in shown_defaults:
      text += f" (default here: {shown_defaults[name]})"
    elif use_defaults:
      text += f" (default: {default})"
    flag = "--" + name.replace("_", "-")
    unset = default if use_defaults else None
    if isinstance(default, bool):  # --name / --no-name
      parser.add_argument(flag, action=argparse.BooleanOptionalAction,
                          default=unset, help=text)
      continue
    kind = float if isinstance(default, float) else int
    parser.add_argument(flag, type=kind, default=unset, help=text)


def chosen(args, names) -> dict:
  """The options of `names` that were given a value."""
  return {name: getattr(args, name) for name in names
          if getattr(args, name) is not None}


def add_quality_options(parser):
  """--preamble chat, --sink FILE.npy, --recompute, --recompute-tokens K,
  --no-default-quality."""
  from lazyattn_jax.quality_options import QualityOptions
  docs = {k: v.replace("%", "%%")
          for k, v in attribute_docs(QualityOptions).items()}
  group = parser.add_argument_group("answer quality (lazy and block modes)")
  group.add_argument("--preamble", choices=["chat"],
                     help="encode every document after the chat template's "
                          "text before the user's words (QualityOptions."
                          "preamble)")
  group.add_argument("--sink", metavar="FILE",
                     help="encode every document after these learned "
                          "vectors: the .safetensors file that `python -m "
                          "lazyattn_jax.training.sink` writes, or a .npy "
                          "file of shape [P, D], D the model's hidden size "
                          "(QualityOptions.sink)")
  group.add_argument("--recompute", action="store_true",
                     help=docs["recompute"].replace(
                         "`recompute_tokens`", "K (--recompute-tokens)"))
  group.add_argument("--recompute-tokens", type=int, metavar="K",
                     help="k, a multiple of the page size (default: one "
                          "page); implies --recompute")
  group.add_argument("--no-default-quality", action="store_true",
                     help="turn off the options on by default in lazy and "
                          "block modes (first-page recompute, and the "
                          "shipped learned sink for the default model); "
                          "the options above still apply")


def read_sink(path: str):
  """A learned sink's [P, D] array from a .npy file or a sink .safetensors
  file.  Raises ValueError naming the file when it cannot be read."""
  import numpy as np
  from lazyattn_jax.training.errors import SinkFormatError
  from lazyattn_jax.training.sink_file import load_sink
  try:
    if str(path).endswith(".npy"):
      return np.load(path, allow_pickle=False)
    return load_sink(path)[0]
  except (OSError, ValueError, SinkFormatError) as error:
    raise ValueError(f"cannot read --sink {path}: {error}") from None


def quality_settings(args) -> dict:
  """QualityOptions fields from the options of `add_quality_options`, as
  `LazyEngine.from_pretrained` takes them.  Raises ValueError (a usage
  error) for a sink file that cannot be read or a contradiction."""
  settings = {}
  if getattr(args, "no_default_quality", False):
    settings["quality"] = None
  if args.preamble and args.sink:
    raise ValueError("--preamble and --sink are two preambles: give one")
  if args.preamble:
    settings["preamble"] = args.preamble
  if args.sink:
    settings.update(preamble="sink", sink=read_sink(args.sink))
  if args.recompute or args.recompute_tokens is not None:
    settings["recompute"] = True
  if args.recompute_tokens is not None:
    settings["recompute_tokens"] = args.recompute_tokens
  return settings
