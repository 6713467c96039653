"""The fd-2 filter drops the profiler's chatter and forwards everything else."""
import subprocess
import sys

SCRIPT = r'''
import os
from refimpl.lab.trace.native_stderr import filtered_native_stderr
with filtered_native_stderr():
    os.write(2, b"USDT:2026-12-01 00:33:24 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
    os.write(2, b"a real warning\n")
    os.write(2, b"[W1201 CPUAllocator.cpp:245] Memory block of unknown size was allocated before the profiling started, x\n")
os.write(2, b"after\n")
'''


def test_only_the_chatter_is_dropped():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    assert out.stderr.splitlines() == ["a real warning", "after"]
