#!/usr/bin/env bash
# GPU plan, command 1 of 3: the decisive W1 numbers. One device command (the device allows 600 s):
# the step limits below sum to 540 s (tests/unit/test_gpu_scripts.py checks it), BUDGET_S = 570 s
# caps the whole, and a phase that no longer fits is skipped, saying so.
#
#   phase      limit  measured on one H100 80GB HBM3 on 2026-11-24 (PyTorch 2.11, 16 cores)
#   env          60   23 s: torch/CUDA/driver, GPU, the SDPA kernel for GPT-2 small's attention
#                     shapes and each backend's time, `turbotrain doctor --probe --json`
#   w1          400   ~330 s expected: W1 gpt2-small (vocab 50304, B=16, T=1024), eager-bf16,
#                     handtuned, turbotrain, accelerate, lightning, each twice (--repeat 2, round-robin:
#                     every contender runs once before any runs twice), cold compile cache per row;
#                     turbotrain's speedup over each in ONE JSON; a profiler table of 3 turbotrain
#                     steps; graph breaks and recompiles in the row logs. Measured: eager-bf16,
#                     handtuned, turbotrain x2 244 s; accelerate + lightning once 47 s (each row also
#                     costs ~11 s of process start, imports and data outside its own timing)
#   gpu-tests    80   39 s (15 tests, 27 s in pytest): tests/gpu to the end (no -x), JUnit XML kept
#
# Every step runs under `timeout -k` (SIGTERM, then SIGKILL 15 s later). `turbotrain bench` writes
# its JSON and markdown after every row, and every row's log.txt and result.json are kept, so a
# step cut at its limit keeps every row it finished. After EVERY phase the results are packed into
# $OUT/proof.tgz; $OUT/proof.log is the log: two files come back however far the script got.
#
#   TT_COMMIT=<sha> OUT=/some/dir bash benchmarks/gpu_proof.sh   # <sha>: `git rev-parse HEAD` on the host
#   then benchmarks/gpu_ablation.sh (command 2) and benchmarks/gpu_rest.sh (command 3)
cd "$(dirname "$0")/.."
. benchmarks/gpu_common.sh  # set -uo pipefail, PY, BUDGET_S (570), KILL_AFTER, phase/step/pack
start_script proof "$@"

phase env 30
step 10 "$PY" -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "python", platform.python_version()); print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
step 10 nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv
step 20 "$PY" benchmarks/sdpa_probe.py --batch 16 --heads 12 --seq 1024 --head-dim 64 --out "$RES/sdpa.json"
step_to "$RES/doctor.json" 20 "$PY" -m turbotrain doctor --probe --json
pack

phase w1 120
step 400 env TORCH_LOGS=graph_breaks,recompiles "$PY" -m turbotrain bench --workload gpt2-small --compare \
  --contenders eager-bf16,handtuned,turbotrain,accelerate,lightning --repeat 2 --timeout-s 110 \
  --profile "$RES/profile" --out "$RES" --work-dir "$WORK/w1"
keep_row_logs w1
pack

phase gpu-tests 40
step 80 "$PY" -m pytest -q -rfEs tests/gpu -p no:cacheprovider --junitxml "$RES/gpu-tests.xml"
pack

finish_script
