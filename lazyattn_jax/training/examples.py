"""A sample in tokens, laid out as the engine serves it.

The prompt goes through the engine's own path
(`lazyattn_jax.requests.encode_request`): the chat text before the user's
words becomes a leading document, each document is tokenized alone and
ends with a blank line, and the query is wrapped in the chat template.  So
what is trained is what is served.

The answer is what the chat template writes for the assistant's turn, up
to and including the first stop token (e.g. "Paris<|im_end|>" in ChatML):
the model learns to answer and to stop.
"""

from __future__ import annotations

import dataclasses

from lazyattn_jax.errors import InvalidRequestError
from lazyattn_jax.requests import encode_request
from lazyattn_jax.training.data import Sample
from lazyattn_jax.training.errors import TrainingInputError

_SENTINEL = "\u0000lazyattn-user\u0000"


@dataclasses.dataclass(frozen=True)
class TokenSample:
  """A sample in token ids.

  Attributes:
    documents: the engine's documents: the chat prefix (when the template
      has one) then the sample's documents, each as the engine encodes it.
    query: the wrapped query, ending where the assistant's reply starts.
    answer: the reply's ids, ending with a stop token.
    leading: how many of `documents` the engine added in front (the chat
      prefix), which its chat preamble replaces.
  """
  documents: tuple[tuple[int, ...], ...]
  query: tuple[int, ...]
  answer: tuple[int, ...]
  leading: int = 0

  @property
  def prompt_len(self) -> int:
    """Tokens of documents and query (the full-attention prompt)."""
    return sum(map(len, self.documents)) + len(self.query)


def answer_ids(tokenizer, answer: str) -> list[int]:
  """Ids of the assistant's turn `answer` as the chat template writes it
  after the generation prompt, cut after the first stop token (EOS is
  appended where the template writes none)."""
  text = None
  if tokenizer.chat_template is not None:
    user = [{"role": "user", "content": _SENTINEL}]
    try:
      prompt = tokenizer.render_chat(user)
      whole = tokenizer.render_chat(
          user + [{"role": "assistant", "content": answer}],
          add_generation_prompt=False)
    except Exception:  # a template that refuses this conversation
      whole, prompt = "", None
    if prompt is not None and whole.startswith(prompt):
      text = whole[len(prompt):]
  ids = (tokenizer.encode(text) if text is not None else
         tokenizer.encode(answer, parse_special=False))
  stops = set(tokenizer.stop_token_ids)
  for i, token in enumerate(ids):
    if token in stops:
      return ids[:i + 1]
  if tokenizer.eos_token_id is not None:
    ids.append(tokenizer.eos_token_id)
  return ids


def tokenize_sample(tokenizer, sample: Sample, vocab_size: int) -> TokenSample:
  """The engine's token layout of `sample` and its answer's ids.

  Raises:
    TrainingInputError: the sample is not valid input for the engine (the
      message says why), or there is no tokenizer.
  """
  if tokenizer is None:
    raise TrainingInputError("training on text needs the model's tokenizer")
  try:
    query, documents, leading = encode_request(tokenizer, sample.query,
                                         list(sample.documents), vocab_size)
  except InvalidRequestError as e:
    raise TrainingInputError(f"sample is not a valid request: {e}") from e
  answer = answer_ids(tokenizer, sample.answer)
  if not answer or max(answer) >= vocab_size:
    raise TrainingInputError("the answer's ids do not fit the model's "
                             f"vocabulary of {vocab_size}")
  return TokenSample(tuple(tuple(d) for d in documents), tuple(query),
                     tuple(answer), leading)
