#!/bin/bash
# Questions 200-599 of the same synthetic set (Q_START=200 --questions 600),
# lazy + sink only: A, B, C.
cd /work/main && . .venv/bin/activate && export PYTHONPATH=$PWD
D=${D:-benchmarks/results/fp8_side_pool_cpu}
S=lazyattn_jax/data/smollm2_135m_sink.safetensors
COMMON="--no-progress --dataset synthetic --questions 600 --max-new-tokens 16 --save-predictions"
SINK="lazy,sink=$S"
F8="dtype=float8_e4m3fn"
set -x
# First: the emulated B pool on the same first 30 questions as real_30.json
# (answers depend on the run's question count through batching and pool
# size, so B is compared with the real pool at the same --questions).
EMU=all python $D/emu_quality.py --no-progress --dataset synthetic --questions 30 --max-new-tokens 16 --save-predictions --run "$SINK,$F8,label=B lazy + sink" --run "lazy,sink=$S,recompute=true,$F8,label=B lazy + sink + recompute" --out $D/B_30.json > $D/B_30.log 2>&1
export Q_START=200
EMU=off python $D/emu_quality.py $COMMON --run "$SINK,label=A lazy + sink" --out $D/A_200to600.json > $D/A_200to600.log 2>&1
EMU=all python $D/emu_quality.py $COMMON --run "$SINK,$F8,label=B lazy + sink" --out $D/B_200to600.json > $D/B_200to600.log 2>&1
EMU=nopreamble EMU_EXEMPT_PAGES=0 python $D/emu_quality.py $COMMON --run "$SINK,$F8,label=C lazy + sink" --out $D/C_200to600.json > $D/C_200to600.log 2>&1
