#!/usr/bin/env bash
# Engine runs on the H200 (issues 3 and 5), in one device call:
#   tests - engine parity tests with the Pallas GPU kernels;
#   probe - compiled memory of the 8B prefill step, picks the pool carry;
#   smoke - throughput smoke: Llama-3-8B shape, 64 concurrent requests;
#   paper - the RAG serving comparison at the paper-like load (pool 1/3 of the
#           corpus; PAPER_FRACTION=0.15 for a tighter pool, still within the
#           issue's "at most a third"; PAPER_CONCURRENCY=64 and
#           PAPER_REQUESTS=128 for twice the requests in flight;
#           WARM_CACHE=N measures from a cache warmed by N other requests;
#           GROUP_TOKENS=N sets the engine's first-token group size;
#           EVICTION=lru for the old eviction order);
#   tuned - the same with decode layers unrolled and a prefill budget per
#           scheduling step (not yet measured);
#   rates, budget - the TTFT-vs-rate and throughput-vs-budget sweeps;
#   mgpu  - Mosaic GPU prefill kernel: per-call and per-layer (plan made
#           once) timing against Triton and cuDNN, and its parts timed
#           alone (issue 2, ~60 s; MGPU_PARITY=1 adds the parity cases;
#           MGPU_VARIANTS names the tiles, default the default tiles
#           (k128w2s2-qreg-csrec-sched) and its copied-cos/sin form);
#   kernels - the kernel table of record, decode and prefill (issue 2;
#           MOSAIC_VARIANTS names the Mosaic decode tiles timed, default
#           the default tiles: each adds whole-call and per-layer rows at
#           every shape, and all of them do not fit one call);
#   fp8   - the paper-like load at a 10% pool in lazy and block, each again
#           with a float8 pool of the same bytes (issue 16, part 3;
#           FP8_FRACTION, FP8_MODES).
#   idle  - the plain lazy run of the throughput bar (20% pool, warm cache,
#           4,096-token groups), then its trace replayed under the profiler
#           with the Python tracer: device busy and idle time, idle by gap
#           size and by the host's Python frame (benchmarks/idle_profile.py).
#   step  - the decode step of 32 rows against its HBM floor, per compile
#           form (benchmarks/decode_step.py; STEP_VARIANTS), with an op
#           breakdown from a profile (issue 16, decode-step bar);
#   mixed - the paper-like load (20% pool) in lazy, plain beside running
#           requests decoding inside the round's prefill calls (issue 16,
#           part 2; MIXED_FRACTION, GROUP_TOKENS; MIXED_BUDGET=1024 with
#           GROUP_TOKENS=1024 cuts the round's prefill into calls of two
#           512-token documents, each carrying a decode token;
#           MIXED_CHUNK=256 encodes documents in 256-token chunks;
#           MIXED_EXTRA adds rag_serving options, e.g. "--gpu-xla-option
#           xla_gpu_dot_merger_threshold_mb=0"; MIXED_PROFILE=1 replays
#           each run under the profiler and prints where the device idled,
#           as the idle stage does; MIXED_ONLY=1 skips the plain run;
#           MIXED_EXTRA=--decode-loops-to-first-finish ends decode loops at
#           the first request that reaches its output length, in both runs).
#   wholecall - the Mosaic kernels' whole calls (plan included) against
#           their per-layer calls: decode at B64 and B32 / ctx 8192 beside
#           the Triton decode (the default, one step per block with the
#           rope and its cos / sin in the kernel: k128s2-blocks-rope-compactcs;
#           the former default k128s2-blocks-rope; with the records read by the
#           kernel: k128s2-blocks-rope-fields; WHOLECALL_VARIANTS names
#           others), prefill (the default, and with each segment's cos /
#           sin in the step records: k128w2s2-qreg-csrec-sched; each kernel
#           also with one rotation a CTA and with no masks, timing only)
#           at the 512- and 128-token chunks beside cuDNN, after the plans'
#           device time by op (benchmarks/plan_profile.py) (issue 16, parts
#           1 and 4 as whole calls; ~200 s).
#   levers - the opt-in levers for the shuffled-page bars of issue 16
#           (rotate_ahead, l2_prefetch; neither kept, benchmarks/RESULTS.md):
#           the decode at B64 / ctx 8192 and the prefill at the 512-token
#           chunk, each against the default on shuffled pages
#           (LEVERS_LAYOUT=documents for the other layout, LEVERS_TESTS=1 to
#           run their GPU tests first, 140 s more; up to 520 s without).
#   mixedstep - a mixed step against its parts, alone and chained, at
#           MIXEDSTEP_TOKENS document tokens per call (benchmarks/mixed_step.py;
#           ~70 s).
# On two or more GPUs (issue 15, tensor parallelism):
#   tptests - tests/multi_device with the Pallas kernels (engine parity at
#           tensor parallel 2 in every mode, kernels per device, loading);
#   tp    - the paper-like load at tensor parallel 1 and 2 side by side
#           (Llama-3-8B shape; TP_LIST=1,2), with the communication share of
#           a profiled decode (TP_FRACTION=0.2 of the corpus as the pool);
#   tp70  - the same load on a Llama-3-70B shape at tensor parallel 2, the
#           pool in the memory the weights leave (TP70_POOL=0.5 of it).
# Usage: bash benchmarks/h200_engine.sh OUTDIR [parts...]
set -uo pipefail
out=${1:-/tmp/out}; shift || true
parts=${*:-tests probe smoke paper}
export PYTHONUNBUFFERED=1
# JAX takes 75% of the GPU by default; the pool is most of the rest.
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.93}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
bits=""
fraction=0.3333
# Prints each run's profile replay of a rag_serving JSON: device busy and
# idle time, idle by gap size and by the host's Python frame.
idle_summary() {
  python3 -c "
import json, sys
for run in json.load(open(sys.argv[1]))['runs']:
  p = run.get('profile')
  if not p:
    continue
  print(run['mode'], {k: round(p[k], 3) for k in ('wall_s', 'busy_s', 'span_s', 'idle_s')})
  print(p['idle_by_gap_size'])
  for name, seconds, share in p['idle_by_frame'][:15]:
    print(f'{seconds:8.4f} {share:5.2f} {name}')
" "$1"
}
for part in $parts; do
  echo "== $part $(date +%T)"
  case $part in
    tests)
      timeout 150 python3 -m pytest -q -x tests/test_engine.py tests/test_engine_modes.py \
        --engine-impl gpu -k "dense or block_matches" \
        -p no:cacheprovider 2>&1 | tail -15 | tee "$out/engine_tests_gpu.txt"
      timeout 120 python3 -m pytest -q -m gpu tests/test_step_jit.py \
        -p no:cacheprovider 2>&1 | tail -4 | tee -a "$out/engine_tests_gpu.txt" ;;
    probe)
      timeout 150 python3 -m benchmarks.memory_probe 2>&1 | grep -v Warning | tee "$out/memory_probe.txt" | tail -6
      best=$(grep -o 'BEST=[a-z]*' "$out/memory_probe.txt" | cut -d= -f2)
      copies=$(grep -o 'COPIES=[0-9.]*' "$out/memory_probe.txt" | cut -d= -f2)
      [ "$best" = bits ] && bits="--pool-as-bits"
      # 15 GiB of weights + the pool and its copies must fit in ~125 GiB.
      if [ -n "$copies" ] && python3 -c "import sys; sys.exit(0 if float('$copies') > 1.5 else 1)"; then
        fraction=0.2
      fi
      echo "pool carry: ${best:-native} (${copies:-?} pool copies); paper cache fraction $fraction" ;;
    smoke)
      timeout 150 python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 64 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 0 --concurrency 64 --max-batch 64 --num-requests 64 --modes lazy \
        --cache-pages 3072 --decode-steps 16 --no-progress \
        --out "$out/smoke_llama3_8b.json" 2>&1 | grep -v Warning | tail -6 ;;
    paper)
      timeout ${PAPER_TIMEOUT:-300} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency ${PAPER_CONCURRENCY:-32} --max-batch ${PAPER_CONCURRENCY:-32} \
        --num-requests ${PAPER_REQUESTS:-64} --warm-cache-requests ${WARM_CACHE:-0} \
        --group-tokens ${GROUP_TOKENS:-0} --eviction ${EVICTION:-lfu} \
        --cache-fraction ${PAPER_FRACTION:-$fraction} --modes ${MODES:-lazy,block,full,prefix} --decode-steps 16 \
        --quality-runs "${QUALITY_RUNS:-}" \
        --no-progress --out "$out/rag_paper_like.json" 2>&1 | grep -v Warning | tail -30 ;;
    tuned)
      timeout ${PAPER_TIMEOUT:-300} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency 32 --max-batch 32 --num-requests 64 \
        --cache-fraction $fraction --modes ${MODES:-lazy,block,full,prefix} --decode-steps 16 \
        --decode-unroll --prefill-tokens-per-step ${PREFILL_BUDGET:-8192} \
        --no-progress --out "$out/rag_paper_like_tuned.json" 2>&1 | grep -v Warning | tail -30 ;;
    rates)
      timeout ${SWEEP_TIMEOUT:-200} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --max-batch 32 --num-requests ${SWEEP_REQUESTS:-48} --skip-base --sweep-rates ${RATES:-2,8} \
        --cache-fraction $fraction --modes ${MODES:-lazy,block,full,prefix} --decode-steps 16 \
        --no-progress --out "$out/rag_rates.json" --plot-dir "$out" 2>&1 | grep -v Warning | tail -12 ;;
    budget)
      timeout ${SWEEP_TIMEOUT:-200} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 500 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency 32 --max-batch 32 --num-requests ${SWEEP_REQUESTS:-48} --skip-base \
        --sweep-cache-fractions ${FRACTIONS:-0.05,0.33,1.0} \
        --modes ${MODES:-lazy,block,full,prefix} --decode-steps 16 \
        --no-progress --out "$out/rag_budget.json" --plot-dir "$out" 2>&1 | grep -v Warning | tail -12 ;;
    mgpu)
      parity=--skip-parity; [ "${MGPU_PARITY:-0}" = 1 ] && parity=""
      timeout ${MGPU_TIMEOUT:-120} python3 -m benchmarks.mgpu_prefill_check $parity \
        --variants ${MGPU_VARIANTS:-k128w2s2-qreg-sched,k128w2s2-qreg-csrec-sched} 2>&1 \
        | grep -v Warning | tee "$out/mgpu_prefill.txt" | tail -20 ;;
    tptests)
      timeout 300 python3 -m pytest -q tests/multi_device --engine-impl gpu \
        -p no:cacheprovider 2>&1 | tail -15 | tee "$out/tp_tests_gpu.txt" ;;
    tp)
      timeout ${TP_TIMEOUT:-540} python3 -m benchmarks.tensor_parallel --model llama3-8b-shape \
        --tensor-parallel ${TP_LIST:-1,2} $bits --cache-fraction ${TP_FRACTION:-0.2} \
        --profile-dir "$out/tp_profile" --no-progress --out "$out/tp_8b.json" \
        2>&1 | grep -v Warning | tail -12 ;;
    tp70)
      timeout ${TP_TIMEOUT:-540} python3 -m benchmarks.tensor_parallel --model llama3-70b-shape \
        --tensor-parallel ${TP70_LIST:-2} $bits --pool-memory-fraction ${TP70_POOL:-0.5} \
        --num-requests ${TP70_REQUESTS:-32} \
        --profile-dir "$out/tp70_profile" --no-progress --out "$out/tp_70b.json" \
        2>&1 | grep -v Warning | tail -12 ;;
    fp8)
      timeout ${PAPER_TIMEOUT:-540} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency 32 --max-batch 32 --num-requests 64 \
        --warm-cache-requests ${WARM_CACHE:-192} --group-tokens ${GROUP_TOKENS:-4096} \
        --eviction lfu --cache-fraction ${FP8_FRACTION:-0.1} --modes ${FP8_MODES:-lazy,block} \
        --kv-dtypes float8_e4m3fn --decode-steps 16 \
        --no-progress --out "$out/rag_paper_like_fp8.json" 2>&1 | grep -v Warning | tail -12 ;;
    mixed)
      riding=--decode-during-prefill-runs
      [ -n "${MIXED_ONLY:-}" ] && riding=--decode-during-prefill-only
      timeout ${PAPER_TIMEOUT:-540} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency 32 --max-batch 32 --num-requests 64 \
        --warm-cache-requests ${WARM_CACHE:-192} --group-tokens ${GROUP_TOKENS:-4096} \
        --eviction lfu --cache-fraction ${MIXED_FRACTION:-0.2} --modes lazy \
        $riding --decode-steps 16 \
        --max-prefill-tokens ${MIXED_BUDGET:-16384} --prefill-chunk-tokens ${MIXED_CHUNK:-0} \
        ${MIXED_EXTRA:-} ${MIXED_PROFILE:+--profile-replay-dir /tmp/mixed_profile} \
        --no-progress --out "$out/rag_paper_like_mixed_${MIXED_BUDGET:-16384}.json" 2>&1 | grep -v Warning | tail -12
      [ -n "${MIXED_PROFILE:-}" ] && idle_summary "$out/rag_paper_like_mixed_${MIXED_BUDGET:-16384}.json" ;;
    wholecall)
      timeout 120 python3 -m benchmarks.plan_profile --trace-dir /tmp/plan_profile --top 12 2>&1 \
        | grep -v Warning | tee "$out/plan_profile.txt" | tail -28
      timeout ${KERNELS_TIMEOUT:-240} python3 -m benchmarks.kernels --decode-only \
        --no-baselines --decode-shapes 64x8192,32x8192 --mosaic-variants ${WHOLECALL_VARIANTS:-k128s2-blocks-rope-compactcs,k128s2-blocks-rope,k128s2-blocks-rope-fields} --time-budget 200 \
        --json "$out/kernels_decode_wholecall.json" 2>&1 | grep -v Warning | grep -v "^  tune" \
        | tail -16
      timeout ${KERNELS_TIMEOUT:-240} python3 -m benchmarks.mgpu_prefill_check --skip-parity \
        --variants k128w2s2-qreg-sched,k128w2s2-qreg-csrec-sched 2>&1 | grep -v Warning \
        | tee "$out/mgpu_prefill_wholecall.txt" | tail -30 ;;
    levers)
      if [ "${LEVERS_TESTS:-0}" != 0 ]; then
        timeout 150 python3 -m pytest -q -m gpu -n 4 -p no:cacheprovider \
          tests/test_l2_prefetch.py tests/test_gpu_decode_blocks.py \
          -k "rotate_ahead or prefetch or segment_steps" 2>&1 | tail -3 \
          | tee "$out/levers_tests.txt"
      fi
      timeout 310 python3 -m benchmarks.kernels --decode-only --no-baselines \
        --no-triton-decode --decode-shapes 64x8192 --page-layout ${LEVERS_LAYOUT:-pages} \
        --mosaic-variants k128s2-blocks-rope,k128s2-blocks-rope-ahead,k128s2-blocks-rope-l2pf \
        --time-budget 240 --json "$out/levers_decode.json" 2>&1 | grep -v Warning \
        | grep "B64/ctx8192\|PASS\|MISS" | tee "$out/levers_decode.txt"
      timeout 200 python3 -m benchmarks.mgpu_prefill_check --skip-parity \
        --variants k128w2s2-qreg-csrec-sched,k128w2s2-qreg-csrec-sched-l2pf \
        --shapes chunk512 --page-layout ${LEVERS_LAYOUT:-pages} --tables 3 \
        --rows "mgpu[k128,kernel[k128w2s2-qreg-csrec-sched" 2>&1 | grep -v Warning \
        | tee "$out/levers_prefill.txt" | tail -30 ;;
    mixedstep)
      timeout ${PAPER_TIMEOUT:-300} python3 -m benchmarks.mixed_step \
        --prefill-tokens ${MIXEDSTEP_TOKENS:-512,1024,2048} --repeats 5 \
        --out "$out/mixed_step.json" 2>&1 | grep -v Warning | tail -4 ;;
    idle)
      timeout ${PAPER_TIMEOUT:-300} python3 -m benchmarks.rag_serving --model llama3-8b-shape $bits \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency 32 --max-batch 32 --num-requests 64 \
        --warm-cache-requests ${WARM_CACHE:-192} --group-tokens ${GROUP_TOKENS:-4096} \
        --eviction lfu --cache-fraction ${PAPER_FRACTION:-0.2} --modes lazy --decode-steps 16 \
        --profile-replay-dir /tmp/idle_profile --no-progress --out "$out/rag_paper_like_idle.json" \
        2>&1 | grep -v Warning | tail -2
      idle_summary "$out/rag_paper_like_idle.json" ;;
    step)
      timeout ${STEP_TIMEOUT:-300} python3 -m benchmarks.decode_step \
        --variants ${STEP_VARIANTS:-triton,plain,merge,graphs} --loops 4 \
        --profile-dir /tmp/decode_step_profile --out "$out/decode_step.json" 2>&1 \
        | grep -v Warning | tail -6 ;;
    kernels)
      timeout ${KERNELS_TIMEOUT:-540} python3 -m benchmarks.kernels --json "$out/kernels.json" \
        --time-budget ${KERNELS_BUDGET:-480} --mosaic-variants ${MOSAIC_VARIANTS:-k128s2} 2>&1 \
        | grep -v Warning | tee "$out/kernels.txt" | tail -45 ;;
  esac
done
