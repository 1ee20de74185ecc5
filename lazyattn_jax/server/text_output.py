"""Generated text as it grows, cut at the first stop string.

The engine stops on stop tokens; OpenAI's `stop` strings are text, so the
server watches the decoded text.  Tokens go in one at a time, so a stop
string is pinned to the token that completed it: the answer's token ids
and token count end there, as its text does.  While streaming, the last
(longest stop string - 1) characters are held back, so a stop string that
arrives split over two rounds is never partly sent.
"""

from __future__ import annotations


class TextOutput:
  """Incremental text of one request.

  Args:
    tokenizer: the engine's tokenizer.
    stops: stop strings; the text ends before the first one found.

  Attributes:
    text: the text so far (cut before the stop string once one is found).
    stopped: a stop string was found.
    tokens: generated tokens taken in; once stopped, those up to and
      including the one that completed the stop string.
  """

  def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
    self._decoder = tokenizer.incremental_decoder()
    self._stops = stops
    self._hold = max(map(len, stops)) - 1 if stops else 0
    self.text = ""
    self.stopped = False
    self.tokens = 0
    self._sent = 0

  def push(self, token_ids) -> str:
    """Adds generated tokens; returns the text that may be sent now.
    Tokens after a stop string's are ignored."""
    for token in token_ids:
      if self.stopped:
        break
      self._take(self._decoder.push(int(token)))
      self.tokens += 1
    return self._release(final=False)

  def finish(self) -> str:
    """The generation ended; returns the rest of the text."""
    if not self.stopped:
      self._take(self._decoder.finish())
    return self._release(final=True)

  def _take(self, new_text: str):
    # Text before this point was searched already: a new stop string
    # ends in `new_text`, so it starts at most `_hold` characters earlier.
    start = max(0, len(self.text) - self._hold)
    self.text += new_text
    found = [i for i in (self.text.find(s, start) for s in self._stops)
             if i >= 0]
    if found:
      self.text = self.text[:min(found)]
      self.stopped = True

  def _release(self, final: bool) -> str:
    end = len(self.text)
    if not (final or self.stopped):
      end = max(self._sent, end - self._hold)
    piece, self._sent = self.text[self._sent:end], end
    return piece
