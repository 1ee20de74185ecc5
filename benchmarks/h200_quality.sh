#!/usr/bin/env bash
# Answer quality of SmolLM2-135M-Instruct (the embedded default model) on one
# GPU: full attention against lazy, with each training-free option alone and
# combined, then a learned sink trained there and measured, then (stage
# "finetune") block fine-tuning and the fine-tuned model measured.
#
#   bash benchmarks/h200_quality.sh OUT options   # baseline + options + sink
#   bash benchmarks/h200_quality.sh OUT finetune  # fine-tune + measure
#   bash benchmarks/h200_quality.sh OUT hotpot-options|hotpot-sink|synthetic
#       # one dataset's runs each, for calls of under 10 minutes
#
# Environment: HOTPOT_QUESTIONS (held-out questions, default 300),
# SINK_STEPS / SINK_MINUTES, FT_STEPS / FT_MINUTES.  The model and the data
# come from the user cache ($LAZYATTN_CACHE); every step has a time limit
# so one slow step still leaves the others' results in OUT.
set -uo pipefail
OUT=${1:?usage: h200_quality.sh OUT options|finetune}
STAGE=${2:-options}
Q=${HOTPOT_QUESTIONS:-300}
mkdir -p "$OUT"
# Compiling, not serving, is most of a run's time on the GPU (about 4 s per
# program; the runs report `compile_seconds`): keep compiled programs on
# disk so a later call on the same machine reuses them.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax-compile-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
SHIPPED_SINK=lazyattn_jax/data/smollm2_135m_sink.safetensors
log() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$OUT/steps.log"; }

quality() {  # quality NAME SECONDS ARGS...
  local name=$1 limit=$2; shift 2
  log "start $name"
  timeout "$limit" python -m benchmarks.rag_quality --no-progress --batch 64 \
      --out "$OUT/$name.json" "$@" > "$OUT/$name.log" 2>&1
  log "end $name rc=$?"
}

OPTION_RUNS=(--modes full --run lazy
  --run "lazy,preamble=chat,label=lazy + chat preamble"
  --run "lazy,recompute=true,label=lazy + recompute"
  --run "lazy,preamble=chat,recompute=true,label=lazy + chat preamble + recompute")

if [ "$STAGE" = options ]; then
  quality quality_synthetic 70 --dataset synthetic --questions 200 \
      --max-new-tokens 16 "${OPTION_RUNS[@]}"
  quality quality_hotpotqa 160 --dataset hotpotqa --layout dataset \
      --questions "$Q" "${OPTION_RUNS[@]}"
  log "start sink"
  timeout 200 python -m lazyattn_jax.training.sink --data hotpotqa \
      --out "$OUT/sink" --preamble-len 16 --steps "${SINK_STEPS:-400}" \
      --batch-size 16 --lr 3e-3 --warmup-steps 30 --dtype bfloat16 \
      --eval-batches 4 --remat --max-minutes "${SINK_MINUTES:-2.5}" --no-progress \
      > "$OUT/sink.log" 2>&1
  log "end sink rc=$?"
  SINK="$OUT/sink/sink.safetensors"
  if [ -f "$SINK" ]; then
    SINK_RUNS=(--run "lazy,sink=$SINK,label=lazy + sink"
      --run "lazy,sink=$SINK,recompute=true,label=lazy + sink + recompute")
    quality quality_synthetic_sink 50 --dataset synthetic --questions 200 \
        --max-new-tokens 16 "${SINK_RUNS[@]}"
    quality quality_hotpotqa_sink 90 --dataset hotpotqa --layout dataset \
        --questions "$Q" "${SINK_RUNS[@]}"
  fi
elif [ "$STAGE" = hotpot-options ]; then
  quality quality_hotpotqa_options 570 --dataset hotpotqa --layout dataset \
      --questions "$Q" "${OPTION_RUNS[@]}" \
      --run "lazy,sink=$SHIPPED_SINK,label=lazy + sink"
elif [ "$STAGE" = hotpot-sink ]; then
  quality quality_hotpotqa_sink 570 --dataset hotpotqa --layout dataset \
      --questions "$Q" --modes full --run lazy \
      --run "lazy,sink=$SHIPPED_SINK,recompute=true,label=lazy + sink + recompute" \
      --run "lazy,sink=$SHIPPED_SINK,label=lazy + sink"
elif [ "$STAGE" = synthetic ]; then
  quality quality_synthetic_options 570 --dataset synthetic --questions 200 \
      --max-new-tokens 16 "${OPTION_RUNS[@]}" \
      --run "lazy,sink=$SHIPPED_SINK,label=lazy + sink" \
      --run "lazy,sink=$SHIPPED_SINK,recompute=true,label=lazy + sink + recompute"
elif [ "$STAGE" = finetune ]; then
  log "start finetune"
  timeout 330 python -m lazyattn_jax.cli finetune --data hotpotqa \
      --out /tmp/ft --steps "${FT_STEPS:-1500}" --batch-size 32 --lr 2e-5 \
      --warmup-steps 50 --dtype bfloat16 --remat --checkpoint-every 100000 \
      --max-minutes "${FT_MINUTES:-4.5}" --no-progress > "$OUT/finetune.log" 2>&1
  log "end finetune rc=$?"
  cp /tmp/ft/*.json /tmp/ft/*.png "$OUT/" 2>/dev/null
  MODEL=$(dirname "$(find /tmp/ft -name config.json | head -1)")
  if [ -n "$MODEL" ] && [ -f "$MODEL/config.json" ]; then
    quality quality_hotpotqa_finetuned 150 --model "$MODEL" --dataset hotpotqa \
        --layout dataset --questions "$Q" --modes full,lazy
    quality quality_synthetic_finetuned 60 --model "$MODEL" \
        --dataset synthetic --questions 200 --max-new-tokens 16 --modes full,lazy
  fi
else
  echo "unknown stage $STAGE" >&2; exit 2
fi
log done
