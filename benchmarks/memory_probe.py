"""Compiled memory of the engine's prefill step at Llama-3-8B shape.

Compiles the step for two pool sizes: if its temporary memory grows with the
pool, XLA copies the pool (and a pool near half the device would not fit).
Does so for the pool carried natively and as uint16 bits; prints the variant
needing fewer pool-sized temporaries last (read by h200_engine.sh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lazyattn_jax import model_runner
from lazyattn_jax.cache_state import CacheConfig
from models.config import LlamaConfig
from models.llama import Llama
from models.paged_inputs import PagedAttentionInputs


def temp_bytes(num_pages: int, pool_as_bits: bool) -> tuple[int, int, int]:
  """(pool bytes, temp bytes, aliased bytes) of the compiled prefill step."""
  config = LlamaConfig.llama3_8b()
  model = nnx.eval_shape(lambda: Llama(config, dtype=jnp.bfloat16,
                                       param_dtype=jnp.bfloat16,
                                       rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(model)
  cache = CacheConfig(num_pages=num_pages, page_size=16, num_layers=config.num_layers,
                      num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                      dtype="bfloat16", max_docs=64, max_pages_per_doc=32)
  pool = jax.ShapeDtypeStruct(cache.pool_shape, jnp.bfloat16)
  batch, length, pages = 8, 512, 32
  i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
  inputs = PagedAttentionInputs(i32(batch, pages), i32(batch, pages),
                                i32(batch, pages), i32(batch, pages),
                                i32(batch, length), i32(batch, length),
                                i32(batch, length))
  sampling = (jax.ShapeDtypeStruct((batch,), jnp.float32), i32(batch),
              jax.ShapeDtypeStruct((batch,), jnp.float32), i32(batch))
  # The form the engine's runner compiles on this platform (step_jit.py).
  step = model_runner._prefill_step.for_platform(jax.default_backend())
  compiled = step.lower(
      params, pool, pool, i32(batch, length), inputs, i32(batch), sampling,
      graphdef=graphdef, impl="auto", pool_as_bits=pool_as_bits).compile()
  mem = compiled.memory_analysis()
  return pool.size * 2, mem.temp_size_in_bytes, mem.alias_size_in_bytes


def main():
  """Prints, per variant, how many pool-sized temporaries the step needs;
  last line: BEST=<native|bits> COPIES=<n> (the variant with fewest)."""
  gib = 2 ** 30
  copies = {}
  for name, bits in (("native", False), ("bits", True)):
    small, large = temp_bytes(2048, bits), temp_bytes(6144, bits)
    for pool, temp, alias in (small, large):
      print(f"{name}: pool {pool / gib:.2f} GiB: temp {temp / gib:.2f} GiB, "
            f"aliased in->out {alias / gib:.2f} GiB", flush=True)
    copies[name] = (large[1] - small[1]) / (large[0] - small[0])
    if large[2] < 2 * large[0]:
      copies[name] += 2  # outputs not donated: two more pool buffers
  best = min(copies, key=copies.get)
  print(f"BEST={best} COPIES={copies[best]:.2f}")


if __name__ == "__main__":
  main()
