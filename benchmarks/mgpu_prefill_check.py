"""H200 check of the Mosaic GPU lazy prefill kernel (gpu_prefill_mgpu.py).

Run on the GPU machine from the repository root:
  python -m benchmarks.mgpu_prefill_check [--skip-parity] [--skip-timing]

(a) Parity of lazy_prefill_mgpu against the jnp reference (and the float64
    truth where small) on a few cases; each case is wrapped so that one
    failure is printed and the others still run (mgpu_prefill_parity.py;
    the variants and inputs: mgpu_prefill_cases.py).
(b) Timing, bf16, Hq/Hkv 32/8, H 128, page 16, context 8192 tokens in 16
    documents of 512 (each at its own shift) plus the chunk's own pages
    (benchmarks/kernels.py inputs): a 512-token chunk at B 4 and a 128-token
    chunk at B 8, of
      mgpu[...]   lazy_prefill_mgpu, a few block-size variants;
      triton      lazy_attention(..., impl="gpu") (the Pallas Triton kernel);
      cudnn       jax.nn.dot_product_attention(implementation="cudnn") on
                  dense pre-rotated K/V of context + chunk, no mask
                  (benchmarks/kernels.py explains why): 3.0% more score
                  pairs than the chunk's mask leaves at chunk512;
      cudnn-split the chunk's own problem in two cuDNN calls, the context
                  unmasked and the chunk causal (timing only, unmerged);
      jax-mgpu    JAX's own Mosaic GPU flash attention
                  (pallas/ops/gpu/attention_mgpu) on the same dense K/V in
                  f16: what the Pallas stack reaches without pages,
                  rotations or masks.
    FLOPs: 4 * H * Hq per visible (query, key) pair, for every row.  Times
    include everything the lazy API does per call (query rotation, step
    lists, kernel), except the rows marked per-layer, plan only, XLA
    query rotation only (the pass the xlarope variant makes before its
    kernel; the default rotates the query in the kernel) and kernel[...],
    which time those parts alone, and
    "kernel 1-rot[...]": the kernel with a plan that rotates each CTA's
    query once (wrong results; against kernel[...], what the rotations
    cost), and "kernel bare[...]": that, and no step masked or fixed up;
    "kernel bare p128[...]": that on a pool of 128-token pages (one TMA
    copy per K and V a step); "mgpu p32[...]" and "kernel p32[...]" (and
    p64): the whole call and the kernel alone on pools of 32- and 64-token
    pages, every page shuffled; "kernel+N ops[...]": the kernel after N
    tiny dependent XLA ops (against kernel[...], what a launch before the
    kernel costs: the floor of a plan made of XLA ops).
    Median
    over 21 samples, each a chain of calls (benchmarks.kernel_timing.ChainTimer),
    after a warm-up run; every row is compiled first, then sampled
    round-robin (one sample of each row a round, the order reversed every
    other round), so a slow drift over the run does not favour the rows
    timed first; each sample first runs its row untimed for SETTLE_S
    (--settle-s), so that under the GPU's power cap each row is timed at
    its own clock.  Each sample is a chain, each call's input perturbed by
    a run-time zero: for the lazy whole calls, q_pos (which the query
    rotation or the plan reads; so a kernel that rotates the query itself
    pays no pass over q it does not make); for cuDNN and JAX's dense kernel
    the query, a pass over q of its own (about 11 us, standing in for the
    RoPE pass a dense path makes over q; without it cuDNN measured 1.5-1.8%
    slower, not faster: benchmarks/RESULTS.md).  The kernel-alone rows are
    not perturbed, so they time the kernel only.
With --tables N the rows are timed N times over, one table after another
from the same compiled calls, and a last table gives each row's median,
lowest and highest ratio to cuDNN over them (each table's own cuDNN row):
one table resolves about +-1.3% (benchmarks/RESULTS.md).
Prints a final table: variant, ms, TFLOP/s, ratio to cuDNN, and the
median SM clock and board power while the row was timed (nvidia-smi,
benchmarks/gpu_clock_log.py; its power trails the load by most of a
second, so it mostly shows the row's settling and the rows before).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.kernel_cases import (DTYPE, HEAD_DIM, NUM_HEADS,
                                     PAGE_LAYOUTS, PAGE_SIZE, ROPE, SM_SCALE,
                                     prefill_plan, prefill_plan_only,
                                     prefill_planned, prefill_planned_perturb,
                                     visible_pairs)
from benchmarks.gpu_clock_log import ClockLog
from benchmarks.kernel_timing import (SETTLE_S, ChainTimer,
                                      perturb_dependent_ops, perturb_lazy,
                                      perturb_none, perturb_positions,
                                      perturb_query)
from benchmarks.mgpu_prefill_cases import VARIANTS, build_inputs, coarse_pages
from benchmarks.mgpu_prefill_parity import run_parity
from benchmarks.prefill_check_tables import (print_table,
                                           print_tables_summary,
                                           sample_round_robin)
from pallas_kernels import lazy_attention
from pallas_kernels.gpu_prefill import lazy_prefill_gpu
from pallas_kernels.gpu_prefill_mgpu import (MgpuBlockSizes, PrefillPlan,
                                             lazy_prefill_mgpu,
                                             mgpu_prefill_kernel,
                                             query_operand,
                                             rotated_query_tokens)
from pallas_kernels.gpu_prefill_mgpu_plan import INT32_MIN, RecordLayout


# (name, batch, query tokens, context tokens in documents)
SHAPES = [("chunk512", 4, 512, 8192), ("chunk128", 8, 128, 8192)]


# --------------------------------------------------------------------------
# (b) timing; (a), parity, is benchmarks/mgpu_prefill_parity.py


def _timer(fn, args, perturb):
  return ChainTimer(fn, [args], perturb, target_total_s=0.04)


def _timing_plans(plan, pages_per_block):
  """Timing-only forms of `plan` (wrong results): (every new-segment flag
  after a CTA's first step cleared, so each CTA rotates its query once;
  that, and no step masked or fixed up either)."""
  layout = RecordLayout(pages_per_block)
  one_rotation = plan._replace(
      records=plan.records.at[:, 1:, layout.new_seg].set(0))
  bare = one_rotation._replace(
      records=one_rotation.records.at[:, :, layout.fixup].set(0)
      .at[:, :, layout.max_pos].set(INT32_MIN))
  return one_rotation, bare


# (block_q, block_kv, max_concurrent_steps) of JAX's reference kernel; four
# concurrent steps need 297 KB of shared memory, more than an H200's 227.
JAX_MGPU_CONFIGS = ((64, 128, 2),)


def jax_mgpu_dense(q, k, v, *, cfg):
  """JAX's Mosaic GPU flash attention with tuning `cfg` (a
  JAX_MGPU_CONFIGS entry), on `jax_mgpu_dense_inputs`."""
  from jax.experimental.pallas.ops.gpu import attention_mgpu
  config = attention_mgpu.TuningConfig(block_q=cfg[0], block_kv=cfg[1],
                                       max_concurrent_steps=cfg[2])
  return attention_mgpu.attention(q, k, v, config)


def jax_mgpu_dense_inputs(q, k_dense, v_dense):
  """f16 q, K, V for `jax_mgpu_dense` (its shared memory is f16); its
  kernel does not scale the scores, so q comes scaled (timing only)."""
  return ((q * SM_SCALE).astype(jnp.float16), k_dense.astype(jnp.float16),
          v_dense.astype(jnp.float16))


def kernel_inputs(lazy_args, sizes):
  """(query operand, plan) that `mgpu_prefill_kernel` alone takes for the
  lazy arguments and block sizes `sizes`."""
  plan = PrefillPlan(*jax.jit(prefill_plan, static_argnums=8)(*lazy_args,
                                                              sizes))
  q_rot = jax.jit(query_operand, static_argnums=(2, 4, 5))(
      lazy_args[0], lazy_args[7], ROPE, jnp.float32(SM_SCALE),
      plan.row_pos.shape[1], sizes)
  return q_rot, plan


def whole_call(*lazy_args, sizes=None):
  """`lazy_prefill_mgpu` at the benchmark's RoPE and scale: everything a
  call does (plan, rotated query, kernel)."""
  return lazy_prefill_mgpu(*lazy_args, rope=ROPE,
                           sm_scale=jnp.float32(SM_SCALE), block_sizes=sizes)


def kernel_alone(q_rot, k_pages, v_pages, plan, *, sizes):
  """`mgpu_prefill_kernel` alone on `kernel_inputs`' rotated query and plan
  (the plan as a tuple)."""
  return mgpu_prefill_kernel(q_rot, k_pages, v_pages, PrefillPlan(*plan),
                             out_dtype=DTYPE, block_sizes=sizes,
                             sm_scale=jnp.float32(SM_SCALE))


# Pages of the "mgpu pN" and "kernel pN" rows, in 16-token pages.
COARSE_PAGE_FACTORS = (2, 4)

# Dependent-op counts of the "kernel+N ops" rows.
DEPENDENT_OP_COUNTS = (1, 3, 10)


def cudnn_dense(q, k_dense, v_dense):
  """cuDNN's flash attention on the dense pre-rotated K/V, no mask."""
  return jax.nn.dot_product_attention(q, k_dense, v_dense, scale=SM_SCALE,
                                      implementation="cudnn")


def dense_split(k_dense, v_dense, context: int):
  """(context K, context V, chunk K, chunk V) of the dense K/V, whose keys
  are the context's then the chunk's own (`build_inputs`)."""
  return (k_dense[:, :context], v_dense[:, :context], k_dense[:, context:],
          v_dense[:, context:])


def cudnn_split(q, k_context, v_context, k_chunk, v_chunk):
  """cuDNN doing the chunk's own problem, in two calls: the context with
  no mask, and the chunk's own keys under a causal mask (top-left is the
  chunk's mask where its queries and keys are the same tokens).  Timing
  only: the two parts are not merged (a merge needs each part's softmax
  sums, which jax's cuDNN call does not return), which favours cuDNN."""
  return tuple(jax.nn.dot_product_attention(
      q, k, v, scale=SM_SCALE, is_causal=causal, implementation="cudnn")
               for k, v, causal in ((k_context, v_context, False),
                                    (k_chunk, v_chunk, True)))


def row_selected(name, patterns):
  """Whether row `name` is one that `--rows` names: one of `patterns`
  begins the name or one of its words ("mgpu[" picks "mgpu[...]" but not
  "jax-mgpu[...]"; "per-layer" picks "mgpu per-layer (plan once)")."""
  return any(name.startswith(p) or f" {p}" in name for p in patterns)


def run_timing(variants, only=(), shapes=None, layout="pages",
               settle_s=SETTLE_S, tables=1):
  """Times every row, or those `row_selected` picks by `only` (cuDNN's
  always, for the ratio), at `shapes` (None: all), the pages placed by
  `layout`, each sample settled for `settle_s` seconds first, `tables`
  times over from the same compiled calls.  Returns `tables` lists of
  rows (shape, variant, seconds or None, flops, note), one per table."""
  per_table = [[] for _ in range(tables)]
  selected = lambda name: (not only or name in ("cudnn", "cudnn-split")
                           or row_selected(name, only))
  for shape, batch, q_len, context in SHAPES:
    if shapes is not None and shape not in shapes:
      continue
    print(f"# timing {shape}: B {batch}, T {q_len}, context {context}",
          flush=True)
    inputs = build_inputs(jax.random.PRNGKey(1), np.random.default_rng(1),
                          batch=batch, q_len=q_len, context=context,
                          layout=layout)
    lazy_args, (k_dense, v_dense) = inputs[:8], inputs[8:]
    flops = 4.0 * HEAD_DIM * NUM_HEADS * visible_pairs(
        lazy_args[7], lazy_args[4], lazy_args[6])
    methods = []
    for name, sizes in variants.items():
      methods.append((f"mgpu[{name}]",
                      functools.partial(whole_call, sizes=sizes), lazy_args,
                      perturb_positions))
    plan = tuple(jax.jit(prefill_plan)(*lazy_args))
    planned_args = (lazy_args[0], lazy_args[1], lazy_args[2], lazy_args[7],
                    plan)
    methods.append(("mgpu per-layer (plan once)", prefill_planned, planned_args,
                    prefill_planned_perturb()))
    methods.append(("mgpu plan only (per batch)", prefill_plan_only, lazy_args,
                    perturb_lazy))
    # The XLA query rotation alone: the pass a call makes before its
    # kernel where the kernel does not rotate the query itself
    # (query_rope_in_kernel=False, the xlarope variant).
    t_pad = PrefillPlan(*plan).row_pos.shape[1]
    in_f32 = MgpuBlockSizes().query_in_f32
    methods.append(("mgpu XLA query rotation only", lambda q, q_pos:
                    rotated_query_tokens(q, q_pos, ROPE,
                                         jnp.float32(SM_SCALE), t_pad,
                                         in_f32),
                    (lazy_args[0], lazy_args[7]), perturb_query))
    # The kernel alone on a precomputed plan and rotated query, per
    # variant; then, timing only (wrong results), with every new-segment
    # flag after a CTA's first step cleared, so each CTA rotates its query
    # once (against the row before, what the rotations cost), and "bare":
    # also no step masked or fixed up (what the masks cost; what is left is
    # the paged steps themselves).
    # Unperturbed (perturb_none): q + 0 would be a pass over q of its own,
    # not the kernel's.
    for name, sizes in variants.items():
      q_rot, plan_v = kernel_inputs(lazy_args, sizes)
      one_rotation, bare = _timing_plans(plan_v,
                                         sizes.block_kv // PAGE_SIZE)
      for label, rows_plan in (("kernel", plan_v),
                               ("kernel 1-rot", one_rotation),
                               ("kernel bare", bare)):
        methods.append((f"{label}[{name}]", functools.partial(
            kernel_alone, sizes=sizes), (q_rot, lazy_args[1], lazy_args[2],
                                   tuple(rows_plan)), perturb_none))
      for count in DEPENDENT_OP_COUNTS:
        methods.append((f"kernel+{count} ops[{name}]", functools.partial(
            kernel_alone, sizes=sizes), (q_rot, lazy_args[1], lazy_args[2],
                                         tuple(plan_v)),
                        perturb_dependent_ops(count)))
      # The whole call and the kernel alone on pools of coarser pages (the
      # same K/V bytes, every page shuffled): what the page size costs
      # where no block's pages are consecutive (16 copies a step at 16
      # tokens, 4 at 64).
      # Their kernel-alone plans are made only for rows --rows selects.
      for factor in COARSE_PAGE_FACTORS:
        coarse = coarse_pages(lazy_args, factor)
        tokens = PAGE_SIZE * factor
        methods.append((f"mgpu p{tokens}[{name}]", functools.partial(
            whole_call, sizes=sizes), coarse, perturb_positions))
        if selected(f"kernel p{tokens}[{name}]"):
          q_rot_c, plan_c = kernel_inputs(coarse, sizes)
          methods.append((f"kernel p{tokens}[{name}]", functools.partial(
              kernel_alone, sizes=sizes), (q_rot_c, coarse[1], coarse[2],
                                           tuple(plan_c)), perturb_none))
      # "bare" again on a pool of block_kv-token pages: one TMA copy per K
      # and per V a step instead of one per 16-token page (against the
      # bare row, what the page copies cost).
      bare_name = f"kernel bare p{sizes.block_kv}[{name}]"
      if selected(bare_name):
        coarse = coarse_pages(lazy_args, sizes.block_kv // PAGE_SIZE)
        plan_c = PrefillPlan(*jax.jit(prefill_plan, static_argnums=8)(
            *coarse, sizes))
        _, bare_c = _timing_plans(plan_c, 1)
        methods.append((bare_name,
                        functools.partial(kernel_alone, sizes=sizes),
                        (q_rot, coarse[1], coarse[2], tuple(bare_c)),
                        perturb_none))
    methods.append(("lazy_attention[gpu]", lambda *a: lazy_attention(
        *a, rope=ROPE, sm_scale=SM_SCALE, impl="gpu"), lazy_args,
                    perturb_positions))
    methods.append(("triton", lambda *a: lazy_prefill_gpu(
        *a, rope=ROPE, sm_scale=jnp.float32(SM_SCALE)), lazy_args,
                    perturb_lazy))
    methods.append(("cudnn", cudnn_dense, (lazy_args[0], k_dense, v_dense),
                    perturb_query))
    if context:  # cuDNN's call above computes the chunk's masked pairs too
      methods.append(("cudnn-split", cudnn_split,
                      (lazy_args[0], *dense_split(k_dense, v_dense, context)),
                      perturb_query))
    # JAX's own Mosaic GPU flash attention (pallas/ops/gpu/attention_mgpu)
    # on the same dense K/V, in f16 (its shared memory is f16): what the
    # Pallas stack reaches with no pages, rotations or masks.
    for cfg in JAX_MGPU_CONFIGS:
      methods.append((f"jax-mgpu[q{cfg[0]}k{cfg[1]}s{cfg[2]}]",
                      functools.partial(jax_mgpu_dense, cfg=cfg),
                      jax_mgpu_dense_inputs(lazy_args[0], k_dense, v_dense),
                      perturb_query))
    methods = [m for m in methods if selected(m[0])]
    timers = {}  # method -> ChainTimer, or the note of its failure
    for method, fn, args, perturb in methods:
      start = time.perf_counter()
      try:
        timers[method] = _timer(fn, args, perturb)
        print(f"  {method:24s} compiled ({time.perf_counter() - start:.0f} s)",
              flush=True)
      except Exception as e:  # keep going
        timers[method] = (f"failed: {type(e).__name__}: "
                          f"{str(e).splitlines()[0][:120]}")
        print(f"  {method:24s} {timers[method]}", flush=True)
        traceback.print_exc(file=sys.stdout)
    for table, rows in enumerate(per_table):
      if tables > 1:
        print(f"  table {table + 1} of {tables}", flush=True)
      windows = {}
      with ClockLog() as clocks:
        sampled = sample_round_robin(timers, windows, settle_s)
      for method, seconds, note in sampled:
        if seconds is not None:
          seen = clocks.during(windows[method])
          note = f"{seen[0]:.0f} MHz, {seen[1]:.0f} W" if seen else ""
          print(f"  {method:24s} {seconds * 1e3:8.3f} ms "
                f"{flops / seconds / 1e12:6.1f} TFLOP/s  {note}", flush=True)
        rows.append((shape, method, seconds, flops, note))
    del inputs, lazy_args, k_dense, v_dense
  return per_table


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--skip-parity", action="store_true")
  parser.add_argument("--skip-timing", action="store_true")
  parser.add_argument("--variants", default=",".join(VARIANTS),
                      help="comma-separated subset of " + ",".join(VARIANTS))
  parser.add_argument("--rows", default="",
                      help="comma-separated: time only the rows whose name, "
                      "or a word of it, begins with one (and cuDNN's)")
  parser.add_argument("--shapes", default=",".join(s[0] for s in SHAPES),
                      help="comma-separated subset of "
                      + ",".join(s[0] for s in SHAPES))
  parser.add_argument("--page-layout", choices=PAGE_LAYOUTS, default="pages",
                      help="timing: every page shuffled (default), or each "
                      "document's pages consecutive")
  parser.add_argument("--settle-s", type=float, default=SETTLE_S,
                      help="seconds each sample first runs its row untimed "
                      f"(default {SETTLE_S})")
  parser.add_argument("--tables", type=int, default=1,
                      help="time every row this many times, one table after "
                      "another from the same compiled calls, and print "
                      "each row's median, lowest and highest x cuDNN over "
                      "them (default 1)")
  args = parser.parse_args(argv)
  if args.tables < 1:
    parser.error(f"--tables must be >= 1, got {args.tables}")
  if args.settle_s < 0:
    parser.error(f"--settle-s must be >= 0, got {args.settle_s}")
  if jax.default_backend() != "gpu":
    raise SystemExit("needs a GPU (jax.default_backend() is "
                     f"{jax.default_backend()!r})")
  print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, "
        f"page layout: {args.page_layout}, settle {args.settle_s} s",
        flush=True)
  start = time.perf_counter()
  if not args.skip_parity:
    ok = run_parity()
    print(f"parity: {'all OK' if ok else 'FAILURES (see above)'} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
  if not args.skip_timing:
    names = [n for n in args.variants.split(",") if n]
    shapes = [n for n in args.shapes.split(",") if n]
    unknown = sorted(set(shapes) - {s[0] for s in SHAPES})
    if unknown:
      raise SystemExit(f"unknown shapes {unknown}")
    per_table = run_timing({n: VARIANTS[n] for n in names},
                           only=[r for r in args.rows.split(",") if r],
                           shapes=shapes, layout=args.page_layout,
                           settle_s=args.settle_s, tables=args.tables)
    for table, table_rows in enumerate(per_table):
      if args.tables > 1:
        print(f"\n# table {table + 1} of {args.tables}")
      print_table(table_rows)
    if args.tables > 1:
      print_tables_summary(per_table)
  print(f"total {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
  main()
