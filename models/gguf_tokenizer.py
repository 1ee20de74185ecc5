"""Rebuild a byte-level BPE tokenizer from a GGUF file's metadata.

A GGUF file carries no `tokenizer.json`: it stores the vocabulary, the merges,
the token types, the special token ids and the chat template as metadata
under llama.cpp's key names.  `bpe_from_gguf_metadata` rebuilds the byte-level
BPE from them with the `tokenizers` library.  How text is split before BPE
(the pre-tokenizer) is not stored, only named by `tokenizer.ggml.pre`; the
table `_PRE_TOKENIZER_SPLITS` maps the names we support to the split that the
model's own tokenizer uses (the same regexes as llama.cpp's llama-vocab.cpp).
`models.tokenizer.LlamaTokenizer.from_gguf` is the public way in.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tokenizers
from tokenizers import (AddedToken, Regex, decoders, models, normalizers,
                        pre_tokenizers)

from models.errors import ModelFormatError, UnsupportedTokenizerError

# llama.cpp's token types (gguf.TokenType), from tokenizer.ggml.token_type.
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# GPT-2's pre-tokenizer regex, which `ByteLevel(use_regex=True)` applies.
_GPT2_SPLIT = (r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+"
               r"|\s+(?!\S)|\s+")
# Llama 3's pre-tokenizer regex (numbers in groups of up to three digits).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                 r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
                 r"|\s+")
# Qwen2's (Qwen2, Qwen2.5, Qwen3): Llama 3's, with every digit on its own.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+"
                r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)"
                r"|\s+")


@dataclasses.dataclass(frozen=True)
class _PreTokenizerSpec:
  """How a vocabulary's training split text: regexes applied in order (each
  one isolates its matches), then the byte-level alphabet."""
  splits: tuple[str, ...]
  ignore_merges: bool = False  # a whole pre-token in the vocab wins (Llama 3)
  nfc: bool = False  # text is NFC-normalized first (Qwen2's tokenizer.json)


_GPT2_SPEC = _PreTokenizerSpec((_GPT2_SPLIT,))
# StarCoder-style vocabularies, SmolLM's among them: every digit on its own,
# then GPT-2's split. The original SmolLM2 tokenizer.json says the same with
# Digits(individual_digits=True) followed by ByteLevel(use_regex=True).
_DIGITS_THEN_GPT2_SPEC = _PreTokenizerSpec((r"\p{N}", _GPT2_SPLIT))
_LLAMA3_SPEC = _PreTokenizerSpec((_LLAMA3_SPLIT,), ignore_merges=True)
# llama.cpp does not normalize; the model's own tokenizer (and transformers'
# Qwen2Tokenizer) does, and they are what the model was trained with.
_QWEN2_SPEC = _PreTokenizerSpec((_QWEN2_SPLIT,), nfc=True)

_PRE_TOKENIZER_SPLITS: dict[str, _PreTokenizerSpec] = {
    "default": _GPT2_SPEC,
    "gpt2": _GPT2_SPEC,
    "smollm": _DIGITS_THEN_GPT2_SPEC,
    "starcoder": _DIGITS_THEN_GPT2_SPEC,
    "refact": _DIGITS_THEN_GPT2_SPEC,
    "codeshell": _DIGITS_THEN_GPT2_SPEC,
    "llama-bpe": _LLAMA3_SPEC,
    "llama3": _LLAMA3_SPEC,
    "llama-v3": _LLAMA3_SPEC,
    "falcon3": _LLAMA3_SPEC,
    "smaug-bpe": _LLAMA3_SPEC,
    "dbrx": _LLAMA3_SPEC,
    "qwen2": _QWEN2_SPEC,
}

# Pre-tokenizers after which llama.cpp puts BOS before a prompt when the file
# has no tokenizer.ggml.add_bos_token key (its vocabulary loader's default;
# every other BPE pre-tokenizer defaults to no BOS).
PRE_TOKENIZERS_ADDING_BOS = frozenset({"llama-bpe", "llama3", "llama-v3",
                                       "falcon3"})


def _byte_to_unicode() -> dict[int, str]:
  """GPT-2's byte-level alphabet: each byte as one printable character.

  Printable Latin-1 bytes stand for themselves; the others (controls, space)
  are moved to code points 256 and up, in byte order.
  """
  printable = (list(range(ord("!"), ord("~") + 1))
               + list(range(ord("\xa1"), ord("\xac") + 1))
               + list(range(ord("\xae"), ord("\xff") + 1)))
  mapping = {}
  moved = 0
  for byte in range(256):
    if byte in printable:
      mapping[byte] = chr(byte)
    else:
      mapping[byte] = chr(256 + moved)
      moved += 1
  return mapping


def _byte_level_spelling(token: str, alphabet: frozenset[str],
                         spelling: dict[int, str]) -> str:
  """A GGUF token as the BPE model knows it. Byte-level files store tokens in
  the byte alphabet already; a token with any other character is re-spelled
  from its UTF-8 bytes (as transformers' GGUF converter does)."""
  if set(token) <= alphabet:
    return token
  return "".join(spelling[b] for b in token.encode("utf-8"))


def _pre_tokenizer(spec: _PreTokenizerSpec) -> pre_tokenizers.PreTokenizer:
  steps = [pre_tokenizers.Split(Regex(pattern), behavior="isolated")
           for pattern in spec.splits]
  steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False,
                                        use_regex=False))
  return pre_tokenizers.Sequence(steps)


def read_gguf_fields(reader) -> dict[str, Any]:
  """The tokenizer.* metadata of a GGUFReader as Python values."""
  return {key: field.contents() for key, field in reader.fields.items()
          if key.startswith("tokenizer.")}


def bpe_from_gguf_metadata(meta: dict[str, Any]) -> tokenizers.Tokenizer:
  """The byte-level BPE that GGUF `tokenizer.*` metadata values describe.

  Raises:
    UnsupportedTokenizerError: not a byte-level BPE (`tokenizer.ggml.model`
      "gpt2") with a known pre-tokenizer, or metadata it cannot rebuild
      exactly.
    ModelFormatError: merges that are not two tokens and a space, or that
      name tokens the vocabulary lacks.
  """
  model_type = meta.get("tokenizer.ggml.model")
  if model_type != "gpt2":
    raise UnsupportedTokenizerError(
        f"tokenizer.ggml.model is {model_type!r}; only byte-level BPE "
        "('gpt2') GGUF tokenizers are supported. Pass token ids instead of "
        "text for this model.")
  pre = meta.get("tokenizer.ggml.pre", "default")
  spec = _PRE_TOKENIZER_SPLITS.get(pre)
  if spec is None:
    raise UnsupportedTokenizerError(
        f"tokenizer.ggml.pre is {pre!r}, which is not supported; supported: "
        f"{sorted(_PRE_TOKENIZER_SPLITS)}. Pass token ids instead of text "
        "for this model.")
  tokens = meta.get("tokenizer.ggml.tokens")
  merges = meta.get("tokenizer.ggml.merges")
  if not tokens or merges is None:
    raise UnsupportedTokenizerError(
        "the GGUF metadata lacks tokenizer.ggml.tokens or "
        "tokenizer.ggml.merges")
  token_types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)

  spelling = _byte_to_unicode()
  alphabet = frozenset(spelling.values())
  vocab = {}
  for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
    # A control token is matched whole in the text as it is written, so it
    # keeps its literal spelling (llama.cpp's converter stores added tokens
    # so: DeepSeek's "<｜User｜>"); no merge makes it.
    spelled = (token if token_type == _TOKEN_TYPE_CONTROL else
               _byte_level_spelling(token, alphabet, spelling))
    vocab.setdefault(spelled, token_id)
  pairs = []
  for merge in merges:
    left, sep, right = merge.partition(" ")
    if not sep or " " in right:  # a damaged file, not another tokenizer
      raise ModelFormatError(
          f"tokenizer.ggml.merges holds a malformed merge {merge!r} (two "
          f"tokens and one space expected)")
    pairs.append((left, right))

  try:
    backend = tokenizers.Tokenizer(models.BPE(
        vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False,
        ignore_merges=spec.ignore_merges))
  except Exception as e:  # the Rust library's: a merge of unknown tokens
    raise ModelFormatError(
        f"tokenizer.ggml.merges cannot be built: {e}") from None
  if spec.nfc:
    backend.normalizer = normalizers.NFC()
  backend.pre_tokenizer = _pre_tokenizer(spec)
  backend.decoder = decoders.ByteLevel()

  # Control tokens (<|im_start|>, ...) are matched whole in text and are
  # "special" (skipped by decode); user-defined ones are matched whole but
  # decode as text.
  control, user_defined = [], []
  for token_id, (token, token_type) in enumerate(zip(tokens, token_types)):
    if token_type == _TOKEN_TYPE_CONTROL:
      control.append((token_id, AddedToken(token, special=True,
                                           normalized=False)))
    elif token_type == _TOKEN_TYPE_USER_DEFINED and token in vocab:
      user_defined.append((token_id, AddedToken(token, special=False,
                                                normalized=False)))
  backend.add_special_tokens([t for _, t in control])
  backend.add_tokens([t for _, t in user_defined])
  for token_id, added in control + user_defined:
    if backend.token_to_id(added.content) != token_id:
      raise UnsupportedTokenizerError(
          f"added token {added.content!r} did not keep its id {token_id}")
  if backend.get_vocab_size(with_added_tokens=True) != len(tokens):
    raise UnsupportedTokenizerError(
        f"rebuilt vocabulary has {backend.get_vocab_size(True)} tokens, the "
        f"file lists {len(tokens)}")
  return backend
