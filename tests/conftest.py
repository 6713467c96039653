import os
import sys

# One thread per process, before torch is imported: the in-process reference runs beside rank
# processes on a 2-core machine, and oversubscribed threads made a 0.1 s step take 2.5 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests import helpers from `tests.*` inside rank processes: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))




def pytest_configure(config):
    config.addinivalue_line("markers", "ranks: launches rank processes (refimpl.launch.run, the CLI)")
    config.addinivalue_line("markers", "slow: takes more than a few seconds in one process")
    config.addinivalue_line("markers", "full: beyond make test's time budget; make test-full runs it")
    if os.environ.get("REFIMPL_FORBID_RANKS") == "1":
        # `make test-fast` deselects the `ranks` tests and sets this: a test (or a module's
        # fixture) that starts a rank anyway fails here, so the marker cannot go stale silently.
        import refimpl.launch

        def refuse(*args, **kwargs):
            raise RuntimeError("this test launches ranks: mark it (or its module) pytest.mark.ranks")

        refimpl.launch._start_rank = refuse   # every launch starts its ranks through this
