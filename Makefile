# Every target installs what it needs into .venv first, so a fresh clone needs only Python 3.11.
#   make lab                  a fresh .venv with torch==2.13.0 (CPU build on a CPU machine)
#   make lab TORCH=system     .venv-system on top of the machine's own torch (a GPU image's CUDA
#                             build): --system-site-packages, no torch installed
#   make ... WHEELS=dir       install from wheel files only (a machine with no network)
PYTHON ?= python3
TORCH  ?= pinned
ifeq ($(TORCH),system)
VENV   := .venv-system
else
VENV   := .venv
endif
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 6006
PIP_FROM := $(if $(WHEELS),--no-index --find-links $(WHEELS),)
# jupyter refuses to start as root without --allow-root (containers and GPU images run as root)
ROOT_FLAG := $(if $(filter 0,$(shell id -u)),--allow-root,)

.PHONY: install lab lint test test-fast test-full launch-check slurm-check tensorboard bench report e2e gpu-check gpu-wheels env clean

install: $(STAMP)

# torch is installed first, on its own and pinned: if anything else pulled it in unpinned,
# pip would download a multi-GB CUDA build on a CPU-only machine. TORCH=system keeps the
# machine's torch (pyproject only asks for >= the oldest torch the code supports).
$(STAMP): pyproject.toml
ifeq ($(TORCH),system)
	$(PYTHON) -c "import torch" || (echo "TORCH=system: $(PYTHON) has no torch; set PYTHON=... or drop TORCH=system" && false)
	test -x $(BIN)/python || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PYTHON) scripts/system_torch_pth.py $(BIN)/python
	$(BIN)/python -c "import torch; print('using the system torch', torch.__version__, 'CUDA', torch.version.cuda)"
	$(BIN)/python -m pip install -q $(PIP_FROM) $(if $(WHEELS),--no-build-isolation,) -e ".[notebooks]"
else
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q $(PIP_FROM) --upgrade pip
	$(BIN)/python -m pip install -q $(PIP_FROM) "torch==2.13.0"
	$(BIN)/python -m pip install -q $(PIP_FROM) $(if $(WHEELS),--no-build-isolation,) -e ".[notebooks,dev]"
endif
	touch $(STAMP)

# The project's JupyterLab settings (jupyter/settings/overrides.json): no news pop-up, no
# update checks (both would reach the network).
lab: install
	$(BIN)/jupyter lab $(ROOT_FLAG) --ip=127.0.0.1 --no-browser --notebook-dir=notebooks \
		--LabApp.app_settings_dir=$(CURDIR)/jupyter/settings

env: install
	$(BIN)/python -m refimpl env

# One thread per process: ranks and the in-process reference share the machine's cores. Two
# xdist workers (TEST_WORKERS): a multi-rank test leaves cores idle while its ranks wait on each
# other (three workers were no faster on 2 cores: 653 s against 638 s, and one launch failed).
# --dist loadfile keeps each module on one worker (its launch-once caches run once) and each
# notebook whole in one kernel. Tests and notebooks in one session, so neither worker idles while
# the other finishes. The longest modules first, in the order given (--no-loadscope-reorder:
# xdist's default order is by number of tests, which put the layout matrix's two modules, a few
# tests of 2-3 minutes each, last, one worker running the 4-rank one alone for minutes while the
# other had nothing left: 770 s against 601 s), then the notebooks, then the short test files.
# The longest test modules after them, so that the run ends on short files and both workers
# finish together (longest first is the classic rule for two machines).
LONGEST := tests/test_layout_matrix_4.py tests/test_layout_matrix.py \
	notebooks/07_pipeline_parallel.ipynb notebooks/09_composition.ipynb \
	tests/test_nccl_rules.py tests/test_zero3_fsdp.py tests/test_wrappers.py tests/test_zero12.py \
	tests/test_composition.py tests/test_tp_strategy.py tests/test_recovery.py \
	tests/test_when_it_goes_wrong.py
TEST_WORKERS ?= 2
# Every rank launch of make test (tests, notebooks, the bench and notebook helpers they run) goes
# through the staged backend (refimpl.lab.runtime.shared_device): gloo on CPU ranks under NCCL's stream order,
# message pairing and argument rules, so a posting order that would hang on a GPU server, a host
# tensor handed to NCCL or a non-contiguous buffer fails here. STAGED= runs plain gloo (or NCCL
# where every rank has a GPU); STAGED=cuda:0 puts every rank on that one GPU.
STAGED ?= cpu
test: install lint
	OMP_NUM_THREADS=1 REFIMPL_SHARED_DEVICE=$(STAGED) $(BIN)/python -m pytest $(LONGEST) notebooks/ tests/ --nbval-lax -q \
		-p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		-m "not full" --durations=30

# What does not fit make test's 10 minutes on 2 cores, marked `full`: the layout matrix's whole
# space (every layout validated), its pairwise cover with 8 ranks and the DTensor twins and its
# three-wise cover (about an hour), and the named equivalence lists the matrix supersedes.
# -rP prints the matrix's counts (ran, equal, refused by reason).
test-full: install
	OMP_NUM_THREADS=1 REFIMPL_SHARED_DEVICE=$(STAGED) $(BIN)/python -m pytest tests/ -q -p no:cacheprovider \
		-n $(TEST_WORKERS) --dist loadfile -m full -rP

# The tests that start no rank process and take seconds (arithmetic, schedules, the model, the
# import layers, the planner): under a minute. A test that launches ranks must be marked `ranks`;
# REFIMPL_FORBID_RANKS makes an unmarked one fail here (tests/conftest.py).
test-fast: install
	REFIMPL_FORBID_RANKS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/ -q -n $(TEST_WORKERS) \
		-m "not ranks and not slow" -p no:cacheprovider

# The CLI under torchrun as a scheduler runs it (scripts/launch_check.py), 15-25 min on 2 cores:
# 2 agents x 2 ranks with the c10d rendezvous on localhost, LAUNCH_RUNS times in a row with and
# without --profile, every exit 0 and the losses of single; then torchrun --max-restarts 1 with a
# rank killed (kill -9) after a checkpoint: the job resumes and ends with single's weights.
LAUNCH_RUNS ?= 20
launch-check: install
	OMP_NUM_THREADS=1 $(BIN)/python scripts/launch_check.py --runs $(LAUNCH_RUNS)

# The CPU sbatch recipe (scripts/slurm/cpu.sbatch) on a one-node Slurm cluster started here from
# scripts/slurm/slurm.conf.in; installs Debian's slurm-wlm and munge when missing (root). Under 3
# minutes after the install; stops the daemons it started. See scripts/slurm_check.sh.
slurm-check: install
	PYTHON=$(BIN)/python bash scripts/slurm_check.sh

# ruff (pinned in the dev extra, configured in pyproject.toml): pyflakes and import order. A
# TORCH=system venv may lack it (the GPU wheels leave it out): then it says so and skips.
lint: install
	@if $(BIN)/python -m ruff --version >/dev/null 2>&1; then $(BIN)/python -m ruff check .; \
	else echo "lint: ruff is not installed in $(VENV) (the dev extra); skipped"; fi

tensorboard: install
	$(BIN)/tensorboard --logdir profiles --host 127.0.0.1 --port $(PORT)

# Speed is a benchmark, not a test: each script compares ours with PyTorch's in one run, as ratios.
# bench_bubble before the 4-rank launches: right after them its measured bubbles read up to 13-20 %
# off their replays, against 3-10 % on a quiet machine.
bench: install
	$(BIN)/python scripts/bench_table.py --reset
	$(BIN)/python scripts/bench_collectives.py
	$(BIN)/python scripts/bench_dp.py
	$(BIN)/python scripts/bench_fsdp.py
	$(BIN)/python scripts/bench_tp.py
	$(BIN)/python scripts/bench_bubble.py
	$(BIN)/python scripts/bench_pp.py
	$(BIN)/python scripts/bench_pp.py --nproc 4 --micro-batches 8 --layers 8
	$(BIN)/python scripts/bench_composition.py
	$(BIN)/python scripts/bench_plan_cpu.py
	$(BIN)/python scripts/bench_table.py

# Execute every notebook and export it with its figures as offline HTML: report/index.html.
report: install
	OMP_NUM_THREADS=1 $(BIN)/python scripts/make_report.py

# The rank-timeline plugin inside TensorBoard on localhost, in headless Chromium (Debian's); fails
# if the timeline does not render or any request leaves the machine. Screenshot: /tmp/plugin.png
# (`make e2e E2E_ARGS=--docs` also refreshes docs/plugin.png, the README's picture).
e2e: install
	test -x /usr/bin/chromium || (apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y chromium)
	$(BIN)/python -c "import playwright" 2>/dev/null || $(BIN)/python -m pip install -q playwright
	$(BIN)/python scripts/e2e_browser.py --screenshot /tmp/plugin.png $(E2E_ARGS)

# One command on a GPU server, under 9 minutes (works on CPU too, skipping the GPU parts): issue
# 35's defects, CUDA memory vs the arithmetic, a CUDA-profiled step, fp32/bf16 steps, ranks sharing
# the GPU, then notebooks and tests as time allows; one markdown table, in a fresh folder per run.
# It uses whatever python has torch (PYTHON=...); see scripts/gpu_check.sh.
gpu-check:
	PYTHON=$(PYTHON) bash scripts/gpu_check.sh

# The wheels gpu-check installs on a machine with no network (Python 3.12, x86_64): carry wheels/.
gpu-wheels:
	$(PYTHON) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux_2_28_x86_64 -d wheels -r scripts/gpu_wheels.txt \
		-r scripts/gpu_wheels_optional.txt

clean:
	rm -rf profiles/*/ report/ .pytest_cache
