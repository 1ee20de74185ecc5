"""Chat templates (Jinja) compiled as transformers' apply_chat_template does."""

from __future__ import annotations

import datetime
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

from models.errors import ModelFormatError


def compile_chat_template(template: str) -> jinja2.Template:
  """Compiles a chat template the way transformers' apply_chat_template does:
  a sandbox (templates come from model files, which are untrusted), blocks
  trimmed, loop controls, `raise_exception`, `strftime_now` and a `tojson`
  that does not HTML-escape.

  Raises:
    ModelFormatError: the template does not compile (it came from a model
      file, so the file is at fault).
  """

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(value, ensure_ascii=False, indent=None, separators=None,
             sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  env = jinja2.sandbox.ImmutableSandboxedEnvironment(
      trim_blocks=True, lstrip_blocks=True,
      extensions=[jinja2.ext.loopcontrols])
  env.filters["tojson"] = tojson
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  try:
    return env.from_string(template)
  except jinja2.TemplateSyntaxError as e:
    raise ModelFormatError(f"the chat template does not compile: {e} (line "
                           f"{e.lineno})") from e
