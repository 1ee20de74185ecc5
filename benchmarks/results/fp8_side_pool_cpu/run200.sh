#!/bin/bash
# The six runs of 200 questions (A, B, C x two configurations), then the
# real float8 pool on the first 30 questions.
cd /work/main && . .venv/bin/activate && export PYTHONPATH=$PWD
D=${D:-benchmarks/results/fp8_side_pool_cpu}
S=lazyattn_jax/data/smollm2_135m_sink.safetensors
N=${N:-200}
COMMON="--no-progress --dataset synthetic --questions $N --max-new-tokens 16 --save-predictions"
SINK="lazy,sink=$S"
RC="lazy,sink=$S,recompute=true"
F8="dtype=float8_e4m3fn"
set -x
EMU=off python $D/emu_quality.py $COMMON --run "$SINK,label=A lazy + sink" --run "$RC,label=A lazy + sink + recompute" --out $D/A_$N.json > $D/A_$N.log 2>&1
EMU=all python $D/emu_quality.py $COMMON --run "$SINK,$F8,label=B lazy + sink" --run "$RC,$F8,label=B lazy + sink + recompute" --out $D/B_$N.json > $D/B_$N.log 2>&1
EMU=nopreamble EMU_EXEMPT_PAGES=0 python $D/emu_quality.py $COMMON --run "$SINK,$F8,label=C lazy + sink" --run "$RC,$F8,label=C lazy + sink + recompute" --out $D/C_$N.json > $D/C_$N.log 2>&1
