#!/usr/bin/env bash
# Answer quality of SmolLM2-135M-Instruct (the embedded default model) on one
# GPU: full attention against lazy, with each training-free option alone and
# combined, then a learned sink trained there and measured, then (stage
# "finetune") block fine-tuning and the fine-tuned model measured.
#
#   bash benchmarks/h200_quality.sh OUT options   # baseline + options + sink
#   bash benchmarks/h200_quality.sh OUT finetune       # fine-tune: 250 steps
#       # take ~8.5 min; the first call stops at 7 with a checkpoint (and
#       # the model so far), the same stage run again resumes, finishes and
#       # exports /tmp/ft/model
#   bash benchmarks/h200_quality.sh OUT finetune-eval  # then, same machine:
#       # base full and lazy beside the fine-tuned model (HotpotQA);
#       # finetune-synthetic likewise on the synthetic set
#   bash benchmarks/h200_quality.sh OUT hotpot-options|hotpot-sink|synthetic
#       # one dataset's runs each, for calls of under 10 minutes
#   bash benchmarks/h200_quality.sh OUT fp8   # float8 pages' quality cost, each
#       # pool with its default options (float8: the float8 sink)
#       # (fp8-full / fp8-lazy: one mode each)
#   bash benchmarks/h200_quality.sh OUT fp8-sink       # a sink trained for
#       # float8 pages (the shipped sink's command with --float8-pages),
#       # kept in /tmp/sink8 and copied to OUT (3 files)
#   bash benchmarks/h200_quality.sh OUT fp8-sink-eval  # then, same machine:
#       # bf16 pages + the shipped sink beside float8 pages + that sink
#
# Environment: HOTPOT_QUESTIONS (held-out questions, default 300),
# SINK_STEPS / SINK_MINUTES, FT_STEPS / FT_LR / FT_WARMUP / FT_MINUTES.  The model and the data
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
SHIPPED_SINK8=lazyattn_jax/data/smollm2_135m_sink_float8.safetensors  # float8 pools
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
elif [ "$STAGE" = fp8 ] || [ "$STAGE" = fp8-full ] || [ "$STAGE" = fp8-lazy ]; then
  # Each mode with bf16 pages beside float8 pages, one process per mode
  # (fp8 runs both) so each fits a call; the predictions let
  # benchmarks/paired_quality compare the runs item by item.  Lazy runs
  # each pool's default options: float8 pools take the float8 sink.
  DEFAULTS="sink=$SHIPPED_SINK,recompute=true"
  [ "$STAGE" != fp8-lazy ] && quality quality_hotpotqa_fp8_full 570 \
      --dataset hotpotqa --layout dataset --questions "$Q" --modes full \
      --save-predictions --run "full,dtype=float8_e4m3fn,label=full fp8 pages"
  [ "$STAGE" != fp8-full ] && quality quality_hotpotqa_fp8_lazy 570 \
      --dataset hotpotqa --layout dataset --questions "$Q" --save-predictions \
      --run "lazy,$DEFAULTS,label=lazy + sink + recompute" \
      --run "lazy,sink=$SHIPPED_SINK8,recompute=true,dtype=float8_e4m3fn,label=lazy + float8 sink + recompute fp8 pages"
elif [ "$STAGE" = fp8-sink ]; then  # training only: about 3 minutes
  log "start fp8-sink"
  timeout 280 python -m lazyattn_jax.training.sink --data hotpotqa \
      --out /tmp/sink8 --preamble-len 16 --steps "${SINK_STEPS:-400}" \
      --batch-size 16 --lr 3e-3 --warmup-steps 30 --dtype bfloat16 \
      --eval-batches 4 --remat --max-minutes "${SINK_MINUTES:-2.5}" \
      --float8-pages --no-progress > "$OUT/fp8_sink.log" 2>&1
  log "end fp8-sink rc=$?"
  cp /tmp/sink8/* "$OUT/" 2>/dev/null
elif [ "$STAGE" = fp8-sink-eval ]; then  # the next call, on the same machine
  quality quality_hotpotqa_fp8_sink 570 --dataset hotpotqa --layout dataset \
      --questions "$Q" --save-predictions \
      --run "lazy,sink=$SHIPPED_SINK,recompute=true,label=lazy + sink + recompute" \
      --run "lazy,sink=/tmp/sink8/sink.safetensors,recompute=true,dtype=float8_e4m3fn,label=lazy + float8 sink + recompute fp8 pages"
elif [ "$STAGE" = finetune ]; then  # training only: about 8 minutes
  log "start finetune"
  timeout 570 python -m lazyattn_jax.cli finetune --data hotpotqa \
      --out /tmp/ft --steps "${FT_STEPS:-250}" --batch-size 32 \
      --lr "${FT_LR:-5e-5}" --warmup-steps "${FT_WARMUP:-20}" --dtype bfloat16 \
      --remat --checkpoint-every 100000 --max-minutes "${FT_MINUTES:-7}" \
      --no-progress > "$OUT/finetune.log" 2>&1
  log "end finetune rc=$?"
  cp /tmp/ft/*.json /tmp/ft/*.png "$OUT/" 2>/dev/null
elif [ "$STAGE" = finetune-eval ]; then  # the next call, on the same machine
  # The finished export only (a call cut off while exporting may leave a
  # model.tmp-* beside it).
  MODEL=/tmp/ft/model
  # The base model's full attention beside the fine-tuned model, one process.
  quality quality_hotpotqa_finetuned 570 --dataset hotpotqa --layout dataset \
      --questions "$Q" --modes full --run lazy \
      --run "full,model=$MODEL,label=fine-tuned full" \
      --run "lazy,model=$MODEL,label=fine-tuned lazy"
elif [ "$STAGE" = finetune-synthetic ]; then
  MODEL=/tmp/ft/model
  quality quality_synthetic_finetuned 570 --dataset synthetic --questions 200 \
      --max-new-tokens 16 --modes full --run lazy \
      --run "full,model=$MODEL,label=fine-tuned full" \
      --run "lazy,model=$MODEL,label=fine-tuned lazy"
else
  echo "unknown stage $STAGE" >&2; exit 2
fi
log done
