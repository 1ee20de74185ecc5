"""How much float8 pages change the stored K/V, per kind of page and scale.

Encodes documents into a float32 pool of the default engine (the learned
sink and first-page recompute on), then quantizes every written token's
K and V vector to float8 (e4m3) and back, with the pool's rule (one
power-of-two scale per page and KV head, `pallas_kernels.kv_quant`) and
with one scale per token, and reports the relative error of each vector
(|dequantized - x| / |x|), grouped by page kind: the sink's pages, each
document's first page, and its other pages.

Before building finer scales or a 16-bit side pool for the sink, this
says whether the sink's pages are stored worse than the documents' (they
would then need other scales), or stored as well and matter more (they
would need more bits).

  python -m benchmarks.fp8_error_probe --documents 12 --out probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import kv_quant


def relative_errors(x, per_token: bool) -> np.ndarray:
  """Relative error of each vector of x [..., T, H] after a float8 round
  trip, with one power-of-two scale per [T, H] block (per_token False) or
  per vector (True).  Returns [..., T]; 0 for zero vectors."""
  x = jnp.asarray(x, jnp.float32)
  axes = (-1,) if per_token else (-2, -1)
  scale = kv_quant.power_of_two_scale(jnp.max(jnp.abs(x), axis=axes,
                                              keepdims=True))
  back = kv_quant.quantize(x, scale).astype(jnp.float32) * scale
  norm = jnp.linalg.norm(x, axis=-1)
  error = jnp.linalg.norm(back - x, axis=-1)
  return np.asarray(jnp.where(norm > 0, error / jnp.where(norm > 0, norm, 1),
                              0.0))


def page_kinds(state, preamble_key):
  """(kind, page id, tokens written) of every cached entry's pages; kind
  is "sink", "doc first page" or "doc other pages"."""
  keys = np.asarray(state.doc_key)
  pages = np.asarray(state.doc_pages)
  lengths = np.asarray(state.doc_len)
  page_size = state.k.shape[3]
  out = []
  for slot in np.flatnonzero(np.asarray(state.doc_valid)):
    sink = preamble_key is not None and tuple(keys[slot]) == tuple(
        preamble_key)
    for i in range(int(np.asarray(state.doc_num_pages)[slot])):
      kind = ("sink" if sink else
              "doc first page" if i == 0 else "doc other pages")
      out.append((kind, int(pages[slot, i]),
                  int(min(page_size, lengths[slot] - i * page_size))))
  return out


def probe(engine) -> dict:
  """Error statistics per (page kind, K or V, scale granularity)."""
  state = engine.state
  preamble = getattr(engine._mode, "preamble", None)
  groups = {}
  for kind, page, written in page_kinds(state, preamble and preamble.key):
    for name, pool in (("k", state.k), ("v", state.v)):
      x = np.asarray(pool[:, :, page, :written, :])  # [K, L, T, H]
      for per_token in (False, True):
        key = (kind, name, "per token" if per_token else "per page")
        groups.setdefault(key, []).append(
            relative_errors(x, per_token).reshape(-1))
  rows = []
  for (kind, name, scales), parts in sorted(groups.items()):
    e = np.concatenate(parts)
    rows.append(dict(pages=kind, tensor=name, scales=scales,
                     vectors=int(e.size), mean=float(e.mean()),
                     p99=float(np.percentile(e, 99)), max=float(e.max())))
  return dict(rows=rows)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--documents", type=int, default=12,
                 help="documents of the demo corpus to encode (it has 12)")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  if args.documents < 1:
    p.error("--documents must be >= 1")
  from importlib import resources
  from lazyattn_jax.engine import LazyEngine
  corpus = json.loads(resources.files("lazyattn_jax").joinpath(
      "data/demo_corpus.json").read_text())["documents"]
  docs = [d if isinstance(d, str) else d["text"] for d in corpus]
  docs = docs[:args.documents]
  engine = LazyEngine.from_pretrained(dtype="float32")
  try:
    engine.encode_documents(docs)
    report = dict(device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
                  command="python -m benchmarks.fp8_error_probe " + " ".join(
                      argv if argv is not None else sys.argv[1:]),
                  **probe(engine))
  finally:
    engine.close()
  for r in report["rows"]:
    print(f"{r['pages']:>16} {r['tensor']} {r['scales']:>9}: mean "
          f"{r['mean']:.4f} p99 {r['p99']:.4f} max {r['max']:.4f} "
          f"({r['vectors']} vectors)")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
  return report


if __name__ == "__main__":
  main()
