#!/usr/bin/env bash
# The optional second device command of a 15-minute lease, after benchmarks/gpu_plan.sh: the rows
# of the issue being worked on, picked by phase name. The chosen phases' step limits must sum to
# <= 180 s (refused in one line otherwise; tests/unit/test_gpu_scripts.py checks every phase's
# limits against LIMIT below); BUDGET_S (default 200 s) caps the whole.
#
#   TT_COMMIT=<sha> OUT=/some/dir bash benchmarks/gpu_extra.sh PHASE [PHASE ...]
#
#   phase                  limit  what (2026-11-24 H100 figures where measured)
#   env                       40  23 s: the SDPA kernel for W1's attention shapes and each
#                                 backend's time (sdpa.json), `turbotrain doctor --probe --json`
#   w1-cudnn-attention       120  ablation bf16-compile and +cudnn-attention on W1 (cold compile)
#   w1-fp32-eager            170  the fp32 eager ladder's eager rows: baseline, +bf16-mixed, +tf32,
#                                 +fused-adamw, +sdpa-flash, +cudnn-attention, +chunked-loss,
#                                 +prefetch (~17-20 s a row)
#   w1-fp32-compiled         170  the fp32 ladder's compiled rows: baseline, +compile, +cuda-graphs,
#                                 all, turbotrain-defaults (shared cache, ~25-50 s a row)
#   w1-precision-rest         60  the precision matrix's tf32 and fp8 rows beside fp32 (compile off)
#   w1-contenders            110  W1 eager-bf16, accelerate, lightning, turbotrain (shared cache;
#                                 the frameworks' 1.69x/1.66x were measured cold: 47 s for two rows)
#   w1-fp8-train             180  `turbotrain train` W1 bf16-mixed then fp8 (compile, 60 steps each),
#                                 compared by fp8_compare.py: tokens/s, MFU, loss (torchao wheel)
#   cnn-cifar-contenders     130  120 s: cnn-cifar's five contenders (shared cache)
#   cnn-cifar-fp32-graphs     70  cnn-cifar ablation baseline and +cuda-graphs (fp32 + reduce-overhead)
#   cnn-224                  150  135 s: cnn-224's five contenders (shared cache)
#   train-w1                  75  65 s: `turbotrain train --preset gpt2-small --data.tokenizer=bpe`, 120 steps
#   finder                   120  60 s: the batch finder on gpt2-small and gpt2-medium, compile off
#   checkpointing            100  58 s: activation checkpointing off / full, each at its found size
#   memory-report             60  31 s: `turbotrain memory --measure` on gpt2-small and gpt2-medium
#   checkpoint-stall          70  checkpoint_stall.py on gpt2-small: sync vs async checkpoint stall
#   cnn-choose               170  issue 34: `train --model examples/workload_cnn.py:make` (32x32 CNN, B=64) with
#                                 choose.measure=always: the decision table (eager bf16 vs fp32, compile,
#                                 CUDA graphs) kept or rejected by measurement; then the same model
#                                 again: the cached decision, nothing measured (choose.json measured=false)
#   w1-warm-start            150  issue 34: GPT-2 small compiled, twice, each with its own empty inductor cache:
#                                 the second loads the first's torch.compiler artefacts (goal: first step
#                                 under 5 s; 34 s cold on 2026-11-24)
#   cnn-graphs                80  issue 34: the same CNN, compile off, without and with compile.cuda_graphs
#                                 (whole-step capture, core/graphs.py): samples/s both ways
#   hf-trainer-w1            130  a Hugging Face Trainer on GPT-2 small, its defaults then
#                                 training_args_recipe() (hf_trainer_recipe.py, one process each):
#                                 tokens/s, MFU, first step; needs transformers there
#   cnn-cifar-auto           150  issue 34 item 5: cnn-cifar's eager, turbotrain, turbotrain-auto (choose's measured
#                                 choice, its decision cost apart) and turbotrain-graphs (compile.cuda_graphs)
#   levers                   180  the loss and memory levers: torch's version and whether it has
#                                 F.linear_cross_entropy (levers.txt); loss_probe.py at W1's head
#                                 (full / chunked / fused: ms and peak); `train` W1 with
#                                 --model.loss=fused (compiled, 40 steps); `bench --inference` bf16-mixed
#                                 and fp32 on gpt2-small; empty_cache_cost.py (a step with and without
#                                 torch.cuda.empty_cache())
#   fp8-layers               180  fp8 per layer: fp8_layers.py's table on gpt2-small (each shape in bf16,
#                                 fp8 tensorwise and rowwise, compiled), then `train` W1 with
#                                 --precision.mode=fp8 --precision.fp8_layers=timed (torchao wheel carried)
#
# Results: benchmarks/results/<gpu>/<date>/extra/<phase>/, packed into $OUT/extra.tgz after every
# phase that ran, with $OUT/extra.log. Phases run in the order above, whatever order they are named in.
cd "$(dirname "$0")/.."
declare -A LIMIT=(
  [env]=40 [w1-cudnn-attention]=120 [w1-fp32-eager]=170 [w1-fp32-compiled]=170 [w1-precision-rest]=60
  [w1-contenders]=110 [w1-fp8-train]=180 [cnn-cifar-contenders]=130 [cnn-cifar-fp32-graphs]=70 [cnn-224]=150
  [train-w1]=75 [finder]=120 [checkpointing]=100 [memory-report]=60 [checkpoint-stall]=70
  [cnn-choose]=170 [w1-warm-start]=150 [cnn-graphs]=80 [hf-trainer-w1]=130 [cnn-cifar-auto]=150 [levers]=180 [fp8-layers]=180
)
ORDER=(env w1-cudnn-attention w1-fp32-eager w1-fp32-compiled w1-precision-rest w1-contenders w1-fp8-train
       cnn-cifar-contenders cnn-cifar-fp32-graphs cnn-224 train-w1 finder checkpointing memory-report checkpoint-stall
       cnn-choose w1-warm-start cnn-graphs hf-trainer-w1 cnn-cifar-auto levers fp8-layers)
COMMAND_LIMIT_S=180
menu() { local p out=(); for p in "${ORDER[@]}"; do out+=("$p (${LIMIT[$p]} s)"); done; local IFS=,; echo "${out[*]}" | sed 's/,/, /g'; }
if (( $# == 0 )); then
  echo "gpu_extra.sh: name the phases to run (step limits <= ${COMMAND_LIMIT_S} s together): $(menu)" >&2
  exit 2
fi
total=0
for p in "$@"; do
  [ -n "${LIMIT[$p]+x}" ] || { echo "gpu_extra.sh: unknown phase '$p'; choose from: $(menu)" >&2; exit 2; }
  total=$(( total + LIMIT[$p] ))
done
if (( total > COMMAND_LIMIT_S )); then
  echo "gpu_extra.sh: phases $* need ${total} s of step limits, over the ${COMMAND_LIMIT_S} s of the second command; name fewer" >&2
  exit 2
fi

BUDGET_S=${BUDGET_S:-200}
. benchmarks/gpu_common.sh  # set -uo pipefail, PY, KILL_AFTER, phase/step/pack
SELECTED=("$@")
start_script extra "$@"
SHORT=(--train.checkpoint_every 0 --no-progress --run.out_dir "$RUNS")
GPT2=(--preset gpt2-small --model.vocab_size=50304)

phase env 20
step 20 "$PY" benchmarks/sdpa_probe.py --batch 16 --heads 12 --seq 1024 --head-dim 64 --out "$RES/sdpa.json"
step_to "$RES/doctor.json" 20 "$PY" -m turbotrain doctor --probe --json
pack

phase w1-cudnn-attention 60
step 120 "$PY" -m turbotrain bench --workload gpt2-small --matrix ablation --rows bf16-compile+cudnn-attention \
  --warmup 5 --steps 10 --timeout-s 80 --compile-cache shared --out "$RES/w1-cudnn-attention" --work-dir "$WORK/w1"
keep_row_logs w1
pack

phase w1-fp32-eager 40
step 170 "$PY" -m turbotrain bench --workload gpt2-small --matrix ablation \
  --rows +bf16-mixed,+tf32,+fused-adamw,+sdpa-flash,+cudnn-attention,+chunked-loss,+prefetch \
  --warmup 5 --steps 10 --timeout-s 40 --out "$RES/w1-fp32-eager" --work-dir "$WORK/w1-fp32"
keep_row_logs w1-fp32
pack

phase w1-fp32-compiled 60
step 170 "$PY" -m turbotrain bench --workload gpt2-small --matrix ablation --rows +compile,+cuda-graphs,all,turbotrain-defaults \
  --warmup 5 --steps 10 --timeout-s 70 --compile-cache shared --out "$RES/w1-fp32-compiled" --work-dir "$WORK/w1"
keep_row_logs w1
pack

phase w1-precision-rest 30
step 60 "$PY" -m turbotrain bench --workload gpt2-small --matrix precision --rows tf32,fp8 \
  --warmup 3 --steps 10 --timeout-s 30 --out "$RES/w1-precision-rest" --work-dir "$WORK/w1-precision"
keep_row_logs w1-precision
pack

phase w1-contenders 40
step 110 "$PY" -m turbotrain bench --workload gpt2-small --compare --contenders eager-bf16,accelerate,lightning,turbotrain \
  --compile-cache shared --timeout-s 60 --out "$RES/w1-contenders" --work-dir "$WORK/w1"
keep_row_logs w1
pack

phase w1-fp8-train 60  # same protocol for both: compile (model), byte data, 60 steps, a checkpoint only at the end
W1=("${GPT2[@]}" --train.max_steps 60 --train.eval_every 0 --monitor.log_every 10)
step 85 "$PY" -m turbotrain train "${W1[@]}" --precision.mode=bf16-mixed --run.name gpt2-small-bf16 "${SHORT[@]}"
step 85 "$PY" -m turbotrain train "${W1[@]}" --precision.mode=fp8 --run.name gpt2-small-fp8 "${SHORT[@]}"
step_to "$RES/fp8-vs-bf16.json" 10 "$PY" benchmarks/fp8_compare.py "$RUNS/gpt2-small-bf16" "$RUNS/gpt2-small-fp8"
keep_runs
pack

W2=eager,handtuned,accelerate,lightning,turbotrain
phase cnn-cifar-contenders 40
step 130 "$PY" -m turbotrain bench --workload cnn-cifar --compare --contenders $W2 --compile-cache shared --timeout-s 60 \
  --out "$RES/cnn-cifar-contenders" --work-dir "$WORK/cnn-cifar"
keep_row_logs cnn-cifar
pack

phase cnn-cifar-fp32-graphs 30
step 70 "$PY" -m turbotrain bench --workload cnn-cifar --matrix ablation --rows +cuda-graphs --compile-cache shared \
  --timeout-s 50 --out "$RES/cnn-cifar-fp32-graphs" --work-dir "$WORK/cnn-cifar"
keep_row_logs cnn-cifar
pack

phase cnn-224 60
step 150 "$PY" -m turbotrain bench --workload cnn-224 --compare --contenders $W2 --compile-cache shared --timeout-s 100 \
  --out "$RES/cnn-224" --work-dir "$WORK/cnn-224"
keep_row_logs cnn-224
pack

phase train-w1 60  # BPE training and encoding + compile + 120 steps
step 75 "$PY" -m turbotrain train "${GPT2[@]}" --data.tokenizer=bpe --train.max_steps 120 \
  --train.eval_every 60 --train.eval_batches 5 --run.name gpt2-small-bpe50304 "${SHORT[@]}"
keep_runs
pack

phase finder 80
step 60 "$PY" -m turbotrain train "${GPT2[@]}" --compile.scope=off \
  --batch.micro=auto --batch.global_size=64 --train.max_steps 20 --train.eval_every 0 --run.name gpt2-small-auto-eager "${SHORT[@]}"
step 60 "$PY" -m turbotrain train --preset gpt2-medium --model.vocab_size=50304 --compile.scope=off \
  --batch.micro=auto --batch.global_size=32 --train.max_steps 15 --train.eval_every 0 --run.name gpt2-medium-auto-eager "${SHORT[@]}"
keep_runs
pack

phase checkpointing 60  # global batch = the found micro-batch, so each finds its own ceiling
step 50 "$PY" -m turbotrain train "${GPT2[@]}" --compile.scope=off \
  --batch.micro=auto --batch.global_size=0 --batch.accumulation=1 --memory.checkpointing=off \
  --train.max_steps 15 --train.eval_every 0 --run.name gpt2-small-auto-ckpt-off "${SHORT[@]}"
step 50 "$PY" -m turbotrain train "${GPT2[@]}" --compile.scope=off \
  --batch.micro=auto --batch.global_size=0 --batch.accumulation=1 --memory.checkpointing=full \
  --train.max_steps 15 --train.eval_every 0 --run.name gpt2-small-auto-ckpt-full "${SHORT[@]}"
keep_runs
pack

phase memory-report 30
step_to "$RES/memory-gpt2-small.json" 30 "$PY" -m turbotrain memory --preset gpt2-small --measure --json --compile.scope=off
step_to "$RES/memory-gpt2-medium.json" 30 "$PY" -m turbotrain memory --preset gpt2-medium --measure --json --compile.scope=off
pack

phase checkpoint-stall 60  # 2 processes (sync, async), 150 timed steps + 50 warm-up each, checkpoints at 50..200
step 70 "$PY" benchmarks/checkpoint_stall.py --model gpt2-small --micro 4 --every 50 --warmup 50 --steps 150 \
  --rounds 1 --contenders sync,async --out "$RES/checkpoint_stall.json"
pack

phase cnn-choose 60  # a new run measures (compile included: ~20 s a compiled candidate), the next reuses the table
CNN=(--model examples/workload_cnn.py:make --train.max_steps 100000 --train.stop_after_steps 30 --train.eval_every 0)
step 130 env XDG_CACHE_HOME="$WORK/xdg-choose" "$PY" -m turbotrain train "${CNN[@]}" --choose.measure=always --choose.steps 20 \
  --run.name cnn-choose-1 "${SHORT[@]}"
step 40 env XDG_CACHE_HOME="$WORK/xdg-choose" "$PY" -m turbotrain train "${CNN[@]}" --run.name cnn-choose-2 "${SHORT[@]}"
keep_runs
pack

phase w1-warm-start 60  # the second run's inductor cache is empty: only the saved artefacts can warm it
WARM=("${GPT2[@]}" --compile.scope=model --choose.measure=off --train.max_steps 10 --train.eval_every 0)
A=(XDG_CACHE_HOME="$WORK/xdg-warm" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-a" TRITON_CACHE_DIR="$WORK/triton-a")
B=(XDG_CACHE_HOME="$WORK/xdg-warm" TORCHINDUCTOR_CACHE_DIR="$WORK/inductor-b" TRITON_CACHE_DIR="$WORK/triton-b")
step 90 env "${A[@]}" "$PY" -m turbotrain train "${WARM[@]}" --run.name w1-cold "${SHORT[@]}"
step 60 env "${B[@]}" "$PY" -m turbotrain train "${WARM[@]}" --run.name w1-warm "${SHORT[@]}"
keep_runs
pack

phase cnn-graphs 30
GRAPHS=(--model examples/workload_cnn.py:make --compile.scope=off --choose.measure=off --train.max_steps 300 --train.eval_every 0)
step 40 "$PY" -m turbotrain train "${GRAPHS[@]}" --compile.cuda_graphs=false --run.name cnn-eager "${SHORT[@]}"
step 40 "$PY" -m turbotrain train "${GRAPHS[@]}" --compile.cuda_graphs=true --run.name cnn-graphs "${SHORT[@]}"
keep_runs
pack

phase hf-trainer-w1 60  # issue 36: the Trainer's defaults (fp32, eager) vs turbotrain's recipe (bf16, TF32, compile)
step 50 "$PY" benchmarks/hf_trainer_recipe.py --variant defaults --size small --steps 30 --out "$RES/hf-trainer-w1/defaults"
step 80 "$PY" benchmarks/hf_trainer_recipe.py --variant recipe --size small --steps 30 --out "$RES/hf-trainer-w1/recipe"
pack

phase cnn-cifar-auto 40  # each row cold: the auto row's first step and its decision cost are both a first run's
step 150 "$PY" -m turbotrain bench --workload cnn-cifar --compare --contenders eager,turbotrain,turbotrain-auto,turbotrain-graphs \
  --timeout-s 60 --out "$RES/cnn-cifar-auto" --work-dir "$WORK/cnn-cifar-auto"
keep_row_logs cnn-cifar-auto
pack

phase levers 20  # torch's own fused loss, the loss three ways, a W1 run with it, inference, empty_cache's cost
step_to "$RES/levers.txt" 10 "$PY" -c "import torch, torch.nn.functional as F; print(torch.__version__, hasattr(F, 'linear_cross_entropy'))"
step 25 "$PY" benchmarks/loss_probe.py --tokens 16384 --d 768 --vocab 50304 --repeats 10 --out "$RES/loss_probe.json"
W1F=("${GPT2[@]}" --train.max_steps 40 --train.eval_every 0 --monitor.log_every 10)
step 75 "$PY" -m turbotrain train "${W1F[@]}" --model.loss=fused --run.name gpt2-small-fused-loss "${SHORT[@]}"
step 40 "$PY" -m turbotrain bench --inference --workload gpt2-small --rows bf16-mixed,fp32 --steps 20 --warmup 3 \
  --out "$RES/inference"
step 30 "$PY" benchmarks/empty_cache_cost.py --preset gpt2-small --micro 8 --steps 30 --out "$RES/empty_cache.json"
keep_runs
pack

phase fp8-layers 60  # needs the carried torchao wheel (benchmarks/README.md); without it both say why in one line
step 90 "$PY" benchmarks/fp8_layers.py --preset gpt2-small --micro 16 --repeats 20 --out "$RES/fp8-layers"
W1T=("${GPT2[@]}" --train.max_steps 60 --train.eval_every 0 --monitor.log_every 10)
step 90 "$PY" -m turbotrain train "${W1T[@]}" --precision.mode=fp8 --precision.fp8_layers=timed \
  --run.name gpt2-small-fp8-timed "${SHORT[@]}"
keep_runs
pack

finish_script
