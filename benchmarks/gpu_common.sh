# Shared by gpu_proof.sh and gpu_rest.sh (sourced, not run). Budget, phases, steps and packing:
#   start_script NAME   find the GPU, make benchmarks/results/<gpu>/NAME/ ($RES), start the log
#   phase NAME SECONDS  start a phase, or skip it (saying so) when fewer seconds are left
#   step SECONDS CMD..  run CMD under `timeout -k` within the phase and the budget, log its output
#   step_to FILE SECONDS CMD..   the same, CMD's stdout into FILE
#   keep_row_logs NAME  copy the bench rows' logs of phase NAME into $RES/logs/
#   pack                $RES -> $OUT/$NAME.tgz as <gpu>/NAME/... (after every phase: a cut command keeps its work)
#   finish_script       the summary line: phases run and skipped
# Needs: PY, OUT, BUDGET_S, KILL_AFTER set by the caller; the repo root as the working directory.

start_script() {
  NAME=$1
  START=$(date +%s)
  mkdir -p "$OUT"
  LOG="$OUT/$NAME.log"
  : > "$LOG"
  GPU=$(timeout -k 5 60 "$PY" -c 'import torch; assert torch.cuda.is_available(); print(torch.cuda.get_device_name(0))' 2>>"$LOG") \
    || { echo "gpu_$NAME.sh: no CUDA GPU visible to torch" | tee -a "$LOG" >&2; exit 1; }
  SLUG=$(printf '%s' "$GPU" | tr '[:upper:]' '[:lower:]' | sed -E 's/[^a-z0-9]+/-/g; s/^-+|-+$//g')
  RES=${RESULTS:-benchmarks/results}/$SLUG/$NAME
  WORK=${WORK:-/tmp/turbotrain-gpu-$NAME-work}
  rm -rf "$RES" "$WORK"  # a re-run must not pass off an earlier run's results as its own
  mkdir -p "$RES/logs" "$WORK"
  RAN=() SKIPPED=()
  {
    echo "command: OUT=$OUT BUDGET_S=$BUDGET_S bash benchmarks/gpu_$NAME.sh ${*:2}"
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "gpu: $GPU"
    echo "started: $(date -u +%FT%TZ)"
  } > "$RES/COMMAND.txt"
  say "gpu_$NAME.sh on $GPU -> $RES (budget ${BUDGET_S}s)"
}

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( BUDGET_S - $(elapsed) )); }
say() { echo "== $* (+$(elapsed)s)" | tee -a "$LOG"; }

phase() {  # phase NAME SECONDS_NEEDED
  PHASE=$1
  if (( $(left) < $2 )); then
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

keep_row_logs() {
  for log in "$WORK/$1"/*/*/log.txt "$WORK/$1"/*/log.txt; do
    [ -f "$log" ] || continue
    cp "$log" "$RES/logs/$1--$(basename "$(dirname "$log")").txt"
  done
}

pack() {
  cp "$LOG" "$RES/$NAME.log"
  tar czf "$OUT/$NAME.tgz.tmp" -C "$(dirname "$(dirname "$RES")")" "$SLUG/$NAME" && mv "$OUT/$NAME.tgz.tmp" "$OUT/$NAME.tgz"
}

finish_script() {
  say "done: ran ${RAN[*]:-nothing}; skipped ${SKIPPED[*]:-nothing}"
  echo "finished: $(date -u +%FT%TZ) after $(elapsed)s; ran: ${RAN[*]:-}; skipped: ${SKIPPED[*]:-}" >> "$RES/COMMAND.txt"
  pack
}
