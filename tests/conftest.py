import os
import sys

# One thread per process, before torch is imported: the in-process reference runs beside rank
# processes on a 2-core machine, and oversubscribed threads made a 0.1 s step take 2.5 s.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# The tests import helpers from `tests.*` inside rank processes: make the repo root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

