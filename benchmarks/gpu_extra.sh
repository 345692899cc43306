#!/usr/bin/env bash
# Not part of the three-command GPU plan (gpu_proof.sh, gpu_ablation.sh, gpu_rest.sh): a fourth
# device command for a later window, the product's memory paths on W1, fp8 vs bf16 and the checkpoint stall (step limits 540 s; BUDGET_S
# = 570 s caps the whole). Measured on one H100 80GB HBM3 on 2026-11-24 (PyTorch 2.11, 16 cores):
#
#   finder          120   60 s: the batch finder (`--batch.micro=auto`) on gpt2-small and
#                         gpt2-medium, compile off (the finder's trials never compile)
#   checkpointing   100   58 s: activation checkpointing off / full, each at its own found size
#   memory-report    60   31 s: `turbotrain memory --measure` on gpt2-small and gpt2-medium
#   w1-fp8          190   not yet: W1 gpt2-small with compile, 60 steps, bf16-mixed then fp8 (torchao
#                         float8 linears, tensorwise, torchao's size filter), same protocol; then
#                         benchmarks/fp8_compare.py: tokens/s, MFU against the bf16 peak, loss after
#                         the timed steps. Needs torchao on the machine (its wheel travels:
#                         benchmarks/README.md, "FP8"); without it the fp8 run is refused in one line
#                         (exit 2) and the comparison's fp8 row says why
#   checkpoint-stall 70   not yet: benchmarks/checkpoint_stall.py on gpt2-small (bf16, compile off, micro 4),
#                         a checkpoint every 50 steps (~1.4 GiB: weights + AdamW), written synchronously
#                         then in the background (train.async_checkpoint), each in its own process:
#                         the step-time stall per checkpoint (issue 25 item 5)
#
#   TT_COMMIT=<sha> OUT=/some/dir bash benchmarks/gpu_extra.sh   # <sha>: `git rev-parse HEAD` on the host
#
# Results: benchmarks/results/<gpu>/extra/, packed into $OUT/extra.tgz after every phase, with
# $OUT/extra.log. The runs are named for compile off, so nobody reads them as the compiled path.
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh  # set -uo pipefail, PY, BUDGET_S (570), KILL_AFTER, phase/step/pack
start_script extra "$@"
SHORT=(--train.checkpoint_every 0 --no-progress --run.out_dir "$RUNS")

phase finder 80
step 60 "$PY" -m turbotrain train --preset gpt2-small --model.vocab_size=50304 --compile.scope=off \
  --batch.micro=auto --batch.global_size=64 --train.max_steps 20 --train.eval_every 0 --run.name gpt2-small-auto-eager "${SHORT[@]}"
step 60 "$PY" -m turbotrain train --preset gpt2-medium --model.vocab_size=50304 --compile.scope=off \
  --batch.micro=auto --batch.global_size=32 --train.max_steps 15 --train.eval_every 0 --run.name gpt2-medium-auto-eager "${SHORT[@]}"
keep_runs
pack

phase checkpointing 60  # global batch = the found micro-batch, so each finds its own ceiling
step 50 "$PY" -m turbotrain train --preset gpt2-small --model.vocab_size=50304 --compile.scope=off \
  --batch.micro=auto --batch.global_size=0 --batch.accumulation=1 --memory.checkpointing=off \
  --train.max_steps 15 --train.eval_every 0 --run.name gpt2-small-auto-ckpt-off "${SHORT[@]}"
step 50 "$PY" -m turbotrain train --preset gpt2-small --model.vocab_size=50304 --compile.scope=off \
  --batch.micro=auto --batch.global_size=0 --batch.accumulation=1 --memory.checkpointing=full \
  --train.max_steps 15 --train.eval_every 0 --run.name gpt2-small-auto-ckpt-full "${SHORT[@]}"
keep_runs
pack

phase memory-report 30
step_to "$RES/memory-gpt2-small.json" 30 "$PY" -m turbotrain memory --preset gpt2-small --measure --json --compile.scope=off
step_to "$RES/memory-gpt2-medium.json" 30 "$PY" -m turbotrain memory --preset gpt2-medium --measure --json --compile.scope=off
pack

phase w1-fp8 60  # same protocol for both: compile (model), byte data, 60 steps, a checkpoint only at the end
W1=(--preset gpt2-small --model.vocab_size=50304 --train.max_steps 60 --train.eval_every 0 --monitor.log_every 10)
step 90 "$PY" -m turbotrain train "${W1[@]}" --precision.mode=bf16-mixed --run.name gpt2-small-bf16 "${SHORT[@]}"
step 90 "$PY" -m turbotrain train "${W1[@]}" --precision.mode=fp8 --run.name gpt2-small-fp8 "${SHORT[@]}"
step_to "$RES/fp8-vs-bf16.json" 10 "$PY" benchmarks/fp8_compare.py "$RUNS/gpt2-small-bf16" "$RUNS/gpt2-small-fp8"
keep_runs
pack

phase checkpoint-stall 60  # 2 processes (sync, async), 150 timed steps + 50 warm-up each, checkpoints at 50..200
step 70 "$PY" benchmarks/checkpoint_stall.py --model gpt2-small --micro 4 --every 50 --warmup 50 --steps 150 \
  --rounds 1 --contenders sync,async --out "$RES/checkpoint_stall.json"
pack

finish_script
