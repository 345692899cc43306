#!/usr/bin/env bash
# The decisive GPU numbers in ONE device command (the device allows 600 s; this script budgets
# BUDGET_S = 530 s and skips, saying so, any phase that no longer fits). Most decisive first:
#
#   a. environment: torch/CUDA/driver, GPU, the SDPA kernel chosen for GPT-2 small's attention
#      shapes and each backend's time, `turbotrain doctor --probe --json`               (~45 s)
#   b. W1 gpt2-small (vocab 50304, B=16, T=1024): eager-bf16, handtuned, turbotrain, twice each,
#      a profiler table of 3 turbotrain steps, graph breaks and recompiles in the row logs (~260 s)
#   c. W1 accelerate and lightning (their documented default recipes)                 (~100 s)
#   d. tests/gpu                                                                        (~90 s)
#
# Every step runs under `timeout -k` (a SIGTERM'd run still gets 10 s to save, then SIGKILL).
# After EVERY phase the results are packed into $OUT/proof.tgz; $OUT/proof.log is the log:
# two files come back from the device however far the script got.
#
#   OUT=/some/dir bash benchmarks/gpu_proof.sh        # on the GPU machine, from anywhere
#   benchmarks/gpu_rest.sh                            # the second command: the rest
#
# PYTHON=/path/to/python overrides the interpreter (tests dry-run this script with a stand-in).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/turbotrain-gpu-proof}
BUDGET_S=${BUDGET_S:-530}
KILL_AFTER=10  # seconds between SIGTERM and SIGKILL
. benchmarks/gpu_common.sh
start_script proof "$@"

phase env 45
step 10 "$PY" -c 'import torch, platform; print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(), "python", platform.python_version()); print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))'
step 10 nvidia-smi --query-gpu=name,driver_version,memory.total,power.limit,clocks.max.sm --format=csv
step 25 "$PY" benchmarks/sdpa_probe.py --batch 16 --heads 12 --seq 1024 --head-dim 64 --out "$RES/sdpa.json"
step_to "$RES/doctor.json" 40 "$PY" -m turbotrain doctor --probe --json
pack

phase w1-core 260
step 250 env TORCH_LOGS=graph_breaks,recompiles "$PY" -m turbotrain bench --workload gpt2-small --compare \
  --contenders eager-bf16,handtuned,turbotrain --repeat 2 --timeout-s 110 --profile "$RES/profile" \
  --out "$RES" --work-dir "$WORK/w1-core"
keep_row_logs w1-core
pack

phase w1-frameworks 100
step 95 "$PY" -m turbotrain bench --workload gpt2-small --compare --contenders accelerate,lightning \
  --timeout-s 90 --out "$RES/frameworks" --work-dir "$WORK/w1-frameworks"
keep_row_logs w1-frameworks
pack

phase gpu-tests 90
step 90 "$PY" -m pytest -q -x tests/gpu -p no:cacheprovider
pack

finish_script
