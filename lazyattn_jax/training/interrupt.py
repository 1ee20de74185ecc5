"""Ctrl-C as a request to stop training between two steps.

A training step donates its state, so a KeyboardInterrupt inside one can
leave nothing to save.  Under `stop_on_interrupt` the first SIGINT only asks
the loop to stop; the loop then ends as when its time is up (the fine-tuning
saves a checkpoint and exports, the sink trainer writes the sink so far).  A
second SIGINT interrupts at once, as without it."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class StopRequest:
  """Callable flag: True once a stop was asked for."""

  def __init__(self):
    self.requested = False

  def __call__(self) -> bool:
    return self.requested


@contextlib.contextmanager
def stop_on_interrupt(what: str):
  """Yields a StopRequest that the first SIGINT sets (printing that `what`
  will stop after this step); the previous handler is restored on exit.
  Outside the main thread, where no handler can be set, the request is
  never set and Ctrl-C behaves as usual."""
  request = StopRequest()
  if threading.current_thread() is not threading.main_thread():
    yield request
    return

  def handle(signum, frame):
    if request.requested:
      raise KeyboardInterrupt
    request.requested = True
    print(f"\n{what}: stopping after this step (Ctrl-C again to abort "
          "now)", file=sys.stderr, flush=True)

  previous = signal.signal(signal.SIGINT, handle)
  try:
    yield request
  finally:
    signal.signal(signal.SIGINT, previous)
