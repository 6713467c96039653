# The GPU check's stage runner and its table (sourced by scripts/gpu_check.sh; tests/test_gpu_check.py
# sources it alone). The caller sets:
#   DIR      the run's folder (status.txt, logs/, table.md)      PYTHON   the interpreter with torch
#   START    $SECONDS when the check began                        BUDGET   seconds for the whole check
#   STOP     no stage starts after STOP seconds                   TABLE_S  seconds kept for the table
#   PLAN     1: write each stage's command line to $DIR/plan.txt instead of running it
#
# A stage's outcome, one row of status.txt (section, stage, outcome, the file of its rows or ""):
#   ok in N s                  it exited 0
#   FAILED (exit N)            it exited non-zero
#   TIMED OUT after N s        it ran past its own cap: a stage that hangs or is far too slow
#   not finished (budget)      the check's budget ended it before its own cap: what it reached
#                              is in the row; the budget is not a fault of the stage
#   not run                    no time was left to start it
#   INTERRUPTED                the check itself was stopped (Ctrl-C, TERM) inside it
# The exit status is 1 when a row says FAILED, TIMED OUT or INTERRUPTED (or a figure says FAILED),
# else 0: a stage cut short by the budget does not fail the check.

CURRENT=""          # the stage in flight, named in the table if the check is stopped inside it
STAGE_PID=""        # its timeout process, stopped (with the stage) if the check is

say() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "${4:-}" >> "$DIR/status.txt"; echo "[gpu_check] $1: $2: $3"; }

# The status of the check from its rows: 1 when any stage or figure failed, else 0.
check_status() {
  if grep -qE "FAILED|INTERRUPTED|TIMED OUT" "$DIR/status.txt" "$DIR"/figures-*.json 2>/dev/null; then
    return 1
  fi
  return 0
}

finish() {
  trap - EXIT INT TERM
  if [ -n "$STAGE_PID" ]; then kill -TERM "$STAGE_PID" 2>/dev/null; wait "$STAGE_PID" 2>/dev/null; fi
  if [ -n "$CURRENT" ]; then say "${CURRENT%%|*}" "${CURRENT#*|}" "INTERRUPTED (the check was stopped inside it)"; fi
  say total "wall time" "$((SECONDS - START)) s (budget ${BUDGET} s)"
  {
    echo
    echo "## refimpl GPU check"
    echo
    "$PYTHON" scripts/gpu_check.py table "$DIR" 2>"$DIR/logs/table.log" ||
      awk -F'\t' 'BEGIN {print "| section | figure | value |"; print "|---|---|---|"}
                  {print "| " $1 " | " $2 " | " $3 " |"}' "$DIR/status.txt"
    echo
    echo "(files: $DIR: table.md, env.json, figures-*.json, rank_timeline.html, cuda_memory.csv, logs/)"
  } | tee "$DIR/table.md"
  check_status
  exit $?
}

# stage SECTION NAME CAP ATTACH -- command...: run it under min(CAP, what the budget leaves), its
# output in logs/, its outcome one row. ATTACH: the file of its rows (figures JSON, JUnit XML), or -.
stage() {
  local section=$1 name=$2 cap=$3 attach=$4; shift 5
  local elapsed=$((SECONDS - START))
  local left=$((BUDGET - TABLE_S - elapsed)) t0=$SECONDS rc line
  if [ "$elapsed" -ge "$STOP" ] || [ "$left" -lt 1 ]; then
    say "$section" "$name" "not run: ${elapsed} s spent, no stage starts after ${STOP} s (budget ${BUDGET} s)"
    return
  fi
  local limit=$((cap < left ? cap : left))
  local log="$DIR/logs/$(echo "$section-$name" | tr -c 'A-Za-z0-9_.\n-' '_' | cut -c1-80).log"
  [ "$attach" = "-" ] && attach=""
  if [ "${PLAN:-0}" = 1 ]; then
    printf '%s\t' "$section" >> "$DIR/plan.txt"; printf '%q ' "$@" >> "$DIR/plan.txt"; echo >> "$DIR/plan.txt"
    say "$section" "$name" "planned (cap ${cap} s)"
    return
  fi
  CURRENT="$section|$name"
  # in the background, waited for: a signal to this script then runs its trap at once, rather
  # than once the stage has ended
  timeout -k 5 "$limit" "$@" >"$log" 2>&1 &
  STAGE_PID=$!
  wait $STAGE_PID
  rc=$?
  CURRENT="" STAGE_PID=""
  line=$(grep -E "[0-9]+ (passed|failed|error)" "$log" | tail -1)
  case $rc in
    0) say "$section" "$name" "ok in $((SECONDS - t0)) s${line:+: $line}" "$attach" ;;
    124|137)
      local reached seen
      reached=$(grep -o '\[ *[0-9]*%\]' "$log" | tail -1)
      # pytest -q's progress lines ("..F.s  [ 40%]", the last one cut short without its
      # percentage): a failure seen before the cut is a failure
      seen=$(grep -E '^[.FEsxX]+( *\[ *[0-9]+%\])?$' "$log" | tr -cd 'FE' | wc -c)
      if [ "$limit" -lt "$cap" ]; then
        say "$section" "$name" "not finished (budget): stopped after ${limit} s, all the ${BUDGET} s budget left it (its cap ${cap} s)${reached:+, at $reached}${line:+: $line}$([ "$seen" -gt 0 ] && echo ", $seen FAILED before the cut") (see ${log#$DIR/})" "$attach"
      else
        say "$section" "$name" "TIMED OUT after its cap of ${limit} s${reached:+ at $reached}${line:+: $line} (see ${log#$DIR/})" "$attach"
      fi ;;
    *) say "$section" "$name" "FAILED (exit $rc) in $((SECONDS - t0)) s${line:+: $line} (see ${log#$DIR/})" "$attach" ;;
  esac
}
