#!/usr/bin/env bash
# GPU plan, command 3 of 3: the rest of the figures in one device command (step limits: 540 s,
# checked by tests/unit/test_gpu_scripts.py; BUDGET_S = 570 s caps the whole; a phase that no
# longer fits is skipped, saying so). Most decisive first:
#
#   phase          limit  measured on one H100 80GB HBM3 on 2026-11-24 (PyTorch 2.11, 16 cores)
#   w1-precision    135   not yet with compile off: 6 eager rows incl. fp8 (fp32 step 292 ms), ~15-20 s each
#   nccl             50   not yet: `torchrun --nproc-per-node 1 -m turbotrain train` on gpt-tiny
#                         (compile off, 30 steps, a final checkpoint), --distributed.strategy ddp,
#                         then fsdp (FSDP2): NCCL joins, wraps, trains, saves. ~15-20 s each expected
#   train-w1         75   65 s: `turbotrain train --preset gpt2-small --data.tokenizer=bpe` (a
#                         50304-token BPE trained on the built-in corpus, ~15 s on 16 cores, cached
#                         after) with compile, 120 steps, its summary and plots
#   w2-cnn-224      150   135 s: cnn-224 eager, handtuned, accelerate, lightning, turbotrain
#   w2-cnn-cifar    130   120 s: the same five on cnn-cifar (data resident on the GPU)
#
# (the W2 compares share one compile cache per bench: time to first step is then a lower bound).
# The batch finder, activation checkpointing and `turbotrain memory --measure` do not fit here:
# benchmarks/gpu_extra.sh, a fourth command for a later window. The GPU tests run in gpu_proof.sh.
#
#   TT_COMMIT=<sha> OUT=/some/dir bash benchmarks/gpu_rest.sh   # <sha>: `git rev-parse HEAD` on the host
#
# Each train run is short on purpose (tens of steps, a checkpoint only at the end) so SIGTERM's
# graceful save fits in `timeout -k`'s grace. Results: benchmarks/results/<gpu>/rest/, packed into
# $OUT/rest.tgz after every phase, with $OUT/rest.log.
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh  # set -uo pipefail, PY, BUDGET_S (570), KILL_AFTER, phase/step/pack
start_script rest "$@"
SHORT=(--train.checkpoint_every 0 --no-progress --run.out_dir "$RUNS")

phase w1-precision 40
step 135 "$PY" -m turbotrain bench --workload gpt2-small --matrix precision --timeout-s 60 --out "$RES" --work-dir "$WORK/w1-precision"
keep_row_logs w1-precision
pack

phase nccl 25  # one process, so NCCL's own paths run (init, all-reduce, FSDP2 all-gather and reduce-scatter)
SMOKE=(--preset gpt-tiny --compile.scope=off --train.max_steps 30 --train.eval_every 15 --train.eval_batches 2)
step 25 env NCCL_DEBUG=VERSION "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m turbotrain train \
  --distributed.strategy ddp "${SMOKE[@]}" --run.name nccl-ddp "${SHORT[@]}"
step 25 env NCCL_DEBUG=VERSION "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 -m turbotrain train \
  --distributed.strategy fsdp "${SMOKE[@]}" --run.name nccl-fsdp "${SHORT[@]}"
keep_runs
pack

phase train-w1 60  # BPE training and encoding + compile + 120 steps
step 75 "$PY" -m turbotrain train --preset gpt2-small --data.tokenizer=bpe --model.vocab_size=50304 --train.max_steps 120 \
  --train.eval_every 60 --train.eval_batches 5 --run.name gpt2-small-bpe50304 "${SHORT[@]}"
keep_runs
pack

W2=eager,handtuned,accelerate,lightning,turbotrain
phase w2-cnn-224 60
step 150 "$PY" -m turbotrain bench --workload cnn-224 --compare --contenders $W2 --compile-cache shared --timeout-s 100 \
  --out "$RES" --work-dir "$WORK/w2-cnn-224"
keep_row_logs w2-cnn-224
pack

phase w2-cnn-cifar 60
step 130 "$PY" -m turbotrain bench --workload cnn-cifar --compare --contenders $W2 --compile-cache shared --timeout-s 90 \
  --out "$RES" --work-dir "$WORK/w2-cnn-cifar"
keep_row_logs w2-cnn-cifar
pack

finish_script
