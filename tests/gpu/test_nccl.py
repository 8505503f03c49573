"""The backend over NCCL on one GPU (world_size 1): collectives, DDP with the hooks, the optimizer.

Each check lives in _world1.py and runs in its own interpreter (a process group per process);
this test fails naming every check that failed. Skipped without a GPU (conftest.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


TIMEOUT_S = 300


def test_backend_world1_on_cuda(tmp_path):
    """Every check of _world1.py passes on the GPU (see its docstring for the two modes)."""
    out = tmp_path / "world1.json"
    env = dict(os.environ, GF_WORLD1_DEVICE="cuda:0")
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("_world1.py")), str(out)],
                          capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    failed = [c for c in result["checks"] if not c["ok"]]
    assert not failed, "\n\n".join(f"{c['name']}: {c['error']}\n{c.get('traceback', '')}"
                                   for c in failed)
    # Every supported torch constructs the backend itself (backend.py's base class).
    assert result["mode"] == "backend", result["mode"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
