#!/bin/bash
# make slurm-check: the CPU sbatch recipe (scripts/slurm/cpu.sbatch) on a one-node Slurm cluster
# started on this machine, as a new user would run it.
#   1. installs Debian's slurm-wlm and munge when missing (needs root);
#   2. starts munged, slurmctld and slurmd from scripts/slurm/slurm.conf.in, everything under a
#      temporary directory, on ports the OS says are free (nothing of the machine's own Slurm,
#      if any, is touched);
#   3. submits cpu.sbatch (zero1 x tp 2 on 2 ranks, 3 steps, float64), waits for the job, checks
#      its state and exit code (scontrol show job) and that its losses equal single's;
#   4. stops the daemons it started, by their pids, whatever happened.
# Under 3 minutes once the packages are installed. PYTHON: the interpreter with torch (.venv's).
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-$REPO/.venv/bin/python}
PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON")
cd "$REPO"
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} OMP_NUM_THREADS=1

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" != 0 ]; then
    echo "slurm-check: slurm-wlm and munge are not installed, and installing them needs root" >&2
    exit 2
  fi
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge
fi
[ "$(id -u)" = 0 ] || { echo "slurm-check: the one-node cluster runs its daemons as root" >&2; exit 2; }

DIR=$(mktemp -d /tmp/refimpl-slurm-XXXXXX)
chmod 700 "$DIR"
mkdir -p "$DIR/state" "$DIR/spool"
HOST=$(hostname -s)
free_port() { "$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
CTLD_PORT=$(free_port); SLURMD_PORT=$(free_port); RDZV_PORT=$(free_port)
sed -e "s|@DIR@|$DIR|g" -e "s|@HOST@|$HOST|g" -e "s|@CTLD_PORT@|$CTLD_PORT|g" \
    -e "s|@SLURMD_PORT@|$SLURMD_PORT|g" "$REPO/scripts/slurm/slurm.conf.in" > "$DIR/slurm.conf"
export SLURM_CONF=$DIR/slurm.conf

stop() {   # the daemons this script started, by the pids they wrote; then the directory
  for f in slurmd slurmctld munged; do
    if [ -s "$DIR/$f.pid" ]; then kill "$(cat "$DIR/$f.pid")" 2>/dev/null || true; fi
  done
  sleep 1
  for f in slurmd slurmctld munged; do
    if [ -s "$DIR/$f.pid" ]; then kill -9 "$(cat "$DIR/$f.pid")" 2>/dev/null || true; fi
  done
  [ -n "${KEEP:-}" ] && echo "slurm-check: logs kept in $DIR" || rm -rf "$DIR"
}
trap stop EXIT

# munge: its own key and socket (slurm.conf's AuthInfo points at it)
dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
chmod 400 "$DIR/munge.key"
munged --force --key-file="$DIR/munge.key" --socket="$DIR/munge.socket" \
  --pid-file="$DIR/munged.pid" --log-file="$DIR/munged.log" --seed-file="$DIR/munged.seed"
slurmctld -f "$SLURM_CONF" -c        # -c: a fresh state, no jobs from an earlier check
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
  state=$(sinfo -h -N -o %T 2>/dev/null | head -n 1 || true)
  [ "$state" = idle ] && break
  sleep 1
done
[ "$state" = idle ] || { echo "slurm-check: the node did not come up (state: ${state:-none})"; \
  tail -5 "$DIR/slurmctld.log" "$DIR/slurmd.log"; exit 1; }

# The CPU recipe, as written; only what ties it to this machine comes from the environment.
JOB=$(REFIMPL_PYTHON=$PYTHON RDZV_PORT=$RDZV_PORT GLOO_SOCKET_IFNAME=lo \
      sbatch --parsable --chdir "$REPO" --output "$DIR/job.out" --error "$DIR/job.err" \
      "$REPO/scripts/slurm/cpu.sbatch")
echo "slurm-check: submitted job $JOB to the one-node cluster on $HOST"
for _ in $(seq 170); do
  show=$(scontrol show job "$JOB")
  job_state=$(grep -o 'JobState=[A-Z_]*' <<<"$show" | cut -d= -f2)
  case "$job_state" in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY|BOOT_FAIL|DEADLINE) break;; esac
  sleep 1
done
exit_code=$(grep -o ' ExitCode=[0-9:]*' <<<"$show" | cut -d= -f2)
echo "slurm-check: job $JOB: JobState=$job_state ExitCode=$exit_code"
if [ "$job_state" != COMPLETED ] || [ "$exit_code" != 0:0 ]; then
  echo "slurm-check: FAILED"; tail -20 "$DIR/job.err" || true; exit 1
fi
# Its losses against single's, computed here (scripts/launch_check.py's gate, 1e-9 in float64).
"$PYTHON" - "$DIR/job.out" <<'EOF'
import json, sys
sys.path.insert(0, "scripts")
from refimpl.config import TrainConfig
from refimpl.train import train_on_ranks
from launch_check import GATE, rel_err
got = next(json.loads(l) for l in open(sys.argv[1]) if l.startswith("{"))
want = train_on_ranks(TrainConfig(steps=len(got["losses"]), dtype="float64"))["losses"]
err = rel_err(got["losses"], want)
print(f"slurm-check: {got['strategy']} on {got['world_size']} ranks, losses vs single {err:.1e}")
sys.exit(0 if err < GATE else 1)
EOF
echo "slurm-check: passed"
