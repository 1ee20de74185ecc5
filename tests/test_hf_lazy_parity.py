"""Issue 4 acceptance: a lazy request with 3 documents against HF transformers.

HF gets the concatenated prompt with contiguous position_ids and a custom 4D
block-diagonal mask over the documents; our engine encodes each document alone
and places it by page shifts.  Both load the same SmolLM2 GGUF in float32.
"""

from __future__ import annotations

import numpy as np

from tests.engine_helpers import block_diagonal_mask
from tests.hf_fixtures import hf_lazy_greedy

DOCS = [
    "Lake Varnis is a cold mountain lake in the northern highlands. It freezes "
    "over every winter and is home to a rare species of silver trout.\n\n",
    "The Orrin Bridge is a stone arch bridge built in 1887 by the engineer "
    "Mara Delacourt. It spans the Tessel River with seven arches.\n\n",
    "Copperleaf tea is grown on the eastern slopes of the Kasha hills and is "
    "roasted lightly over cedar wood.\n\n",
]
QUESTION = "Who built the Orrin Bridge, and when?"


def test_hf_4d_mask_is_honoured(hf_smollm2):
  """The custom mask really changes HF's answer (else the test proves nothing)."""
  import torch
  model, tokenizer = hf_smollm2
  ids = tokenizer.encode(DOCS[0] + DOCS[1], add_special_tokens=False)
  n = len(ids)
  causal = torch.tensor(np.tril(np.ones((n, n), bool)))
  mask = torch.where(causal, 0.0, torch.finfo(torch.float32).min)[None, None]
  with torch.no_grad():
    plain = model(torch.tensor([ids])).logits[0, -1]
    as_4d = model(torch.tensor([ids]), attention_mask=mask,
                  position_ids=torch.arange(n)[None]).logits[0, -1]
    blocked = model(torch.tensor([ids]), attention_mask=torch.where(
        torch.from_numpy(block_diagonal_mask([n // 2, n - n // 2], n)), 0.0,
        torch.finfo(torch.float32).min)[None, None],
        position_ids=torch.arange(n)[None]).logits[0, -1]
  torch.testing.assert_close(plain, as_4d, rtol=1e-4, atol=1e-4)
  assert (plain - blocked).abs().max() > 1e-2


def test_lazy_request_with_three_documents_matches_hf(smollm2_gguf_path,
                                                      hf_smollm2):
  from lazyattn_jax.engine import LazyEngine
  from lazyattn_jax.sampling import SamplingParams
  hf_model, _ = hf_smollm2
  engine = LazyEngine.from_pretrained(smollm2_gguf_path, impl="xla",
                                      num_pages=128, progress=False,
                                      quality=None)  # the plain layout
  tok = engine.tokenizer
  documents = [tok.encode(d) for d in DOCS]
  query = tok.chat_prompt(QUESTION)
  want_tokens, want_logits = hf_lazy_greedy(hf_model, documents, query, 16)
  result = engine.generate(query, documents,
                           SamplingParams(max_new_tokens=16, stop_token_ids=()))
  rel = (np.linalg.norm(result.first_logits - want_logits) /
         np.linalg.norm(want_logits))
  assert rel < 1e-3, rel
  assert result.token_ids == want_tokens
  # Reusing the cached documents in a new order equals HF on that order too.
  reordered = [documents[2], documents[0], documents[1]]
  want2, _ = hf_lazy_greedy(hf_model, reordered, query, 8)
  again = engine.generate(query, reordered,
                          SamplingParams(max_new_tokens=8, stop_token_ids=()))
  assert again.doc_hits == [True, True, True]
  assert again.token_ids == want2
