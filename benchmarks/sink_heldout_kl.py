"""KL to full attention of sink files on HotpotQA's held-out questions.

The sink trainer scores its sink on samples it held out from the end of its
own training source.  This scores sink files on the quality benchmark's
held-out ("eval") questions, which no train part reads: each sink with its
K/V as a 16-bit pool holds them and as a float8 pool returns them
(`lazyattn_jax.training.float8_preamble`), beside the layout without a
preamble.  KL(full attention || lazy layout) per answer token, the trainer's
loss.

  python -m benchmarks.sink_heldout_kl SINK [SINK ...] [--batches 4]
      [--batch-size 16] [--dtype bfloat16] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

from lazyattn_jax.training import parallel
from lazyattn_jax.training.batch import Layout
from lazyattn_jax.training.float8_preamble import Float8Preamble
from lazyattn_jax.training.held_out import (evaluation_batches,
                                            evaluation_split)
from lazyattn_jax.training.sink import mean_kl


def heldout_kls(trainable, source, sinks: dict, *, batches: int,
                batch_size: int, page_size: int, max_len: int = 2048) -> dict:
  """KLs of each of `sinks` (name -> [P, D]) on the last samples of
  `source` that fit (`held_out.evaluation_split`, batches x batch_size of
  them), with 16-bit and float8 preamble pages, and without a preamble."""
  lengths = {sink.shape[0] for sink in sinks.values()}
  if len(lengths) != 1:
    raise ValueError(f"the sinks have different lengths {sorted(lengths)}")
  preamble_len = lengths.pop()
  mesh = parallel.data_mesh(None)
  _, picked = evaluation_split(source, trainable.tokenizer,
                               trainable.config.vocab_size,
                               Layout(preamble_len), batches * batch_size,
                               max_len)
  plain = evaluation_batches(picked, Layout(0), batch_size)
  with_sink = evaluation_batches(picked, Layout(preamble_len), batch_size)
  float8 = Float8Preamble(page_size=page_size, preamble_len=preamble_len)
  out = dict(samples=[n for n, _ in picked],
             no_preamble=mean_kl(trainable, plain, mesh))
  for name, sink in sinks.items():
    out[name] = {"16-bit": mean_kl(trainable, with_sink, mesh, sink),
                 "float8": mean_kl(trainable, with_sink, mesh, sink, float8)}
  return out


def main(argv=None) -> dict:
  from lazyattn_jax.loading import DEFAULT_PAGE_SIZE
  from lazyattn_jax.quality.datasets import load_hotpotqa
  from lazyattn_jax.quality.hotpotqa import build_items
  from lazyattn_jax.training.data import ListSource
  from lazyattn_jax.training.model_io import load_trainable
  from lazyattn_jax.training.sink_file import load_sink
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("sinks", nargs="+", help="sink files (.safetensors)")
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--batches", type=int, default=4)
  p.add_argument("--batch-size", type=int, default=16)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
  p.add_argument("--json", help="also write the results here")
  args = p.parse_args(argv)
  started = time.time()
  model = load_trainable(args.model, args.dtype, progress=False)
  source = ListSource(list(build_items(load_hotpotqa(split="eval"),
                                       "dataset")))
  sinks = {path: load_sink(path, hidden_size=model.config.hidden_size)[0]
           for path in args.sinks}
  out = heldout_kls(model, source, sinks, batches=args.batches,
                    batch_size=args.batch_size, page_size=args.page_size)
  out.update(model=model.model_id, dtype=args.dtype, source=len(source),
             seconds=round(time.time() - started, 1))
  print(json.dumps(out))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(out, f, indent=1)
  return out


if __name__ == "__main__":
  main()
