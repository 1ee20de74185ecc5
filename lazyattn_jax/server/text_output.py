"""Generated text as it grows, cut at the first stop string.

The engine stops on stop tokens; OpenAI's `stop` strings are text, so the
server watches the decoded text.  While streaming, the last
(longest stop string - 1) characters are held back, so a stop string that
arrives split over two rounds is never partly sent.
"""

from __future__ import annotations


class TextOutput:
  """Incremental text of one request.

  Args:
    tokenizer: the engine's tokenizer.
    stops: stop strings; the text ends before the first one found.
  """

  def __init__(self, tokenizer, stops: tuple[str, ...] = ()):
    self._decoder = tokenizer.incremental_decoder()
    self._stops = stops
    self._hold = max(map(len, stops)) - 1 if stops else 0
    self.text = ""
    self.stopped = False  # a stop string was found
    self._sent = 0

  def push(self, token_ids) -> str:
    """Adds generated tokens; returns the text that may be sent now."""
    if self.stopped:
      return ""
    self.text += self._decoder.push(list(token_ids))
    return self._release(final=False)

  def finish(self) -> str:
    """The generation ended; returns the rest of the text."""
    if not self.stopped:
      self.text += self._decoder.finish()
    return self._release(final=True)

  def _release(self, final: bool) -> str:
    if self._stops and not self.stopped:
      # Text before `_sent` was searched already, held-back tail included.
      found = [i for i in (self.text.find(s, self._sent) for s in self._stops)
               if i >= 0]
      if found:
        self.text = self.text[:min(found)]
        self.stopped = True
    end = len(self.text)
    if not (final or self.stopped):
      end = max(self._sent, end - self._hold)
    piece, self._sent = self.text[self._sent:end], end
    return piece
