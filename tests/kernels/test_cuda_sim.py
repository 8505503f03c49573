"""numba CUDA kernels under NUMBA_ENABLE_CUDASIM=1 vs the torch reference (in a subprocess).

The simulator must be chosen before numba.cuda is imported and does not take torch tensors, so
the check runs in its own interpreter on numpy arrays (see _cuda_sim_check.py)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_cuda_kernels_under_the_simulator():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    script = Path(__file__).with_name("_cuda_sim_check.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=env)
    if proc.returncode == 77:
        pytest.skip(proc.stdout.strip() or "the CUDA simulator cannot import")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("OK")
