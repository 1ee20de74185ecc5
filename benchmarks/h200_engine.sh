#!/usr/bin/env bash
# Engine runs on the H200 (issues 3 and 5), in one device call:
#   1. engine parity tests with the Pallas GPU kernels;
#   2. throughput smoke: Llama-3-8B shape, 64 concurrent requests;
#   3. the RAG serving comparison at the paper-like load.
# Usage: bash benchmarks/h200_engine.sh OUTDIR [parts...]  (parts: tests smoke paper)
set -uo pipefail
out=${1:-/tmp/out}; shift || true
parts=${*:-tests smoke paper}
export PYTHONUNBUFFERED=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/device.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/device.txt"
for part in $parts; do
  echo "== $part $(date +%T)"
  case $part in
    tests)
      timeout 150 python3 -m pytest -q -x tests/test_engine.py tests/test_engine_modes.py \
        --engine-impl gpu -k "dense or block_matches" \
        -p no:cacheprovider 2>&1 | tail -15 | tee "$out/engine_tests_gpu.txt" ;;
    smoke)
      timeout 150 python3 -m benchmarks.rag_serving --model llama3-8b-shape \
        --num-docs 64 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 0 --concurrency 64 --max-batch 64 --num-requests 64 --modes lazy \
        --cache-fraction 1.0 --add-working-pages --decode-steps 16 --no-progress \
        --out "$out/smoke_llama3_8b.json" 2>&1 | grep -v Warning | tail -6 ;;
    paper)
      timeout ${PAPER_TIMEOUT:-380} python3 -m benchmarks.rag_serving --model llama3-8b-shape \
        --num-docs 2000 --docs-per-request 8 --doc-len 512 --query-len 64 --output-len 64 \
        --zipf 1.1 --concurrency 32 --max-batch 32 --num-requests 64 \
        --cache-fraction 0.3333 --modes ${MODES:-lazy,block,prefix,full} --decode-steps 16 \
        --no-progress --out "$out/rag_paper_like.json" 2>&1 | grep -v Warning | tail -30 ;;
  esac
done
