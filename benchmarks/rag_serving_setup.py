"""What a run of the RAG serving benchmark (benchmarks/rag_serving.py) is
built from: the request trace (one corpus, Zipf document popularity,
Poisson or closed-loop arrivals), the model, the engine, and the cache's
size in pages."""

from __future__ import annotations

import dataclasses

import numpy as np

from pallas_kernels.sizes import ceil_div


@dataclasses.dataclass(frozen=True)
class Trace:
  corpus: list  # list[list[int]]
  requests: list  # list[(query tokens, doc indices)]
  arrivals: np.ndarray | None  # seconds from start, Poisson; None = closed loop


def zipf_probabilities(num_docs: int, exponent: float) -> np.ndarray:
  ranks = np.arange(1, num_docs + 1, dtype=np.float64)
  weights = ranks ** -exponent
  return weights / weights.sum()


def make_trace(args, vocab_size: int, num_requests: int, seed: int) -> Trace:
  rng = np.random.default_rng(seed)
  corpus_rng = np.random.default_rng(args.seed)  # same corpus for every trace
  corpus = [corpus_rng.integers(1, vocab_size, size=args.doc_len).tolist()
            for _ in range(args.num_docs)]
  popularity = zipf_probabilities(args.num_docs, args.zipf)
  # Popularity ranks are shuffled over document ids.
  popularity = popularity[corpus_rng.permutation(args.num_docs)]
  requests = []
  for _ in range(num_requests):
    docs = rng.choice(args.num_docs, size=args.docs_per_request, replace=False,
                      p=popularity)
    query = rng.integers(1, vocab_size, size=args.query_len).tolist()
    requests.append((query, [int(d) for d in docs]))
  arrivals = None
  if args.rate:
    arrivals = np.cumsum(rng.exponential(1.0 / args.rate, size=num_requests))
  return Trace(corpus, requests, arrivals)


# The compute dtype of each --model: a KV pool is in it or in float8.
MODEL_DTYPES = {"tiny": "float32", "llama3-8b-shape": "bfloat16",
                "smollm2": "float32"}


def build_model(args):
  """Returns (config, model, dtype name: MODEL_DTYPES[args.model])."""
  import jax.numpy as jnp
  from flax import nnx
  from models.config import LlamaConfig
  from models.llama import Llama
  if args.model not in MODEL_DTYPES:
    raise SystemExit(f"unknown --model {args.model!r}")
  dtype_name = MODEL_DTYPES[args.model]
  if args.model == "tiny":
    config = dataclasses.replace(LlamaConfig.tiny(), max_position=1 << 16)
    return config, Llama(config, rngs=nnx.Rngs(args.seed)), dtype_name
  if args.model == "llama3-8b-shape":
    config = LlamaConfig.llama3_8b()
    dtype = jnp.dtype(dtype_name)
    # Initialise on the device inside one jit: 8B parameters of random bf16.
    @nnx.jit
    def init():
      return Llama(config, dtype=dtype, param_dtype=dtype,
                   rngs=nnx.Rngs(args.seed))
    return config, init(), dtype_name
  from lazyattn_jax.default_model import default_gguf_path  # smollm2
  from models.gguf_loader import load_gguf
  loaded = load_gguf(default_gguf_path(), dtype=jnp.dtype(dtype_name))
  return loaded[0], loaded[1], dtype_name


def make_engine(args, config, model, dtype: str, mode: str, cache_pages: int,
                tokenizer=None, **engine_kwargs):
  """A LazyEngine for the run's settings (`engine_kwargs`: more of its
  arguments, such as tensor_parallel)."""
  from lazyattn_jax.cache_state import CacheConfig
  from lazyattn_jax.config import RunnerConfig, SchedulerConfig
  from lazyattn_jax.engine import LazyEngine
  pages_per_doc = ceil_div(args.doc_len, args.page_size)
  # prefix mode caches one entry per full page of prompt.
  max_docs = (cache_pages if mode == "prefix" else
              min(args.num_docs, cache_pages // pages_per_doc + 1) + 8)
  cache_config = CacheConfig(
      num_pages=cache_pages, page_size=args.page_size,
      num_layers=config.num_layers, num_kv_heads=config.num_kv_heads,
      head_dim=config.head_dim, dtype=args.kv_dtype or dtype,
      max_docs=max_docs,
      max_pages_per_doc=max(pages_per_doc, 1), eviction=args.eviction)
  scheduler = SchedulerConfig(
      max_batch=args.max_batch, decode_steps=args.decode_steps,
      max_prefill_tokens=args.max_prefill_tokens,
      prefill_tokens_per_step=args.prefill_tokens_per_step or None,
      first_token_group_tokens=args.group_tokens or None,
      decode_during_prefill=bool(getattr(args, "decode_during_prefill",
                                         False)),
      decode_loops_to_first_finish=bool(getattr(
          args, "decode_loops_to_first_finish", False)),
      prefill_chunk_tokens=getattr(args, "prefill_chunk_tokens", 0) or None)
  runner = RunnerConfig(impl=args.impl, pool_as_bits=args.pool_as_bits,
                        decode_layer_unroll=True if args.decode_unroll else 1,
                        gpu_weights_in_place=not getattr(args, "triton_gemm",
                                                         False),
                        gpu_xla_options=tuple(getattr(args, "gpu_xla_option",
                                                      None) or ()))
  return LazyEngine(config, model, cache_config, mode=mode,
                    scheduler=scheduler, runner=runner, tokenizer=tokenizer,
                    **engine_kwargs)


def working_pages(args) -> int:
  """Pages for in-flight requests' own tokens (and block-mode copies)."""
  pages_per_doc = ceil_div(args.doc_len, args.page_size)
  per_request = (ceil_div(args.query_len + args.output_len +
                          args.docs_per_request * args.doc_len, args.page_size) +
                 args.docs_per_request * pages_per_doc)
  return per_request * args.max_batch


def same_bytes_pages(config, args, dtype, kv_dtype: str, pages: int) -> int:
  """Pages of `kv_dtype` that fit in the bytes of `pages` pages of the
  pool's own dtype (--kv-dtype, else the compute dtype), scales counted."""
  from lazyattn_jax.cache_config import CacheConfig

  def page_bytes(pool_dtype):
    return CacheConfig(num_pages=1, page_size=args.page_size,
                       num_layers=config.num_layers,
                       num_kv_heads=config.num_kv_heads,
                       head_dim=config.head_dim, dtype=pool_dtype,
                       max_pages_per_doc=1).bytes_per_page
  return max(1, pages * page_bytes(args.kv_dtype or dtype) //
             page_bytes(kv_dtype))


def cache_pages_for(args, fraction: float) -> int:
  corpus_pages = args.num_docs * ceil_div(args.doc_len, args.page_size)
  pages = max(1, int(round(fraction * corpus_pages)))
  return pages + (working_pages(args) if args.add_working_pages else 0)
