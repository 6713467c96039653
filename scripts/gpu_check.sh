#!/usr/bin/env bash
# The GPU check: one command, under 8 minutes, on a bare GPU machine with only its own torch.
#
#   bash scripts/gpu_check.sh              (or: make gpu-check)
#
# Environment knobs:
#   PYTHON=python3       the interpreter that has torch (a GPU image's CUDA build)
#   WHEELS=wheels        folder of the wheels in scripts/gpu_wheels.txt (make gpu-wheels fetches
#                        them); installed with --no-deps into $DEPS, put first on PYTHONPATH.
#                        Not needed where those packages import already.
#   OUT=/tmp/gpu-check   where figures, traces and logs go
#   BUDGET_TESTS=180 BUDGET_NOTEBOOK=100   seconds per stage (the whole check stays < 8 min)
#   NOTEBOOKS="00_memory_arithmetic 01_collectives"   notebooks run under nbval
#
# Runs: the machine (refimpl env), the figures (scripts/gpu_check.py: ceilings, CUDA memory vs
# the arithmetic, fp32 and bf16 steps, a CUDA-profiled step with kernels in the rank timeline,
# the 2-rank equivalence), 2-4 ranks sharing the one GPU (refimpl.shared_device), the test suite (pytest -x -n 4 where pytest-xdist exists, under a time
# budget), the notebooks that fit, then prints ONE markdown table. On a CPU machine the GPU parts
# print "skipped: no GPU". On one GPU, NCCL (one GPU per rank) cannot run >= 2 ranks: the suite's
# multi-rank runs stay on gloo (CPU) and the table says so; the shared-GPU stage runs the NCCL-rules
# layouts on cuda:0 through the staged backend instead. Exit status: 0 when nothing FAILED.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
OUT=${OUT:-/tmp/gpu-check}
DEPS=${DEPS:-$OUT/deps}
BUDGET_TESTS=${BUDGET_TESTS:-180}
BUDGET_NOTEBOOK=${BUDGET_NOTEBOOK:-100}
NOTEBOOKS=${NOTEBOOKS-"00_memory_arithmetic 01_collectives"}
mkdir -p "$OUT"
: > "$OUT/status.txt"
START=$SECONDS
say() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$OUT/status.txt"; echo "[gpu_check] $1: $2: $3"; }

if [ -n "${WHEELS:-}" ]; then
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --target "$DEPS" \
    -r scripts/gpu_wheels.txt >"$OUT/wheels.log" 2>&1 \
    && say setup wheels "installed $(grep -c '==' scripts/gpu_wheels.txt) from $WHEELS into $DEPS" \
    || say setup wheels "FAILED (see $OUT/wheels.log)"
  "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps --target "$DEPS" \
    -r scripts/gpu_wheels_optional.txt >>"$OUT/wheels.log" 2>&1 \
    && say setup "optional wheels" "HolisticTraceAnalysis installed" \
    || say setup "optional wheels" "not installed (HTA comparison skipped)"
fi
export PYTHONPATH="$DEPS:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export REFIMPL_PROFILES="$OUT/profiles"          # notebooks' traces go here, not into the repo
export MPLBACKEND=Agg

"$PYTHON" -m refimpl env | tee "$OUT/env.txt"

# The figures (each part reports itself, a failing part is recorded and the rest still run).
timeout 240 "$PYTHON" scripts/gpu_check.py figures "$OUT" 2>"$OUT/figures.log" \
  || say figures "gpu_check.py" "FAILED or timed out (exit $?; see $OUT/figures.log)"

# The GPU-facing tests first (they must run whatever the budget), then the whole suite.
timeout 120 env OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_env.py \
  tests/test_ceilings.py tests/test_cuda_memory.py tests/test_gpu_trace.py >"$OUT/tests-gpu.log" 2>&1
rc=$?
line=$(grep -E "passed|failed|error" "$OUT/tests-gpu.log" | tail -1)
[ $rc -eq 0 ] && say tests "GPU-facing tests (env, ceilings, cuda_memory, gpu_trace)" "ok: $line" \
  || say tests "GPU-facing tests (env, ceilings, cuda_memory, gpu_trace)" "FAILED (exit $rc): $line (see $OUT/tests-gpu.log)"

# Several ranks on the one GPU (refimpl.shared_device): every strategy, schedule and twin of
# tests/test_nccl_rules.py on cuda:0 tensors, 2 and 4 ranks, collectives staged through gloo; a
# tensor off the device fails the call as NCCL would. Needs a GPU: skipped on a CPU machine.
if "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  timeout 240 env OMP_NUM_THREADS=1 REFIMPL_SHARED_DEVICE=cuda:0 "$PYTHON" -m pytest -q \
    -p no:cacheprovider tests/test_nccl_rules.py >"$OUT/tests-shared-gpu.log" 2>&1
  rc=$?
  line=$(grep -E "passed|failed|error" "$OUT/tests-shared-gpu.log" | tail -1)
  [ $rc -eq 0 ] && say tests "ranks sharing cuda:0 (test_nccl_rules, staged)" "ok: $line" \
    || say tests "ranks sharing cuda:0 (test_nccl_rules, staged)" "FAILED (exit $rc): $line (see $OUT/tests-shared-gpu.log)"
else
  say tests "ranks sharing cuda:0 (test_nccl_rules, staged)" "skipped: no GPU"
fi

# The test suite, under a budget: -x stops at the first failure, xdist spreads it over cores.
XDIST=""
"$PYTHON" -c "import xdist" 2>/dev/null && XDIST="-n 4 --dist loadfile"   # a module (and its launch-once caches) per worker
timeout "$BUDGET_TESTS" env OMP_NUM_THREADS=1 "$PYTHON" -m pytest tests/ -q -x $XDIST \
  -p no:cacheprovider --ignore=tests/test_e2e_browser.py --junitxml="$OUT/tests.xml" \
  >"$OUT/tests.log" 2>&1
rc=$?
tail_line=$(grep -E "passed|failed|error" "$OUT/tests.log" | tail -1)
if [ $rc -eq 124 ]; then
  reached=$(grep -o '\[ *[0-9]*%\]' "$OUT/tests.log" | tail -1)
  say tests "pytest tests/ (budget ${BUDGET_TESTS} s)" "TIMED OUT at ${reached:-0%} of the suite, no failure before it (-x)"
elif [ $rc -eq 0 ]; then
  say tests "pytest tests/" "ok: ${tail_line}"
else
  say tests "pytest tests/" "FAILED: ${tail_line} (see $OUT/tests.log)"
fi

# The notebooks that fit in the time left.
for nb in $NOTEBOOKS; do
  left=$(( 420 - (SECONDS - START) ))
  if [ $left -lt 60 ]; then say notebooks "$nb" "skipped: the 7-minute budget is spent"; continue; fi
  budget=$(( left < BUDGET_NOTEBOOK ? left : BUDGET_NOTEBOOK ))
  t0=$SECONDS
  timeout "$budget" env OMP_NUM_THREADS=1 "$PYTHON" -m pytest --nbval-lax "notebooks/$nb.ipynb" -q \
    -p no:cacheprovider >"$OUT/nb-$nb.log" 2>&1
  rc=$?
  case $rc in
    0) say notebooks "$nb" "ok in $((SECONDS - t0)) s" ;;
    124) say notebooks "$nb" "TIMED OUT after ${budget} s" ;;
    *) say notebooks "$nb" "FAILED: $(grep -E 'passed|failed|error' "$OUT/nb-$nb.log" | tail -1) (see $OUT/nb-$nb.log)" ;;
  esac
done

say total "wall time" "$((SECONDS - START)) s"
echo
echo "## refimpl GPU check"
echo
"$PYTHON" scripts/gpu_check.py table "$OUT"
echo
echo "(files: $OUT: env.json, figures.json, rank_timeline.html, cuda_memory.csv, d2d_copy_sweep.csv, logs)"
! grep -q "FAILED" "$OUT/status.txt" "$OUT/figures.json" 2>/dev/null
