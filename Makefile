# Every target installs what it needs into .venv first, so a fresh clone needs only Python 3.11.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PORT   ?= 6006

.PHONY: install lab test test-unit test-notebooks tensorboard bench report e2e clean

install: $(STAMP)

# torch is installed first, on its own and pinned: if anything else pulled it in unpinned,
# pip would download a multi-GB CUDA build on a CPU-only machine.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "torch==2.13.0"
	$(BIN)/python -m pip install -q -e ".[notebooks]"
	touch $(STAMP)

lab: install
	$(BIN)/jupyter lab --ip=127.0.0.1 --no-browser --notebook-dir=notebooks

# One thread per process: ranks and the in-process reference share the machine's cores.
test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests/ -q
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest --nbval-lax notebooks/ -q -p no:cacheprovider

tensorboard: install
	$(BIN)/tensorboard --logdir profiles --host 127.0.0.1 --port $(PORT)

# Speed is a benchmark, not a test: each script compares ours with PyTorch's in one run, as ratios.
bench: install
	$(BIN)/python scripts/bench_collectives.py
	$(BIN)/python scripts/bench_dp.py
	$(BIN)/python scripts/bench_fsdp.py

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

clean:
	rm -rf profiles/*/ report/ .pytest_cache
