#!/usr/bin/env bash
# The whole GPU benchmark set in ONE device command (budget: 10 minutes; this script stops at
# BUDGET_S, 560 s by default, and skips a phase that no longer fits):
#
#   1. W1 gpt2-small --compare           all six contenders; cold compile cache per contender
#                                          (fair time to first step); a profiler trace of 3
#                                          turbotrain steps after its timed window
#   2. W1 gpt2-small --matrix precision  fp32 / tf32 / fp16-mixed / bf16-mixed / bf16-true, eager
#   3. W2 --compare: cnn-224, then       five contenders (no eager-bf16), compile cache shared
#   4. cnn-cifar (data on the GPU)         between rows to fit; each phase writes its own results
#
# Needs: python3 with torch (CUDA), accelerate, lightning; no network. Run from anywhere:
#   OUT=/some/dir bash benchmarks/gpu_suite.sh
# Writes benchmarks/results/<gpu>/<workload>-<kind>.json + .md, and under $OUT: a copy of those,
# suite.log, doctor.txt, each phase's output, each row's log, the profiler trace and op table.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-560}
START=$(date +%s)
OUT=${OUT:-/tmp/turbotrain-gpu-suite}
WORK=${WORK:-/tmp/turbotrain-bench-work}

GPU=$($PY -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))') \
  || { echo "gpu_suite.sh: no CUDA GPU visible to torch" >&2; exit 1; }
SLUG=$(printf '%s' "$GPU" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
RES=benchmarks/results/$SLUG
mkdir -p "$RES" "$OUT/logs/rows" "$OUT/profile" "$WORK"
echo "gpu_suite.sh on $GPU -> $RES (budget ${BUDGET_S}s)" | tee "$OUT/suite.log"

left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }

phase() {  # phase NAME SECONDS_NEEDED bench-arguments...
  local name=$1 need=$2 remaining
  shift 2
  remaining=$(left)
  if (( remaining < need )); then
    echo "== $name: skipped (${remaining}s left, needs ~${need}s)" | tee -a "$OUT/suite.log"
    return
  fi
  echo "== $name at +$(( $(date +%s) - START ))s: turbotrain bench $*" | tee -a "$OUT/suite.log"
  timeout --kill-after=10 "$remaining" "$PY" -m turbotrain bench "$@" --out "$RES" --work-dir "$WORK/$name" \
    > "$OUT/logs/$name.txt" 2>&1
  local code=$?
  echo "== $name: exit $code at +$(( $(date +%s) - START ))s" | tee -a "$OUT/suite.log"
  grep -E '^\| ' "$OUT/logs/$name.txt" >> "$OUT/suite.log" || true
}

timeout 60 "$PY" -m turbotrain doctor > "$OUT/doctor.txt" 2>&1 || true

phase w1-compare 200 --workload gpt2-small --compare --timeout-s 200 --profile "$OUT/profile"
phase w1-precision 60 --workload gpt2-small --matrix precision --timeout-s 90
W2_CONTENDERS=eager,handtuned,accelerate,lightning,turbotrain
phase w2-cnn-224 120 --workload cnn-224 --compare --contenders $W2_CONTENDERS --compile-cache shared --timeout-s 150
phase w2-cnn-cifar 100 --workload cnn-cifar --compare --contenders $W2_CONTENDERS --compile-cache shared --timeout-s 150

cp -r "$RES" "$OUT/results"
for log in "$WORK"/*/*/log.txt; do
  [ -f "$log" ] || continue
  cp "$log" "$OUT/logs/rows/$(basename "$(dirname "$(dirname "$log")")")--$(basename "$(dirname "$log")").txt"
done
echo "done at +$(( $(date +%s) - START ))s; results in $RES and $OUT/results" | tee -a "$OUT/suite.log"
