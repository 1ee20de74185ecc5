"""One process of the two-process CPU run in tests/test_tensor_parallel.py:
an engine split over both processes' devices, driven in lockstep from
process 0 (`lazyattn_jax.multihost.Lockstep`).

  python -m tests.multi_host_worker PROCESS_ID PORT OUT_JSON
"""

from __future__ import annotations

import json
import sys


def scenario(driver, config) -> dict:
  """Requests arriving over several rounds, a cancel and documents encoded
  ahead of use; returns {request id: (finish reason, tokens)}."""
  import numpy as np
  from lazyattn_jax.sampling import SamplingParams
  rng = np.random.default_rng(0)
  docs = [rng.integers(1, config.vocab_size, n).tolist()
          for n in (9, 14, 6, 11)]
  greedy = SamplingParams(max_new_tokens=6, temperature=0.0,
                          stop_token_ids=())
  query = lambda: rng.integers(1, config.vocab_size, 4).tolist()
  results = {}

  def run(rounds=None):
    while driver.engine.has_work() and rounds != 0:
      for r in driver.step():
        results[r.request_id] = (r.finish_reason, list(r.token_ids))
      rounds = None if rounds is None else rounds - 1

  driver.submit(query(), docs[:2], greedy)
  driver.submit(query(), [docs[2], docs[0]], greedy)
  run(rounds=1)
  doomed = driver.submit(query(), [docs[3]], greedy)
  driver.submit(query(), [docs[1], docs[3]], greedy)
  driver.cancel(doomed)
  run()
  driver.encode_documents([docs[2], docs[3]])
  driver.submit(query(), [docs[3], docs[2]], greedy)
  run()
  return {str(k): v for k, v in sorted(results.items())}


class _Plain:
  """The same calls on an engine alone (the one-process reference)."""

  def __init__(self, engine):
    self.engine = engine
    self.submit = engine.submit
    self.cancel = engine.cancel
    self.step = engine.step
    self.encode_documents = engine.encode_documents


def main(process_id: int, port: int, out: str):
  import jax
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                             num_processes=2, process_id=process_id)
  from lazyattn_jax.cache_state import CacheConfig
  from lazyattn_jax.config import split_settings
  from lazyattn_jax.engine import LazyEngine
  from lazyattn_jax.multihost import Lockstep
  from lazyattn_jax.sharding import random_model, tensor_parallel_for
  from models.config import LlamaConfig
  config = LlamaConfig.tiny(num_heads=8, num_kv_heads=4, max_position=512)
  cache = CacheConfig(num_pages=24, page_size=4, num_layers=config.num_layers,
                      num_kv_heads=config.num_kv_heads,
                      head_dim=config.head_dim, dtype="float32", max_docs=16,
                      max_pages_per_doc=8)
  scheduler, runner = split_settings(None, None, dict(
      impl="xla", max_batch=2, decode_steps=4))

  def engine(tp):
    model = random_model(config, tensor_parallel_for(
        config, tensor_parallel=tp), dtype="float32", seed=1)
    return LazyEngine(config, model, cache, scheduler=scheduler,
                      runner=runner, tensor_parallel=tp)

  sharded = engine(2)
  lock = Lockstep(sharded)
  report = dict(process=jax.process_index(), devices=jax.device_count(),
                local_devices=jax.local_device_count())
  if lock.leader:
    report["results"] = scenario(lock, config)
    lock.close()
    report["cache"] = sharded.cache.stats(sharded.state)
  else:
    report["rounds"] = lock.follow()
    report["cache"] = sharded.cache.stats(sharded.state)
    # The reference, here while the leader finishes: one device alone.
    report["reference"] = scenario(_Plain(engine(None)), config)
  with open(out, "w") as f:
    json.dump(report, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
