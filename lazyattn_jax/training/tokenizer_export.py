"""Writing a LlamaTokenizer as Hugging Face tokenizer files.

A GGUF model carries its tokenizer as metadata, rebuilt by
`models.gguf_tokenizer` into a `tokenizers.Tokenizer`; exported weights
need it as files.  This writes that same backend as tokenizer.json, the
special tokens, BOS setting and chat template as tokenizer_config.json,
and every stop id as generation_config.json's eos_token_id, which is what
`LlamaTokenizer.from_tokenizer_json` reads back: the same ids for every
text, the same chat prompt, the same stop tokens.
"""

from __future__ import annotations

import json
import os


def _content(tokenizer, token_id):
  return None if token_id is None else tokenizer.backend.id_to_token(token_id)


def export_tokenizer(tokenizer, directory) -> list[str]:
  """Writes tokenizer.json, tokenizer_config.json and
  generation_config.json for `tokenizer` (a models.tokenizer
  LlamaTokenizer) into `directory`; returns the paths."""
  directory = os.fspath(directory)
  os.makedirs(directory, exist_ok=True)
  paths = [os.path.join(directory, name) for name in (
      "tokenizer.json", "tokenizer_config.json", "generation_config.json")]
  tokenizer.backend.save(paths[0])
  config = {"tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": _content(tokenizer, tokenizer.bos_token_id),
            "eos_token": _content(tokenizer, tokenizer.eos_token_id),
            "pad_token": _content(tokenizer, tokenizer.pad_token_id),
            "add_bos_token": bool(tokenizer.add_bos_token),
            "clean_up_tokenization_spaces": False}
  if tokenizer.chat_template:
    config["chat_template"] = tokenizer.chat_template
  generation = {"eos_token_id": list(tokenizer.stop_token_ids)}
  if tokenizer.bos_token_id is not None:
    generation["bos_token_id"] = tokenizer.bos_token_id
  for path, value in zip(paths[1:], (config, generation)):
    with open(path, "w", encoding="utf-8") as f:
      json.dump(value, f, indent=2, ensure_ascii=False)
  return paths
