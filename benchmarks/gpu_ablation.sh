#!/usr/bin/env bash
# GPU plan, command 2 of 3: the W1 optimization ablation, alone in one device command (step limits:
# 540 s, checked by tests/unit/test_gpu_scripts.py; BUDGET_S = 570 s caps the whole).
#
#   turbotrain bench --workload gpt2-small --matrix ablation --warmup 5 --steps 10 --compile-cache shared
#
# Not measured on a GPU yet. Expected on one H100 (each row ~11 s of process start, imports and data
# besides its own run; fp32 eager steps ~0.3 s; a cold GPT-2 compile ~30 s, less when the shared
# cache already holds its kernels), in the order the rows run:
#   bf16 + compile ladder: bf16-compile, +cudnn-attention, +chunked-loss, +cuda-graphs, +fp8 (skipped
#                          without torchao: benchmarks/README.md, "FP8")
#                                                   5 compiled rows, ~40-45 s each   ~215 s
#   fp32 eager ladder: baseline, +bf16-mixed, +tf32, +fused-adamw, +sdpa-flash, +cudnn-attention,
#                      +chunked-loss, +prefetch     8 eager rows, ~17-20 s each      ~150 s
#                      +compile, +cuda-graphs, all, turbotrain-defaults (+cudnn-benchmark is
#                      skipped: no convolutions)     4 compiled rows, ~25-50 s each   ~140 s
#   ~505 s of 540 (fp8 ran): every row should fit. The bench writes its JSON after every row, so a cut keeps
#   every finished row and names the missing ones; the last rows (all, turbotrain-defaults: the
#   latter the same settings as bf16-compile) are the ones a slow compile would cost. If the row
#   list grows (fp8), run the fp32 ladder in a command of its own rather than raise this limit
#   (suite.run_ablation takes only=ROWS; `turbotrain bench` has no flag for it yet).
#
#   TT_COMMIT=<sha> OUT=/some/dir bash benchmarks/gpu_ablation.sh   # <sha>: `git rev-parse HEAD` on the host
#
# Results: benchmarks/results/<gpu>/ablation/, packed into $OUT/ablation.tgz, log $OUT/ablation.log.
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh  # set -uo pipefail, PY, BUDGET_S (570), KILL_AFTER, phase/step/pack
start_script ablation "$@"

phase w1-ablation 120  # shared compile cache: the compiled rows' common kernels compile once
step 540 "$PY" -m turbotrain bench --workload gpt2-small --matrix ablation --warmup 5 --steps 10 --timeout-s 120 \
  --compile-cache shared --out "$RES" --work-dir "$WORK/w1-ablation"
keep_row_logs w1-ablation
pack

finish_script
