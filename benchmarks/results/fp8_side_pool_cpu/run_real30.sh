#!/bin/bash
# The real float8 pool (library unpatched) on the first 30 questions, both
# configurations.
cd /work/main && . .venv/bin/activate && export PYTHONPATH=$PWD
D=${D:-benchmarks/results/fp8_side_pool_cpu}
S=lazyattn_jax/data/smollm2_135m_sink.safetensors
COMMON="--no-progress --dataset synthetic --questions 30 --max-new-tokens 16 --save-predictions"
set -x
EMU=off python $D/emu_quality.py $COMMON --run "lazy,sink=$S,dtype=float8_e4m3fn,label=real fp8 lazy + sink" --run "lazy,sink=$S,recompute=true,dtype=float8_e4m3fn,label=real fp8 lazy + sink + recompute" --out $D/real_30.json > $D/real_30.log 2>&1
