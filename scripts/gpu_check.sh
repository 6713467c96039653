#!/usr/bin/env bash
# The GPU check: one command, under 9 minutes, on a bare GPU machine with only its own torch.
#
#   bash scripts/gpu_check.sh              (or: make gpu-check)
#
# Environment knobs:
#   PYTHON=python3       the interpreter that has torch (a GPU image's CUDA build)
#   WHEELS=wheels        folder of the wheels in scripts/gpu_wheels.txt (make gpu-wheels fetches
#                        them); installed with --no-deps into $DIR/deps, put first on PYTHONPATH.
#                        Not needed where those packages import already.
#   GPU_CHECK_DIR=...    where figures, traces, logs and table.md go: a fresh folder of this run's
#                        own (default /tmp/gpu-check/<UTC time>-<pid>); one that holds files is refused
#   BUDGET=540           seconds of wall time for the whole check, the table included: no stage
#   STOP=500             starts after STOP seconds, and each is cut at BUDGET - 15 (the table's)
#   NOTEBOOKS="00_memory_arithmetic 01_collectives"   notebooks run under nbval
#
#   GPU_CHECK_PLAN=1     run nothing: write each stage's command line to $DIR/plan.txt (the GPU
#                        machine's stages, whatever this machine has)
#
# The stages, ordered so the most is learned first; each under its own timeout, each one row of the
# table (scripts/gpu_check_stages.sh: ok, FAILED, TIMED OUT past its own cap, not finished (budget)
# when the check's budget ended it first, not run when the budget is spent). Every stage's tests
# are selected with -m "not full", as make test's are:
#   machine    refimpl env, the numerics settings
#   (a) issue 35's defects: the rank's CUDA setup (tests/test_cuda_setup.py), labels and bytes of a
#       backward on autograd's thread (tests/test_backward_thread.py), and from
#       tests/test_nccl_rules.py the pipeline's posting order under the strict stream, notebook
#       01's contiguous comparison, zero2 offload's buckets and torch-fsdp2 offload's gather on the
#       rank's device (on the GPU: every rank on cuda:0 through the staged backend)
#   (b) CUDA memory against the arithmetic (scripts/gpu_check.py memory)
#   (c) a CUDA-profiled step: kernels labelled, backward's too (profiled_step)
#   (d) fp32 and bf16 steps (steps); MFU of a Llama 3.2 1B-shaped model in bf16, eager and compiled
#   (e) several ranks on the one GPU (REFIMPL_SHARED_DEVICE=cuda:0): the rest of tests/test_nccl_rules.py
#   then the copy ceilings, NCCL (>= 2 GPUs), the 2-rank equivalence, HTA, async TP (>= 2 GPUs);
#   tp_overlap against tp where the alpha-beta model predicts a saving (a host with spare cores);
#   the GPU-facing tests;
#   (f) the notebooks, then the test suite with whatever time is left (-x, under xdist).
# On a CPU machine the GPU parts print "skipped: no GPU". On one GPU, NCCL (one GPU per rank)
# cannot run >= 2 ranks: the suite's multi-rank runs stay on gloo (CPU) and the table says so.
# The table is printed however the check ends (a stage failing or timing out, Ctrl-C, a TERM):
# the EXIT trap prints it. Exit status: 0 when nothing FAILED, was INTERRUPTED or TIMED OUT past
# its own cap; a stage the budget ended first ("not finished (budget)", the suite always) is not a
# failure, unless a test had failed before the cut.
set -u
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
BUDGET=${BUDGET:-540}
STOP=${STOP:-500}
NOTEBOOKS=${NOTEBOOKS-"00_memory_arithmetic 01_collectives"}
DIR=${GPU_CHECK_DIR:-/tmp/gpu-check/$(date -u +%Y%m%dT%H%M%SZ)-$$}
if [ -d "$DIR" ] && [ -n "$(ls -A "$DIR" 2>/dev/null)" ]; then
  echo "gpu_check: GPU_CHECK_DIR=$DIR already holds files (a previous run's): give a fresh folder" >&2
  exit 2
fi
mkdir -p "$DIR/logs" || exit 2
: > "$DIR/status.txt"
START=$SECONDS
TABLE_S=15          # the table's share of the budget
PLAN=${GPU_CHECK_PLAN:-0}
. scripts/gpu_check_stages.sh   # say, stage, finish: the rows, the budget, the exit status
trap finish EXIT
trap 'exit 130' INT TERM

# Every stage's tests are make test's: -m "not full" (the `full` ones are beyond its budget; make
# test-full runs them).
PYTEST=(env OMP_NUM_THREADS=1 "$PYTHON" -m pytest -q -p no:cacheprovider -m "not full")

if [ -n "${WHEELS:-}" ]; then
  stage setup wheels 90 - -- "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" --no-deps \
    --no-compile --target "$DIR/deps" -r scripts/gpu_wheels.txt
  stage setup "optional wheels (HTA)" 30 - -- "$PYTHON" -m pip install -q --no-index --find-links "$WHEELS" \
    --no-deps --no-compile --target "$DIR/deps" -r scripts/gpu_wheels_optional.txt
fi
export PYTHONPATH="$DIR/deps:$REPO${PYTHONPATH:+:$PYTHONPATH}"
export REFIMPL_PROFILES="$DIR/profiles"          # notebooks' traces go here, not into the repo
export MPLBACKEND=Agg
GPU=0
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null && GPU=1
[ "$PLAN" = 1 ] && GPU=1        # the plan shows the GPU machine's stages
# The staged backend's device: every rank on cuda:0 on a GPU machine, the CPU elsewhere (make test's)
SHARED=$([ $GPU = 1 ] && echo cuda:0 || echo cpu)

stage machine "refimpl env" 60 - -- "$PYTHON" -m refimpl env
cp "$DIR/logs/machine-refimpl_env.log" "$DIR/env.txt" 2>/dev/null
stage machine "figures: machine, numerics" 60 figures-machine.json -- \
  "$PYTHON" scripts/gpu_check.py figures "$DIR" machine machine numerics

# (a) The defects issue 35 fixed, first: they are why this check exists.
# From test_nccl_rules, the tests of those defects and of the helpers run on a staged world; the
# other two files whole. The tests that read the strategies' one staged launch (every layout, the
# bf16 twins, the recorded memory, the fault: `audit_dirs`) are stage (e)'s, which runs the rest of
# the file, so that launch runs once.
DEFECTS="test_cuda_setup or test_backward_thread or strict_stream or stream_order or argument_rules"
STRATEGIES="posting_order_alone or every_tensor_a_rank or bf16 or profiled_run or memory_is_recorded"
DEFECTS="($DEFECTS or offload or refuses or nccl_s_rules) and not ($STRATEGIES or wrong_number_fault)"
stage "(a) issue 35" "CUDA setup, backward's thread, NCCL rules (ranks on $SHARED, staged)" 240 junit-a.xml -- \
  env REFIMPL_SHARED_DEVICE="$SHARED" "${PYTEST[@]}" --junitxml="$DIR/junit-a.xml" \
  tests/test_cuda_setup.py tests/test_backward_thread.py tests/test_nccl_rules.py -k "$DEFECTS"

# (b)-(d) The figures, one stage each (scripts/gpu_check.py).
stage "(b) cuda memory" "memory_allocated against the arithmetic" 120 figures-memory.json -- \
  "$PYTHON" scripts/gpu_check.py figures "$DIR" memory memory
stage "(c) profiled step" "a CUDA-profiled step, its kernels' labels" 120 figures-profiled.json -- \
  "$PYTHON" scripts/gpu_check.py figures "$DIR" profiled profiled_step
stage "(d) steps" "fp32 and bf16 steps" 120 figures-steps.json -- \
  "$PYTHON" scripts/gpu_check.py figures "$DIR" steps steps
stage "(d) MFU" "Llama 3.2 1B shape, bf16, one GPU: eager, then compiled blocks" 240 figures-mfu.json -- \
  "$PYTHON" scripts/gpu_check.py figures "$DIR" mfu mfu_eager mfu_compiled

# (e) Several ranks on the one GPU (refimpl.lab.runtime.shared_device): the rest of tests/test_nccl_rules.py
# (what (a) did not run): every strategy, schedule and twin on cuda:0 tensors in one launch of 2
# ranks (the 4-rank one is `full`), the bf16 twins against gloo's, the recorded memory, a planted
# fault found; collectives staged through gloo; a tensor off the device fails the call as NCCL
# would. make test runs the same file on the CPU.
if [ $GPU = 1 ]; then
  stage "(e) shared GPU" "ranks sharing cuda:0 (the rest of test_nccl_rules, staged)" 300 - -- \
    env REFIMPL_SHARED_DEVICE=cuda:0 "${PYTEST[@]}" tests/test_nccl_rules.py -k "not ($DEFECTS)"
else
  say "(e) shared GPU" "ranks sharing cuda:0 (the rest of test_nccl_rules, staged)" \
    "skipped: no GPU (make test runs this file with the ranks on the CPU)"
fi

stage figures "ceilings, NCCL, equivalence, HTA, async TP" 150 figures-more.json -- \
  "$PYTHON" scripts/gpu_check.py figures "$DIR" more ceilings nccl_step equivalence hta async_tp
stage figures "tp_overlap against tp, beside the alpha-beta saving with this machine's sigma" 150 \
  figures-tp_overlap.json -- "$PYTHON" scripts/gpu_check.py figures "$DIR" tp_overlap tp_overlap
stage tests "GPU-facing tests (env, ceilings, cuda_memory, gpu_trace, moe_slots)" 150 - -- \
  "${PYTEST[@]}" tests/test_env.py tests/test_ceilings.py tests/test_cuda_memory.py \
  tests/test_gpu_trace.py tests/test_moe_slots.py

# (f) The notebooks that fit, then the suite with the time left (-x stops at the first failure;
# xdist spreads it over cores, one module per worker for its launch-once caches).
for nb in $NOTEBOOKS; do
  stage notebooks "$nb" 150 - -- "${PYTEST[@]}" --nbval-lax "notebooks/$nb.ipynb"
done
XDIST=""
if "$PYTHON" -c "import xdist" 2>/dev/null; then
  workers=$(( $(nproc) / 2 )); workers=$(( workers < 2 ? 2 : workers > 8 ? 8 : workers ))
  XDIST="-n $workers --dist loadfile"
fi
stage "(f) suite" "pytest tests/ -m 'not full' -x ${XDIST}, with the time left" "$BUDGET" - -- \
  "${PYTEST[@]}" tests/ -x $XDIST --ignore=tests/test_e2e_browser.py
# the EXIT trap prints the table
