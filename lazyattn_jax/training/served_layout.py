"""The layouts fine-tuning may train: those the engine serves.

The engine's only token preamble is the chat template's prefix
(`QualityOptions(preamble="chat")`), which takes the place of the leading
chat-prefix document a text request otherwise brings; its other preamble is
a learned sink; its first-page recompute takes whole pages.  A model
trained for any other layout is served in one it was not trained for (its
export's default quality is the trained layout:
`lazyattn_jax.trained_quality`), so `finetune` refuses it up front.
"""

from __future__ import annotations

import sys

from lazyattn_jax.errors import InvalidOptionError
from lazyattn_jax.quality_options import QualityOptions
from lazyattn_jax.trained_quality import SERVED_PAGE_SIZE
from lazyattn_jax.training.batch import Layout
from lazyattn_jax.training.errors import TrainingInputError


def chat_preamble_ids(tokenizer) -> tuple[int, ...]:
  """The token ids of the engine's preamble="chat" for `tokenizer`, made
  by the engine's own `preamble.make_preamble`.

  Raises:
    TrainingInputError: no tokenizer, or a chat template with no text
      before the user's words (the engine refuses preamble="chat" too).
  """
  from lazyattn_jax.preamble import make_preamble
  try:
    preamble = make_preamble(QualityOptions(preamble="chat"), model_id="",
                             tokenizer=tokenizer, hidden_size=None,
                             max_doc_tokens=sys.maxsize)
  except InvalidOptionError as e:
    raise TrainingInputError(str(e)) from None
  return tuple(preamble.tokens)


def chat_layout(tokenizer, recompute_tokens: int = 0) -> Layout:
  """The layout `QualityOptions(preamble="chat")` serves (with first-page
  recompute of `recompute_tokens`, 0: none)."""
  ids = chat_preamble_ids(tokenizer)
  return Layout(len(ids), ids, recompute_tokens)


def check_recompute_tokens(k: int, name: str = "recompute_tokens"):
  """Refuses a recompute length the engine cannot serve by default: it
  recomputes whole pages, of SERVED_PAGE_SIZE tokens unless the caller of
  from_pretrained picks another size."""
  if k % SERVED_PAGE_SIZE:
    raise TrainingInputError(
        f"{name} {k} cannot be served: the engine recomputes whole pages, "
        f"{SERVED_PAGE_SIZE} tokens each by default, so it must be a "
        f"multiple of {SERVED_PAGE_SIZE} (0: no recompute)")


def check_servable(layout: Layout, tokenizer):
  """Raises TrainingInputError unless the engine serves `layout`: whole
  pages of recompute, and a token preamble only as the chat template's
  prefix of `tokenizer` (a learned preamble is always served: its sink
  is exported with the model)."""
  check_recompute_tokens(layout.recompute_tokens, "layout.recompute_tokens")
  if layout.preamble_ids is None:
    return
  if tokenizer is None:
    raise TrainingInputError("a token preamble needs the model's tokenizer")
  if tuple(layout.preamble_ids) != chat_preamble_ids(tokenizer):
    raise TrainingInputError(
        "layout.preamble_ids must be the chat template's prefix "
        "(served_layout.chat_layout): the engine serves no other token "
        "preamble (QualityOptions(preamble='chat'))")
