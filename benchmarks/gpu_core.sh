#!/usr/bin/env bash
# The GPU checks of the core, observability and memory issues in ONE device command (~9 min):
#
#   1. the GPU tests (tests/gpu: engine, monitor sync-debug, memory)
#   2. turbotrain doctor --probe --json                     (issue 3)
#   3. gpt2-small, 200 steps, defaults (bf16, compile)       (issues 2 and 3: tokens/s, MFU, peak memory, report)
#   4. gpt2-small --batch.micro=auto, 200 steps              (issue 5: chosen size, search time, no OOM)
#   5. turbotrain memory for gpt2-small / gpt2-medium with checkpointing off/selective/full, measured
#
# and, as a second device command (`memory` phase, ~8 min), the rest of issue 5:
#
#   6. gpt2-medium --batch.micro=auto, 200 steps            (chosen size, search time, no OOM)
#   7. gpt2-small --batch.micro=auto, global batch = micro, checkpointing off and full, 200 steps each
#      (how far checkpointing lets the micro-batch grow, and what it costs in tokens/s)
#
#   OUT=/some/dir bash benchmarks/gpu_core.sh            # phase "core" (1-5)
#   OUT=/some/dir bash benchmarks/gpu_core.sh memory     # phase "memory" (6-7)
# Writes benchmarks/results/<gpu>/core/ and, under $OUT, core-<phase>.tgz (refreshed after every step)
# plus core.log.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/turbotrain-gpu-core}
GPU=$($PY -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))') \
  || { echo "gpu_core.sh: no CUDA GPU visible to torch" >&2; exit 1; }
SLUG=$(printf '%s' "$GPU" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
PHASE=${1:-core}
case "$PHASE" in core|memory) ;; *) echo "gpu_core.sh: unknown phase '$PHASE'; use core or memory" >&2; exit 2;; esac
RES=benchmarks/results/$SLUG/core
RUNS=/tmp/turbotrain-gpu-core-runs-$PHASE
rm -rf "$RUNS"  # a re-run must not pass off an earlier run's results as its own
mkdir -p "$RES" "$OUT" "$RUNS"
log() { echo "== $* (+${SECONDS}s)" | tee -a "$OUT/core.log"; }
# Copy the finished runs into $RES and pack $RES under $OUT after every step: if the device's
# 10-minute limit ends the command, what was done so far still comes back.
collect() {
  for r in "$RUNS"/*/; do
    [ -d "$r" ] || continue
    name=$(basename "$r")
    mkdir -p "$RES/$name"
    cp "$r"/summary.json "$r"/summary.md "$r"/metrics.jsonl "$r"/config.toml "$RES/$name/" 2>/dev/null
    cp -r "$r"/plots "$RES/$name/" 2>/dev/null
  done
  tar czf "$OUT/core-$PHASE.tgz" "$RES"
}
run() { log "$*"; "$@" 2>&1 | tee -a "$OUT/core.log"; collect; }
echo "command: OUT=$OUT bash benchmarks/gpu_core.sh $PHASE (torch $($PY -c 'import torch; print(torch.__version__, torch.version.cuda)'))" >> "$RES/COMMAND.txt"

if [ "$PHASE" = memory ]; then
run timeout 230 $PY -m turbotrain train --preset gpt2-medium --batch.micro=auto --batch.global_size=32 \
    --train.max_steps 200 --train.eval_every 200 --run.out_dir "$RUNS" --run.name gpt2-medium-auto --no-progress
for ckpt in off full; do  # global batch = the found micro-batch, so each finds its own ceiling
run timeout 150 $PY -m turbotrain train --preset gpt2-small --batch.micro=auto --batch.global_size=0 \
    --batch.accumulation=1 --memory.checkpointing=$ckpt --train.max_steps 200 --train.eval_every 200 \
    --run.out_dir "$RUNS" --run.name gpt2-small-auto-ckpt-$ckpt --no-progress
done
else
run timeout 150 $PY -m pytest -q tests/gpu
log "doctor --probe --json"; timeout 40 $PY -m turbotrain doctor --probe --json > "$RES/doctor.json" 2>> "$OUT/core.log"
run timeout 160 $PY -m turbotrain train --preset gpt2-small --train.max_steps 200 --train.eval_every 100 \
    --run.out_dir "$RUNS" --run.name gpt2-small-200 --no-progress
run timeout 160 $PY -m turbotrain train --preset gpt2-small --batch.micro=auto --batch.global_size=32 \
    --train.max_steps 200 --train.eval_every 200 --run.out_dir "$RUNS" --run.name gpt2-small-auto --no-progress
for preset in gpt2-small gpt2-medium; do
  log "memory --preset $preset --measure --json"
  timeout 35 $PY -m turbotrain memory --preset "$preset" --measure --json > "$RES/memory-$preset.json" 2>> "$OUT/core.log"
done
fi
collect
log "wrote $RES and $OUT/core-$PHASE.tgz"
