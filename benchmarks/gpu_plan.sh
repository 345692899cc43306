#!/usr/bin/env bash
# The GPU plan: ONE device command for a 15-minute lease (one cold start of 1-2 min, this command,
# and one short command after it: benchmarks/gpu_extra.sh). Its step limits sum to 480 s
# (tests/unit/test_gpu_scripts.py reads and dry-runs them); BUDGET_S (default 500 s) caps the
# whole. Phases run most valuable first, and a phase that no longer fits is skipped, saying so.
#
#   phase        limit  what it answers (expected on one H100; 2026-11-24 figures where measured)
#   w1-ladder      170  which lever beyond bf16 + compile pays on W1 (GPT-2 small, B=16, T=1024):
#                       `bench --matrix ablation --rows` bf16-compile (= turbotrain's CUDA defaults),
#                       +chunked-loss, +cuda-graphs, +fp8 (torchao wheel carried; skipped, saying
#                       why, without it), 5 warm-up + 10 timed steps, one compile cache for the rows
#                       (the question is step time, not compile time). ~50 s a cold compiled W1 row
#                       (11 s process start + ~33 s first step, measured), ~35-45 s the others.
#                       +cudnn-attention is left to gpu_extra.sh: torch 2.11 already picks cuDNN's
#                       kernels for these shapes (2026-11-24 profile and sdpa.json)
#   cnn-cifar       85  the CIFAR-sized CNN where turbotrain was 0.84x plain fp32 eager: eager (plain
#                       loop, fp32), bf16-compile (turbotrain's defaults) and bf16-compile+cuda-graphs
#                       (compile mode reduce-overhead), shared cache. Measured: eager ~15 s a row,
#                       turbotrain ~32 s (20 s first step)
#   gpu-tests       55  tests/gpu to the end (no -x), JUnit XML: 39 s for 15 tests, 18 now
#   nccl          20+20 one-process NCCL: `torchrun --standalone --nproc-per-node 1 -m turbotrain
#                       train` on gpt-tiny, DDP then FSDP2 (compile off, 30 steps, a final
#                       checkpoint): NCCL joins, wraps, trains, saves. Never run on NCCL yet
#   w1-precision    50  the precision matrix's owed rows: fp32 (the reference), fp16-mixed,
#                       bf16-mixed, bf16-true, compile off, 3 warm-up + 10 timed steps (fp32 292
#                       ms/step measured; ~13-16 s a row). fp8 vs bf16 is w1-ladder's +fp8 row
#   train-model     30  `turbotrain train --model examples/workload_cnn.py:make` (a user's
#                       classifier through the product's path, compile auto), 60 steps: samples/s
#   w1-compare      50  W1 handtuned and turbotrain again, beside the ladder (same machine, same
#                       compile cache as w1-ladder: time to first step is a lower bound here;
#                       the cold figures are 2026-11-24's): every ratio above side by side.
#                       Measured cold: 244 s for 6 rows; expected warm: ~20-25 s a row
#
# Every step runs under `timeout -k` (SIGTERM, then SIGKILL 15 s later); `turbotrain bench` writes
# its JSON and markdown after every row and every row's log.txt and result.json are kept, so a step
# cut at its limit keeps every row it finished. After EVERY phase the results are packed into
# $OUT/plan.tgz (<gpu>/<date>/plan/<phase>/...), beside $OUT/plan.log: two files, however far the
# command got. `python benchmarks/results_readme.py DIR` then writes DIR/README.md from the JSON.
#
#   TT_COMMIT=<sha> OUT=/some/dir bash benchmarks/gpu_plan.sh   # <sha>: `git rev-parse HEAD` on the host
cd "$(dirname "$0")/.."
BUDGET_S=${BUDGET_S:-500}
. benchmarks/gpu_common.sh  # set -uo pipefail, PY, KILL_AFTER, phase/step/pack
start_script plan "$@"
SHORT=(--train.checkpoint_every 0 --no-progress --run.out_dir "$RUNS")
W1_CACHE="$WORK/w1"  # w1-ladder and w1-compare share it: the compare's rows reuse the ladder's kernels

phase w1-ladder 60
step 170 env TORCH_LOGS=graph_breaks,recompiles "$PY" -m turbotrain bench --workload gpt2-small --matrix ablation \
  --rows bf16-compile+chunked-loss,bf16-compile+cuda-graphs,bf16-compile+fp8 --warmup 5 --steps 10 --timeout-s 80 \
  --compile-cache shared --out "$RES/w1-ladder" --work-dir "$W1_CACHE"
keep_row_logs w1
pack

phase cnn-cifar 30  # one bench: the plain eager row, then the ladder's base and its CUDA-graphs row
step 85 "$PY" -m turbotrain bench --workload cnn-cifar --compare --contenders eager --matrix ablation \
  --rows bf16-compile+cuda-graphs --compile-cache shared --timeout-s 50 --out "$RES/cnn-cifar" --work-dir "$WORK/cnn-cifar"
keep_row_logs cnn-cifar
pack

phase gpu-tests 40
step 55 "$PY" -m pytest -q -rfEs tests/gpu -p no:cacheprovider --junitxml "$RES/gpu-tests.xml"
pack

phase nccl 20  # one process, so NCCL's own paths run (init, all-reduce, FSDP2 all-gather and reduce-scatter)
SMOKE=(--preset gpt-tiny --compile.scope=off --train.max_steps 30 --train.eval_every 15 --train.eval_batches 2)
step 20 env NCCL_DEBUG=VERSION "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m turbotrain train \
  --distributed.strategy ddp "${SMOKE[@]}" --run.name nccl-ddp "${SHORT[@]}"
step 20 env NCCL_DEBUG=VERSION "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m turbotrain train \
  --distributed.strategy fsdp "${SMOKE[@]}" --run.name nccl-fsdp "${SHORT[@]}"
keep_runs
pack

phase w1-precision 30  # compile off: each row isolates the precision
step 50 "$PY" -m turbotrain bench --workload gpt2-small --matrix precision --rows fp16-mixed,bf16-mixed,bf16-true \
  --warmup 3 --steps 10 --timeout-s 30 --out "$RES/w1-precision" --work-dir "$WORK/w1-precision"
keep_row_logs w1-precision
pack

phase train-model 20
step 30 "$PY" -m turbotrain train --model examples/workload_cnn.py:make --train.max_steps 60 --train.eval_every 30 \
  --train.eval_batches 2 --run.name cnn-workload "${SHORT[@]}"
keep_runs
pack

phase w1-compare 30
step 50 "$PY" -m turbotrain bench --workload gpt2-small --compare --contenders handtuned,turbotrain --compile-cache shared \
  --timeout-s 45 --out "$RES/w1-compare" --work-dir "$W1_CACHE"
keep_row_logs w1
pack

finish_script
