"""Does APE's attention temperature help lazy attention on this model?

APE (adaptive parallel encoding, Yang et al., ICLR 2025) reads contexts
that were encoded independently with two read-time changes: the query's
attention logits over context keys are divided by a temperature T, and
those keys' attention weights are multiplied by a scale S (log S added to
their logits).  Both act when a query reads, not on the stored KV, so they
would fit the engine's shared pages; the kernels would need a per-page
score scale and bias.  Before building that, this probe measures whether it
helps, with the training's dense forward (the engine's layout, exact):

- teacher: the model's full attention over the plain causal prompt;
- student: the lazy layout (each document alone, optionally after the
  shipped sink), with APE on every (query or answer row, document key)
  pair, in every layer;
- score: KL(teacher || student) and the answer's cross-entropy, per answer
  token, teacher-forced, on held-out questions (HotpotQA's eval split, or
  synthetic questions from a seed no training used).

  python -m benchmarks.ape_probe --data synthetic --samples 48 \\
      --settings 1:1,0.9:1,0.8:1,0.7:1,0.9:0.9,0.8:0.8 --sink \\
      --out benchmarks/results/ape_probe_synthetic_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import numpy as np

from lazyattn_jax.buckets import length_bucket
from lazyattn_jax.training.batch import (Layout, _pad, student_sequence,
                                         teacher_sequence)
from lazyattn_jax.training.examples import tokenize_sample
from lazyattn_jax.training.forward import kl_and_ce


def parse_settings(text: str) -> list[tuple[float, float]]:
  """"T:S,T:S" -> [(T, S)]; T and S must be positive."""
  out = []
  for item in text.split(","):
    t, _, s = item.partition(":")
    pair = (float(t), float(s or 1.0))
    if not all(v > 0 for v in pair):  # NaN too
      raise ValueError(f"temperature and scale must be > 0, got {item!r}")
    out.append(pair)
  return out


def held_out_samples(name: str, count: int, seed: int):
  """`count` held-out text samples of the named source."""
  if name == "hotpotqa":
    from lazyattn_jax.quality.datasets import load_hotpotqa
    from lazyattn_jax.quality.hotpotqa import build_items
    from lazyattn_jax.training.data import ListSource
    source = ListSource(list(build_items(load_hotpotqa(split="eval"),
                                         "dataset")))
  elif name == "synthetic":
    from lazyattn_jax.training.data import SyntheticFacts
    source = SyntheticFacts(max(count, 1), 4, seed)
  else:
    raise ValueError(f"unknown data {name!r}")
  return [source[i] for i in range(min(count, len(source)))]


def ape_arrays(student, context: tuple[int, int], temperature: float,
               scale: float):
  """logit_scale and logit_bias [1, L, L] for one padded student sequence:
  1/T and log S where a query or answer row (index >= context[1]) reads a
  retrieved document's key (index in [context[0], context[1])), else 1
  and 0.  The preamble and the chat prefix before the documents are APE's
  shared prefix, read unchanged."""
  length = student["tokens"].shape[1]
  index = np.arange(length)
  rows = index >= context[1]
  keys = (index >= context[0]) & (index < context[1])
  pair = rows[:, None] & keys[None, :]
  logit_scale = np.where(pair, 1.0 / temperature, 1.0).astype(np.float32)
  logit_bias = np.where(pair, math.log(scale), 0.0).astype(np.float32)
  return logit_scale[None], logit_bias[None]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--data", choices=["synthetic", "hotpotqa"],
                 default="synthetic")
  p.add_argument("--samples", type=int, default=48)
  p.add_argument("--seed", type=int, default=20261201)
  p.add_argument("--settings", default="1:1,0.9:1,0.8:1,0.7:1,0.9:0.9,0.8:0.8",
                 help="T:S pairs; 1:1 is plain lazy")
  p.add_argument("--sink", action="store_true",
                 help="also every setting after the shipped sink")
  p.add_argument("--out", help="write the JSON report here")
  args = p.parse_args(argv)
  try:
    settings = parse_settings(args.settings)
  except ValueError as e:  # float("abc") too
    p.error(f"--settings takes T:S pairs of numbers > 0: {e}")

  from lazyattn_jax.quality_options import shipped_sink_for
  from lazyattn_jax.training.model_io import load_trainable
  model = load_trainable(args.model, "float32", progress=False)
  sinks = {"no preamble": None}
  if args.sink:
    sink = shipped_sink_for(model.model_id)
    if sink is None:
      raise SystemExit(f"no shipped sink for {model.model_id}")
    sinks["sink"] = np.asarray(sink, np.float32)
  forward = jax.jit(model.functions.answer_logits)
  score = jax.jit(kl_and_ce)

  totals = {}  # (preamble, T, S) -> [kl * n, ce * n, n]
  started = time.perf_counter()
  samples = held_out_samples(args.data, args.samples, args.seed)
  for index, sample in enumerate(samples):
    tokens = tokenize_sample(model.tokenizer, sample, model.config.vocab_size)
    answer_len = length_bucket(len(tokens.answer), 16)
    teacher = _pad([teacher_sequence(tokens)],
                   length_bucket(tokens.prompt_len + len(tokens.answer), 64),
                   answer_len)
    teacher_logits = forward(model.params, teacher)
    labels = np.zeros((1, answer_len), np.int32)
    labels[0, :len(tokens.answer)] = tokens.answer
    weights = np.zeros((1, answer_len), np.float32)
    weights[0, :len(tokens.answer)] = 1.0
    for name, sink in sinks.items():
      layout = Layout(0 if sink is None else sink.shape[0])
      seq = student_sequence(tokens, layout, full=False)
      student = _pad([seq], length_bucket(len(seq[0]), 64), answer_len)
      query_start = int(seq[4][0]) - len(tokens.query) + 1
      chat_prefix = (len(tokens.documents[0])
                     if model.tokenizer.chat_template else 0)
      context = (layout.preamble_len + chat_prefix, query_start)
      for temperature, scale in settings:
        logit_scale, logit_bias = ape_arrays(student, context, temperature,
                                             scale)
        logits = forward(model.params, dict(student, logit_scale=logit_scale,
                                            logit_bias=logit_bias), sink)
        kl, ce = score(logits, teacher_logits, labels, weights)
        total = totals.setdefault((name, temperature, scale), [0.0, 0.0, 0])
        n = len(tokens.answer)
        total[0] += float(kl) * n
        total[1] += float(ce) * n
        total[2] += n
    print(f"[{index + 1}/{len(samples)}] {time.perf_counter() - started:.0f} s",
          file=sys.stderr, flush=True)

  rows = [dict(preamble=name, temperature=t, scale=s, kl=kl / n, ce=ce / n,
               answer_tokens=n)
          for (name, t, s), (kl, ce, n) in totals.items()]
  print("preamble | T | S | KL | answer CE")
  for r in rows:
    print(f"{r['preamble']} | {r['temperature']} | {r['scale']} | "
          f"{r['kl']:.4f} | {r['ce']:.4f}")
  if args.out:
    report = dict(date=time.strftime("%Y-%m-%d"), device=jax.devices()[0].device_kind,
                  jax=jax.__version__, model=model.model_id,
                  command="python -m benchmarks.ape_probe " + " ".join(
                      argv if argv is not None else sys.argv[1:]),
                  samples=len(samples), rows=rows)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main())
