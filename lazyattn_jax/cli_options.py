"""Command-line options made from a settings dataclass: one option per
field, named after it, typed by its default, and documented by the class
docstring's "Attributes:" section, so the help never drifts from the docs."""

from __future__ import annotations

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


def add_config_options(parser, cls, names, *, use_defaults: bool = True):
  """Adds --field-name options for `names` of dataclass `cls`.

  `use_defaults=False` leaves unset options None, so the caller passes only
  what the user set (and the owner's own defaults apply).
  """
  docs = attribute_docs(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  for name in names:
    default = fields[name].default
    kind = float if isinstance(default, float) else int
    text = docs.get(name, "").replace("%", "%%")
    if use_defaults:
      text += f" (default: {default})"
    parser.add_argument("--" + name.replace("_", "-"), type=kind,
                        default=default if use_defaults else None, help=text)


def chosen(args, names) -> dict:
  """The options of `names` that were given a value."""
  return {name: getattr(args, name) for name in names
          if getattr(args, name) is not None}
