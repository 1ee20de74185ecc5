"""Shared pieces of the answer-quality engine tests: engines with
QualityOptions, the options under test with their dense layouts, and the
work each request should cost."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from lazyattn_jax.quality_options import QualityOptions
from tests.test_engine import PAGE, make_engine
from tests.test_engine_faults import FakeChatTokenizer

CHAT = FakeChatTokenizer()
PREFIX = CHAT.encode("<sys>be brief</sys><user>")
SINK = np.random.default_rng(70).standard_normal((3, 64)).astype(np.float32)
OTHER_SINK = SINK + np.float32(0.25)


class OtherChatTokenizer(FakeChatTokenizer):
  """Another chat template: another system prompt, so another prefix."""

  def render_chat(self, messages):
    return f"<sys>be long</sys><user>{messages[0]['content']}</user><bot>"


# name: (options, what the dense layout takes, tokenizer)
OPTIONS = {
    "recompute": (QualityOptions(recompute=True),
                  dict(recompute_tokens=PAGE), None),
    "sink": (QualityOptions(preamble="sink", sink=SINK),
             dict(preamble_embeddings=SINK), None),
    "sink+recompute": (QualityOptions(preamble="sink", sink=SINK,
                                      recompute=True),
                       dict(preamble_embeddings=SINK, recompute_tokens=PAGE),
                       None),
    "sink+recompute-2-pages": (
        QualityOptions(preamble="sink", sink=SINK, recompute=True,
                       recompute_tokens=2 * PAGE),
        dict(preamble_embeddings=SINK, recompute_tokens=2 * PAGE), None),
    "chat": (QualityOptions(preamble="chat"), dict(preamble=PREFIX), CHAT),
    "chat+recompute": (QualityOptions(preamble="chat", recompute=True),
                       dict(preamble=PREFIX, recompute_tokens=PAGE), CHAT),
}


def quality_engine(model_and_config, quality=None, *, mode="lazy",
                   tokenizer=None, num_pages=96, eviction="lfu",
                   nan_pool=True, **settings):
  """An engine as tests.test_engine.make_engine builds it, with `quality`.

  With `nan_pool`, every slot of the pool starts as NaN, so a read of a
  slot nobody wrote (a private page the layout forgot to fill) shows.
  """
  engine = make_engine(model_and_config, num_pages=num_pages, mode=mode,
                       eviction=eviction, tokenizer=tokenizer,
                       quality=quality, **settings)
  if nan_pool:
    state = engine.state
    engine.rounds.state = state.replace(k=jnp.full_like(state.k, jnp.nan),
                                        v=jnp.full_like(state.v, jnp.nan))
  return engine


def query_ids(tokenizer, query):
  """The query's token ids as the engine reads it: a text query wrapped in
  the chat format (its prefix is the preamble or a leading document)."""
  if isinstance(query, str):
    return tokenizer.encode(query + "</user><bot>")
  return list(query)


def recomputed_tokens(doc_lens, k) -> int:
  """Tokens a request recomputes: min(k, L) of each document but the first."""
  return sum(min(k, n) for n in doc_lens[1:]) if k else 0


def table_keys(engine) -> set[tuple[int, int]]:
  """Keys of the documents (and preamble) cached now."""
  state = engine.state
  valid = np.asarray(state.doc_valid)
  return {tuple(int(w) for w in key)
          for key in np.asarray(state.doc_key)[valid]}


def relative_error(got, want) -> float:
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))
