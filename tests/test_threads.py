"""Our threads run torch ops with the thread count the program gave torch.

`torch.set_num_threads(n)` sets the OpenMP team of the calling thread only: a thread Python
starts forms teams of one member per core. Two ranks on two cores that each set one thread ran
our codec on two, and the idle members spun on the cores the training needed
(gradientflow/threads.py: follow_torch_threads). In a fresh process: the test workers set
OMP_NUM_THREADS, which hides the difference.
"""
from __future__ import annotations

import pytest


def omp_max_threads() -> int | None:
    """The calling thread's OpenMP team size for its next parallel region, read from the
    OpenMP runtime torch loaded (None: torch loaded none)."""
    import ctypes

    import torch  # noqa: F401 - loads the runtime

    for line in open("/proc/self/maps"):
        path = line.split()[-1]
        if any(k in path for k in ("libgomp", "libiomp", "libomp")):
            return ctypes.CDLL(path).omp_get_max_threads()
    return None


def test_a_thread_of_ours_has_torch_thread_count():
    """The helper itself, in a fresh process: torch set to 3 threads (no machine's default), a
    thread started through it forms OpenMP teams of 3 (a plain Python thread's default is
    one per core)."""
    import subprocess
    import sys

    code = f"""
import sys, threading, torch
sys.path.insert(0, {str(__import__('pathlib').Path(__file__).parent)!r})
from test_threads import omp_max_threads
from gradientflow.threads import following_torch_threads
torch.set_num_threads(3)
out = []
t = threading.Thread(target=following_torch_threads(lambda: out.append(omp_max_threads())))
t.start(); t.join()
print(out[0])
"""
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()
    if got == "None":
        pytest.skip("torch loaded no OpenMP runtime")
    assert got == "3", f"a thread of ours forms OpenMP teams of {got} with torch set to 3"
