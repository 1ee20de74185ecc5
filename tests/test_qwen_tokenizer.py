"""Qwen's tokenizer and ChatML chat template through `LlamaTokenizer`, from
GGUF metadata (`tokenizer.ggml.pre` "qwen2") and from tokenizer.json.

The reference is transformers' own `Qwen2Tokenizer` (NFC, Qwen's split regex,
byte-level BPE) built on the same vocabulary and merges.  The vocabulary is
SmolLM2's (a real byte-level BPE whose control tokens include ChatML's
<|im_start|>, <|im_end|> and <|endoftext|>), read from the embedded model's
GGUF file; only the pre-tokenizer and template make it Qwen's.
"""

from __future__ import annotations

import pytest

from lazyattn_jax.default_model import default_gguf_path
from models.tokenizer import LlamaTokenizer
from tests.tokenizer_strings import STRINGS

transformers = pytest.importorskip("transformers")

# A ChatML template in Qwen2.5's manner: a default system turn when the
# conversation has none.
CHATML = (
    "{% if messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
ENDOFTEXT, IM_START, IM_END = 0, 1, 2  # ids in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def qwen_metadata():
  """SmolLM2's tokenizer metadata, marked as a Qwen2 GGUF file's would be."""
  import gguf
  from models.gguf_tokenizer import read_gguf_fields
  meta = read_gguf_fields(gguf.GGUFReader(default_gguf_path(progress=False)))
  return {**meta, "tokenizer.ggml.pre": "qwen2",
          "tokenizer.ggml.bos_token_id": ENDOFTEXT,
          "tokenizer.ggml.eos_token_id": IM_END,
          "tokenizer.ggml.padding_token_id": ENDOFTEXT,
          "tokenizer.ggml.add_bos_token": False,
          "tokenizer.chat_template": CHATML}


@pytest.fixture(scope="module")
def ours(qwen_metadata):
  return LlamaTokenizer.from_gguf_metadata(qwen_metadata)


@pytest.fixture(scope="module")
def hf_qwen(qwen_metadata):
  tokens = qwen_metadata["tokenizer.ggml.tokens"]
  control = [t for t, kind in zip(tokens,
                                  qwen_metadata["tokenizer.ggml.token_type"])
             if kind == 3]
  hf = transformers.Qwen2Tokenizer(
      vocab={t: i for i, t in enumerate(tokens)},
      merges=[tuple(m.split(" ")) for m in
              qwen_metadata["tokenizer.ggml.merges"]],
      eos_token="<|im_end|>", chat_template=CHATML)
  hf.add_special_tokens({"additional_special_tokens": control})
  return hf


def _chat_ids(hf, messages):
  out = hf.apply_chat_template(messages, add_generation_prompt=True,
                               tokenize=True)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_ids_match_transformers_qwen2_tokenizer(ours, hf_qwen):
  mismatches = [(s, ours.encode(s), hf_qwen.encode(s, add_special_tokens=False))
                for s in STRINGS]
  mismatches = [m for m in mismatches if m[1] != m[2]]
  assert not mismatches, f"{len(mismatches)} differ, e.g. {mismatches[:3]}"


def test_digits_one_by_one_and_text_normalized_to_nfc(ours, qwen_metadata):
  pieces = lambda tok, s: [p for p, _ in
                           tok.backend.pre_tokenizer.pre_tokenize_str(s)]
  assert pieces(ours, "abc 12345") == ["abc", "\u0120", "1", "2", "3", "4",
                                       "5"]
  llama3 = LlamaTokenizer.from_gguf_metadata(
      {**qwen_metadata, "tokenizer.ggml.pre": "llama-bpe"})
  assert pieces(llama3, "abc 12345") == ["abc", "\u0120", "123", "45"]
  # A decomposed accent encodes as the composed character.
  assert ours.encode("cafe\u0301") == ours.encode("caf\u00e9")
  assert llama3.encode("cafe\u0301") != llama3.encode("caf\u00e9")


def test_special_ids_and_stops(ours):
  assert (ours.bos_token_id, ours.eos_token_id) == (ENDOFTEXT, IM_END)
  assert {IM_END, ENDOFTEXT} <= set(ours.stop_token_ids)
  assert not ours.add_bos_token
  assert ours.encode("<|im_start|>user")[0] == IM_START


def test_chatml_prompt_from_gguf_matches_apply_chat_template(ours, hf_qwen):
  for user in ["What is the capital of France?", "  x\n\ny  ",
               "\u4f60\u597d 2024"]:
    assert ours.chat_prompt(user) == _chat_ids(
        hf_qwen, [{"role": "user", "content": user}]), repr(user)
  system = "Answer in one word."
  assert ours.chat_prompt("Sky colour?", system=system) == _chat_ids(
      hf_qwen, [{"role": "system", "content": system},
                {"role": "user", "content": "Sky colour?"}])


def test_from_tokenizer_json_matches_transformers(hf_qwen, tmp_path):
  hf_qwen.save_pretrained(tmp_path)
  loaded = LlamaTokenizer.from_tokenizer_json(tmp_path)
  assert loaded.vocab_size == len(hf_qwen)
  assert loaded.eos_token_id == IM_END and loaded.bos_token_id is None
  assert {IM_END, ENDOFTEXT} <= set(loaded.stop_token_ids)
  for s in STRINGS[::3]:
    assert loaded.encode(s) == hf_qwen.encode(s, add_special_tokens=False), \
        repr(s)
  assert loaded.chat_prompt("hi") == _chat_ids(
      hf_qwen, [{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("form", ["safetensors", "gguf"])
def test_engine_wraps_a_string_query_in_chatml(form, qwen_metadata, hf_qwen,
                                               tmp_path):
  """From a Qwen2 checkpoint, an HF directory with its tokenizer.json or a
  GGUF file with its tokenizer metadata: a string query becomes the shared
  ChatML prefix (system turn, user header), then the documents, then the
  query and the assistant header."""
  from lazyattn_jax.engine import LazyEngine
  from lazyattn_jax.requests import chat_parts
  from tests.hf_arch_models import hf_model, write_gguf_like_llama_cpp
  model = hf_model("qwen2", vocab_size=len(hf_qwen))
  if form == "safetensors":
    model.save_pretrained(tmp_path, safe_serialization=True)
    hf_qwen.save_pretrained(tmp_path)
    path = tmp_path
  else:
    path = tmp_path / "qwen2.gguf"
    write_gguf_like_llama_cpp(path, model, "qwen2", metadata={
        k: v for k, v in qwen_metadata.items()
        if k not in ("tokenizer.ggml.bos_token_id",
                     "tokenizer.ggml.eos_token_id")})
  engine = LazyEngine.from_pretrained(path, impl="xla", num_pages=64,
                                      page_size=8, max_batch=1,
                                      progress=False)
  prefix, query = chat_parts(engine.tokenizer, "Who built it?")
  assert engine.tokenizer.decode(prefix, skip_special_tokens=False) == (
      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
      "<|im_start|>user\n")
  assert engine.tokenizer.decode(query, skip_special_tokens=False) == (
      "Who built it?<|im_end|>\n<|im_start|>assistant\n")
  assert IM_END in engine.default_stop_ids()
  document = "The Orrin Bridge was built in 1887 by Mara Delacourt."
  as_text = engine.generate("Who built it?", [document], max_new_tokens=4,
                            stop_token_ids=())
  as_ids = engine.generate(query, [prefix, engine.tokenizer.encode(
      document + "\n\n")], max_new_tokens=4, stop_token_ids=())
  assert as_text.token_ids == as_ids.token_ids
  assert as_ids.doc_hits == [True, True]  # the same prefix and document
