# Shared by the GPU scripts (sourced, not run): budget, phases, steps and packing.
#   start_script NAME   find the GPU, make benchmarks/results/<gpu>/<date>/NAME/ ($RES), start the
#                       log, write COMMAND.txt (the script that was run, the commit, the GPU)
#   phase NAME SECONDS  start a phase, or skip it (saying so) when fewer seconds are left; a phase
#                       not in SELECTED (when the script fills it) is passed over without a word
#   step SECONDS CMD..  run CMD under `timeout -k` within the phase and the budget, log its output
#   step_to FILE SECONDS CMD..   the same, CMD's stdout into FILE
#   keep_row_logs NAME  copy the bench rows' log.txt and result.json of phase NAME into $RES/logs/
#   keep_runs           copy the train runs' summaries, metrics, configs and plots into $RES/runs/
#   pack                $RES -> $OUT/$NAME.tgz as <gpu>/NAME/... (after every phase: a cut command keeps its work)
#   finish_script       the summary line: phases run and skipped
# Sourced from the repo root. Environment: OUT (where the two files go back; default
# /tmp/turbotrain-gpu-NAME), BUDGET_S (the whole command's cap: each script sets its default
# before sourcing this), PYTHON (the interpreter; tests dry-run the scripts with a stand-in),
# TT_COMMIT (below), RESULTS and WORK.
#
# The step limits of each script are its plan: tests/unit/test_gpu_scripts.py reads them from the
# script's `step N` / `step_to FILE N` lines and checks they sum to <= 480 s for gpu_plan.sh and
# <= 180 s for any selection of gpu_extra.sh's phases: a 15-minute lease holds one cold start,
# both commands and their margins (the GPU probe, packing, `timeout -k`'s grace after a limit).
#
# Provenance: the device machine gets the working tree without .git, so the commit comes from
# TT_COMMIT when it is set (put it in the device command from the host side:
# TT_COMMIT=<output of git rev-parse HEAD here>), else from git, else "unknown". TT_COMMIT stays
# exported, so every result file the Python side writes (bench/results.py) records the same commit.

set -uo pipefail
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
: "${BUDGET_S:?the script sets BUDGET_S before sourcing gpu_common.sh}"
SELECTED=()  # gpu_extra.sh: the phases asked for; empty = every phase
KILL_AFTER=15  # seconds between a step's SIGTERM at its limit and SIGKILL: a graceful save fits

start_script() {
  NAME=$1
  OUT=${OUT:-/tmp/turbotrain-gpu-$NAME}
  SCRIPT=benchmarks/$(basename "$0")  # the script actually run (we are in the repo root)
  START=$(date +%s)
  mkdir -p "$OUT"
  LOG="$OUT/$NAME.log"
  : > "$LOG"
  GPU=$(timeout -k 5 60 "$PY" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))' 2>>"$LOG") \
    || { echo "$(basename "$0"): no CUDA GPU visible to torch" | tee -a "$LOG" >&2; exit 1; }
  SLUG=$(printf '%s' "$GPU" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
  DAY=$(date -u +%F)  # results/<gpu>/<date>/<name>: a later window adds a folder, never overwrites
  RES=${RESULTS:-benchmarks/results}/$SLUG/$DAY/$NAME
  WORK=${WORK:-/tmp/turbotrain-gpu-$NAME-work}
  RUNS="$WORK/runs"
  rm -rf "$RES" "$WORK"  # a re-run must not pass off an earlier run's results as its own
  mkdir -p "$RES/logs" "$WORK"
  RAN=() SKIPPED=()
  local commit args="${*:2}"
  if [ -n "${TT_COMMIT:-}" ]; then
    export TT_COMMIT
    commit="$TT_COMMIT (from TT_COMMIT)"
  elif commit=$(git rev-parse HEAD 2>/dev/null); then
    git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
  else
    commit=unknown
  fi
  {
    echo "command: ${TT_COMMIT:+TT_COMMIT=$TT_COMMIT }OUT=$OUT BUDGET_S=$BUDGET_S bash $SCRIPT${args:+ $args}"
    echo "commit: $commit"
    echo "gpu: $GPU"
    echo "started: $(date -u +%FT%TZ)"
  } > "$RES/COMMAND.txt"
  say "$SCRIPT on $GPU -> $RES (budget ${BUDGET_S}s, commit $commit)"
}

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
say() { echo "== $* (+$(elapsed)s)" | tee -a "$LOG"; }

phase() {  # phase NAME SECONDS_NEEDED (the least worth starting: its first rows, its first run)
  PHASE=$1
  if (( ${#SELECTED[@]} )) && [[ " ${SELECTED[*]} " != *" $PHASE "* ]]; then
    PHASE_OK=0
  elif (( $(left) < $2 )); then
    PHASE_OK=0
    SKIPPED+=("$PHASE")
    say "$PHASE: skipped ($(left)s left, needs ~$2s)"
  else
    PHASE_OK=1
    RAN+=("$PHASE")
    say "$PHASE: start"
  fi
}

_limit() {  # the step's own limit, cut to what the budget has left
  local want=$1 have
  have=$(left)
  (( have < want )) && want=$have
  (( want < 1 )) && want=1
  echo "$want"
}

step() {  # step SECONDS CMD...
  (( PHASE_OK )) || return 0
  local limit
  limit=$(_limit "$1"); shift
  say "$PHASE: $* (limit ${limit}s)"
  timeout -k "$KILL_AFTER" "$limit" "$@" 2>&1 | tee -a "$LOG"
  local code=${PIPESTATUS[0]}
  (( code == 124 || code == 137 )) && say "$PHASE: TIMED OUT after ${limit}s: $1" || say "$PHASE: exit $code"
  return 0
}

step_to() {  # step_to FILE SECONDS CMD...
  (( PHASE_OK )) || return 0
  local file=$1 limit
  limit=$(_limit "$2"); shift 2
  say "$PHASE: $* > $file (limit ${limit}s)"
  timeout -k "$KILL_AFTER" "$limit" "$@" > "$file" 2>> "$LOG"
  say "$PHASE: exit $?"
}

keep_row_logs() {  # each row's log and its own result.json: a bench cut at its limit still shows every finished row
  local dir row
  for dir in "$WORK/$1"/*/*/ "$WORK/$1"/*/; do
    [ -f "$dir/log.txt" ] || [ -f "$dir/result.json" ] || continue
    row=$(basename "$dir")
    [ -f "$dir/log.txt" ] && cp "$dir/log.txt" "$RES/logs/$1--$row.txt"
    [ -f "$dir/result.json" ] && cp "$dir/result.json" "$RES/logs/$1--$row.result.json"
  done
  return 0
}

keep_runs() {  # summaries, metrics, configs and plots of the train runs under $RUNS (not their checkpoints)
  local r
  for r in "$RUNS"/*/; do
    [ -d "$r" ] || continue
    mkdir -p "$RES/runs/$(basename "$r")"
    cp "$r"/summary.json "$r"/summary.md "$r"/metrics.jsonl "$r"/config.toml "$r"/choose.json "$r"/choose.md \
      "$RES/runs/$(basename "$r")/" 2>/dev/null
    cp -r "$r"/plots "$RES/runs/$(basename "$r")/" 2>/dev/null
  done
  return 0
}

pack() {
  (( PHASE_OK )) || [ "${1:-}" = final ] || return 0  # a phase passed over or skipped added nothing
  cp "$LOG" "$RES/$NAME.log"
  tar czf "$OUT/$NAME.tgz.tmp" -C "$(dirname "$(dirname "$(dirname "$RES")")")" "$SLUG/$DAY/$NAME" && mv "$OUT/$NAME.tgz.tmp" "$OUT/$NAME.tgz"
}

finish_script() {
  say "done: ran ${RAN[*]:-nothing}; skipped ${SKIPPED[*]:-nothing}"
  echo "finished: $(date -u +%FT%TZ) after $(elapsed)s; ran: ${RAN[*]:-}; skipped: ${SKIPPED[*]:-}" >> "$RES/COMMAND.txt"
  pack final
}
