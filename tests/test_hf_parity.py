"""Issue 4 acceptance: the real SmolLM2-135M-Instruct GGUF, our loader and
paged forward pass (impl="xla") against HF transformers (PyTorch, CPU,
float32) loading the same file, on a full-attention prompt."""

import numpy as np
import pytest

from tests.hf_fixtures import greedy_generate_paged, hf_greedy

NUM_GREEDY = 32
PROMPT = [{"role": "user",
           "content": "Write a short story about a lighthouse keeper who "
                      "finds a message in a bottle."}]


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def prompt_ids(hf_smollm2):
  _, tokenizer = hf_smollm2
  ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True,
                                      tokenize=True)
  if isinstance(ids, dict) or hasattr(ids, "keys"):
    ids = ids["input_ids"]
  return [int(t) for t in ids]


def test_config_read_from_gguf(smollm2_ours):
  config, _, metadata = smollm2_ours
  assert (config.vocab_size, config.hidden_size, config.num_layers,
          config.num_heads, config.num_kv_heads, config.head_dim,
          config.intermediate_size) == (49152, 576, 30, 9, 3, 64, 1536)
  assert config.rope_theta == 100000.0 and config.rope_scaling is None
  assert config.tie_word_embeddings
  assert metadata.tokenizer_model == "gpt2"
  assert len(metadata.tokens) == 49152 and len(metadata.merges) > 40000
  assert "<|im_start|>" in metadata.chat_template
  # The tokenizer can be built from what load_gguf already read.
  from models.tokenizer import LlamaTokenizer
  tokenizer = LlamaTokenizer.from_gguf_metadata(metadata.key_values())
  assert tokenizer.encode("The capital of France is") == [504, 3575, 282,
                                                          4649, 314]


def test_full_prompt_logits_and_greedy_tokens_match_hf(
    smollm2_ours, hf_smollm2, prompt_ids):
  _, model, _ = smollm2_ours
  hf_model, _ = hf_smollm2
  assert len(prompt_ids) > 20  # spans several 16-slot pages

  prompt_logits, ours_tokens, ours_step_logits = greedy_generate_paged(
      model, prompt_ids, NUM_GREEDY, page_size=16, impl="xla")
  hf_tokens, hf_step_logits = hf_greedy(hf_model, prompt_ids, NUM_GREEDY)

  # Last prompt token: the logits that choose the first generated token.
  assert _rel(prompt_logits[-1], hf_step_logits[0]) < 1e-3
  assert ours_tokens == hf_tokens
  # Every decode step of the paged pool stays on HF's logits, too.
  for step in range(NUM_GREEDY):
    assert _rel(ours_step_logits[step], hf_step_logits[step]) < 1e-3, step
