"""Every supported architecture against HF transformers: a random small
model saved as an HF safetensors checkpoint, served by the engine
(`LazyEngine.from_pretrained`) as a lazy request with three documents, gives
HF's greedy tokens when HF gets the concatenated prompt with contiguous
positions and a 4D block-diagonal document mask (as tests/
test_hf_lazy_parity.py does for the real SmolLM2).  Qwen2's Q/K/V biases and
Qwen3's Q/K norms are random, so a missing or misplaced one changes the
tokens."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from tests.engine_helpers import block_diagonal_mask, dense_lazy_logits
from tests.hf_arch_models import ARCHS, hf_model
from tests.hf_fixtures import hf_lazy_greedy

torch = pytest.importorskip("torch")

DOC_LENGTHS = (7, 12, 5)
QUERY_LENGTH = 6
STEPS = 12


def _rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@functools.lru_cache(maxsize=None)
def _request(vocab_size: int):
  rng = np.random.default_rng(5)
  docs = [[int(t) for t in rng.integers(3, vocab_size, n)]
          for n in DOC_LENGTHS]
  query = [int(t) for t in rng.integers(3, vocab_size, QUERY_LENGTH)]
  return docs, query


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
  """(arch, HF model, directory of its safetensors checkpoint)."""
  arch = request.param
  model = hf_model(arch)
  directory = tmp_path_factory.mktemp(arch)
  model.save_pretrained(directory, safe_serialization=True)
  return arch, model, directory


def _engine(directory, **settings):
  from lazyattn_jax.engine import LazyEngine
  return LazyEngine.from_pretrained(directory, impl="xla", num_pages=48,
                                    page_size=4, max_batch=2, decode_steps=4,
                                    progress=False,
                                    **{"quality": None, **settings})


def test_block_diagonal_mask_changes_hf_logits(checkpoint):
  """HF honours the 4D mask for this architecture (else parity proves
  nothing about the lazy layout)."""
  _, model, _ = checkpoint
  docs, query = _request(model.config.vocab_size)
  seq = [t for d in docs for t in d] + query
  n = len(seq)

  def last_logits(allowed):
    mask = torch.where(torch.from_numpy(allowed), 0.0,
                       torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
      return model(torch.tensor([seq]), attention_mask=mask,
                   position_ids=torch.arange(n)[None]).logits[0, -1].numpy()

  causal = last_logits(np.tril(np.ones((n, n), bool)))
  with torch.no_grad():
    plain = model(torch.tensor([seq])).logits[0, -1].numpy()
  np.testing.assert_allclose(causal, plain, rtol=1e-4, atol=1e-4)
  blocked = last_logits(block_diagonal_mask(list(map(len, docs)), n))
  assert np.abs(blocked - causal).max() > 1e-2


def test_lazy_request_matches_hf_greedy_tokens(checkpoint):
  arch, model, directory = checkpoint
  from lazyattn_jax.sampling import SamplingParams
  engine = _engine(directory)
  config = engine.config
  assert config.attention_bias == (arch == "qwen2")
  assert config.qk_norm == (arch == "qwen3")
  docs, query = _request(config.vocab_size)
  want_tokens, want_logits = hf_lazy_greedy(model, docs, query, STEPS)
  greedy = SamplingParams(max_new_tokens=STEPS, stop_token_ids=())
  result = engine.generate(query, docs, greedy)
  assert _rel(result.first_logits, want_logits) < 1e-4
  assert result.token_ids == want_tokens
  # The cached documents, read in place in a new order, still equal HF.
  reordered = [docs[2], docs[0], docs[1]]
  want_reordered, _ = hf_lazy_greedy(model, reordered, query, 6)
  again = engine.generate(query, reordered,
                          SamplingParams(max_new_tokens=6, stop_token_ids=()))
  assert again.doc_hits == [True, True, True]
  assert again.token_ids == want_reordered
  # The dense reference (what the engine tests compare against) is HF too.
  from models.safetensors_loader import load_safetensors
  _, ours = load_safetensors(directory)
  dense = dense_lazy_logits(ours, docs, query)
  assert _rel(dense[-1], want_logits) < 1e-4


def test_memory_counts_the_loaded_weights_and_pool(checkpoint):
  _, model, directory = checkpoint
  engine = _engine(directory, dtype="bfloat16")
  hf_elements = sum(p.numel() for p in model.parameters())  # tied: once
  memory = engine.memory
  assert memory["weights_bytes"] == 2 * hf_elements
  c, cache = engine.config, engine.cache_config
  assert memory["kv_pool_bytes"] == 2 * 2 * (
      c.num_kv_heads * c.num_layers * cache.num_pages * cache.page_size *
      c.head_dim)
