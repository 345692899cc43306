#!/usr/bin/env bash
# The rest of the GPU figures, after benchmarks/gpu_proof.sh, in three more device commands (each
# budgeted at BUDGET_S = 530 s of the device's 600; a phase that no longer fits is skipped, saying so):
#
#   bash benchmarks/gpu_rest.sh bench   W1 precision matrix; W2 cnn-224 and cnn-cifar (data on the
#                                       GPU) side by side                                 (~320 s)
#   bash benchmarks/gpu_rest.sh ablation  W1 optimization ablation: 12 rows, four of them compiled
#                                       (eager ~20 s, compiled ~60 s each), alone: a bench writes
#                                       its JSON only when every row has run                (~500 s)
#   bash benchmarks/gpu_rest.sh train   the product's own path: `turbotrain train --preset gpt2-small
#                                       --data.tokenizer=bpe` (a 50304-token BPE trained offline on the
#                                       built-in corpus: a real 124M GPT-2 small on subword tokens) with its report;
#                                       the batch finder on gpt2-small and gpt2-medium; checkpointing
#                                       off/full at the found size; `turbotrain memory --measure`  (~480 s)
#
# Each run is short on purpose (tens of steps, checkpoints only at the end) so SIGTERM's graceful
# save fits in `timeout -k`'s grace; the finder runs (whose trials never compile) train with compile
# off to stay short, and say so in their run names. Results: benchmarks/results/<gpu>/rest-<group>/, packed
# into $OUT/rest-<group>.tgz after every phase, with $OUT/rest-<group>.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
GROUP=${1:-}
case "$GROUP" in bench|ablation|train) ;; *) echo "gpu_rest.sh: give a group: bench, ablation or train" >&2; exit 2;; esac
OUT=${OUT:-/tmp/turbotrain-gpu-rest}
BUDGET_S=${BUDGET_S:-530}
KILL_AFTER=15
. benchmarks/gpu_common.sh
start_script "rest-$GROUP" "$@"
RUNS="$WORK/runs"
SHORT=(--train.checkpoint_every 0 --no-progress --run.out_dir "$RUNS")

keep_runs() {  # summaries, metrics, configs and plots of the train runs (not their checkpoints)
  for r in "$RUNS"/*/; do
    [ -d "$r" ] || continue
    mkdir -p "$RES/runs/$(basename "$r")"
    cp "$r"/summary.json "$r"/summary.md "$r"/metrics.jsonl "$r"/config.toml "$RES/runs/$(basename "$r")/" 2>/dev/null
    cp -r "$r"/plots "$RES/runs/$(basename "$r")/" 2>/dev/null
  done
}

if [ "$GROUP" = bench ]; then
  phase w1-precision 100
  step 100 "$PY" -m turbotrain bench --workload gpt2-small --matrix precision --timeout-s 60 --out "$RES" --work-dir "$WORK/w1-precision"
  keep_row_logs w1-precision; pack
  W2=eager,handtuned,accelerate,lightning,turbotrain
  phase w2-cnn-224 120
  step 120 "$PY" -m turbotrain bench --workload cnn-224 --compare --contenders $W2 --compile-cache shared --timeout-s 100 --out "$RES" --work-dir "$WORK/w2-cnn-224"
  keep_row_logs w2-cnn-224; pack
  phase w2-cnn-cifar 100
  step 100 "$PY" -m turbotrain bench --workload cnn-cifar --compare --contenders $W2 --compile-cache shared --timeout-s 90 --out "$RES" --work-dir "$WORK/w2-cnn-cifar"
  keep_row_logs w2-cnn-cifar; pack
elif [ "$GROUP" = ablation ]; then
  phase w1-ablation 500  # shared compile cache: the compiled rows' common kernels compile once
  step 500 "$PY" -m turbotrain bench --workload gpt2-small --matrix ablation --warmup 5 --steps 15 --timeout-s 110 \
    --compile-cache shared --out "$RES" --work-dir "$WORK/w1-ablation"
  keep_row_logs w1-ablation; pack
else
  phase train-w1 180  # BPE training and encoding (~15 s on 16 cores, cached after) + compile + 120 steps
  step 180 "$PY" -m turbotrain train --preset gpt2-small --data.tokenizer=bpe --model.vocab_size=50304 --train.max_steps 120 \
    --train.eval_every 60 --train.eval_batches 5 --run.name gpt2-small-bpe50304 "${SHORT[@]}"
  keep_runs; pack
  phase finder 160
  step 80 "$PY" -m turbotrain train --preset gpt2-small --model.vocab_size=50304 --compile.scope=off \
    --batch.micro=auto --batch.global_size=64 --train.max_steps 20 --train.eval_every 0 --run.name gpt2-small-auto-eager "${SHORT[@]}"
  step 80 "$PY" -m turbotrain train --preset gpt2-medium --model.vocab_size=50304 --compile.scope=off \
    --batch.micro=auto --batch.global_size=32 --train.max_steps 15 --train.eval_every 0 --run.name gpt2-medium-auto-eager "${SHORT[@]}"
  keep_runs; pack
  phase checkpointing 120
  for ckpt in off full; do  # global batch = the found micro-batch, so each finds its own ceiling
    step 60 "$PY" -m turbotrain train --preset gpt2-small --model.vocab_size=50304 --compile.scope=off \
      --batch.micro=auto --batch.global_size=0 --batch.accumulation=1 --memory.checkpointing=$ckpt \
      --train.max_steps 15 --train.eval_every 0 --run.name gpt2-small-auto-ckpt-$ckpt "${SHORT[@]}"
  done
  keep_runs; pack
  phase memory-report 60
  for preset in gpt2-small gpt2-medium; do
    step_to "$RES/memory-$preset.json" 30 "$PY" -m turbotrain memory --preset "$preset" --measure --json --compile.scope=off
  done
  pack
fi
finish_script
