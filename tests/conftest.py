import os
import sys

# One thread per process, before torch is imported: the in-process reference runs beside rank
# processes on a 2-core machine, and oversubscribed threads made a 0.1 s step take 2.5 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests import helpers from `tests.*` inside rank processes: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# `make test` runs the suite on two xdist workers (`-n 2 --dist loadgroup`): the ranks of one
# test leave the cores idle while they wait on each other, so two streams of tests fill them.
# Each test module is one group, so its launch-once caches run in one worker; modules that share
# a cache of runs (tests/*_runs.py) share a group.
SHARED_RUNS = {"test_dp": "data_parallel_runs", "test_zero12": "data_parallel_runs",
               "test_run_record": "trace_runs", "test_tb_plugin": "trace_runs",
               "test_trace_merge": "trace_runs", "test_e2e_browser": "trace_runs"}


def pytest_collection_modifyitems(config, items):
    import pytest

    for item in items:
        stem = item.path.stem
        item.add_marker(pytest.mark.xdist_group(SHARED_RUNS.get(stem, stem)))
