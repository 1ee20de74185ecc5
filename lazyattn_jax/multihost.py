"""Several hosts serving one tensor-parallel engine, in lockstep.

Under `jax.distributed` every process runs the same program: each builds
the same `LazyEngine` on the global mesh, and every jitted step is one
collective program that all processes must enter together, with the same
shapes.  The engine's scheduler is host-side Python that decides from the
calls made on it (submit, cancel, encode_documents, step) and from the
cache tables, which every process computes identically: it reads no clock
and draws no random numbers to decide.  So the processes stay in step if
they make the same calls in the same order.

`Lockstep` makes that so when requests reach one process only (an HTTP
server on process 0): the leader records its calls, and before each round
broadcasts them to every process (`multihost_utils.broadcast_one_to_all`,
two small collectives per round); followers replay them and step.  A
program in which every process makes the same calls by itself (a batch job
reading one input) needs none of this.

  leader (process 0):   lock = Lockstep(engine); lock.submit(...);
                        results = lock.step(); ...; lock.close()
  followers:            Lockstep(engine).follow()   # returns at close()
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import jax
import numpy as np

from lazyattn_jax.errors import CacheCapacityError

__all__ = ["Lockstep"]

_STOP = "stop"
_MIN_PAYLOAD = 1024


def _broadcast_bytes(payload: bytes | None) -> bytes:
  """`payload` of process 0, on every process (others pass None).  Two
  broadcasts: the length, then the bytes padded to a power of two (so a
  steady run compiles a few broadcast programs, not one per length)."""
  from jax.experimental import multihost_utils
  leader = jax.process_index() == 0
  size = np.asarray([len(payload) if leader else 0], np.int64)
  size = int(multihost_utils.broadcast_one_to_all(size)[0])
  padded = max(_MIN_PAYLOAD, 1 << (size - 1).bit_length())
  buffer = np.zeros((padded,), np.uint8)
  if leader:
    buffer[:size] = np.frombuffer(payload, np.uint8)
  buffer = multihost_utils.broadcast_one_to_all(buffer)
  return bytes(np.asarray(buffer)[:size])


class Lockstep:
  """One process's side of an engine that runs on every process.

  On process 0 (the leader) call `submit`, `submit_prepared`, `cancel`,
  `encode_documents` and `step` as on the engine; on the others call
  `follow()`.  Each `step` first sends the leader's calls since the last
  round to every process, which make them in the same order, then every
  process runs the round.  Results (and request ids) are the leader's,
  held by its engine until `engine.pop_result` takes them; followers
  compute the same ones and drop them.  Bad input raises on the leader
  before any process sees it; an error every process meets alike (a batch
  of documents the pool cannot take now) raises on the leader, and the
  followers go on.  After `close()` the leader's calls raise.

  Args:
    engine: this process's `LazyEngine` (built the same way everywhere).
  """

  def __init__(self, engine):
    self.engine = engine
    self.leader = jax.process_index() == 0
    self._calls: list[tuple] = []
    self._closed = False

  def _leader_only(self, name: str):
    if not self.leader:
      raise RuntimeError(f"Lockstep.{name} is for process 0; process "
                         f"{jax.process_index()} calls follow()")
    if self._closed:  # the followers have returned: a send would hang
      raise RuntimeError(f"Lockstep.{name} after close(): the followers "
                         f"have stopped")

  # --- process 0 -------------------------------------------------------------
  def submit(self, query, documents=(), sampling=None, **overrides) -> int:
    """Validates on the leader (bad input raises here, before any process
    sees it) and queues the request everywhere at the next round."""
    self._leader_only("submit")
    return self.submit_prepared(
        self.engine.prepare(query, documents, sampling, **overrides))

  def submit_prepared(self, request, *,
                      arrival_time: float | None = None) -> int:
    """Queues a `LazyEngine.prepare` result; returns its id (the same on
    every process: ids count submissions, which every process replays).
    `arrival_time` as `LazyEngine.submit`'s (the leader's clock)."""
    self._leader_only("submit_prepared")
    request_id = self.engine.submit_prepared(request,
                                             arrival_time=arrival_time)
    self._calls.append(("submit_prepared", request))
    return request_id

  def cancel(self, request_id: int) -> bool:
    """`LazyEngine.cancel` on process 0, recorded for the followers."""
    self._leader_only("cancel")
    cancelled = self.engine.cancel(request_id)  # a closed engine raises
    self._calls.append(("cancel", request_id))
    return cancelled

  def step(self, on_first_tokens=None):
    """Sends this round's calls, then runs the round on every process;
    returns the leader's results (`on_first_tokens` as for
    `LazyEngine.step`, on the leader)."""
    self._leader_only("step")
    # A round the leader's engine refuses (closed, or a step inside its
    # on_first_tokens) is never sent: followers would run it alone.
    self.engine._check_can_step()
    self._send(self._calls)
    self._calls = []
    return self.engine.step(on_first_tokens)

  def encode_documents(self, documents) -> list[bool]:
    """Encodes documents on every process now (calls made before it are
    sent first, as they came first).  They are checked and tokenized here
    first, so bad input raises before any process sees it, and every
    process encodes the same token ids (an iterator is read once)."""
    self._leader_only("encode_documents")
    self.engine._check_can_encode()  # the mode, a closed engine
    if isinstance(documents, Iterator):
      documents = list(documents)
    tokens = self.engine.validator.documents(documents)
    self._send(self._calls + [("encode_documents", tokens)])
    self._calls = []
    return self.engine.encode_documents(tokens)

  def close(self):
    """Lets the followers' `follow()` return; the leader's calls raise
    from now on."""
    self._leader_only("close")
    self._send(_STOP)
    self._closed = True

  def _send(self, message):
    if jax.process_count() > 1:
      _broadcast_bytes(pickle.dumps(message))

  # --- the other processes ---------------------------------------------------
  def follow(self) -> int:
    """Replays the leader's calls and rounds until it closes; returns the
    number of rounds run."""
    if self.leader:
      raise RuntimeError("process 0 leads; follow() is for the others")
    rounds = 0
    while True:
      message = pickle.loads(_broadcast_bytes(None))
      if message == _STOP:
        return rounds
      run_round = True
      for name, argument in message:
        if name == "submit_prepared":
          self.engine.submit_prepared(argument)
        elif name == "cancel":
          self.engine.cancel(argument)
        else:  # encode_documents ends its message: no round follows
          try:
            self.engine.encode_documents(argument)
          except CacheCapacityError:
            pass  # the leader met it too, at the same batch, and raised it
          run_round = False
      if run_round:
        for result in self.engine.step():  # the leader's to report
          self.engine.pop_result(result.request_id)
        rounds += 1
