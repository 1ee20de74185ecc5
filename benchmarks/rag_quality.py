"""Answer quality of each mode on a synthetic fact-lookup set (real weights).

Each question's answer sits in exactly one of k retrieved documents (short
biographies of made-up people); the other k-1 are distractors about other
people.  Documents recur across questions, so lazy and block read them from
the cache at changing positions.  An answer is correct when the generated
text contains the expected value.  SmolLM2 was not block-fine-tuned, so lazy
and block (documents encoded without seeing each other) are expected to trail
full and prefix (plain causal prompt); this measures by how much.

  python -m benchmarks.rag_quality --questions 240 --out benchmarks/results/quality.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

FIRST = ["Talia", "Oren", "Mira", "Jonas", "Priya", "Kenji", "Lena", "Tomas",
         "Amara", "Felix", "Sana", "Ivo", "Noor", "Elias", "Rhea", "Marek",
         "Yara", "Bastian", "Ines", "Caleb"]
LAST = ["Brennick", "Falkner", "Osei", "Lindqvist", "Moreau", "Tanaka",
        "Quill", "Harrow", "Vance", "Okafor", "Delacourt", "Stroud"]
CITIES = ["Lisbon", "Nairobi", "Oslo", "Kyoto", "Lima", "Cairo", "Dublin",
          "Hanoi", "Quebec", "Tbilisi", "Perth", "Bogota", "Krakow", "Accra",
          "Seville", "Manila"]
JOBS = ["carpenter", "pilot", "chemist", "librarian", "baker", "surgeon",
        "architect", "fisherman", "violinist", "geologist", "journalist",
        "gardener"]
PETS = ["parrot", "tortoise", "ferret", "goldfish", "rabbit", "hamster",
        "lizard", "beagle", "canary", "hedgehog"]
QUESTIONS = {
    "city": "In which city does {name} live?",
    "job": "What is the job of {name}?",
    "pet": "What pet does {name} have?",
}


def make_dataset(num_people: int, num_questions: int, docs_per_question: int,
                 seed: int):
  rng = np.random.default_rng(seed)
  names = [f"{f} {l}" for f in FIRST for l in LAST]
  rng.shuffle(names)
  people = []
  for name in names[:num_people]:
    person = dict(name=name, city=str(rng.choice(CITIES)),
                  job=str(rng.choice(JOBS)), pet=str(rng.choice(PETS)))
    person["doc"] = (f"{name} lives in {person['city']}. {name} works as a "
                     f"{person['job']}. {name} has a {person['pet']} as a pet.")
    people.append(person)
  questions = []
  for _ in range(num_questions):
    picks = rng.choice(num_people, size=docs_per_question, replace=False)
    target = int(picks[0])
    attribute = str(rng.choice(list(QUESTIONS)))
    order = rng.permutation(picks)
    questions.append(dict(
        query=QUESTIONS[attribute].format(name=people[target]["name"]),
        answer=people[target][attribute],
        documents=[people[int(i)]["doc"] for i in order],
        answer_position=int(np.where(order == target)[0][0])))
  return questions


def evaluate(engine, questions, max_new_tokens: int, batch: int):
  from lazyattn_jax.engine import Request
  from lazyattn_jax.sampling import SamplingParams
  from tqdm import tqdm
  sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
  correct = []
  with tqdm(total=len(questions), desc=engine.mode, file=sys.stderr) as bar:
    for start in range(0, len(questions), batch):
      chunk = questions[start:start + batch]
      results = engine.generate_batch([Request(q["query"], q["documents"], sampling)
                                       for q in chunk])
      for q, r in zip(chunk, results):
        correct.append(q["answer"].lower() in r.text.lower())
      bar.update(len(chunk))
  return correct


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--model", default="smollm2-135m-instruct")
  p.add_argument("--questions", type=int, default=240)
  p.add_argument("--people", type=int, default=60)
  p.add_argument("--docs-per-question", type=int, default=4)
  p.add_argument("--max-new-tokens", type=int, default=24)
  p.add_argument("--modes", default="full,prefix,block,lazy")
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--impl", default="auto")
  p.add_argument("--out", default="")
  args = p.parse_args(argv)
  import jax
  from lazyattn_jax.engine import LazyEngine
  questions = make_dataset(args.people, args.questions, args.docs_per_question,
                           args.seed)
  base = LazyEngine.from_pretrained(args.model, impl=args.impl,
                                    max_batch=args.batch, num_pages=2048)
  rows = []
  for mode in args.modes.split(","):
    engine = LazyEngine(base.config, nnx_merge(base), base.cache_config,
                        mode=mode, scheduler=base.scheduler_config,
                        runner=base.runner_config, model_id=base.model_id,
                        tokenizer=base.tokenizer)
    t0 = time.perf_counter()
    correct = evaluate(engine, questions, args.max_new_tokens, args.batch)
    by_pos = {}
    for q, ok in zip(questions, correct):
      by_pos.setdefault(q["answer_position"], []).append(ok)
    rows.append(dict(mode=mode, accuracy=float(np.mean(correct)),
                     correct=int(np.sum(correct)), questions=len(correct),
                     accuracy_by_answer_position={
                         str(k): float(np.mean(v)) for k, v in sorted(by_pos.items())},
                     seconds=time.perf_counter() - t0))
    print(json.dumps(rows[-1]), flush=True)
  report = dict(device=str(jax.devices()[0].device_kind), jax=jax.__version__,
                date=time.strftime("%Y-%m-%d"), model=args.model,
                command="python -m benchmarks.rag_quality " +
                " ".join(argv if argv is not None else sys.argv[1:]),
                args=vars(args), runs=rows)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(report, f, indent=2)
  print("mode | accuracy | correct/questions")
  for r in rows:
    print(f"{r['mode']} | {r['accuracy']:.3f} | {r['correct']}/{r['questions']}")
  return report


def nnx_merge(engine):
  """The engine's model, rebuilt from its split form (shares the weights)."""
  from flax import nnx
  return nnx.merge(engine.runner.graphdef, engine.runner.params)


if __name__ == "__main__":
  main()
