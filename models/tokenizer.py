"""Tokenizer and chat template for Llama-family models, from a GGUF file or a
Hugging Face `tokenizer.json`.

A GGUF file's tokenizer is rebuilt from its metadata by
`models.gguf_tokenizer`; chat templates are compiled by
`models.chat_template`.

Conventions for the engine: documents are encoded on their own, without BOS
(`encode(text)`); a string query is wrapped in the model's chat format
(`chat_prompt`). Encoding never runs the post-processor, so BOS is only ever
added where `add_bos=True` asks for it or where the chat template writes it.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers

from models.chat_template import compile_chat_template
from models.errors import ModelFormatError, UnsupportedTokenizerError
from models.json_files import read_json_object
from models.gguf_tokenizer import (PRE_TOKENIZERS_ADDING_BOS,
                                   bpe_from_gguf_metadata, read_gguf_fields)

__all__ = ["IncrementalDecoder", "LlamaTokenizer", "UnsupportedTokenizerError"]

# Special tokens that end an assistant turn in common chat formats. Where the
# vocabulary has one as a special token, generation stops on it as on EOS.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>",
                       "<|end_of_text|>", "<|eom_id|>", "<end_of_turn>",
                       "<|end|>", "</s>")


def _special_token_content(value: Any) -> str | None:
  """tokenizer_config.json writes a special token as a string or as a dict
  with its "content"."""
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


def _post_processor_adds_bos(backend: tokenizers.Tokenizer,
                             bos: str | None) -> bool:
  """Whether tokenizer.json's post-processor puts `bos` before a single
  text (Llama 3's way, and transformers 5's files', of asking for BOS
  where tokenizer_config.json has no add_bos_token); transformers and
  llama.cpp's converter read it so."""
  if bos is None:
    return False
  processor = json.loads(backend.to_str()).get("post_processor") or {}
  parts = (processor.get("processors") or [] if processor.get("type") ==
           "Sequence" else [processor])
  for part in parts:
    if isinstance(part, dict) and part.get("type") == "TemplateProcessing":
      single = part.get("single") or [{}]
      first = single[0] if isinstance(single[0], dict) else {}
      return (first.get("SpecialToken") or {}).get("id") == bos
  return False


def _gguf_adds_bos(meta: dict[str, Any]) -> bool:
  """tokenizer.ggml.add_bos_token, or where the file has none, llama.cpp's
  default for its pre-tokenizer (BOS after Llama 3's)."""
  flag = meta.get("tokenizer.ggml.add_bos_token")
  if flag is not None:
    return bool(flag)
  return meta.get("tokenizer.ggml.pre") in PRE_TOKENIZERS_ADDING_BOS


def _as_id_list(value: Any) -> list[int]:
  if value is None:
    return []
  if isinstance(value, int):
    return [value]
  return [v for v in value if isinstance(v, int)]


class LlamaTokenizer:
  """Text <-> token ids for one model, plus its chat template.

  Build it with `from_gguf` or `from_tokenizer_json`. All encoding is without
  the post-processor: `encode(text)` returns exactly the tokens of `text`, with
  BOS only if `add_bos=True`.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *,
               bos_token_id: int | None, eos_token_id: int | None,
               pad_token_id: int | None = None,
               extra_stop_token_ids: Iterable[int] = (),
               chat_template: str | None = None,
               add_bos_token: bool = False):
    """Wraps a `tokenizers.Tokenizer`.

    Args:
      tokenizer: the backend; its added special tokens are the control tokens.
      bos_token_id, eos_token_id, pad_token_id: special ids, or None.
      extra_stop_token_ids: ids that end generation besides EOS.
      chat_template: a Jinja chat template, or None.
      add_bos_token: whether the model expects BOS before plain text prompts
        (informational; `encode` only adds it when asked).
    """
    self._tokenizer = tokenizer
    self._vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    for name, value in (("bos_token_id", bos_token_id),
                        ("eos_token_id", eos_token_id),
                        ("pad_token_id", pad_token_id)):
      if value is not None and not 0 <= value < self._vocab_size:
        raise ValueError(f"{name}={value} is outside the vocabulary of "
                         f"{self._vocab_size} tokens")
    self.bos_token_id = bos_token_id
    self.eos_token_id = eos_token_id
    self.pad_token_id = pad_token_id
    self.add_bos_token = add_bos_token
    self.chat_template = chat_template
    self._compiled_template = (compile_chat_template(chat_template)
                               if chat_template else None)

    special = {token.content: token_id for token_id, token in
               tokenizer.get_added_tokens_decoder().items() if token.special}
    stops = set(extra_stop_token_ids)
    if eos_token_id is not None:
      stops.add(eos_token_id)
    stops.update(special[t] for t in _END_OF_TURN_TOKENS if t in special)
    for token_id in stops:
      if not 0 <= token_id < self._vocab_size:
        raise ValueError(f"stop token id {token_id} is outside the vocabulary "
                         f"of {self._vocab_size} tokens")
    self.stop_token_ids: tuple[int, ...] = tuple(sorted(stops))
    self._plain_text_tokenizer = None  # built on first parse_special=False

  # --- construction -------------------------------------------------------

  @classmethod
  def from_gguf(cls, path_or_reader) -> "LlamaTokenizer":
    """Builds the tokenizer a GGUF file describes.

    Args:
      path_or_reader: a path to a .gguf file, or an open `gguf.GGUFReader`
        (so a weights loader that has one need not parse the file twice).

    Raises:
      UnsupportedTokenizerError: the file's tokenizer is not a byte-level BPE
        (`tokenizer.ggml.model` "gpt2") with a known pre-tokenizer.
      ModelFormatError: a path that is not a readable GGUF file, or
        tokenizer metadata that contradicts itself (merges of tokens the
        vocabulary lacks, a special id outside it, a chat template that
        does not compile).
    """
    if isinstance(path_or_reader, (str, os.PathLike)):
      from models.gguf_metadata import open_gguf
      reader, _ = open_gguf(os.fspath(path_or_reader))
    else:
      reader = path_or_reader
    return cls.from_gguf_metadata(read_gguf_fields(reader))

  @classmethod
  def from_gguf_metadata(cls, meta: dict[str, Any]) -> "LlamaTokenizer":
    """Builds the tokenizer from GGUF `tokenizer.*` metadata values.

    Raises:
      UnsupportedTokenizerError, ModelFormatError: as `from_gguf`.
    """
    backend = bpe_from_gguf_metadata(meta)
    extra_stops = _as_id_list(meta.get("tokenizer.ggml.eot_token_id"))
    extra_stops += _as_id_list(meta.get("tokenizer.ggml.eom_token_id"))
    return cls._from_file("GGUF tokenizer metadata", backend,
                          bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
                          eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
                          pad_token_id=meta.get(
                              "tokenizer.ggml.padding_token_id"),
                          extra_stop_token_ids=extra_stops,
                          chat_template=meta.get("tokenizer.chat_template"),
                          add_bos_token=_gguf_adds_bos(meta))

  @classmethod
  def from_tokenizer_json(cls, path: str | os.PathLike) -> "LlamaTokenizer":
    """Loads a Hugging Face `tokenizer.json`.

    Args:
      path: the tokenizer.json file, or the model directory holding it. From
        the same directory it also reads, where present, tokenizer_config.json
        (BOS/EOS tokens, chat template, add_bos_token), chat_template.jinja or
        chat_template.json (newer places for the template), and the
        eos_token_id of generation_config.json and config.json (extra stops).

    Raises:
      FileNotFoundError: no tokenizer.json there.
      ModelFormatError: an unreadable tokenizer.json or JSON file beside it,
        a chat template that does not compile, or a special or stop id
        outside the vocabulary.
    """
    path = pathlib.Path(path)
    json_path = path / "tokenizer.json" if path.is_dir() else path
    if not json_path.is_file():
      raise FileNotFoundError(f"no tokenizer.json at {json_path}")
    folder = json_path.parent
    try:
      backend = tokenizers.Tokenizer.from_file(str(json_path))
    except Exception as e:  # the Rust library raises a bare Exception
      raise ModelFormatError(f"{json_path}: not a readable tokenizer.json "
                             f"({e})") from e
    config = read_json_object(folder / "tokenizer_config.json",
                              missing_ok=True)

    def token_id(key):
      content = _special_token_content(config.get(key))
      if content is None and config.get(key) is not None:
        raise ModelFormatError(
            f"{folder / 'tokenizer_config.json'}: {key} must be a string or "
            f"an object with a string \"content\", got {config.get(key)!r}")
      return backend.token_to_id(content) if content is not None else None

    template = config.get("chat_template")
    if isinstance(template, list) and all(isinstance(e, dict)
                                          for e in template):
      # [{"name": ..., "template": ...}, ...]
      template = {e.get("name"): e.get("template")
                  for e in template}.get("default")
    if template is not None and not isinstance(template, str):
      raise ModelFormatError(
          f"{folder / 'tokenizer_config.json'}: chat_template must be a "
          f"string or a list of {{name, template}} objects, got "
          f"{type(template).__name__}")
    if (folder / "chat_template.jinja").is_file():
      template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    elif not template:
      template = read_json_object(folder / "chat_template.json",
                                  missing_ok=True).get("chat_template")

    extra_stops = []
    for name in ("generation_config.json", "config.json"):
      extra_stops += _as_id_list(read_json_object(
          folder / name, missing_ok=True).get("eos_token_id"))
    eos = token_id("eos_token")
    if eos is None and extra_stops:
      eos = extra_stops[0]
    return cls._from_file(str(folder), backend,
                          bos_token_id=token_id("bos_token"),
                          eos_token_id=eos,
                          pad_token_id=token_id("pad_token"),
                          extra_stop_token_ids=extra_stops,
                          chat_template=template or None,
                          add_bos_token=bool(config.get(
                              "add_bos_token", _post_processor_adds_bos(
                                  backend, _special_token_content(
                                      config.get("bos_token"))))))

  @classmethod
  def _from_file(cls, source: str, backend, **settings) -> "LlamaTokenizer":
    """`cls(backend, **settings)` read from `source`: a setting the
    constructor refuses (a special or stop id outside the vocabulary) is
    the file's fault, a ModelFormatError naming it."""
    try:
      return cls(backend, **settings)
    except ModelFormatError:  # a chat template that does not compile
      raise
    except ValueError as e:
      raise ModelFormatError(f"{source}: {e}") from None

  # --- encoding and decoding -----------------------------------------------

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included."""
    return self._vocab_size

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying `tokenizers.Tokenizer` (do not mutate it)."""
    return self._tokenizer

  def encode(self, text: str, *, add_bos: bool = False,
             parse_special: bool = True) -> list[int]:
    """Token ids of `text`.

    Args:
      text: the text; a document is encoded on its own, without BOS.
      add_bos: put the BOS token first.
      parse_special: match special tokens written in the text (such as
        "<|im_end|>") as those tokens, as transformers does; with False they
        are encoded as plain text, for untrusted input.
    """
    if not isinstance(text, str):
      raise TypeError(f"text must be a str, got {type(text).__name__}")
    if add_bos and self.bos_token_id is None:
      raise ValueError("add_bos=True but this tokenizer has no BOS token")
    backend = self._tokenizer if parse_special else self._plain_text_backend()
    ids = backend.encode(text, add_special_tokens=False).ids
    return [self.bos_token_id] + ids if add_bos else ids

  def _plain_text_backend(self) -> tokenizers.Tokenizer:
    # A copy whose special tokens are not matched in text; the switch is a
    # mutable flag, so it lives on a private copy rather than being toggled.
    if self._plain_text_tokenizer is None:
      copy = tokenizers.Tokenizer.from_str(self._tokenizer.to_str())
      copy.encode_special_tokens = True
      self._plain_text_tokenizer = copy
    return self._plain_text_tokenizer

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids`; special tokens are left out unless asked for."""
    ids = [int(i) for i in ids]
    for i in ids:
      if not 0 <= i < self._vocab_size:
        raise ValueError(f"ids: token id {i} is outside the vocabulary of "
                         f"{self._vocab_size} tokens")
    return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

  def incremental_decoder(self, skip_special_tokens: bool = True
                          ) -> "IncrementalDecoder":
    """A decoder for streaming: feed ids as generated, get text as it
    becomes complete (never half a UTF-8 character)."""
    return IncrementalDecoder(self, skip_special_tokens=skip_special_tokens)

  # --- chat ------------------------------------------------------------------

  def render_chat(self, messages: Sequence[dict[str, Any]], *,
                  add_generation_prompt: bool = True) -> str:
    """The chat template applied to `messages` ({"role", "content"} dicts).

    Raises:
      ValueError: the tokenizer has no chat template.
    """
    if self._compiled_template is None:
      raise ValueError("this tokenizer has no chat template")
    token_strings = {}
    for name, token_id in (("bos_token", self.bos_token_id),
                           ("eos_token", self.eos_token_id),
                           ("pad_token", self.pad_token_id)):
      if token_id is not None:
        token_strings[name] = self._tokenizer.id_to_token(token_id)
    return self._compiled_template.render(
        messages=list(messages), add_generation_prompt=add_generation_prompt,
        **token_strings)

  def chat_prompt(self, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat ending in the assistant's turn opener.

    Renders the model's chat template as transformers' `apply_chat_template(
    ..., add_generation_prompt=True, tokenize=True)` does; templates that want
    a default system prompt (SmolLM2's does) insert it when `system` is None.
    Without a chat template, the prompt is the plain text (system text, a blank
    line, then the user text), with BOS where the model expects it.
    """
    if not isinstance(user_text, str):
      raise TypeError(
          f"user_text must be a str, got {type(user_text).__name__}")
    if self._compiled_template is None:
      text = f"{system}\n\n{user_text}" if system else user_text
      return self.encode(text, add_bos=self.add_bos_token
                         and self.bos_token_id is not None)
    messages = []
    if system is not None:
      messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user_text})
    return self.encode(self.render_chat(messages))


class IncrementalDecoder:
  """Streaming detokenization that emits only whole characters.

  Keeps two offsets into the generated ids: text up to `_read` has been
  emitted; decoding restarts from `_prefix` (one step behind) so that
  decoders that depend on context (a SentencePiece leading space) see the
  same context each time. New text is emitted only when it does not end in
  U+FFFD, which is what a byte-level decoder gives for a character whose
  bytes have not all arrived yet. `finish()` emits whatever is left.
  """

  def __init__(self, tokenizer: LlamaTokenizer, *,
               skip_special_tokens: bool = True):
    self._tokenizer = tokenizer
    self._skip_special = skip_special_tokens
    self._ids: list[int] = []
    self._prefix = 0
    self._read = 0

  def _delta(self) -> str:
    before = self._tokenizer.decode(self._ids[self._prefix:self._read],
                                    self._skip_special)
    after = self._tokenizer.decode(self._ids[self._prefix:],
                                   self._skip_special)
    return after[len(before):]

  def push(self, token_ids: int | Iterable[int]) -> str:
    """Adds generated ids; returns the newly completed text (maybe "")."""
    if isinstance(token_ids, int):
      self._ids.append(token_ids)
    else:
      self._ids.extend(int(i) for i in token_ids)
    delta = self._delta()
    if not delta or delta.endswith("\ufffd"):
      return ""
    self._prefix, self._read = self._read, len(self._ids)
    return delta

  def finish(self) -> str:
    """Returns the text still held back (an incomplete character shows as
    U+FFFD) and resets the decoder."""
    delta = self._delta()
    self._ids, self._prefix, self._read = [], 0, 0
    return delta
