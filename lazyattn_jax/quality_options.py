"""Answer-quality options for documents encoded without their neighbours.

A stock model loses answers when each document is encoded alone (lazy and
block modes): nothing before a document's first token, and an attention
sink at the start of every document the query reads.  Two training-free
remedies keep every document's pages shared (zero copy):

- a shared preamble: each document is encoded after the same preamble (the
  chat template's prefix, or P learned vectors), whose KV is itself one
  cache entry; the query reads the preamble once;
- first-page recompute (as in EPIC and MEPIC): per request, the first k
  tokens of each document after the request's first cache entry (the
  preamble, or a text query's chat prefix, else the first document) are
  computed again, attending to everything before them, into the request's
  private pages; the rest of the document is read from the shared pages.

`LazyEngine.from_pretrained` turns them on by default in lazy and block
modes (`default_quality`): first-page recompute for every model, and for
the model the shipped sink was trained on (the embedded SmolLM2), that
sink as the preamble; a model fine-tuned by `lazyattn finetune` gets the
layout it was trained for instead (`lazyattn_jax.trained_quality`).
`LazyEngine(...)` itself takes them as given (off unless given).  See
docs/design.md, "Answer quality".
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np

from lazyattn_jax.errors import InvalidOptionError

PREAMBLES = (None, "chat", "sink")


@dataclasses.dataclass(frozen=True, eq=False)
class QualityOptions:
  """Training-free answer-quality options (lazy and block modes only).

  Attributes:
    preamble: what every document is encoded after: None (nothing: each
      document alone from position 0), "chat" (the chat template's text
      before the user's words; needs a tokenizer with a chat template), or
      "sink" (the learned vectors in `sink`).
    sink: float array [P, D], D the model's hidden size: a learned
      preamble whose KV is computed from these vectors instead of token
      embeddings (preamble="sink" only).
    recompute: recompute the first `recompute_tokens` tokens of each
      document after the request's first cache entry (the preamble, or a
      text query's chat prefix, else the first document), attending to
      everything before them; the rest of the document stays shared.
    recompute_tokens: k, a multiple of the page size (None: one page); a
      shorter document is recomputed whole.
  """

  preamble: str | None = None
  sink: Any = None
  recompute: bool = False
  recompute_tokens: int | None = None

  def __post_init__(self):
    if self.preamble not in PREAMBLES:
      raise InvalidOptionError(
          f"QualityOptions.preamble must be one of {PREAMBLES}, got "
          f"{self.preamble!r}")
    if (self.sink is not None) != (self.preamble == "sink"):
      raise InvalidOptionError(
          "QualityOptions.sink is given exactly when preamble='sink' (got "
          f"preamble={self.preamble!r} and "
          f"{'a' if self.sink is not None else 'no'} sink)")
    if self.sink is not None:
      object.__setattr__(self, "sink", _checked_sink(self.sink))
    if not isinstance(self.recompute, bool):
      raise InvalidOptionError(
          f"QualityOptions.recompute must be a bool, got {self.recompute!r}")
    k = self.recompute_tokens
    if k is not None:
      if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise InvalidOptionError(
            f"QualityOptions.recompute_tokens must be an int >= 1 or None, "
            f"got {k!r}")
      if not self.recompute:
        raise InvalidOptionError(
            "QualityOptions.recompute_tokens needs recompute=True")

  @property
  def enabled(self) -> bool:
    """Whether any option is on."""
    return self.preamble is not None or self.recompute

  def tokens_to_recompute(self, page_size: int) -> int:
    """k for pages of `page_size` tokens (0: recompute is off).

    A whole number of pages, so that a document's shared pages split
    exactly where the recomputed tokens end.
    """
    if not self.recompute:
      return 0
    k = self.recompute_tokens or page_size
    if k % page_size:
      raise InvalidOptionError(
          f"QualityOptions.recompute_tokens={k} is not a multiple of the "
          f"page size ({page_size})")
    return k

  def check_sink_width(self, hidden_size: int):
    if self.sink is not None and self.sink.shape[1] != hidden_size:
      raise InvalidOptionError(
          f"QualityOptions.sink has shape {self.sink.shape}; it must be "
          f"[P, D] with D = the model's hidden size {hidden_size}")

  def _identity(self):
    sink = None if self.sink is None else (
        str(self.sink.dtype), self.sink.shape, self.sink.tobytes())
    return (self.preamble, sink, self.recompute, self.recompute_tokens)

  def __eq__(self, other):
    if not isinstance(other, QualityOptions):
      return NotImplemented
    return self._identity() == other._identity()

  def __hash__(self):
    return hash(self._identity())


def _checked_sink(sink) -> np.ndarray:
  """A read-only copy of a learned preamble: 2-D, floating, finite."""
  try:
    array = np.array(sink, copy=True)
  except Exception as error:  # noqa: BLE001 - any non-array input
    raise InvalidOptionError(
        f"QualityOptions.sink must be an array [P, D], got "
        f"{type(sink).__name__}: {error}") from None
  if not jnp.issubdtype(array.dtype, jnp.floating):
    raise InvalidOptionError(
        f"QualityOptions.sink must hold floats, got dtype {array.dtype}")
  if array.ndim != 2 or 0 in array.shape:
    raise InvalidOptionError(
        f"QualityOptions.sink must be [P, D] with P, D >= 1, got shape "
        f"{array.shape}")
  if not np.isfinite(array.astype(np.float32)).all():
    raise InvalidOptionError("QualityOptions.sink holds NaN or infinity")
  array.setflags(write=False)
  return array


DEFAULT = "default"
# The learned sinks shipped with the package (`lazyattn_jax.training.sink`;
# benchmarks/RESULTS.md, "Answer quality"); each file's metadata names the
# model it was trained for and whether it was trained for float8 pages.
SHIPPED_SINKS = ("data/smollm2_135m_sink.safetensors",
                 "data/smollm2_135m_sink_float8.safetensors")


def shipped_sink_for(model_id: str, kv_dtype=None, files=None):
  """The [P, D] array of a shipped sink trained for the model of `model_id`
  (`LoadedModel.model_id`), else None.

  Among several for the model, the one trained for the pool's pages: with
  `--float8-pages` for a float8 `kv_dtype`, without for any other (None:
  16-bit); if none was, the first for the model.  A float8 sink serves a
  pool of any page size: its scales are powers of two, and e4m3 rounds a
  value alike at every power-of-two scale (but in its subnormal range), so
  how the pool's pages split the preamble barely changes its rounding.
  `files` (default SHIPPED_SINKS) are package data paths; an absolute path
  is read as is.
  """
  import importlib.resources
  import pathlib
  from lazyattn_jax.training.sink_file import load_sink
  from pallas_kernels.kv_quant import is_quantized
  float8 = kv_dtype is not None and is_quantized(kv_dtype)
  fallback = None
  for name in SHIPPED_SINKS if files is None else files:
    path = pathlib.Path(name)
    if not path.is_absolute():
      path = importlib.resources.files("lazyattn_jax").joinpath(name)
    with importlib.resources.as_file(path) as file:
      sink, metadata = load_sink(str(file))
    if metadata.get("model_id") != model_id:
      continue
    if (metadata.get("float8_pages") == "true") == float8:
      return sink
    fallback = sink if fallback is None else fallback
  return fallback


def default_quality(takes_options: bool, model_id: str,
                    kv_dtype=None) -> QualityOptions:
  """What `from_pretrained` uses unless told otherwise, for a model not
  fine-tuned for a layout (`trained_quality.trained_default` comes first):
  nothing for modes that take no options (prefix, full); first-page
  recompute for lazy and block, after a shipped sink where one was trained
  for this model (`shipped_sink_for`, for the pool's `kv_dtype`).

  On SmolLM2-135M-Instruct, lazy with both matches full attention on
  HotpotQA and the synthetic set, for about 25% more TTFT at the
  paper-like load (benchmarks/RESULTS.md, "Answer quality")."""
  if not takes_options:
    return QualityOptions()
  sink = shipped_sink_for(model_id, kv_dtype)
  return QualityOptions(preamble=None if sink is None else "sink", sink=sink,
                        recompute=True)


def with_fields(quality: QualityOptions, given: dict) -> QualityOptions:
  """`quality` with the fields in `given` replaced; a new preamble (or
  sink) replaces the old one whole, so a default sink gives way to
  preamble="chat" or preamble=None."""
  if not given:
    return quality
  given = dict(given)
  if "sink" in given and "preamble" not in given:
    given["preamble"] = None if given["sink"] is None else "sink"
  if "preamble" in given and "sink" not in given:
    given["sink"] = None
  if given.get("recompute") is False and "recompute_tokens" not in given:
    given["recompute_tokens"] = None
  return dataclasses.replace(quality, **given)


def pop_quality_fields(settings: dict) -> dict:
  """The QualityOptions fields among keyword `settings` (they leave it)."""
  names = [f.name for f in dataclasses.fields(QualityOptions)]
  return {name: settings.pop(name) for name in names if name in settings}


def split_quality(quality: QualityOptions | None,
                  settings: dict) -> QualityOptions:
  """`quality` (default QualityOptions()) with the QualityOptions fields
  among keyword `settings` applied; those fields leave `settings`."""
  quality = quality or QualityOptions()
  if not isinstance(quality, QualityOptions):
    raise InvalidOptionError(
        f"quality must be a QualityOptions, got {type(quality).__name__}")
  return with_fields(quality, pop_quality_fields(settings))
